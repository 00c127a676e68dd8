"""docker-compose.yml, the Dockerfiles and the Kubernetes manifests, checked offline.

No Docker engine or cluster here: compose goes through the compose CLI where one is
installed and always through the Compose JSON schema; Kubernetes objects through
kubernetes-validate's bundled OpenAPI schemas; KEDA objects through a schema written
from the KEDA CRDs (tests/data/README.md).
"""

from __future__ import annotations

import copy
import json
import urllib.parse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from diffq.app import fleet
from diffq.app.cli import app
from diffq.core.contract import ShapeKey, is_shape_queue, queue_name
from diffq.core.options import GenerationOptions
from diffq.producer.submit import make_options, validate
from diffq.worker.device.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "infra" / "k8s"
DOCKERFILES = {dev: ROOT / "infra" / "docker" / f"Dockerfile.{dev}" for dev in ("cpu", "cuda", "neuron", "tpu")}
# The oldest Kubernetes EKS and GKE still support, and the newest schema shipped.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
DIFFQ_IMAGE_ENTRYPOINT = ["diffq", "worker"]

# How the committed per-shape manifests were made; regenerated and compared below.
COMMITTED = {
    "trn2": ["--device", "neuron", "--storage-class", "efs-sc", "--out-prefix", "s3://diffq-runs/runs"],
    "tpu": ["--device", "tpu", "--storage-class", "standard-rwx", "--out-prefix", "gs://diffq-runs/runs"],
}
COMMITTED_SHAPES = ["--model", "black-forest-labs/FLUX.2-klein-4B", "--shapes", "1024x1024,768x1344",
                    "--batch-size", "4", "--max-sequence-length", "512"]

runner = CliRunner()


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def keda_validator():
    return jsonschema.Draft202012Validator(json.loads((DATA / "keda.schema.json").read_text()))


def validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        keda_validator().validate(doc)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def diffq_argv(service: dict) -> list[str]:
    entrypoint = service.get("entrypoint", DIFFQ_IMAGE_ENTRYPOINT)
    command = service.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else command
    return list(entrypoint) + [str(c) for c in command]


def parse_cli(argv: list[str]):
    """Parse argv like the `diffq` command would, without running it: every option,
    type and choice is checked. Returns (subcommand name, its parsed params)."""
    assert argv[0] == "diffq"
    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="diffq")
    name = argv[1]
    command = group.get_command(ctx, name)
    assert command is not None, f"no diffq command {name!r}"
    return name, command.make_context(name, list(argv[2:]), parent=ctx).params


# --- docker-compose.yml -----------------------------------------------------

