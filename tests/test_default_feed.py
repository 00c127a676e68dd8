"""The broker window on the user's default path (producer/feed.py, core/feeds.py):
`fleet manifests` with its required options renders a feeder under the fleet's
out-prefix; `submit` with its required options finds it by its heartbeat above OUT
and keeps only a window in the broker; with no live feeder it publishes everything
and says why. Started here from the rendered YAML's own command and env."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.core.options import DEFAULTS
from diffq.core import layout
from diffq.core.feeds import FEEDS_DIR, LIVE_S, find_feeder, heartbeat, live, run_feed_counts
from diffq.core.runfolder import iter_records
from diffq.core.storage import open_storage
from diffq.producer.feed import DEFAULT_WINDOW, read_pointer, read_state
from diffq.producer.submit import submit
from diffq.results.status import status
from tests.helpers import assert_run_complete
from tests.test_feed import BROKERS, broker, run_feeder, write_prompts  # noqa: F401 (the fixture)

runner = CliRunner()
BIN = str(Path(sys.executable).parent)


def render(prefix: str, *args: str) -> list[dict]:
    """`diffq fleet manifests` with its required options (and `args`)."""
    result = runner.invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "128x128", "--out-prefix", prefix,
                                 *args], env={"DIFFQ_ALLOWED_OUT_PREFIXES": None, "DIFFQ_FEEDS": None})
    assert result.exit_code == 0, result.output
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def container(docs: list[dict], name: str) -> dict:
    [deployment] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def pod_env(container_: dict, secrets: dict[str, str]) -> dict[str, str]:
    """The container's env as a pod gets it: values, and the Secret's keys where set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFQ_")}
    for item in container_["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            if ref["key"] in secrets and ref["name"] == "diffq-broker":
                env[item["name"]] = secrets[ref["key"]]
            else:
                assert ref.get("optional"), item
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.pop("DIFFQ_METRICS_PORT", None)  # tests side by side: no fixed port
    env.pop("HF_HOME", None)  # the pod's cache volume
    return env


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log.open("a"), text=True)
    proc.log = log
    return proc


def said(proc: subprocess.Popen) -> str:
    return proc.log.read_text()[-4000:]


def start_backlog(docs: list[dict], secrets: dict[str, str], log: Path) -> subprocess.Popen:
    """The rendered backlog/feeder container's command and env, on a free port."""
    backlog = container(docs, "diffq-backlog")
    command = backlog["command"] + ["--host", "127.0.0.1", "--port", "0"]  # the last --port wins
    return start(command, pod_env(backlog, secrets), log)


