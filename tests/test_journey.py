"""The user's journey on defaults, device by device: `diffq submit` with no options →
`diffq fleet manifests` with only the prefix runs live under (`--out-prefix`) → the
rendered worker command serves the queue the producer published and the KEDA trigger
watches, and its rendered env admits the submitted run folder. For cpu the rendered
command and env then really run, against a private Redis and the S3 server, and
finish the run (a run outside the prefix is refused). Nothing is lined up by hand:
every name below is read from what a command printed, published or rendered."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
import yaml
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.app.fleet import BACKLOG_PORT, CACHE_MOUNT, SECRET
from diffq.core.settings import Settings
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.results.status import status
from diffq.worker.device.backends import BACKENDS, get_backend
from diffq.worker.delivery.admission import under
from diffq.worker.delivery.routing import startup_queues
from tests.helpers import assert_run_complete
from tests.test_brokers import amqp_url  # noqa: F401  (fixture: a private vhost on the local RabbitMQ)

runner = CliRunner()
ENTRYPOINT = ["diffq", "worker"]  # the images' ENTRYPOINT (infra/docker/Dockerfile.*)
DEPLOYABLE = [name for name, backend in BACKENDS.items() if backend.k8s is not None]


def write_prompts(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"id": f"j{i}", "prompt": f"a journey {i}"}) + "\n" for i in range(n)))
    return path


def invoke(*args: str, env: dict | None = None):
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, f"diffq {' '.join(args)}:\n{result.output}"
    return result


def cli(*args: str, env: dict | None = None) -> str:
    """What the command printed on stdout (warnings go to stderr)."""
    return invoke(*args, env=env).stdout


def published_queues(url: str) -> dict[str, int]:
    """What is really on the broker: every diffq list and its length."""
    client = redis.Redis.from_url(url)
    return {key.decode(): client.llen(key) for key in client.scan_iter(match="diffq.*", _type="list")}


def render(tmp_path: Path, *args: str, out_prefix: str | None = None, env: dict | None = None) -> list[dict]:
    """`fleet manifests` for a fleet whose runs live under `out_prefix` (default: tmp_path)."""
    folder = tmp_path / "manifests"
    cli("fleet", "manifests", *args, "--out-prefix", out_prefix or str(tmp_path), "--out", str(folder), env=env)
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def pools(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(worker Deployment, its ScaledObject) pairs."""
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    return [(d, scaled[d["metadata"]["name"]]) for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/name"] == "diffq-worker"]


def worker_args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def rendered_env(deployment: dict) -> dict[str, str]:
    """The worker container's literal env (not what it reads from Secrets)."""
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if "value" in e}


def admits(deployment: dict, out: str) -> bool:
    """The rendered env, read by the worker's own settings, lets it write into `out`
    (the worker's rule: the run folder as its storage spells it, on a path boundary)."""
    settings = Settings(**{k.removeprefix("DIFFQ_").lower(): json.loads(v) for k, v in rendered_env(deployment).items()
                           if k == "DIFFQ_ALLOWED_OUT_PREFIXES"})
    url = open_storage(out).url
    return any(under(url, open_storage(prefix).url) for prefix in settings.allowed_out_prefixes)


def plan_env(device: str, broker: str, deployment: dict) -> dict:
    env = {**rendered_env(deployment), "DIFFQ_BROKER_URL": broker}
    if device == "neuron":  # what the Neuron device plugin sets for `--cores auto`
        env["NEURON_RT_VISIBLE_CORES"] = "0-7"
    return env