def test_compose_matches_compose_schema(compose):
    schema = json.loads((DATA / "compose_spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose)


def test_compose_cli_config_accepts_file():
    """`docker compose config` needs no daemon; neither does v1 `docker-compose config`."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run(cmd + ["version"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            continue
        done = subprocess.run(cmd + ["-f", str(COMPOSE), "config", "-q"], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return
    pytest.skip("no compose CLI here (neither `docker compose` nor `docker-compose`)")


def test_compose_services_run_real_diffq_commands(compose):
    seen = set()
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        command, params = parse_cli(diffq_argv(service))
        seen.add(command)
        if command == "worker":
            assert params["model"] == "/models/tiny"
    assert seen == {"tiny-pipeline", "worker", "submit", "fleet"}


def compose_env(service: dict) -> dict[str, str]:
    """A service's environment as its container sees it, with nothing set in the shell
    (`${VAR:-default}` is its default)."""
    return {name: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
            for name, value in service.get("environment", {}).items()}


def test_compose_worker_plan_runs(compose):
    """The worker's exact arguments and environment, run with --plan: the real command,
    nothing started."""
    argv = diffq_argv(compose["services"]["worker"])
    result = runner.invoke(app, argv[1:] + ["--plan"], env=compose_env(compose["services"]["worker"]))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    # Told where to write and what to load, it only warns that batches are unsigned.
    assert "DIFFQ_ALLOWED_OUT_PREFIXES" not in result.stderr and "DIFFQ_ALLOWED_MODELS" not in result.stderr
    assert [child["device"] for child in plan] == ["cpu"]


def test_compose_workers_discover_the_producers_queues(compose):
    """Workers name no queues: they serve every shape queue of the producer's model
    that the broker lists (worker/delivery/routing.py), whatever shapes a run has."""
    _, submit = parse_cli(diffq_argv(compose["services"]["producer"]))
    _, worker = parse_cli(diffq_argv(compose["services"]["worker"]))
    assert worker["queues"] is None and worker["run"] is None
    assert worker["serve_models"] == worker["model"] == submit["model"]
    options, defaults = make_options(model=submit["model"], options=GenerationOptions.of(batch_size=submit["batch_size"],
                                     steps=submit["steps"], guidance_scale=submit["guidance_scale"],
                                     max_sequence_length=submit["max_sequence_length"],
                                     height=submit["height"], width=submit["width"],
                                     dtype=submit["dtype"].value))
    plan = validate(ROOT / submit["prompts"], options, defaults)
    assert all(is_shape_queue(s.queue, [worker["serve_models"]]) for s in plan.shapes)
    assert "diffq.tiny-" not in COMPOSE.read_text()  # no example queue names hard-coded


def test_compose_fleet_wiring(compose):
    services = compose["services"]
    redis = services["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "mc mb" in " ".join(services["minio-init"]["command"])
    assert "s3://diffq/" in " ".join(services["producer"]["command"])
    for name in ("redis", "minio", "worker", "flower", "feeder"):
        assert "healthcheck" in services[name], name
    # The producer's run folder lies under the feeder's prefix, and it waits for the feeder:
    # its submit finds the heartbeat and keeps a window in Redis (producer/feed.py).
    feeder = diffq_argv(services["feeder"])
    prefix = feeder[feeder.index("--out-prefix") + 1]
    _, submit = parse_cli(diffq_argv(services["producer"]))
    assert submit["out_"].startswith(prefix + "/") and feeder[1:3] == ["fleet", "backlog"]
    assert services["producer"]["depends_on"]["feeder"]["condition"] == "service_healthy"
    worker = services["worker"]
    assert worker["deploy"]["replicas"] >= 2
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("worker", "producer"):
        conditions = services[name]["depends_on"]
        assert conditions["tiny-model"]["condition"] == "service_completed_successfully"
        assert conditions["minio-init"]["condition"] == "service_completed_successfully"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
    assert mounts["/cache/compile"] in compose["volumes"] and mounts["/cache/hf"] in compose["volumes"]
    assert worker["environment"]["HF_HOME"] == "/cache/hf"
    assert worker["environment"]["DIFFQ_BROKER_URL"].startswith("redis://redis:")


def test_compose_workers_write_where_the_producer_runs_and_load_its_model(compose, monkeypatch):
    """The worker env, read by the real settings: the producer's --out lies under an
    allowed prefix (on a path boundary, as workers check it), its --model is allowed, and
    producer and workers share the signing key."""
    from diffq.core.settings import Settings
    from diffq.core.storage import open_storage

    services = compose["services"]
    _, submit = parse_cli(diffq_argv(services["producer"]))
    for name, value in compose_env(services["worker"]).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    out = open_storage(submit["out_"]).url
    assert settings.allowed_out_prefixes and any(out.startswith(p.rstrip("/") + "/")
                                                 for p in settings.allowed_out_prefixes)
    assert settings.allowed_models == [submit["model"]]
    for key in ("DIFFQ_SIGNING_KEY", "DIFFQ_SIGNING_KEY_PREVIOUS"):
        assert services["worker"]["environment"][key] == services["producer"]["environment"][key]
        assert services["worker"]["environment"][key] == f"${{{key}:-}}"  # from the shell, empty by default


# --- Dockerfiles --------------------------------------------------------------

def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        instruction, _, args = current.partition(" ")
        lines.append((instruction.upper(), args.strip()))
        current = ""
    return lines


@pytest.mark.parametrize("device", sorted(DOCKERFILES))
def test_dockerfile_structure(device):
    instructions = dockerfile(DOCKERFILES[device])
    kinds = [i for i, _ in instructions]
    args = lambda kind: [a for i, a in instructions if i == kind]  # noqa: E731
    assert kinds[0] in ("FROM", "ARG") and "FROM" in kinds
    users = args("USER")
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN"), "nothing runs as root after USER"
    assert json.loads(args("ENTRYPOINT")[-1]) == DIFFQ_IMAGE_ENTRYPOINT  # exec form: SIGTERM reaches diffq
    volumes = [v for a in args("VOLUME") for v in json.loads(a)]
    env = " ".join(args("ENV"))
    assert "HF_HOME=/cache/hf" in env and "/cache/hf" in volumes
    assert "DIFFQ_COMPILE_CACHE=/cache/compile" in env and "/cache/compile" in volumes
    runs = args("RUN")
    assert any("useradd" in r and "chown" in r for r in runs)
    # torch pinned, and installed before diffq so pip never swaps in another build.
    torch_at = next(i for i, r in enumerate(runs) if "torch" in r.lower())
    diffq_at = next(i for i, r in enumerate(runs) if re.search(r'pip install\b.*(\s\.$|"\.\[)', r))
    assert torch_at < diffq_at
    assert re.search(r"torch==2\.13\.0|torch-neuronx==2\.13\.\*", DOCKERFILES[device].read_text())


def test_dockerfile_backends():
    neuron = DOCKERFILES["neuron"].read_text()
    assert "https://pip.repos.neuron.amazonaws.com" in neuron and "torch-neuronx" in neuron
    assert "aws-neuronx-runtime-lib" in neuron and '".[neuron]"' in neuron
    # BACKENDS.md Trainium "install": torch-neuronx plus neuronx-cc==2.* and nki, in the
    # image and in the `neuron` extra (the vendor quickstart installs all three).
    install = next(a for i, a in dockerfile(DOCKERFILES["neuron"]) if i == "RUN" and "TORCH_NEURONX_SPEC" in a)
    assert "NEURONX_CC_SPEC" in install and install.rstrip().endswith("nki")
    assert 'NEURONX_CC_SPEC="neuronx-cc==2.*"' in neuron
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"neuronx-cc==2.*", "nki"} <= set(extras["neuron"]) and extras["neuron"][0].startswith("torch-neuronx")
    assert extras["tpu"] == ["torch-tpu==0.2.0"]
    tpu = DOCKERFILES["tpu"].read_text()
    assert '"torch-tpu==0.2.0"' in tpu and "libtpu" in tpu
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES["cpu"].read_text()


# --- Kubernetes -----------------------------------------------------------------

def committed_docs() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(K8S.rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_committed_manifests_validate():
    docs = committed_docs()
    kinds = {doc["kind"] for _, doc in docs}
    assert {"Deployment", "ScaledObject", "TriggerAuthentication", "PersistentVolumeClaim",
            "Secret", "Namespace"} <= kinds
    for path, doc in docs:
        try:
            validate_manifest(doc)
        except Exception as exc:
            raise AssertionError(f"{path.relative_to(ROOT)} {doc['kind']}: {exc}") from exc


@pytest.mark.parametrize("folder", sorted(COMMITTED))
def test_committed_manifests_are_rendered(folder, tmp_path):
    """The committed per-shape files are exactly what `diffq fleet manifests` renders."""
    result = runner.invoke(app, ["fleet", "manifests", *COMMITTED_SHAPES, *COMMITTED[folder],
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rendered = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    committed = {p.name: p.read_text() for p in (K8S / folder).glob("*.yaml")}
    assert rendered == committed, f"regenerate infra/k8s/{folder} (see infra/README.md)"


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def worker_deployments(docs: list[dict]) -> list[dict]:
    """The worker pools (not the backlog service discovery pools scale on)."""
    return [d for d in by_kind(docs, "Deployment")
            if d["metadata"]["labels"]["app.kubernetes.io/name"] == "diffq-worker"]


def plain_env(deployment: dict) -> dict[str, str]:
    """A worker container's literal env values (not those from Secrets)."""
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if "value" in e}


# Where the tests' fleets write (a fleet must name it: --out-prefix or --any-out).
OUT_PREFIX = "s3://diffq-runs/runs"


def render_cli(*args: str, env: dict | None = None) -> list[dict]:
    prefix = [] if {"--out-prefix", "--any-out"} & set(args) else ["--out-prefix", OUT_PREFIX]
    result = runner.invoke(app, ["fleet", "manifests", *args, *prefix],
                           env={"DIFFQ_ALLOWED_OUT_PREFIXES": None, **(env or {})})
    assert result.exit_code == 0, result.output
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def flux2_queues(device: str) -> list[str]:
    # No --dtype: auto, as `diffq submit` publishes without one (each worker runs it at its
    # device's default_dtype).
    return [queue_name(ShapeKey(model="/models/flux2", height=h, width=w, batch_size=2, max_sequence_length=256,
                                cfg=True, dtype="auto"))
            for h, w in [(1024, 1024), (768, 1344)]]


@pytest.mark.parametrize("device", ["neuron", "tpu"])
def test_rendered_shape_pools_validate_and_match_queue_names(device):
    """Devices whose compiles take minutes: one pool per shape queue."""
    docs = render_cli("--model", "/models/flux2", "--shapes", "1024x1024,768x1344", "--batch-size", "2",
                      "--device", device, "--guidance-scale", "3.5", "--max-sequence-length", "256")
    for doc in docs:
        validate_manifest(doc)
    deployments, scaled = worker_deployments(docs), by_kind(docs, "ScaledObject")
    assert len(deployments) == len(scaled) == 2
    for queue, dep, so in zip(flux2_queues(device), deployments, scaled):
        # The queue's list, and its whole backlog (the feeder under --out-prefix holds the rest in OUT).
        [trigger, backlog] = so["spec"]["triggers"]
        assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == queue
        assert backlog["type"] == "metrics-api" and backlog["metadata"]["url"].endswith(
            "/backlog?" + urllib.parse.urlencode({"queue": queue}))
        assert so["spec"]["minReplicaCount"] == 0
        assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--queues") + 1] == queue
        # The args really parse as `diffq worker` options.
        name, params = parse_cli(DIFFQ_IMAGE_ENTRYPOINT + args)
        assert (name, params["device"].value, params["queues"]) == ("worker", device, queue)
        env = {e["name"]: e for e in container["env"]}
        assert env["DIFFQ_BROKER_URL"]["valueFrom"]["secretKeyRef"]["name"] == fleet.SECRET


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_rendered_model_pools_discover_every_shape(device):
    """Devices whose workers serve every shape: one pool per model, no queue names in
    its args (the workers list the model's queues), scaled on every shape's list."""
    docs = render_cli("--model", "/models/flux2", "--shapes", "1024x1024,768x1344", "--batch-size", "2",
                      "--device", device, "--guidance-scale", "3.5", "--max-sequence-length", "256")
    for doc in docs:
        validate_manifest(doc)
    [dep], [so] = worker_deployments(docs), by_kind(docs, "ScaledObject")
    *lists, backlog = so["spec"]["triggers"]
    assert [t["metadata"]["listName"] for t in lists] == flux2_queues(device)
    # Shapes first published after rendering: the model's backlog over all its queues.
    assert backlog["type"] == "metrics-api" and backlog["metadata"]["valueLocation"] == "backlog"
    assert backlog["metadata"]["url"].endswith(f"/backlog?model={flux2_queues(device)[0].split('.')[1]}")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(queue in " ".join(args) for queue in flux2_queues(device))
    name, params = parse_cli(DIFFQ_IMAGE_ENTRYPOINT + args)
    assert (name, params["device"].value, params["queues"], params["serve_models"]) == \
        ("worker", device, None, "/models/flux2")
    result = runner.invoke(app, ["worker", *args, "--plan"],
                           env={**plain_env(dep), "DIFFQ_BROKER_URL": "redis://redis:6379/0"})
    assert result.exit_code == 0, result.output
    assert all(child["discover"] and child["serve_models"] == ["/models/flux2"] for child in json.loads(result.stdout))


def test_neuron_cores_match_request():
    docs = render_cli("--model", "m", "--shapes", "1024x1024", "--batch-size", "1", "--device", "neuron",
                      "--devices-per-pod", "16")
    pod = worker_deployments(docs)[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    # The cores the Neuron device plugin allocated, never a hard-coded range over them.
    assert args[args.index("--cores") + 1] == "auto"
    name, params = parse_cli(DIFFQ_IMAGE_ENTRYPOINT + args)
    assert params["cores"] == "auto"
    result = runner.invoke(app, ["worker", *args, "--plan"],
                           env={**plain_env(worker_deployments(docs)[0]), "DIFFQ_BROKER_URL": "redis://r:6379/0",
                                "NEURON_RT_VISIBLE_CORES": "16-31"})
    assert result.exit_code == 0, result.output
    assert [p["env"]["NEURON_RT_VISIBLE_CORES"] for p in json.loads(result.stdout)] == [str(c) for c in range(16, 32)]
    # The queue says auto, as submit publishes it; the plan says what it runs at here.
    assert args[args.index("--dtype") + 1] == "auto"
    assert {(p["dtype"], p["runs_dtype"]) for p in json.loads(result.stdout)} == {("auto", "bfloat16")}
    assert container["resources"]["limits"]["aws.amazon.com/neuroncore"] == 16
    assert container["resources"]["requests"]["aws.amazon.com/neuroncore"] == 16
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"].startswith("trn2")
    assert any(t["key"] == "aws.amazon.com/neuron" for t in pod["tolerations"])
    assert pod["terminationGracePeriodSeconds"] >= 1800


def test_tpu_selectors_and_chips():
    docs = render_cli("--model", "m", "--shapes", "1024x1024", "--batch-size", "1", "--device", "tpu")
    pod = worker_deployments(docs)[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][container["args"].index("--chips") + 1] == "0-3"
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= set(pod["nodeSelector"])
    # A first TPU compile can take ~1,100 s: the grace period must outlast it.
    assert pod["terminationGracePeriodSeconds"] > 1100
    # BACKENDS.md TPU "tier-2 cache": tier 3 needs tier 2 in /dev/shm (tier3_compilation_cache.cc):
    # a memory-backed /dev/shm of a stated size.
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    for device in ("neuron", "cuda", "cpu"):
        other = worker_deployments(render_cli("--model", "m", "--shapes", "64x64", "--batch-size", "1",
                                              "--device", device))[0]["spec"]["template"]["spec"]
        assert [v["name"] for v in other["volumes"]] == ["cache"]


def test_every_backend_is_deployable_or_says_it_is_not(monkeypatch):
    """A backend cannot be half-added: its pod facts are a required field of its table row."""
    import dataclasses

    from diffq.worker.device import backends

    keys = fleet.shape_keys("m", [(64, 64)], batch_size=1)
    for name, backend in backends.BACKENDS.items():
        assert backend.k8s is None or isinstance(backend.k8s, backends.K8sPod), name
        if backend.k8s is not None:
            rendered = fleet.render(keys, fleet.FleetOptions(device=name, out_prefixes=(OUT_PREFIX,)))
            [pool] = [stem for stem in rendered if stem != "common"]
            for doc in rendered[pool]:
                validate_manifest(doc)
    fields = dataclasses.fields(backends.Backend)
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert "k8s" in required
    with pytest.raises(TypeError, match="k8s"):
        backends.Backend(**{f: getattr(backends.BACKENDS["cpu"], f) for f in required - {"k8s"}})
    # Explicitly not deployable: rendering says so instead of guessing a pod.
    monkeypatch.setitem(backends.BACKENDS, "cpu", dataclasses.replace(backends.BACKENDS["cpu"], k8s=None))
    with pytest.raises(ValueError, match="--device cpu is not deployable"):
        fleet.render(keys, fleet.FleetOptions(device="cpu", out_prefixes=(OUT_PREFIX,)))


def test_shared_objects_fit_together():
    docs = [doc for _, doc in committed_docs()]
    pvc = by_kind(docs, "PersistentVolumeClaim")[0]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    secret = secrets[fleet.SECRET]
    auth = by_kind(docs, "TriggerAuthentication")[0]
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    for dep in by_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        if dep in worker_deployments(docs):  # the backlog service mounts nothing and keeps one replica
            assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
            assert "replicas" not in dep["spec"], "KEDA owns the replica count"
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["DIFFQ_BROKER_URL"]["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]
        # Every Secret a pod reads has its example, with the keys it needs.
        for ref in (e["valueFrom"]["secretKeyRef"] for e in env.values() if "valueFrom" in e):
            assert ref["key"] in secrets[ref["name"]]["stringData"] or ref.get("optional"), ref
    assert set(secrets[fleet.SIGNING_SECRET]["stringData"]) == {key for _, key in fleet.SIGNING_ENV}
    for so in by_kind(docs, "ScaledObject"):
        assert so["spec"]["triggers"][0]["authenticationRef"]["name"] == auth["metadata"]["name"]


def test_long_queue_names_make_valid_object_names():
    shape = ShapeKey(model="/very/long/path/to/a-model-with-an-extremely-long-folder-name-v2",
                     height=1024, width=1344, batch_size=16, max_sequence_length=512, cfg=True,
                     dtype="bfloat16")
    name = fleet.k8s_name(shape.queue)
    assert len(name) <= 52 and "1024x1344-b16-l512-cfg-bf16" in name
    for doc in fleet.render([shape], fleet.FleetOptions(device="neuron", out_prefixes=(OUT_PREFIX,)))[name]:
        validate_manifest(doc)


def test_validators_reject_mistakes():
    """The validators are live: a typo and a non-string KEDA value both fail."""
    docs = fleet.render(fleet.shape_keys("m", [(64, 64)], batch_size=1),
                        fleet.FleetOptions(device="cpu", any_out=True))
    dep, so = next(docs[k] for k in docs if k != "common")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["listLength"] = 4
    with pytest.raises(jsonschema.ValidationError):
        keda_validator().validate(bad)


def test_fleet_manifests_rejects_bad_shapes():
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "1024", "--batch-size", "1",
                                 "--out-prefix", OUT_PREFIX])
    assert result.exit_code == 2 and "HEIGHTxWIDTH" in result.output


# --- what a rendered worker admits: run folders, models, signed batches ---------------

DEPLOYABLE = sorted(name for name, backend in BACKENDS.items() if backend.k8s is not None)
FLEET_BROKERS = ["redis://", "rediss://r:6380/0", "sqs://", "amqp://rabbit:5672//", "pyamqp://rabbit//",
                 "amqps://rabbit:5671//"]


def container_env(deployment: dict) -> dict[str, dict]:
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("device", DEPLOYABLE)
def test_a_fleet_without_a_run_folder_prefix_is_refused(device):
    """No --out-prefix, no DIFFQ_ALLOWED_OUT_PREFIXES: nothing is rendered, and the
    error names both ways out."""
    args = ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--device", device]
    result = runner.invoke(app, args, env={"DIFFQ_ALLOWED_OUT_PREFIXES": None})
    assert result.exit_code == 2 and not result.stdout
    assert "--out-prefix s3://BUCKET/runs" in result.output and "--any-out" in result.output
    with pytest.raises(ValueError, match="--out-prefix"):
        fleet.render(fleet.shape_keys("m", [(64, 64)], batch_size=1), fleet.FleetOptions(device=device))
    contradiction = runner.invoke(app, [*args, "--any-out", "--out-prefix", OUT_PREFIX])
    assert contradiction.exit_code == 2 and "contradict" in contradiction.output


def test_the_prefix_defaults_to_the_setting():
    docs = render_cli("--model", "m", "--shapes", "64x64", "--device", "cpu", "--any-out")
    assert all("DIFFQ_ALLOWED_OUT_PREFIXES" not in container_env(d) for d in worker_deployments(docs))
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--device", "cpu"],
                           env={"DIFFQ_ALLOWED_OUT_PREFIXES": '["gs://from-env/runs/"]'})
    assert result.exit_code == 0, result.output
    [dep] = worker_deployments([d for d in yaml.safe_load_all(result.stdout) if d])
    assert json.loads(container_env(dep)["DIFFQ_ALLOWED_OUT_PREFIXES"]["value"]) == ["gs://from-env/runs"]
    # --out-prefix beats the setting.
    docs = render_cli("--model", "m", "--shapes", "64x64", "--device", "cpu", "--out-prefix", "/data/runs",
                      env={"DIFFQ_ALLOWED_OUT_PREFIXES": '["gs://from-env/runs"]'})
    [dep] = worker_deployments(docs)
    assert json.loads(container_env(dep)["DIFFQ_ALLOWED_OUT_PREFIXES"]["value"]) == ["/data/runs"]


