"""`diffq queues` against a private Redis with real published batches and a real
worker, and Flower watching the same broker through its HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import redis
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.producer.submit import submit
from diffq.app.queues import PRIORITY_SEP, queue_report
from diffq.worker.process.supervisor import Supervisor, plan_children
from diffq.testing.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "prompts.jsonl")
# Nothing is published here, so the worker idles and always answers remote control.
IDLE_QUEUE = "diffq.idle-000000.64x64.b1.l64.nocfg.fp32"


@pytest.fixture(scope="module")
def worker(redis_server):
    """One real spawned worker process consuming IDLE_QUEUE; yields its Celery hostname."""
    from diffq.core.brokers.app import make_celery

    supervisor = Supervisor(plan_children(device="cpu", devices=[0], broker_url=redis_server,
                                          queues=[IDLE_QUEUE], models=[], name_prefix="qtest"),
                            restart=False)
    supervisor.start()
    app = make_celery(redis_server)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            replies = app.control.inspect(timeout=0.5).active_queues() or {}
            names = [n for n in replies if n.startswith("qtest-cpu0@")]
            if names:
                yield names[0]
                break
            assert supervisor.alive(), "worker process died"
        else:
            pytest.fail("worker did not answer within 90 s")
    finally:
        supervisor.stop(timeout=30)


@pytest.fixture(scope="module")
def published(redis_server, tmp_path_factory):
    """The example prompts submitted for a model path no one serves: batches stay queued.
    The producer never loads the model, so any path string will do."""
    model = str(tmp_path_factory.mktemp("models") / "unserved")
    out = str(tmp_path_factory.mktemp("runs") / "r1")
    return submit(EXAMPLES, out, model=model, broker_url=redis_server, batch_size=4)


def test_depth_per_shape_queue(redis_server, published):
    report = {q.queue: q for q in queue_report(redis_server, timeout=0)}
    for queue, batches in published.queues.items():
        assert report[queue].depth == batches
        assert report[queue].consumers == 0
    assert sum(published.queues.values()) == published.batches == 8


def test_missing_queue_is_zero_and_priority_lists_fold(redis_server):
    client = redis.Redis.from_url(redis_server)
    base = "diffq.prio-000000.64x64.b1.l64.nocfg.fp32"
    client.lpush(base, b"{}", b"{}")
    client.lpush(base + PRIORITY_SEP + "6", b"{}")
    try:
        report = {q.queue: q.depth for q in queue_report(redis_server, ["diffq.nothing.here"], timeout=0)}
        assert report[base] == 3 and report["diffq.nothing.here"] == 0
        assert not any(PRIORITY_SEP in q for q in report)
    finally:
        client.delete(base, base + PRIORITY_SEP + "6")


def test_consumers_from_live_worker(redis_server, worker, published):
    report = {q.queue: q for q in queue_report(redis_server, timeout=1.0)}
    assert report[IDLE_QUEUE].consumers == 1 and report[IDLE_QUEUE].depth == 0
    assert all(report[q].consumers == 0 for q in published.queues)


def test_queues_cli_json_and_table(redis_server, worker, published):
    runner = CliRunner()
    result = runner.invoke(app, ["queues", "--broker", redis_server, "--json", "--timeout", "1"])
    assert result.exit_code == 0, result.output
    rows = {row["queue"]: row for row in json.loads(result.output)}
    assert {q: rows[q]["depth"] for q in published.queues} == published.queues
    assert rows[IDLE_QUEUE]["consumers"] == 1
    result = runner.invoke(app, ["queues", "--timeout", "0"], env={"DIFFQ_BROKER_URL": redis_server})
    assert result.exit_code == 0 and all(q in result.output for q in published.queues)


def test_flower_sees_worker(redis_server, worker, tmp_path):
    port = free_port()
    env = dict(os.environ, FLOWER_UNAUTHENTICATED_API="true")
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen([sys.executable, "-m", "celery", "--broker", redis_server, "flower",
                               "--address=127.0.0.1", f"--port={port}", f"--db={tmp_path / 'flower.db'}"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        workers: dict = {}
        while time.monotonic() < deadline and worker not in workers:
            assert flower.poll() is None, (tmp_path / "flower.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=5) as r:
                    workers = json.loads(r.read())
            except OSError:
                time.sleep(0.3)
        assert worker in workers, (tmp_path / "flower.log").read_text()[-2000:]
        assert [q["name"] for q in workers[worker]["active_queues"]] == [IDLE_QUEUE]
    finally:
        flower.terminate()
        flower.wait(10)
        log.close()


def test_queues_cli_unreachable_broker():
    result = CliRunner().invoke(app, ["queues", "--broker", f"redis://127.0.0.1:{free_port()}/0"])
    assert result.exit_code == 1 and "unreachable" in result.output