@pytest.mark.parametrize("device", DEPLOYABLE)
def test_defaults_meet_from_submit_to_the_rendered_workers(device, tmp_path, make_redis_server, tiny_model):
    broker = make_redis_server().url
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = str(tmp_path / "run")
    cli("submit", str(prompts), "--model", tiny_model, "--out", out, "--broker", broker)
    published = published_queues(broker)
    manifest = read_manifest(open_storage(out))
    assert set(published) == {s.queue for s in manifest.shapes} and sum(published.values()) == manifest.batches
    [(height, width)] = {(s.shape.height, s.shape.width) for s in manifest.shapes}

    docs = render(tmp_path, "--model", tiny_model, "--shapes", f"{height}x{width}", "--device", device)
    backend = get_backend(device)
    watched: set[str] = set()
    for deployment, scaled in pools(docs):
        triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis"]
        watched |= {t["metadata"]["listName"] for t in triggers}
        # The prefix reaches the worker: its rendered env admits the run submit wrote, and
        # not a folder beside the prefix; it may load the model submit named.
        assert admits(deployment, out) and not admits(deployment, f"{tmp_path}-elsewhere/run")
        assert json.loads(rendered_env(deployment)["DIFFQ_ALLOWED_MODELS"]) == \
            (manifest.models or [manifest.defaults.model])
        args = worker_args(deployment)
        result = invoke("worker", *args, "--plan", env=plan_env(device, broker, deployment))
        # Told where to write and what to load, the worker does not warn about either.
        assert "DIFFQ_ALLOWED_OUT_PREFIXES" not in result.stderr and "DIFFQ_ALLOWED_MODELS" not in result.stderr
        plan = json.loads(result.stdout)
        # auto on the queue; the device's own dtype is what runs.
        assert {(child["dtype"], child["runs_dtype"]) for child in plan} == {("auto", backend.default_dtype)}
        if backend.k8s.pool == "shape":
            assert {q for child in plan for q in child["queues"]} == {t["metadata"]["listName"] for t in triggers}
        else:
            # A discovery pool lists its model's queues on the broker at start.
            [child] = {json.dumps(child["serve_models"]) for child in plan}
            found = startup_queues(broker, json.loads(child), dtypes=backend.served_dtypes)
            assert set(found) == set(published)
    assert watched == set(published), "KEDA watches exactly the queues submit filled"


def test_a_discovery_pool_scales_on_shapes_published_after_rendering(tmp_path, make_redis_server, tiny_model):
    """The backlog service sums every shape queue of the model, so the pool's metrics-api
    trigger sees a shape no trigger named at render time."""
    from diffq.app.backlog import Backlog, model_backlogs, serve

    broker = make_redis_server().url
    docs = render(tmp_path, "--model", tiny_model, "--shapes", "128x128", "--device", "cuda", "--broker", broker)
    [(_, scaled)] = pools(docs)
    [backlog] = [t for t in scaled["spec"]["triggers"] if t["type"] == "metrics-api"]
    named = {t["metadata"]["listName"] for t in scaled["spec"]["triggers"] if t["type"] == "redis"}
    service = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "diffq-backlog"]
    assert service and service[0]["spec"]["template"]["spec"]["containers"][0]["command"][:3] == \
        ["diffq", "fleet", "backlog"]

    prompts = tmp_path / "later.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"l{i}", "prompt": "later", "height": 64, "width": 96}) + "\n"
                               for i in range(5)))
    cli("submit", str(prompts), "--model", tiny_model, "--out", str(tmp_path / "later"), "--broker", broker)
    published = published_queues(broker)
    assert published and not set(published) & named, "a shape the rendered triggers do not name"

    server = serve(Backlog(lambda: model_backlogs(broker), refresh_s=0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = backlog["metadata"]["url"].replace(f"diffq-backlog.diffq.svc:{BACKLOG_PORT}",
                                                 f"127.0.0.1:{server.server_address[1]}")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    finally:
        server.shutdown()
    assert body[backlog["metadata"]["valueLocation"]] == sum(published.values()) == 2  # 5 items, batches of 4
    assert body["queues"] == published


def test_the_backlog_answers_its_last_good_listing_when_the_broker_goes_away(tmp_path, make_redis_server,
                                                                             tiny_model):
    """KEDA's metrics-api scaler takes any status but 200 as an error and keeps no value
    (kedacore/keda pkg/scalers/metrics_api_scaler.go): the service answers its last good
    listing with its age and the error instead; 503 only before any good listing."""
    from diffq.app.backlog import Backlog, model_backlogs, serve

    server_process = make_redis_server()
    broker = server_process.url
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "x", "height": 64, "width": 64}) + "\n"
                               for i in range(5)))
    cli("submit", str(prompts), "--model", tiny_model, "--out", str(tmp_path / "run"), "--broker", broker)
    published = published_queues(broker)

    def get(server, path: str) -> tuple[int, dict]:
        url = f"http://127.0.0.1:{server.server_address[1]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    slug = next(iter(published)).split(".")[1]
    live = serve(Backlog(lambda: model_backlogs(broker), refresh_s=0), "127.0.0.1", 0)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    try:
        code, body = get(live, f"/backlog?model={slug}")
        assert code == 200 and body["backlog"] == sum(published.values()) == 2 and "error" not in body
        assert body["age_s"] == 0
        server_process.stop()  # the broker goes away
        time.sleep(0.3)
        code, body = get(live, f"/backlog?model={slug}")
        assert code == 200 and body["backlog"] == 2 and body["queues"] == published
        assert body["age_s"] >= 0.3 and body["error"]
        code, body = get(live, "/backlog")
        assert code == 200 and body["backlog"] == 2 and body["error"]
    finally:
        live.shutdown()
    # Never read: nothing to answer but a 503 (KEDA logs the trigger's error).
    cold = serve(Backlog(lambda: model_backlogs(broker), refresh_s=0), "127.0.0.1", 0)
    threading.Thread(target=cold.serve_forever, daemon=True).start()
    try:
        code, body = get(cold, f"/backlog?model={slug}")
        assert code == 503 and "no listing yet" in body["error"]
        assert get(cold, "/healthz")[0] == 200
    finally:
        cold.shutdown()