def test_any_out_renders_no_prefix_and_says_so(tmp_path):
    args = ["fleet", "manifests", "--model", "m", "--shapes", "64x64,128x128", "--device", "neuron", "--any-out"]
    result = runner.invoke(app, args, env={"DIFFQ_ALLOWED_OUT_PREFIXES": '["s3://ignored/runs"]'})
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(fleet.header(fleet.FleetOptions(device="neuron", any_out=True)))
    assert "# WARNING: rendered with --any-out" in result.stdout and "--any-out" in result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    deployments = worker_deployments(docs)
    assert len(deployments) == 2
    for dep in deployments:
        validate_manifest(dep)
        env = container_env(dep)
        assert "DIFFQ_ALLOWED_OUT_PREFIXES" not in env
        assert json.loads(env["DIFFQ_ALLOWED_MODELS"]["value"]) == ["m"]
    # Every written file carries the warning.
    result = runner.invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert all("# WARNING: rendered with --any-out" in p.read_text() for p in tmp_path.glob("*.yaml"))


def test_the_adapter_allow_list_reaches_every_worker_pod_where_set():
    """--allowed-adapters (repeat or comma-separate; else DIFFQ_ALLOWED_ADAPTERS) is each
    worker's DIFFQ_ALLOWED_ADAPTERS, as its settings read it; unset, none is rendered."""
    from diffq.core.settings import Settings

    args = ("--model", "m", "--shapes", "64x64,128x128", "--device", "neuron")
    docs = render_cli(*args, "--allowed-adapters", "s3://loras/styles,/data/loras", "--allowed-adapters", "my-org",
                      env={"DIFFQ_ALLOWED_ADAPTERS": '["s3://ignored"]'})
    deployments = worker_deployments(docs)
    assert len(deployments) == 2
    for dep in deployments:
        value = json.loads(container_env(dep)["DIFFQ_ALLOWED_ADAPTERS"]["value"])
        assert Settings(allowed_adapters=value).allowed_adapters == ["s3://loras/styles", "/data/loras", "my-org"]
    [dep, _] = worker_deployments(render_cli(*args, env={"DIFFQ_ALLOWED_ADAPTERS": '["s3://from-env/loras"]'}))
    assert json.loads(container_env(dep)["DIFFQ_ALLOWED_ADAPTERS"]["value"]) == ["s3://from-env/loras"]
    assert all("DIFFQ_ALLOWED_ADAPTERS" not in container_env(d)
               for d in worker_deployments(render_cli(*args, env={"DIFFQ_ALLOWED_ADAPTERS": None})))