def wait_live(prefix: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    feeds = open_storage(f"{prefix}/{FEEDS_DIR}")
    while not live(feeds):
        assert proc.poll() is None, said(proc)
        assert time.monotonic() < deadline, "no heartbeat from the rendered feeder"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def secrets_of(url: str, api: str | None) -> dict[str, str]:
    return {"broker-url": url, **({"rabbitmq-api": api} if api else {})}


def broker_options(options: dict | None) -> list[str]:
    return [arg for key, value in (options or {}).items() for arg in ("--broker-option", f"{key}={value}")]


@pytest.mark.parametrize("device", ["neuron", "tpu", "cuda", "cpu"])
def test_every_device_renders_the_feeder_on_required_options(device):
    """The backlog service feeds the runs under each out-prefix and every pool, per-shape
    ones too, scales on the whole backlog."""
    docs = render("s3://diffq-runs/runs", "--device", device)
    backlog = container(docs, "diffq-backlog")
    assert backlog["command"][-2:] == ["--out-prefix", "s3://diffq-runs/runs"]
    assert {"DIFFQ_SIGNING_KEY", "DIFFQ_SIGNING_KEY_PREVIOUS"} <= {e["name"] for e in backlog["env"]}
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        assert [t for t in so["spec"]["triggers"] if t["type"] == "metrics-api"], so["metadata"]["name"]


def test_a_default_submit_keeps_the_window_when_the_rendered_feeder_is_live(make_redis_server, tmp_path):
    """200,000 items: Redis grows by the window alone; without the feeder, everything
    is published and one line says why; `status` shows the run waiting once it dies."""
    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    prefix = str(tmp_path / "runs")
    prompts = write_prompts(tmp_path / "p.jsonl", 200_000)
    docs = render(prefix, "--device", "cpu", "--broker", url)
    feeder = start_backlog(docs, secrets_of(url, None), tmp_path / "feeder.log")
    try:
        wait_live(prefix, feeder)
        before = int(client.info("memory")["used_memory"])
        out = f"{prefix}/big"
        shown = runner.invoke(app, ["submit", str(prompts), "--out", out, "--model", "/models/m",
                                    "--broker", url], env={"DIFFQ_FEEDS": None})
        assert shown.exit_code == 0, shown.output
        grown = int(client.info("memory")["used_memory"]) - before
        [queue] = [q.decode() for q in client.keys("diffq.*")]
        assert client.llen(queue) == DEFAULT_WINDOW
        assert grown <= 16 * 2**20, f"{grown:,} bytes"
        assert "no live feeder" not in shown.output
        storage = open_storage(out)
        state = read_state(storage, read_pointer(storage).source)
        batches = 200_000 // DEFAULTS.batch_size
        assert state.feeds == f"{prefix}/{FEEDS_DIR}" and state.unpublished == batches - DEFAULT_WINDOW
        # Per run: `diffq queues` and the backlog service say what is in the broker and in OUT.
        shown = runner.invoke(app, ["queues", "--broker", url, "--out-prefix", prefix, "--timeout", "0"])
        assert (f"{DEFAULT_WINDOW} batches in the broker (about), {batches - DEFAULT_WINDOW} in OUT for the feeder"
                in shown.output), shown.output
        [address] = re.findall(r"backlog on (http://\S+/backlog)", said(feeder))
        deadline = time.monotonic() + 60
        while not (runs := json.loads(urllib.request.urlopen(address).read()).get("runs")):
            assert time.monotonic() < deadline, "the feeder never fed the run"
            time.sleep(0.2)
        assert runs == [{"out": out, "run_id": state.run_id, "in_broker": DEFAULT_WINDOW,
                         "in_out": batches - DEFAULT_WINDOW}]
    finally:
        stop(feeder)
    # The feeder gone (SIGTERM, or dead: its heartbeat ages past LIVE_S): the run waits, visibly.
    beat = heartbeat(open_storage(f"{prefix}/{FEEDS_DIR}"))
    counts = run_feed_counts(storage, {queue: (200_000, DEFAULTS.batch_size)})
    assert counts.in_out == batches - DEFAULT_WINDOW and counts.in_broker == DEFAULT_WINDOW
    assert live(open_storage(f"{prefix}/{FEEDS_DIR}"), clock=lambda: beat.at + LIVE_S + 1) is False
    old = beat.model_copy(update={"at": beat.at - LIVE_S - 1})
    open_storage(f"{prefix}/{FEEDS_DIR}").put_bytes("feeder.heartbeat", old.model_dump_json().encode())
    assert status(out).feed.waiting_for_feeder
    shown = runner.invoke(app, ["status", out])
    assert "waiting for a feeder" in shown.output, shown.output
    client.delete(queue)
    small = write_prompts(tmp_path / "small.jsonl", DEFAULTS.batch_size * (DEFAULT_WINDOW + 10))
    shown = runner.invoke(app, ["submit", str(small), "--out", f"{prefix}/bare", "--model", "/models/m",
                                "--broker", url], env={"DIFFQ_FEEDS": None})
    assert shown.exit_code == 0, shown.output
    assert client.llen(queue) == DEFAULT_WINDOW + 10  # everything published
    [why] = [line for line in shown.output.splitlines() if "no live feeder" in line]
    assert why.startswith("every batch published") and prefix in why
    assert read_pointer(open_storage(f"{prefix}/bare")) is None


def test_a_run_fed_by_hand_waits_for_a_feeder_only_once_its_feeder_stops(make_redis_server, tmp_path):
    """`diffq feed OUT` keeps a heartbeat of its own in the run folder: `status` and
    `queues` (its table and each queue row's runs in --json) do not say "waiting for a
    feeder" while it feeds, and say it once it stops (SIGTERM: at once; SIGKILL: once
    its heartbeat is LIVE_S old). That heartbeat is the run's alone: no submit finds it."""
    url = make_redis_server().url
    prefix = str(tmp_path / "runs")
    out = f"{prefix}/hand"
    # Listed in the fleet's feeds folder under the prefix, whose feeder is not running.
    result = submit(write_prompts(tmp_path / "p.jsonl", 40), out, model="/models/m", broker_url=url, batch_size=4,
                    window=2, feeds=f"{prefix}/{FEEDS_DIR}")
    [queue] = result.queues
    assert (result.batches, result.unpublished) == (2, 8)
    own = open_storage(out)
    queues = ["queues", "--broker", url, "--out-prefix", prefix, "--timeout", "0"]
    env = {"DIFFQ_FEEDS": None, "DIFFQ_ALLOWED_OUT_PREFIXES": None}

    def shown(feeder: str | None) -> None:
        waiting = feeder is None
        feed = status(out).feed
        assert (feed.in_broker, feed.in_out, feed.feeder, feed.waiting_for_feeder) == (2, 8, feeder, waiting)
        said = runner.invoke(app, ["status", out]).output
        assert ("waiting for a feeder" in said) is waiting, said
        table = runner.invoke(app, queues, env=env).output
        [line] = [line for line in table.splitlines() if line.startswith(f"run {result.run_id} ")]
        assert line.endswith("2 batches in the broker (about), 8 in OUT for the feeder"
                             + (": waiting for a feeder" if waiting else "")), line
        rows = {row["queue"]: row for row in json.loads(runner.invoke(app, [*queues, "--json"], env=env).stdout)}
        assert rows[queue]["unpublished"] == 8 and rows[queue]["depth"] == 2
        assert rows[queue]["runs"] == [{"out": own.url, "run_id": result.run_id, "in_broker": 2, "in_out": 8,
                                        "feeder": feeder, "waiting_for_feeder": waiting}]

    def started() -> subprocess.Popen:
        hand = run_feeder(out, url)
        deadline = time.monotonic() + 60
        while not live(own, key=layout.FEEDER):
            assert hand.poll() is None, hand.stderr.read()
            assert time.monotonic() < deadline, "no heartbeat from diffq feed"
            time.sleep(0.1)
        return hand

    shown(feeder=None)
    hand = started()
    try:
        shown(feeder=own.key_url(layout.FEEDER))
        assert find_feeder(f"{out}/nested") is None and find_feeder(f"{prefix}/other") is None
        hand.send_signal(signal.SIGTERM)
        assert hand.wait(timeout=60) == 0
    finally:
        stop(hand)
    assert heartbeat(own, layout.FEEDER) is None
    shown(feeder=None)
    hand = started()
    hand.kill()
    hand.wait()
    shown(feeder=own.key_url(layout.FEEDER))  # killed: not known yet
    beat = heartbeat(own, layout.FEEDER)
    own.put_bytes(layout.FEEDER, beat.model_copy(update={"at": beat.at - LIVE_S - 1}).model_dump_json().encode())
    shown(feeder=None)


@pytest.mark.slow
@pytest.mark.parametrize("broker", BROKERS, indirect=True)
def test_the_default_journey_completes_exactly_once_with_its_feeder_killed(broker, tiny_model, tmp_path):
    """The rendered feeder and worker, each from the YAML's own command and env; the
    feeder SIGKILLed after the run is registered and restarted; every item once."""
    url, options, api = broker
    prefix = str(tmp_path / "runs")
    secrets = secrets_of(url, api)
    docs = render(prefix, "--device", "cpu", "--broker", url, "--model", tiny_model, *broker_options(options))
    feeder = start_backlog(docs, secrets, tmp_path / "feeder.log")
    worker = None
    try:
        wait_live(prefix, feeder)
        total, out = 24, f"{prefix}/run"
        prompts = write_prompts(tmp_path / "p.jsonl", total)
        # A window of 3 so the feeder has work (the default window is bigger than a small run).
        shown = runner.invoke(app, ["submit", str(prompts), "--out", out, "--model", tiny_model, "--broker", url,
                                    "--steps", "1", "--batch-size", "2", "--window", "3"],
                              env={"DIFFQ_FEEDS": None,
                                   "DIFFQ_BROKER_TRANSPORT_OPTIONS": json.dumps(options) if options else None})
        assert shown.exit_code == 0, shown.output
        assert f"feeder of {prefix}/{FEEDS_DIR}" in shown.output
        assert len(list(open_storage(f"{prefix}/{FEEDS_DIR}").list())) == 2  # the run's entry, the heartbeat
        feeder.send_signal(signal.SIGKILL)
        feeder.wait()
        assert status(out).feed.in_out == total // 2 - 3
        feeder = start_backlog(docs, secrets, tmp_path / "feeder.log")
        spec = container(docs, next(d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"
                                    and d["metadata"]["name"] != "diffq-backlog"))
        args = [a.replace("/cache/compile", str(tmp_path / "compile")) for a in spec["args"]]
        worker = start([sys.executable, "-m", "diffq", "worker", *args], pod_env(spec, secrets),
                       tmp_path / "worker.log")
        deadline = time.monotonic() + 600
        while (st := status(out)).done + st.failed < total:
            assert worker.poll() is None, said(worker)
            assert feeder.poll() is None, said(feeder)
            assert time.monotonic() < deadline, st
            time.sleep(0.25)
    finally:
        stop(feeder)
        if worker is not None:
            stop(worker)
    assert (st.done, st.failed) == (total, 0)
    records = list(iter_records(open_storage(out)))
    assert sorted(r.id for r in records) == [f"i{i:08d}" for i in range(total)]  # each once
    assert_run_complete(out, prompts, steps=1, model=tiny_model)
    assert [k for k in open_storage(f"{prefix}/{FEEDS_DIR}").list() if k.endswith(".json")] == []


def test_a_bare_worker_on_a_network_broker_refuses_without_a_scope(make_redis_server, tmp_path):
    """No --run, no --out-prefix, no DIFFQ_ALLOWED_OUT_PREFIXES: refused with the reason;
    --plan still prints the pinning; --any-out starts it, loudly."""
    url = make_redis_server().url
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFQ_")}
    bare = subprocess.run([sys.executable, "-m", "diffq", "worker", "--broker", url, "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "--out-prefix" in bare.stderr and "--any-out" in bare.stderr, bare.stderr
    plan = subprocess.run([sys.executable, "-m", "diffq", "worker", "--broker", url, "--device", "cpu", "--plan"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and json.loads(plan.stdout), plan.stderr
    anywhere = subprocess.Popen([sys.executable, "-m", "diffq", "worker", "--broker", url, "--device", "cpu",
                                 "--queues", "diffq.none", "--any-out"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = anywhere.stderr.readline()
        assert "warning" in line and "writes wherever" in line, line
    finally:
        stop(anywhere)


def test_a_worker_told_no_models_loads_only_those_its_runs_manifest_names(tmp_path):
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.delivery.runtime import Runtime
    from diffq.worker.delivery.spec import ChildSpec
    from diffq.worker.sink.store import Sink

    run = open_storage(str(tmp_path / "run"))
    run.put_bytes("manifest.json", json.dumps({"run_id": "r1", "models": ["/models/a"]}).encode())

    def runtime(**spec) -> Runtime:
        return Runtime(spec=ChildSpec(name="w", broker_url="memory://", queues=["q"], **spec),
                       host=PipelineHost(backend=get_backend("cpu")), sink=Sink())

    bare = runtime()
    assert bare.run_problem(run, "r1") is None
    assert bare.model_problem(run, "/models/a") is None
    assert "is not one run r1's manifest names" in bare.model_problem(run, "/models/b")
    told = runtime(models=["/models/b"])  # told a model list: that list decides (admission, on receipt)
    assert told.run_problem(run, "r1") is None and told.model_problem(run, "/models/b") is None