def test_the_rendered_cpu_worker_completes_the_submitted_run(tmp_path, make_redis_server, tiny_model, s3_bucket):
    """cpu end to end on defaults: the rendered container args and env, run as the image
    would run them (only the pod's cache volume path is this machine's). The fleet's
    prefix is the bucket's `runs` folder: the run there completes; a run submitted
    beside it, to the same queue, is refused unwritten."""
    broker = make_redis_server().url
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=6)
    prefix = s3_bucket.rsplit("/", 1)[0]  # s3://BUCKET/outputs: where this fleet's runs live
    elsewhere = s3_bucket.split("/outputs/")[0] + "/elsewhere/run-1"
    # Published first, so its batches come off the queue before the real run's.
    cli("submit", str(prompts), "--model", tiny_model, "--out", elsewhere, "--broker", broker)
    refused = read_manifest(open_storage(elsewhere)).batches
    cli("submit", str(prompts), "--model", tiny_model, "--out", s3_bucket, "--broker", broker)
    docs = render(tmp_path, "--model", tiny_model, "--shapes", "128x128", "--device", "cpu", out_prefix=prefix)
    [(deployment, _)] = pools(docs)
    assert admits(deployment, s3_bucket) and not admits(deployment, elsewhere)
    args = [a.replace(CACHE_MOUNT, str(tmp_path / "cache")) for a in worker_args(deployment)]
    pod_env = {name: value.replace(CACHE_MOUNT, str(tmp_path / "cache"))
               for name, value in rendered_env(deployment).items()}
    pod_env.pop("DIFFQ_METRICS_PORT")  # no fixed port on a shared test machine
    env = {**os.environ, **pod_env, "DIFFQ_BROKER_URL": broker}
    worker = subprocess.Popen([sys.executable, "-m", "diffq", *ENTRYPOINT[1:], *args, "--loglevel", "ERROR"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (st := status(s3_bucket)).done + st.failed < st.total:
            assert worker.poll() is None, worker.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"timed out: {st}"
            time.sleep(0.5)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)  # the pod's warm shutdown
        code = worker.wait(timeout=120)
    assert code == 0
    assert (st.done, st.failed) == (6, 0)
    records = assert_run_complete(s3_bucket, prompts, steps=4, model=tiny_model)
    assert {r.dtype for r in records} == {"float32"} and all(r.queue.endswith(".auto") for r in records)
    from diffq.results.report import build_report

    assert {name: d["dtypes"] for name, d in build_report(s3_bucket).per_device().items()} == \
        {r.device: ["float32"] for r in records}
    assert [r.id for r in iter_records(open_storage(s3_bucket))]
    # The run outside the prefix: every batch dead-lettered, nothing written to it.
    assert published_queues(broker) == {"diffq.dead": refused}
    assert status(elsewhere).done == 0 and not list(iter_records(open_storage(elsewhere)))


def test_sqs_fleets_scale_on_the_sqs_queue_submit_filled(s3_server, tiny_model, tmp_path):
    """The trigger kind comes from the transport table: aws-sqs-queue, naming the queue
    kombu created (moto's SQS, over HTTP)."""
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    import boto3

    from diffq.producer.submit import submit

    broker = f"sqs://testing:testing@127.0.0.1:{s3_server.port}"
    model = str(tmp_path / f"m{uuid.uuid4().hex[:6]}")  # a fresh slug: queues of its own
    result = submit(write_prompts(tmp_path / "p.jsonl"), str(tmp_path / "run"), model=model, broker_url=broker,
                    transport_options={"region": "us-east-1"})
    docs = render(tmp_path, "--model", model, "--shapes", "128x128", "--device", "neuron", "--broker", broker,
                  "--aws-region", "us-east-1")
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{s3_server.port}")
    [(deployment, scaled)] = pools(docs)
    # The broker's own trigger, beside the backlog service's (which counts what waits in OUT).
    [trigger] = [t for t in scaled["spec"]["triggers"] if t["type"] == "aws-sqs-queue"]
    assert trigger["metadata"]["awsRegion"] == "us-east-1"
    assert [t["type"] for t in scaled["spec"]["triggers"]].count("metrics-api") == 1
    url = sqs.get_queue_url(QueueName=trigger["metadata"]["queueURL"])["QueueUrl"]
    depth = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    assert int(depth["Attributes"]["ApproximateNumberOfMessages"]) == sum(result.queues.values())
    args = worker_args(deployment)
    assert args[args.index("--queues") + 1] in result.queues
    auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"awsAccessKeyID", "awsSecretAccessKey"}