def _worker_arg(dep: dict, option: str) -> str:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(option) + 1]


@pytest.mark.parametrize("device, mode", [("cpu", "swap"), ("cuda", "swap"), ("neuron", "compile"), ("tpu", "compile")])
def test_each_device_renders_the_lora_mode_auto_resolves_to(device, mode, tmp_path):
    """`--lora-mode auto` (the default) is rendered resolved, per device: the backend
    table's mode; a mode named is rendered as named; a LoRA profile measured on the pods'
    device and generation, for the model, wins, one measured elsewhere or for another model
    does not (and the render says why)."""
    from diffq.core.profile import LoraMeasure, LoraProfile

    args = ("--model", "m", "--shapes", "64x64", "--device", device)
    assert {_worker_arg(dep, "--lora-mode") for dep in worker_deployments(render_cli(*args))} == {mode}
    assert {_worker_arg(dep, "--lora-mode") for dep in worker_deployments(render_cli(*args, "--lora-mode", "fuse"))} \
        == {"fuse"}
    pods = fleet.FleetOptions(device=device)
    other = "cuda" if device != "cuda" else "cpu"
    for measured_on, model, expected in ((device, "m", "fuse"), (other, "m", mode), (device, "other", mode)):
        path = tmp_path / f"lora-{measured_on}-{model}.json"
        LoraProfile(model=model, device=measured_on, generation=pods.profile.generation, compile=pods.compile_mode,
                    measured=[LoraMeasure(mode="swap", ok=False, s_per_image_with=0.5, refused="did not show"),
                              LoraMeasure(mode="fuse", ok=True, s_per_image_with=1.0),
                              LoraMeasure(mode="compile", ok=True, s_per_image_with=1.5)]).dump(path)
        result = runner.invoke(app, ["fleet", "manifests", *args, "--lora-mode", str(path), "--out-prefix", OUT_PREFIX])
        assert result.exit_code == 0, result.output
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        assert {_worker_arg(dep, "--lora-mode") for dep in worker_deployments(docs)} == {expected}, measured_on
        assert ("the LoRA profile not applied" in result.stderr) is (expected != "fuse"), result.stderr


