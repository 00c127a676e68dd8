"""The rendered alerts in a real Prometheus (Debian's 2.42, unpacked under .tools/ by
scripts/test-services.sh; CI=true fails without it) scraping a real small fleet: the
backlog service and one worker started from the rendered manifests' commands and env,
each target labelled as the PodMonitor labels it, the rules loaded as rendered. Only
the waits and windows are shortened, through `--alert`.

One run of scenarios, each firing within its wait and window and resolving when its
fault ends: healthy (no alert), a queue whose every item fails (ItemsFailing),
hostile messages (DeadLettersGrowing), the backlog service restarted mid-stall (the
stall keeps its age: RunStalled never resolves), the backlog service kept down
(BacklogServiceDown fires, no run alert resolves), one recompile (Recompiles),
storage failing (StorageFailing, from the sink's failed tries as they happen), one LoRA
adapter set of three failing every batch (AdapterSetFailing for that set's digest alone,
alongside ItemsFailing: its weights cut short, which submit's header check passes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import redis
import yaml
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.app.fleet import CACHE_MOUNT
from diffq.core.feeds import feeds_under
from diffq.testing.servers import free_port, missing

ROOT = Path(__file__).resolve().parent.parent
NS = "diffq"
# Waits and windows short enough for a test, each through its own `--alert`.
SHORT = ["stall_minutes=0.25", "stall_for_minutes=0", "failure_window_minutes=0.34", "failure_for_minutes=0",
         "dead_letter_window_minutes=0.34",
         "backlog_down_minutes=0.1", "recompile_window_minutes=0.34", "storage_window_minutes=0.34",
         "storage_minutes=0"]
POISON = "poisoned-prompt"
# A CPU worker compiles nothing here (and a real recompile on CPU costs minutes of
# inductor): one recompile is this process's, the worker's own metrics module serving
# a queue's shape, then counting one recompile when told (a line on its stdin).
RECOMPILER = """
import sys
from diffq.worker.observe import metrics
metrics.serving(sys.argv[2], sys.argv[3])
metrics.start_server(int(sys.argv[1]), "127.0.0.1")
sys.stdin.readline()
metrics.observe_recompile(sys.argv[3])
sys.stdin.readline()
"""
PROBE_SHAPE = "64x64.b2"


def prometheus() -> str:
    found = shutil.which("prometheus") or next(
        (str(p) for p in [ROOT / ".tools/prometheus/usr/bin/prometheus"] if p.exists()), None)
    if found is None:
        missing("prometheus not found (scripts/test-services.sh unpacks Debian's prometheus package into .tools/)")
    return found


def rendered(tmp_path: Path, model: str, prefix: str) -> list[dict]:
    folder = tmp_path / "manifests"
    result = CliRunner().invoke(app, ["fleet", "manifests", "--model", model, "--shapes", "64x64", "--device", "cpu",
                                      "--devices-per-pod", "1", "--out-prefix", prefix, "--monitoring",
                                      "--out", str(folder), *[a for s in SHORT for a in ("--alert", s)]])
    assert result.exit_code == 0, result.output
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def literal_env(doc: dict, tmp_path: Path) -> dict[str, str]:
    """The container's literal env (Secrets' keys are given below), this machine's cache path."""
    return {e["name"]: e["value"].replace(CACHE_MOUNT, str(tmp_path / "cache")) for e in container(doc)["env"]
            if "value" in e}