def test_amqp_fleets_scale_on_the_rabbitmq_queue_submit_filled(amqp_url, tiny_model, tmp_path):  # noqa: F811
    from diffq.app.queues import queue_report
    from diffq.producer.submit import submit

    result = submit(write_prompts(tmp_path / "p.jsonl"), str(tmp_path / "run"), model=tiny_model,
                    broker_url=amqp_url)
    docs = render(tmp_path, "--model", tiny_model, "--shapes", "128x128", "--device", "cuda", "--broker", amqp_url)
    [(deployment, scaled)] = pools(docs)
    rabbit = [t for t in scaled["spec"]["triggers"] if t["type"] == "rabbitmq"]
    depths = {q.queue: q.depth for q in queue_report(amqp_url, [t["metadata"]["queueName"] for t in rabbit],
                                                     timeout=0)}
    assert {t["metadata"]["queueName"]: depths[t["metadata"]["queueName"]] for t in rabbit} == result.queues
    # KEDA's `host` is the broker's host with the scheme KEDA parses, no credentials: KEDA
    # puts the Secret's username and password into it (rabbitmq_scaler.go) and dials that.
    auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
    assert [(r["parameter"], r["key"]) for r in auth["spec"]["secretTargetRef"]] == \
        [("username", "rabbitmq-username"), ("password", "rabbitmq-password")]
    url = urllib.parse.urlsplit(amqp_url)
    [host] = {t["metadata"]["host"] for t in rabbit}
    assert host == f"amqp://{url.hostname}:{url.port}{url.path}" and url.password not in host
    dialled = host.replace("amqp://", f"amqp://{url.username}:{url.password}@")
    assert {q.queue: q.depth for q in queue_report(dialled, list(result.queues), timeout=0)
            if q.queue in result.queues} == result.queues
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
           for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
           if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == SECRET}
    assert env == {"DIFFQ_BROKER_URL": "broker-url", "DIFFQ_RABBITMQ_API": "rabbitmq-api"}