@pytest.mark.parametrize("device", ["neuron", "tpu"])
def test_lora_runs_on_a_device_compiling_per_set_warn_with_the_compiles(device):
    """With or without --allowed-adapters (none: any adapter) the pools take LoRA runs,
    and where the rendered mode compiles per set the render says what that costs."""
    args = ["fleet", "manifests", "--model", "m", "--shapes", "64x64,128x128,96x96", "--device", device,
            "--out-prefix", OUT_PREFIX]
    for allowed, said in ((["--allowed-adapters", "s3://loras"], "--allowed-adapters"),
                          ([], "no --allowed-adapters: any adapter")):
        result = runner.invoke(app, [*args, *allowed], env={"DIFFQ_ALLOWED_ADAPTERS": None})
        assert result.exit_code == 0, result.output
        assert (f"warning: LoRA runs on --device {device} --compile regional ({said}): --lora-mode compile compiles "
                "one graph set per (shape, adapter set): each worker compiles sets x shapes, here sets x 3 shape(s)") \
            in result.stderr
    result = runner.invoke(app, [*args, "--allowed-adapters", "s3://loras", "--lora-mode", "swap"],
                           env={"DIFFQ_ALLOWED_ADAPTERS": None})
    assert result.exit_code == 0 and "compiles one graph set" not in result.stderr, result.output
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--device", "cpu",
                                 "--out-prefix", OUT_PREFIX, "--allowed-adapters", "s3://loras"],
                           env={"DIFFQ_ALLOWED_ADAPTERS": None})
    assert result.exit_code == 0 and "warning:" not in result.stderr