class Fleet:
    """The processes, started and restarted as the pods would be."""

    def __init__(self, tmp_path: Path, broker: str, docs: list[dict]):
        self.tmp_path, self.broker = tmp_path, broker
        [self.worker_doc] = [d for d in docs if d["kind"] == "Deployment"
                             and d["metadata"]["labels"]["app.kubernetes.io/name"] == "diffq-worker"]
        [self.backlog_doc] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "diffq-backlog"]
        [self.monitor] = [d for d in docs if d["kind"] == "PodMonitor"]
        [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
        self.groups = rule["spec"]["groups"]
        self.backlog_port, self.worker_port, self.prom_port = free_port(), free_port(), free_port()
        self.probe_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []

    def _start(self, name: str, argv: list[str], env: dict[str, str], **kwargs) -> None:
        log = open(self.tmp_path / f"{name}.log", "ab")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, **kwargs)

    def start_probe(self, queue: str) -> None:
        self._start("probe", [sys.executable, "-c", RECOMPILER, str(self.probe_port), queue, PROBE_SHAPE], {},
                    stdin=subprocess.PIPE)

    def tell_probe(self) -> None:
        self.procs["probe"].stdin.write(b"\n")
        self.procs["probe"].stdin.flush()

    def start_backlog(self) -> None:
        command = list(container(self.backlog_doc)["command"])
        assert command[:3] == ["diffq", "fleet", "backlog"]
        port = command.index("--port") + 1
        command[port] = str(self.backlog_port)  # no fixed port on a shared machine
        self._start("backlog", [sys.executable, "-m", "diffq", *command[1:], "--host", "127.0.0.1"],
                    {**literal_env(self.backlog_doc, self.tmp_path), "DIFFQ_BROKER_URL": self.broker})

    def start_worker(self) -> None:
        # The image's ENTRYPOINT is `diffq worker` (infra/docker/Dockerfile.*).
        args = [a.replace(CACHE_MOUNT, str(self.tmp_path / "cache")) for a in container(self.worker_doc)["args"]]
        env = literal_env(self.worker_doc, self.tmp_path)
        # Test-only: a free port on loopback; retries without waiting; the poison fault.
        env |= {"DIFFQ_BROKER_URL": self.broker, "DIFFQ_METRICS_PORT": str(self.worker_port),
                "DIFFQ_METRICS_ADDR": "127.0.0.1", "DIFFQ_RETRY_BACKOFF_S": "0", "DIFFQ_FAULT_POISON": POISON}
        self._start("worker", [sys.executable, "-m", "diffq", "worker", *args, "--loglevel", "ERROR"], env)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def start_prometheus(self, binary: str) -> None:
        """Its scrape jobs: one per PodMonitor endpoint, each target's labels as the
        operator gives them (namespace, pod, container, endpoint, job = NAMESPACE/MONITOR,
        instance) and the endpoint's own relabelings (the worker's `pool`)."""
        job = f"{NS}/{self.monitor['metadata']['name']}"
        endpoints = {e["port"]: e for e in self.monitor["spec"]["podMetricsEndpoints"]}
        pod_labels = self.worker_doc["spec"]["template"]["metadata"]["labels"]
        pool_source = "__meta_kubernetes_pod_label_app_kubernetes_io_instance"
        targets = []
        for doc, port_name, port, pod in ((self.worker_doc, "metrics-0", self.worker_port, "0"),
                                          (self.worker_doc, "metrics-0", self.probe_port, "probe"),
                                          (self.backlog_doc, "http", self.backlog_port, "0")):
            assert port_name in endpoints and port_name in {p["name"] for p in container(doc)["ports"]}
            labels = {"namespace": NS, "pod": f"{doc['metadata']['name']}-{pod}", "container": container(doc)["name"],
                      "endpoint": port_name}
            for relabel in endpoints[port_name].get("relabelings", []):
                assert relabel["sourceLabels"] == [pool_source]  # the one relabeling rendered
                labels[relabel["targetLabel"]] = pod_labels["app.kubernetes.io/instance"]
            targets.append({"job_name": f"{job}/{port_name}/{pod}", "metrics_path": endpoints[port_name]["path"],
                            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}],
                            "relabel_configs": [{"target_label": "job", "replacement": job}]})
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": ["rules.yaml"], "scrape_configs": targets}
        folder = self.tmp_path / "prometheus"
        folder.mkdir()
        (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": self.groups}))  # as rendered
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._start("prometheus", [binary, f"--config.file={folder / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={folder / 'data'}",
                                   f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn"], {})

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self) -> list[dict]:
        """Pending and firing alerts."""
        try:
            return self.api("alerts")["alerts"]
        except OSError:
            return []

    def evaluated(self) -> float:
        """When the rule group was last evaluated (Unix seconds)."""
        [group] = self.api("rules")["groups"]
        # RFC 3339 with nanoseconds: microseconds are what datetime reads.
        stamp = re.sub(r"(\.\d{6})\d*", r"\1", group["lastEvaluation"]).replace("Z", "+00:00")
        return datetime.fromisoformat(stamp).timestamp()

    def query(self, expr: str) -> list[dict]:
        try:
            return self.api("query", query=expr)["result"]
        except OSError:
            return []

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited: " + (self.tmp_path / f"{name}.log").read_text()[-3000:]

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        for log in self.logs:
            log.close()


def firing(fleet: Fleet, name: str, **labels) -> dict | None:
    return next((a for a in fleet.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"
                 and all(a["labels"].get(k) == v for k, v in labels.items())), None)


def set_alerts(fleet: Fleet) -> set[str]:
    """The adapter sets AdapterSetFailing is pending or firing for."""
    return {a["labels"]["adapter_set"] for a in fleet.alerts() if a["labels"]["alertname"] == "DiffqAdapterSetFailing"}


def wait(fleet: Fleet, predicate, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.check_alive()
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; alerts: {fleet.alerts()}")


def submit_run(tmp_path: Path, name: str, prefix: str, model: str, broker: str, n: int, prompt: str = "a cat",
               height: int = 64, loras: tuple[str, ...] = ()) -> tuple[str, str]:
    """`n` items; with `loras`, row i takes adapter i mod len(loras) (a set each)."""
    from diffq.producer.submit import submit

    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{name}{i}", "prompt": f"{prompt} {i}", "height": height,
                                           "width": 64, **({"lora": loras[i % len(loras)]} if loras else {})})
                               + "\n" for i in range(n)))
    out = f"{prefix}/{name}"
    # A window of one batch: the rest waits in OUT, so the run is registered with the
    # fleet's feeder and the backlog service reports it.
    result = submit(prompts, out, model=model, broker_url=broker, batch_size=2, steps=1, window=1,
                    feeds=feeds_under(prefix))
    [queue] = result.queues
    return out, queue