@pytest.mark.parametrize("device", [name for name in DEPLOYABLE if get_backend(name).k8s.pool != "shape"])
def test_a_lora_runs_queue_is_watched_and_served_by_its_models_pool(device, tmp_path, make_redis_server,
                                                                     tiny_pipelines):
    """A LoRA run's queue ends in its layout, a name no rendered redis trigger carries: the
    model's pool still scales on it (the backlog service's metrics-api trigger sums every
    queue of the model) and its rendered worker finds it at start (discovery). Per-shape
    pools (Neuron, TPU): test_a_lora_run_is_found_and_served_by_a_per_shape_pool."""
    from diffq.app.backlog import Backlog, model_backlogs, serve
    from diffq.app.tiny import build_tiny_lora

    flux = tiny_pipelines["flux"]
    lora = str(build_tiny_lora(flux, tmp_path / "style.safetensors", rank=4, seed=1))
    broker = make_redis_server().url
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=5)
    out = str(tmp_path / "run")
    cli("submit", str(prompts), "--model", flux, "--out", out, "--broker", broker, "--lora", f"{lora}@0.8",
        "--height", "64", "--width", "64")
    published = published_queues(broker)
    [queue] = published
    assert read_manifest(open_storage(out)).adapter_layouts[flux].label == queue.rsplit(".", 1)[1]

    docs = render(tmp_path, "--model", flux, "--shapes", "64x64", "--device", device, "--broker", broker)
    [(deployment, scaled)] = pools(docs)
    assert queue not in {t["metadata"].get("listName") for t in scaled["spec"]["triggers"]}
    [backlog] = [t for t in scaled["spec"]["triggers"] if t["type"] == "metrics-api"]
    server = serve(Backlog(lambda: model_backlogs(broker), refresh_s=0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = backlog["metadata"]["url"].replace(f"diffq-backlog.diffq.svc:{BACKLOG_PORT}",
                                                 f"127.0.0.1:{server.server_address[1]}")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    finally:
        server.shutdown()
    assert body[backlog["metadata"]["valueLocation"]] == published[queue] == 2  # 5 items, batches of 4

    plan = json.loads(invoke("worker", *worker_args(deployment), "--plan",
                             env=plan_env(device, broker, deployment)).stdout)
    [child] = {json.dumps(child["serve_models"]) for child in plan}
    assert startup_queues(broker, json.loads(child), dtypes=get_backend(device).served_dtypes) == [queue]


def on_cpu(args: list[str], cache: Path) -> list[str]:
    """A rendered worker's container args with its device faked by this machine's CPU: the
    device option and its device list (the backend table's `device_option`) become `--device
    cpu`, and its compile mode none (the device's compiler is what the flag chose); the
    rest (--queues, --model, --dtype, the drain) as rendered."""
    device_option = get_backend(args[args.index("--device") + 1]).device_option
    kept, skip = [], 0
    for k, arg in enumerate(args):
        if skip:
            skip -= 1
        elif arg in ("--device", device_option, "--compile"):
            skip = 1
        else:
            kept.append(arg.replace(CACHE_MOUNT, str(cache)))
    return ["--device", "cpu", "--compile", "none", *kept]


@pytest.mark.parametrize("allow_list", [True, False], ids=["allowed-adapters", "any-adapter"])
@pytest.mark.parametrize("device", [name for name in DEPLOYABLE if get_backend(name).k8s.pool == "shape"])
def test_a_lora_run_is_found_and_served_by_a_per_shape_pool(device, allow_list, tmp_path, make_redis_server,
                                                             tiny_pipelines):
    """A LoRA run submitted on defaults to a fleet rendered for Neuron or TPU (per-shape
    pools, with --allowed-adapters or without: then any adapter is allowed): its queue is the rendered one with the layout label
    (`Q.r4-…`). The pool's KEDA triggers count it (the backlog service's `?queue=Q` sums Q
    and its layout-labelled variants), the rendered worker's discovery finds it (`--queues
    Q` keeps Q's LoRA runs), and that worker, its device faked by the CPU, finishes the run."""
    from diffq.app.backlog import Backlog, model_backlogs, serve
    from diffq.app.tiny import build_tiny_lora

    flux = tiny_pipelines["flux"]
    loras = tmp_path / "loras"
    lora = str(build_tiny_lora(flux, loras / "style.safetensors", rank=4, seed=1))
    broker = make_redis_server().url
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=5)
    out = str(tmp_path / "run")
    cli("submit", str(prompts), "--model", flux, "--out", out, "--broker", broker, "--lora", f"{lora}@0.8",
        "--height", "64", "--width", "64")
    published = published_queues(broker)
    [queue] = published
    docs = render(tmp_path, "--model", flux, "--shapes", "64x64", "--device", device,
                  *(["--allowed-adapters", str(loras)] if allow_list else []))
    [(deployment, scaled)] = pools(docs)
    args = worker_args(deployment)
    rendered_queue = args[args.index("--queues") + 1]
    assert queue.startswith(rendered_queue + ".r4-") and queue != rendered_queue
    allowed = rendered_env(deployment).get("DIFFQ_ALLOWED_ADAPTERS")
    assert (json.loads(allowed) if allow_list else allowed) == ([str(loras)] if allow_list else None)

    # KEDA: the broker trigger names the rendered queue; the backlog trigger counts the LoRA run's.
    assert {t["metadata"].get("listName") for t in scaled["spec"]["triggers"] if t["type"] == "redis"} == \
        {rendered_queue}
    [backlog] = [t for t in scaled["spec"]["triggers"] if t["type"] == "metrics-api"]
    server = serve(Backlog(lambda: model_backlogs(broker), refresh_s=0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = backlog["metadata"]["url"].replace(f"diffq-backlog.diffq.svc:{BACKLOG_PORT}",
                                                 f"127.0.0.1:{server.server_address[1]}")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    finally:
        server.shutdown()
    assert body[backlog["metadata"]["valueLocation"]] == published[queue] == 2  # 5 items, batches of 4
    assert body["queues"] == published

    # Discovery: the rendered worker keeps its queue's LoRA runs.
    [child] = json.loads(invoke("worker", *args, "--plan", env=plan_env(device, broker, deployment)).stdout)[:1]
    assert child["queues"] == [rendered_queue] and child["variants_of"] == [rendered_queue]
    backend = get_backend(device)
    assert startup_queues(broker, dtypes=backend.served_dtypes, variants_of=child["variants_of"]) == [queue]

    # Served: the rendered args and env, the device faked by the CPU.
    pod_env = {name: value.replace(CACHE_MOUNT, str(tmp_path / "cache"))
               for name, value in rendered_env(deployment).items()}
    pod_env.pop("DIFFQ_METRICS_PORT", None)  # no fixed port on a shared test machine
    env = {**os.environ, **pod_env, "DIFFQ_BROKER_URL": broker}
    worker = subprocess.Popen([sys.executable, "-m", "diffq", *ENTRYPOINT[1:], *on_cpu(args, tmp_path / "cache"),
                               "--loglevel", "ERROR"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (st := status(out)).done + st.failed < st.total:
            assert worker.poll() is None, worker.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, f"timed out: {st}"
            time.sleep(0.5)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        code = worker.wait(timeout=120)
    assert code == 0 and (st.done, st.failed) == (5, 0)
    records = list(iter_records(open_storage(out)))
    assert {r.queue for r in records} == {queue} and all(r.adapters for r in records)