@pytest.mark.parametrize("device", ["neuron", "tpu"])
def test_an_unfed_per_shape_pool_scales_on_its_lora_runs_without_an_allow_list(device):
    """No feeder (--any-out) and no --allowed-adapters: any adapter is allowed, so each
    per-shape pool still scales on its backlog (`?queue=Q` counts Q's LoRA variants `Q.r…`,
    which its workers discover) and the backlog service is rendered. A --tp pool takes no
    adapters: no backlog trigger, and the render says its LoRA queues go unserved."""
    args = ["--model", "m", "--shapes", "64x64,128x128", "--device", device, "--any-out"]
    env = {"DIFFQ_ALLOWED_ADAPTERS": None}
    docs = render_cli(*args, env=env)
    assert [d["metadata"]["name"] for d in by_kind(docs, "Service")] == [fleet.BACKLOG]
    scaled = by_kind(docs, "ScaledObject")
    assert len(scaled) == 2
    for so in scaled:
        queue = so["metadata"]["annotations"]["diffq/queue"]
        [backlog] = [t for t in so["spec"]["triggers"] if t["type"] == "metrics-api"]
        assert backlog["metadata"]["url"].endswith("/backlog?" + urllib.parse.urlencode({"queue": queue}))
    group = str(fleet.FleetOptions(device=device).profile.devices_per_pod)  # one group a pod (TPU: one a host)
    tp = runner.invoke(app, ["fleet", "manifests", *args, "--tp", group], env=env)
    assert tp.exit_code == 0, tp.output
    docs = [d for d in yaml.safe_load_all(tp.stdout) if d]
    assert not by_kind(docs, "Service")
    assert all(t["type"] != "metrics-api" for so in by_kind(docs, "ScaledObject") for t in so["spec"]["triggers"])
    assert (f"warning: these pools take no LoRA adapters: LoRA adapters on a tensor-parallel group (--tp {group})"
            in tp.stderr and "are served by no pool rendered here" in tp.stderr)


