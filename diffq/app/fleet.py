"""Kubernetes manifests for a worker fleet, rendered from the producer's shape keys.

Where one worker serves every shape (CPU, CUDA: compile-aware routing drains a
compiled shape before taking another), one Deployment per model whose workers find
the model's queues themselves (`diffq worker --models M`, no --queues), scaled by
one KEDA ScaledObject with a trigger per shape queue. Where a shape's compile takes
many minutes (Neuron, TPU), one Deployment and ScaledObject per shape queue. Queue
names come from `ShapeKey.queue` built by the producer's own `shape_of`, so the
lists KEDA watches are the names `diffq submit` publishes to.
A device kind's pod facts (resource, selectors, sizes, pool) are its backend table row's
`k8s` field: a backend cannot be added without saying whether and how it deploys.
Every worker pod also says what it admits (`admission_env`): the run-folder prefixes
it may write under (a fleet names them, or says `--any-out`), its pool's models, and
the signing keys from an optional Secret.
"""

from __future__ import annotations

import hashlib
import json
import math
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from diffq.app.backlog import PORT as BACKLOG_PORT
from diffq.core.contract import AUTO_DTYPE, ShapeKey, model_slug, without_layout
from diffq.core.families import cfg_bit, family_of
from diffq.core.model_store import is_model_url
from diffq.core.options import GenerationOptions
from diffq.core.storage import normalise_prefix
from diffq.core.transports import KedaFacts, KedaScaler, Transport, keda_facts, keda_scaler, transport_for
from diffq.producer.bucketing import shape_of
from diffq.worker.api import Backend, K8sPod, get_backend, lora_modes
from diffq.worker.api import DRAIN_MARGIN_S
from diffq.producer.sources import Prompt
from diffq.producer.submit import make_options

NAMESPACE = "diffq"
# keys: broker-url (DIFFQ_BROKER_URL) and those of the broker's KEDA scaler and
# worker env (the transport table: redis-address/redis-password, aws-*,
# rabbitmq-username/rabbitmq-password, rabbitmq-api).
SECRET = "diffq-broker"
TRIGGER_AUTH = "diffq-broker"
# The batches' HMAC keys (diffq/core/settings.py `signing_key`, `signing_key_previous`):
# Secret key -> worker env. Optional, so a fleet without signing still starts; with a
# key set, workers dead-letter unsigned batches (`diffq submit` signs with the same).
SIGNING_SECRET = "diffq-signing"
SIGNING_ENV = (("DIFFQ_SIGNING_KEY", "key"), ("DIFFQ_SIGNING_KEY_PREVIOUS", "previous"))
# What a worker without --run admits (the settings it reads, JSON lists).
OUT_PREFIXES_ENV = "DIFFQ_ALLOWED_OUT_PREFIXES"
MODELS_ENV = "DIFFQ_ALLOWED_MODELS"
ADAPTERS_ENV = "DIFFQ_ALLOWED_ADAPTERS"
NO_PREFIX = ("no run-folder prefix: pass --out-prefix s3://BUCKET/runs (the prefix your `diffq submit --out` "
             "folders live under; workers write only there) or --any-out (workers write wherever a batch says), "
             "or set DIFFQ_ALLOWED_OUT_PREFIXES")
# The per-model backlog service (diffq/app/backlog.py) that discovery pools scale on.
BACKLOG = "diffq-backlog"
CACHE_PVC = "diffq-cache"
CACHE_MOUNT = "/cache"
# Models in object storage (s3://, gs://) are fetched into a per-pod emptyDir on the
# node's local disk, not the shared PVC (docs/fleet.md, "Models from object storage"):
# the pod's worker processes fetch once (a flock) and load at local-disk speed.
MODEL_CACHE = "model-cache"
MODEL_CACHE_MOUNT = "/model-cache"
# The model bucket's own credentials, optional: its keys become the workers' env
# (DIFFQ_MODEL_STORE_ENDPOINT, _PROFILE, _CREDENTIALS, AWS_SHARED_CREDENTIALS_FILE) and
# its files appear under MODEL_STORE_MOUNT (an AWS credentials file, a GCS key).
MODEL_STORE_SECRET = "diffq-model-store"
MODEL_STORE_MOUNT = "/etc/diffq/model-store"
METRICS_PORT = 9400
DEFAULT_IMAGE = "ghcr.io/diffq/diffq-{device}:0.1.0"