@pytest.mark.slow
def test_the_rendered_alerts_fire_and_resolve_in_a_real_prometheus(tmp_path, make_redis_server, tiny_model):
    from diffq.app.tiny import build_tiny_lora
    from diffq.core.records import FailureRecord
    from diffq.core.runfolder import read_manifest
    from diffq.core.storage import open_storage
    from diffq.results.status import status

    binary = prometheus()
    broker = make_redis_server().url
    prefix = str(tmp_path / "runs")
    fleet = Fleet(tmp_path, broker, rendered(tmp_path, tiny_model, prefix))
    try:
        fleet.start_prometheus(binary)
        fleet.start_backlog()

        # Healthy: a run completes; every series is in, and no alert is pending or firing.
        # The worker starts once the backlog service reports the run: a run this small is
        # fed whole and leaves the feeds folder within a second, maybe between two scrapes.
        healthy, queue = submit_run(tmp_path, "healthy", prefix, tiny_model, broker, n=4)
        run_id = read_manifest(open_storage(healthy)).run_id
        wait(fleet, lambda: fleet.query(f'diffq_run_items{{run="{run_id}", state="pending"}} == 4'),
             "the backlog service reporting the run")
        fleet.start_worker()
        wait(fleet, lambda: status(healthy).done == 4, "the healthy run", timeout=300)
        wait(fleet, lambda: fleet.query(f'max_over_time(diffq_run_items{{run="{run_id}", state="done"}}[1m]) == 4')
             and fleet.query(f'diffq_images_total{{queue="{queue}", pool!=""}} == 4'), "the run's series scraped")
        # (A stall while the worker started, seconds long, is fair: it resolves now.)
        wait(fleet, lambda: fleet.alerts() == [], "no alert")
        quiet = fleet.evaluated()
        wait(fleet, lambda: fleet.evaluated() > quiet + 3, "three more evaluations")
        assert fleet.alerts() == []

        # One recompile: seen though it is the shape's first event (its child was at 0).
        fleet.start_probe(queue)
        recompiles = f'diffq_recompiles_total{{shape="{PROBE_SHAPE}", pod=~".*-probe"}}'
        wait(fleet, lambda: fleet.query(f"{recompiles} == 0"), "the probe's recompiles at 0")
        fleet.tell_probe()
        wait(fleet, lambda: fleet.query(f"{recompiles} == 1"), "the probe's recompile scraped")
        wait(fleet, lambda: firing(fleet, "DiffqRecompiles", shape=PROBE_SHAPE), "Recompiles")
        wait(fleet, lambda: not any(a["labels"]["alertname"] == "DiffqRecompiles" for a in fleet.alerts()),
             "Recompiles resolved (its window passed)")
        fleet.stop("probe")

        # A queue whose every item fails (its own shape, so its own queue), and hostile
        # messages on the healthy one.
        failing, failing_queue = submit_run(tmp_path, "failing", prefix, tiny_model, broker, n=4, prompt=POISON,
                                            height=128)
        # Meanwhile (the windows overlap), three LoRA adapter sets, one of them failing
        # every batch at the worker: its file cut short (submit reads the header alone).
        # Three batches a set, interleaved and fed one at a time (seconds apart, scrapes
        # 1 s apart): the failing set's counter is seen rising, which its rate needs.
        loras = tuple(str(build_tiny_lora(tiny_model, tmp_path / "loras" / f"{k}.safetensors", rank=4, seed=k))
                      for k in range(3))
        bad = Path(loras[2])
        bad.write_bytes(bad.read_bytes()[:-64])
        lora_run, _ = submit_run(tmp_path, "lora", prefix, tiny_model, broker, n=18, loras=loras)
        sets = {s.adapters[0].path: digest for digest, s in read_manifest(open_storage(lora_run)).adapter_sets.items()}
        assert sorted(sets) == sorted(loras) and len(set(sets.values())) == 3
        wait(fleet, lambda: firing(fleet, "DiffqItemsFailing", queue=failing_queue), "ItemsFailing")
        redis.Redis.from_url(broker).lpush(queue, b"not a kombu envelope", b"nor this")
        wait(fleet, lambda: firing(fleet, "DiffqDeadLettersGrowing"), "DeadLettersGrowing")
        wait(fleet, lambda: firing(fleet, "DiffqAdapterSetFailing", adapter_set=sets[str(bad)]), "AdapterSetFailing")
        assert set_alerts(fleet) == {sets[str(bad)]}  # the healthy sets are neither pending nor firing
        # The fault ends (nothing more fails, no more letters): all resolve within their windows.
        wait(fleet, lambda: status(failing).failed == 4, "the failing run settled")
        wait(fleet, lambda: (status(lora_run).done, status(lora_run).failed) == (12, 6), "the LoRA run settled")
        assert {FailureRecord.model_validate_json(p.read_text()).error.split(" (")[0]
                for p in (Path(lora_run) / "failures").iterdir()} == {f"AdapterUnsupported: adapter {bad}: its weights "
                                                                      "cannot be read"}
        for path in loras[:2]:
            wait(fleet, lambda p=path: fleet.query(f'diffq_adapter_set_images_total{{adapter_set="{sets[p]}"}} == 6'),
                 "a healthy set's images scraped")
        assert set_alerts(fleet) <= {sets[str(bad)]}
        wait(fleet, lambda: not firing(fleet, "DiffqItemsFailing") and not firing(fleet, "DiffqDeadLettersGrowing")
             and not any(a["labels"]["alertname"] in ("DiffqItemsFailing", "DiffqDeadLettersGrowing",
                                                      "DiffqAdapterSetFailing") for a in fleet.alerts()),
             "ItemsFailing, DeadLettersGrowing and AdapterSetFailing resolved")

        # A run no pool serves (another model): stalled from its creation.
        stalled, _ = submit_run(tmp_path, "stalled", prefix, str(tmp_path / "no-such-model"), broker, n=4)
        stalled_id = read_manifest(open_storage(stalled)).run_id
        created = read_manifest(open_storage(stalled)).created_at
        alert = wait(fleet, lambda: firing(fleet, "DiffqRunStalled", run=stalled_id), "RunStalled")
        age = f'diffq_run_last_progress_timestamp_seconds{{run="{stalled_id}"}}'
        [before] = fleet.query(age)
        assert float(before["value"][1]) == pytest.approx(created, abs=1e-3)

        # The backlog service restarted mid-stall: the stall keeps its age, the alert never resolves.
        fleet.stop("backlog")
        fleet.start_backlog()
        restarted = time.time()
        wait(fleet, lambda: [s for s in fleet.query(f"timestamp({age})") if float(s["value"][1]) > restarted],
             "the restarted service scraped")
        [after] = fleet.query(age)
        assert after["value"][1] == before["value"][1]
        assert firing(fleet, "DiffqRunStalled", run=stalled_id)["activeAt"] == alert["activeAt"]

        # The backlog service kept down: its series go stale, BacklogServiceDown fires,
        # and RunStalled holds (same activeAt: it never resolved meanwhile).
        fleet.stop("backlog")
        down = wait(fleet, lambda: firing(fleet, "DiffqBacklogServiceDown"), "BacklogServiceDown")
        assert down["labels"]["severity"] == "critical"
        assert fleet.query(age) == [] and fleet.query('up{container="backlog"} == 0')  # nothing left of its source
        assert firing(fleet, "DiffqRunStalled", run=stalled_id)["activeAt"] == alert["activeAt"]
        fleet.start_backlog()
        wait(fleet, lambda: not any(a["labels"]["alertname"] == "DiffqBacklogServiceDown" for a in fleet.alerts()),
             "BacklogServiceDown resolved")
        assert firing(fleet, "DiffqRunStalled", run=stalled_id)["activeAt"] == alert["activeAt"]
        # The stall ends (the run cancelled: nothing pending): RunStalled resolves.
        result = CliRunner().invoke(app, ["cancel", stalled])
        assert result.exit_code == 0, result.output
        wait(fleet, lambda: not any(a["labels"]["alertname"] == "DiffqRunStalled" for a in fleet.alerts()),
             "RunStalled resolved")

        # Storage failing: a run folder whose images/ is a file, so every image put fails
        # in the filesystem (as a store denying writes does; chmod would not stop root).
        # The sink's helper retries without giving up; each failed try is counted by the
        # worker as it happens, so StorageFailing fires while the fault lasts.
        blocked = Path(prefix) / "blocked"
        blocked.mkdir()
        (blocked / "images").write_bytes(b"")
        blocked_out, _ = submit_run(tmp_path, "blocked", prefix, tiny_model, broker, n=2)
        wait(fleet, lambda: firing(fleet, "DiffqStorageFailing"), "StorageFailing")
        assert fleet.query('diffq_upload_failures_total{stage="try", pod!~".*-probe"} > 0')
        assert fleet.query('diffq_upload_failures_total{stage="store"} == 0')  # no batch given up on
        assert status(blocked_out).done == 0
        # The fault ends: the next try stores the batch, and the alert resolves a window later.
        (blocked / "images").unlink()
        wait(fleet, lambda: status(blocked_out).done == 2, "the blocked run stored once storage healed")
        wait(fleet, lambda: not any(a["labels"]["alertname"] == "DiffqStorageFailing" for a in fleet.alerts()),
             "StorageFailing resolved")
    finally:
        fleet.close()