def test_a_tp_fleet_with_adapters_is_refused_with_the_reason():
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--device", "neuron",
                                 "--tp", "2", "--out-prefix", OUT_PREFIX, "--allowed-adapters", "s3://loras"],
                           env={"DIFFQ_ALLOWED_ADAPTERS": None})
    assert result.exit_code == 2
    assert "error: --allowed-adapters: LoRA adapters on a tensor-parallel group (--tp 2)" in result.output
    assert render_cli("--model", "m", "--shapes", "64x64", "--device", "neuron", "--tp", "2",
                      env={"DIFFQ_ALLOWED_ADAPTERS": None})


@pytest.mark.parametrize("broker", FLEET_BROKERS)
@pytest.mark.parametrize("device", DEPLOYABLE)
def test_every_worker_pod_carries_the_prefix_models_and_signing_keys(device, broker):
    """Every worker container of every device kind and broker: the fleet's prefixes
    (JSON, as the settings read them), its pool's model, the optional signing Secret;
    the backlog service gets no prefix or model list (it writes no images), only the
    signing keys (its feeder signs what it publishes)."""
    from diffq.core.settings import Settings

    docs = render_cli("--model", "/models/flux2", "--shapes", "1024x1024,768x1344", "--batch-size", "2",
                      "--device", device, "--broker", broker,
                      "--out-prefix", "s3://diffq-runs/runs/,gs://diffq-runs", "--out-prefix", "/data/runs/")
    deployments = worker_deployments(docs)
    assert deployments
    for dep in deployments:
        validate_manifest(dep)
        env = container_env(dep)
        values = {name: e["value"] for name, e in env.items() if "value" in e}
        settings = Settings(**{k.removeprefix("DIFFQ_").lower(): json.loads(v) for k, v in values.items()
                               if k in ("DIFFQ_ALLOWED_OUT_PREFIXES", "DIFFQ_ALLOWED_MODELS")})
        assert settings.allowed_out_prefixes == ["s3://diffq-runs/runs", "gs://diffq-runs", "/data/runs"]
        assert settings.allowed_models == ["/models/flux2"]
        _, params = parse_cli(DIFFQ_IMAGE_ENTRYPOINT + dep["spec"]["template"]["spec"]["containers"][0]["args"])
        assert settings.allowed_models == [params["model"]]
        for name, key in fleet.SIGNING_ENV:
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": fleet.SIGNING_SECRET, "key": key,
                                                              "optional": True}
    for dep in by_kind(docs, "Deployment"):
        if dep not in deployments:  # the backlog service and feeder
            names = set(container_env(dep))
            assert not names & {"DIFFQ_ALLOWED_OUT_PREFIXES", "DIFFQ_ALLOWED_MODELS"}
            assert {name for name, _ in fleet.SIGNING_ENV} <= names