def planned_devices(plan_json: dict) -> dict[str, int]:
    """Devices per shape queue from `diffq plan --json --rates … --deadline|--devices …`:
    the plan's devices split by each queue's share of the device time (at least one
    wherever a queue has work)."""
    fleet = plan_json.get("fleet")
    if not fleet or not fleet.get("devices"):
        raise ValueError("the plan has no fleet figures with a device count: make it with "
                         "`diffq plan … --rates FILE --deadline 6h --json` (or --devices N)")
    work: dict[str, float] = {}
    for shape in fleet["shapes"]:
        queue = without_layout(shape["queue"])  # a LoRA run's queue: its shape's pool serves it
        work[queue] = work.get(queue, 0.0) + shape["device_s"]
    total = sum(work.values()) or 1.0
    return {queue: max(1, math.ceil(fleet["devices"] * seconds / total)) for queue, seconds in work.items()}


def parse_out_prefixes(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--out-prefix` values (repeated or comma-separated) -> normalised prefixes:
    s3://BUCKET[/path] and gs://BUCKET[/path] as their storage spells them, an absolute
    path without '..'; no trailing '/'. Raises ValueError naming the bad one."""
    prefixes: list[str] = []
    for value in (v.strip() for item in values for v in item.split(",")):
        if not value:
            continue
        prefix = normalise_prefix(value, "--out-prefix")
        if prefix not in prefixes:
            prefixes.append(prefix)
    return tuple(prefixes)


def parse_broker_options(values: list[str] | tuple[str, ...]) -> dict:
    """`--broker-option KEY=VALUE` values -> kombu transport options (a JSON value where
    one parses: `ssl=true` is True, `master_name=mymaster` stays a string)."""
    options: dict = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--broker-option {item!r}: expected KEY=VALUE (master_name=mymaster)")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """'1024x1024,768x1344' -> [(1024, 1024), (768, 1344)] (height x width)."""
    shapes = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            height, width = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape '{part}' is not HEIGHTxWIDTH") from None
        shapes.append((height, width))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def shape_keys(model: str, shapes: list[tuple[int, int]], options: GenerationOptions | None = None,
               **generation) -> list[ShapeKey]:
    """The producer's own shape rule (`shape_of`) applied to one prompt per size, under
    the generation options a submit was given (`options`, or them as keywords)."""
    run_options, defaults = make_options(model=model, options=GenerationOptions.given(options, generation))
    cfg = cfg_bit(family_of(model), defaults.guidance_scale)  # as the producer decides it
    return [shape_of(Prompt(line=0, id="fleet", prompt="-", height=h, width=w, seed=None,
                            num_inference_steps=1, guidance_scale=defaults.guidance_scale, cfg=cfg), run_options)
            for h, w in shapes]


def k8s_name(queue: str) -> str:
    """A DNS-1123 name for a queue: dots become dashes.

    At most 52 characters, so ReplicaSet and Pod suffixes still fit in 63: a long
    name keeps the shape part whole, shortens the model part and adds a hash.
    """
    parts = queue.split(".")
    name = "-".join(parts)
    if len(name) <= 52:
        return name
    tail = "-".join(parts[2:] + [hashlib.sha1(queue.encode()).hexdigest()[:6]])
    head = "-".join(parts[:2])[: max(0, 51 - len(tail))].rstrip("-")
    return f"{head}-{tail}" if head else tail[-52:].lstrip("-")


@dataclass
class FleetOptions:
    device: str
    image: str | None = None
    namespace: str = NAMESPACE
    devices_per_pod: int | None = None
    max_replicas: int = 8
    # Queued batches per replica before KEDA adds one.
    batches_per_replica: int = 4
    redis_db: int = 0
    grace_seconds: int | None = None
    compile: str | None = None
    # ReadWriteMany class for the shared cache: EFS on EKS, Filestore on GKE.
    storage_class: str = "efs-sc"
    cache_size: str = "500Gi"
    # Tensor-parallel degree: a pod's devices form groups of `tp` ranks (one consumer each).
    tp: int = 1
    # The per-pod model cache (object-storage models only): its emptyDir's sizeLimit;
    # the cache evicts before the kubelet would evict the pod for outgrowing it.
    model_cache_gib: int = 200
    # The fleet's broker (a URL; its credentials are never rendered): the transport
    # table says which KEDA scaler watches its queues (by scheme: redis, rediss,
    # sentinel, amqp, pyamqp, amqps, sqs) and which credentials pods read; an AMQP
    # broker's host is KEDA's `host` too.
    broker: str = "redis://"
    # kombu's broker transport options, as the workers are given them: `master_name`
    # (sentinel:// brokers: KEDA's sentinelMaster), `ssl` (TLS without a TLS scheme).
    broker_options: dict = field(default_factory=dict)
    aws_region: str = "us-east-1"
    # Run folders workers may write to (DIFFQ_ALLOWED_OUT_PREFIXES, from
    # `parse_out_prefixes`); none is refused unless `any_out` says so by name.
    out_prefixes: tuple[str, ...] = ()
    any_out: bool = False
    # LoRA adapters the workers load (DIFFQ_ALLOWED_ADAPTERS: prefixes); empty: not rendered.
    allowed_adapters: tuple[str, ...] = ()
    # --lora-mode: a mode or auto, and a LoRA profile (core/profile.py LoraProfile) `auto`
    # goes through; the workers are rendered with the mode it resolves to on the device.
    lora_mode: str = "auto"
    lora_profile: object = None
    # From a fleet plan (`diffq plan --json --rates … --deadline …`): the devices each
    # queue needs to meet the deadline; a pool's maxReplicaCount is then its pods.
    planned_devices: dict[str, int] | None = None
    # The feeds folder (DIFFQ_FEEDS) of windowed runs, beside the one the feeder keeps
    # under each out-prefix (producer/feed.py `feeds_under`): the backlog service feeds
    # them and counts what they still hold in OUT, and every pool, per-shape ones too,
    # scales on that backlog (a broker trigger sees only the window).
    feeds: str | None = None

    @property
    def fed(self) -> bool:
        """Whether the backlog service runs a feeder: any out-prefix or a feeds folder."""
        return bool(self.out_prefixes or self.feeds)

    def replicas_for(self, queues: list[str]) -> int:
        """A pool's maxReplicaCount: the plan's pods for its queues, else --max-replicas."""
        if self.planned_devices is None or not set(queues) & set(self.planned_devices):
            return self.max_replicas  # the plan does not cover this pool's shapes
        n = self.devices_per_pod or self.profile.devices_per_pod
        return max(1, math.ceil(sum(self.planned_devices.get(q, 0) for q in queues) / n))

    def check_out(self) -> None:
        """A fleet names where its workers write, or says by name that it is anywhere."""
        if self.any_out and self.out_prefixes:
            raise ValueError("--any-out and --out-prefix contradict each other: pass one")
        if not self.any_out and not self.out_prefixes:
            raise ValueError(NO_PREFIX)

    @property
    def transport(self) -> Transport:
        transport = transport_for(self.broker)
        if transport.keda is None:
            raise ValueError(f"a {transport.name} broker cannot serve a fleet (no KEDA scaler watches it): "
                             f"use redis://, sqs:// or amqp://")
        return transport

    @property
    def scaler(self) -> KedaScaler:
        """KEDA's scaler for the broker's scheme (the transport table's)."""
        self.transport  # refuses a broker no fleet runs on
        return keda_scaler(self.broker)

    @property
    def keda_facts(self) -> KedaFacts:
        return keda_facts(self.broker, self.broker_options, per_replica=self.batches_per_replica,
                          redis_db=self.redis_db, aws_region=self.aws_region)

    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    @property
    def compile_mode(self) -> str:
        return self.compile or self.profile.compile

    def lora(self, models: list[str] | None = None) -> tuple[str, str]:
        """The LoRA mode the workers serving `models` run (rendered as their --lora-mode) and
        why: a LoRA profile matched against the pods' device generation, not this host's, and
        its versions (the image's) not checked here."""
        return lora_modes.resolve(self.backend, self.compile_mode, self.lora_mode, self.lora_profile,
                                  generation=self.profile.generation, models=models, versions=None)

    def adapter_refusal(self) -> str | None:
        """Why the rendered workers take no LoRA adapters (a --tp group, a compile mode with
        no LoRA row), or None."""
        return lora_modes.refusal(self.backend, self.compile_mode, self.lora()[0], self.tp)

    @property
    def takes_adapters(self) -> bool:
        """Whether the rendered workers serve LoRA runs: with no --allowed-adapters any
        adapter is allowed, so every pool whose workers can hold one does."""
        return self.adapter_refusal() is None

    def lora_warnings(self, shapes: int, models: list[str] | None = None) -> list[str]:
        """What LoRA runs cost (or meet) on the rendered pools: none served by a --tp group,
        and one compile per adapter set where the rendered mode compiles per set."""
        if reason := self.adapter_refusal():
            return [f"these pools take no LoRA adapters: {reason}; a LoRA run's queues (Q.r...) are served by no "
                    f"pool rendered here"]
        mode, why = self.lora(models)
        # A --lora-mode FILE.json measured elsewhere: the table's mode, and why.
        warnings = [f"--lora-mode {mode}: {why}"] if lora_modes.PASSED_OVER in why else []
        facts = self.backend.lora_facts(self.compile_mode)
        if mode != "compile" or (facts is not None and facts.graph_inputs):
            return warnings  # compile over weights known to be graph inputs reuses the graphs
        allowed = "--allowed-adapters" if self.allowed_adapters else "no --allowed-adapters: any adapter"
        return warnings + [
            f"LoRA runs on --device {self.device} --compile {self.compile_mode} ({allowed}): --lora-mode {mode} "
            f"compiles one graph set per (shape, adapter set): each worker compiles sets x shapes, here sets x "
            f"{shapes} shape(s), a first batch's compile for every new set it meets ({why})"]

    @property
    def profile(self) -> K8sPod:
        if self.backend.k8s is None:
            raise ValueError(f"--device {self.device} is not deployable on Kubernetes (its backend table row says so)")
        return self.backend.k8s


def worker_args(shape: ShapeKey, options: FleetOptions) -> list[str]:
    """The container args after the image's `ENTRYPOINT ["diffq", "worker"]`: one shape queue."""
    return _args(options, ["--queues", shape.queue, "--model", shape.model, "--dtype", shape.dtype], shape.model)


def pool_args(model: str, dtype: str, options: FleetOptions) -> list[str]:
    """A pool's container args: no --queues, the workers list the model's shape queues."""
    return _args(options, ["--models", model, "--model", model, "--dtype", dtype], model)


def _args(options: FleetOptions, serve: list[str], model: str) -> list[str]:
    backend, profile = options.backend, options.profile
    n = options.devices_per_pod or profile.devices_per_pod
    if n % options.tp:
        raise ValueError(f"--tp {options.tp} must divide the {n} devices per pod")
    compile = options.compile_mode
    # The same checks `diffq worker` makes, at render time: the pod's devices are 0..n-1
    # (or whatever the device plugin allocated: the same count).
    backend.check(compile=compile, devices=list(range(n)), tp=options.tp, generation=profile.generation)
    lora_mode = options.lora([model])[0]
    if options.allowed_adapters and (reason := options.adapter_refusal()):
        raise ValueError(f"--allowed-adapters: {reason}")
    # The option that lists a kind's devices comes from the backend table; where the
    # device plugin names the allocated devices, the manifest does not override it.
    option = backend.device_option
    pin = [option, str(n)] if option == "--workers" else [option, profile.devices_arg or f"0-{n - 1}"]
    tp = ["--tp", str(options.tp)] if options.tp > 1 else []
    # The drain ends (batch finished or handed back, exit 0) before the pod's grace period.
    drain = max(0, grace_seconds(options) - DRAIN_MARGIN_S)
    return ["--device", backend.name, *pin, *tp, *serve, "--compile", compile, "--lora-mode", lora_mode,
            "--compile-cache", f"{CACHE_MOUNT}/compile", "--drain-timeout", str(drain)]


def grace_seconds(options: FleetOptions) -> int:
    return options.grace_seconds or options.profile.grace_seconds


def deployment(name: str, args: list[str], models: list[str], annotations: dict[str, str],
               options: FleetOptions) -> dict:
    profile = options.profile
    n = options.devices_per_pod or profile.devices_per_pod
    labels = {"app.kubernetes.io/name": "diffq-worker", "app.kubernetes.io/instance": name,
              "diffq/device": options.device}
    resources: dict = {"requests": {"cpu": profile.cpu, "memory": profile.memory},
                       "limits": {"memory": profile.memory}}
    if profile.resource:
        resources["requests"][profile.resource] = n
        resources["limits"][profile.resource] = n
    env = broker_env(options) + admission_env(models, options) + [
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        {"name": "DIFFQ_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "DIFFQ_LOG_JSON", "value": "true"},
    ]
    pod: dict = {
        "terminationGracePeriodSeconds": grace_seconds(options),
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
        "containers": [{
            "name": "worker",
            "image": options.image or DEFAULT_IMAGE.format(device=options.device),
            "args": args,
            "env": env,
            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
            "resources": resources,
            "volumeMounts": [{"name": "cache", "mountPath": CACHE_MOUNT}],
        }],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": CACHE_PVC}}],
    }
    if any(is_model_url(model) for model in models):
        _mount_model_cache(pod, options)
    if profile.shm_size:
        # Memory-backed: a container's own /dev/shm is 64 MiB.
        pod["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}})
        pod["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    if profile.node_selector:
        pod["nodeSelector"] = dict(profile.node_selector)
    if profile.tolerations:
        pod["tolerations"] = [dict(t) for t in profile.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": options.namespace, "labels": labels,
                     "annotations": annotations},
        # No `replicas`: KEDA owns the count; re-applying must not reset it.
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": name}},
            # Never surge a second accelerator pod for a rollout; replace in place.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": labels, "annotations": {
                "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}},
                "spec": pod},
        },
    }


def broker_env(options: FleetOptions) -> list[dict]:
    """DIFFQ_BROKER_URL and what else the broker's row says a pod reads from the Secret."""
    # The broker's extras are optional: pods on EKS may get AWS credentials from their
    # service account instead, and only discovery pools need the RabbitMQ API.
    # Transport options the URL cannot carry (Sentinel's master_name): the workers'
    # kombu needs them as much as KEDA's scaler does.
    extra = ([{"name": "DIFFQ_BROKER_TRANSPORT_OPTIONS", "value": json.dumps(options.broker_options, sort_keys=True)}]
             if options.broker_options else [])
    return [{"name": "DIFFQ_BROKER_URL", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "broker-url"}}}] + [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key, "optional": True}}}
        for name, key in options.transport.secret_env] + extra


def _mount_model_cache(pod: dict, options: FleetOptions) -> None:
    """The node-local model cache and the model bucket's optional Secret."""
    container = pod["containers"][0]
    pod["volumes"] += [
        {"name": MODEL_CACHE, "emptyDir": {"sizeLimit": f"{options.model_cache_gib}Gi"}},
        {"name": MODEL_STORE_SECRET, "secret": {"secretName": MODEL_STORE_SECRET, "optional": True}}]
    container["volumeMounts"] += [
        {"name": MODEL_CACHE, "mountPath": MODEL_CACHE_MOUNT},
        {"name": MODEL_STORE_SECRET, "mountPath": MODEL_STORE_MOUNT, "readOnly": True}]
    container["env"] += [
        {"name": "DIFFQ_MODEL_CACHE", "value": MODEL_CACHE_MOUNT},
        # 95% of the sizeLimit (GiB to GB): evicting an unused model beats losing the pod.
        {"name": "DIFFQ_MODEL_CACHE_MAX_GB", "value": f"{options.model_cache_gib * 2**30 * 0.95 / 1e9:.1f}"}]
    container["envFrom"] = [{"secretRef": {"name": MODEL_STORE_SECRET, "optional": True}}]


def admission_env(models: list[str], options: FleetOptions) -> list[dict]:
    """What a worker admits (worker settings, diffq/core/settings.py): run folders under
    the fleet's prefixes (none rendered with --any-out), the pool's models, the LoRA
    adapters under the fleet's adapter prefixes (where given), and batches signed with a
    key of the optional signing Secret."""
    options.check_out()
    env = [{"name": OUT_PREFIXES_ENV, "value": json.dumps(list(options.out_prefixes))}] if options.out_prefixes \
        else []
    env.append({"name": MODELS_ENV, "value": json.dumps(list(models))})
    if options.allowed_adapters:
        env.append({"name": ADAPTERS_ENV, "value": json.dumps(list(options.allowed_adapters))})
    return env + signing_env()


def header(options: FleetOptions) -> str:
    """The comment each rendered file starts with; loud where workers write anywhere."""
    text = "# Generated by `diffq fleet manifests`; regenerate rather than edit.\n"
    if options.any_out:
        text += ("# WARNING: rendered with --any-out: no DIFFQ_ALLOWED_OUT_PREFIXES, so these workers write\n"
                 "# into whatever run folder a batch names. Re-render with --out-prefix s3://BUCKET/runs.\n")
    return text


def queue_triggers(queues: list[str], options: FleetOptions) -> list[dict]:
    """One trigger per queue, of the scaler the transport table names for the broker."""
    scaler, facts = options.scaler, options.keda_facts
    return [{"type": scaler.type, "metadata": scaler.metadata(queue, facts),
             "authenticationRef": {"name": TRIGGER_AUTH}} for queue in queues]


def backlog_trigger(model: str, options: FleetOptions, queue: str | None = None) -> dict:
    """The model's backlog over all its shape queues, including shapes first
    published after rendering, or one queue's (`queue`: a per-shape pool's); queued
    plus what the feeder still holds in OUT (KEDA's metrics-api scaler reads diffq-backlog)."""
    query = f"queue={urllib.parse.quote(queue, safe='')}" if queue else f"model={model_slug(model)}"
    url = f"http://{BACKLOG}.{options.namespace}.svc:{BACKLOG_PORT}/backlog?{query}"
    return {"type": "metrics-api", "metadata": {
        "url": url, "format": "json", "valueLocation": "backlog",
        "targetValue": str(options.batches_per_replica), "activationTargetValue": "0"}}


def scaled_object(name: str, queues: list[str], triggers: list[dict], annotations: dict[str, str],
                  options: FleetOptions) -> dict:
    """The pool serving `queues`, scaled on `triggers` (KEDA takes the largest)."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": options.namespace, "annotations": annotations},
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": 0,
            "maxReplicaCount": options.replicas_for(queues),
            "pollingInterval": 15,
            # LLEN drops to 0 while the last batches still run (they sit in
            # `unacked`); the cooldown and the warm shutdown cover that tail.
            "cooldownPeriod": 300,
            "triggers": triggers,
        },
    }


def common(options: FleetOptions) -> list[dict]:
    """Objects every shape shares: the RWX cache volume and KEDA's broker credentials
    (the parameters of the broker's scaler, from the transport table)."""
    return [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": CACHE_PVC, "namespace": options.namespace},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": options.storage_class,
                  "resources": {"requests": {"storage": options.cache_size}}}},
        {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
         "metadata": {"name": TRIGGER_AUTH, "namespace": options.namespace},
         "spec": {"secretTargetRef": [{"parameter": parameter, "name": SECRET, "key": key}
                                      for parameter, key in options.scaler.auth]}},
    ]


def backlog_args(options: FleetOptions) -> list[str]:
    """The service's command: it feeds the runs registered under each out-prefix (and the feeds folder)."""
    return ["diffq", "fleet", "backlog", "--port", str(BACKLOG_PORT)] + [
        arg for prefix in options.out_prefixes for arg in ("--out-prefix", prefix)] + (
        ["--feeds", options.feeds] if options.feeds else [])


def signing_env() -> list[dict]:
    """The optional signing Secret's keys: workers check with them, the feeder signs."""
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": SIGNING_SECRET, "key": key, "optional": True}}}
            for name, key in SIGNING_ENV]


def backlog_service(options: FleetOptions) -> list[dict]:
    """The per-model backlog (and, given out-prefixes or a feeds folder, the fleet's feeder,
    which signs what it publishes): one small torch-free pod and its Service."""
    labels = {"app.kubernetes.io/name": BACKLOG}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": BACKLOG, "namespace": options.namespace, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                      "containers": [{
                          "name": "backlog",
                          "image": options.image or DEFAULT_IMAGE.format(device=options.device),
                          "command": backlog_args(options),
                          "env": broker_env(options) + (signing_env() if options.fed else []),
                          "ports": [{"name": "http", "containerPort": BACKLOG_PORT}],
                          "readinessProbe": {"httpGet": {"path": "/healthz", "port": BACKLOG_PORT}},
                          "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                        "limits": {"memory": "512Mi"}}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": BACKLOG, "namespace": options.namespace, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": BACKLOG_PORT, "targetPort": BACKLOG_PORT}]}},
    ]


def render(shapes: list[ShapeKey], options: FleetOptions) -> dict[str, list[dict]]:
    """File stem -> documents: `common`, then a Deployment + ScaledObject per pool
    (per model where the profile's workers serve every shape, else per shape queue)."""
    options.check_out()
    rendered = {"common": common(options)}
    if options.profile.pool == "model" or options.fed or options.takes_adapters:
        rendered["common"] += backlog_service(options)
    if options.profile.pool == "model":
        pools: dict[tuple[str, str], list[str]] = {}
        for shape in shapes:
            pools.setdefault((shape.model, shape.dtype), []).append(shape.queue)
        for (model, dtype), queues in pools.items():
            name = k8s_name(f"diffq.{model_slug(model)}.{dtype}")
            annotations = {"diffq/model": model, "diffq/queues": ",".join(queues)}
            # The render-time queues directly, and every queue of the model through the backlog.
            triggers = queue_triggers(queues, options) + [backlog_trigger(model, options)]
            rendered[name] = [deployment(name, pool_args(model, dtype, options), [model], annotations, options),
                              scaled_object(name, queues, triggers, annotations, options)]
        return rendered
    for shape in shapes:
        name = k8s_name(shape.queue)
        annotations = {"diffq/queue": shape.queue}
        triggers = queue_triggers([shape.queue], options)
        # The queue holds only the window, or LoRA runs come on its layout-labelled variants
        # (`Q.r16-…`, served by its workers; any adapter where no allow-list is given): scale
        # on the backlog, which counts them all.
        if options.fed or options.takes_adapters:
            triggers.append(backlog_trigger(shape.model, options, queue=shape.queue))
        rendered[name] = [deployment(name, worker_args(shape, options), [shape.model], annotations, options),
                          scaled_object(name, [shape.queue], triggers, annotations, options)]
    return rendered


class _Dumper(yaml.SafeDumper):
    # Plain YAML without &anchors/*aliases for objects used twice (pod labels).
    def ignore_aliases(self, data) -> bool:
        return True


def dump(documents: list[dict], header: str = "") -> str:
    body = "---\n".join(yaml.dump(doc, Dumper=_Dumper, sort_keys=False) for doc in documents)
    return header + body


def write(rendered: dict[str, list[dict]], directory: str | Path, header: str = "") -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, documents in rendered.items():
        path = directory / f"{stem}.yaml"
        path.write_text(dump(documents, header))
        paths.append(path)
    return paths