@pytest.mark.parametrize("given, prefixes", [
    (["s3://diffq-runs/runs/"], ("s3://diffq-runs/runs",)),
    (["S3://diffq-runs//runs//", "s3://diffq-runs/runs"], ("s3://diffq-runs/runs",)),
    (["gs://diffq-runs,/data/runs/", " /srv/x "], ("gs://diffq-runs", "/data/runs", "/srv/x")),
    (["/data//runs/./a/", "//data/runs/a"], ("/data/runs/a",)),
])
def test_out_prefixes_are_normalised(given, prefixes):
    assert fleet.parse_out_prefixes(given) == prefixes


@pytest.mark.parametrize("bad, says", [
    ("runs/r1", "absolute path"), ("http://host/runs", "s3://BUCKET"), ("file:///data", "s3://BUCKET"),
    ("s3://", "bucket"), ("s3://a/runs", "bucket"), ("/", "--any-out"), ("/data/../etc", "'..'"),
    ("s3://key:secret@bucket/runs", "credentials"),
])
def test_bad_out_prefixes_are_refused(bad, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        fleet.parse_out_prefixes([bad])
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--out-prefix", bad])
    assert result.exit_code == 2 and "--out-prefix" in result.output


@pytest.mark.parametrize("device", ["neuron", "tpu", "cuda", "cpu"])
@pytest.mark.parametrize("grace", [None, "1000"])
def test_drain_timeout_ends_before_the_grace_period(device, grace):
    """SIGTERM: the worker finishes or hands back its batch within --drain-timeout and
    exits 0, so Kubernetes never has to SIGKILL it at the end of the grace period."""
    from diffq.worker.device.backends import BACKENDS
    from diffq.worker.delivery.spec import DRAIN_MARGIN_S, DRAIN_TIMEOUT_S

    docs = render_cli("--model", "m", "--shapes", "1024x1024", "--batch-size", "1", "--device", device,
                      *(["--grace-seconds", grace] if grace else []))
    pod = worker_deployments(docs)[0]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    assert drain == pod["terminationGracePeriodSeconds"] - DRAIN_MARGIN_S > 0
    # The CLI's default fits inside the smallest grace period a profile sets.
    assert DRAIN_TIMEOUT_S <= min(b.k8s.grace_seconds for b in BACKENDS.values() if b.k8s) - DRAIN_MARGIN_S
