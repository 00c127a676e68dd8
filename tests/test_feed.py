"""A window, not the whole run, in the broker (producer/feed.py): what `submit` leaves
in Redis, RabbitMQ and SQS, the backlog signal, and the feeder killed mid-run."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from unittest import mock

import pytest
import redis

from diffq.app.backlog import Backlog, model_backlogs, serve
from diffq.app.queues import queue_report
from diffq.core import layout
from diffq.core.contract import queue_slug
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.producer.feed import DEFAULT_WINDOW, Feeder, RunFeed, parse_window, read_pointer, read_state, waiting
from diffq.producer.publish import CeleryPublisher
from diffq.producer.resume import cancel, resume
from diffq.producer.submit import submit
from diffq.results.status import status
from tests.helpers import assert_run_complete, start_workers, wait_until

ROOT = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int, text: str = "a photo of item {i}") -> Path:
    with path.open("w") as handle:
        for start in range(0, n, 100_000):
            handle.write("".join(json.dumps({"id": f"i{i:08d}", "prompt": text.format(i=i)}) + "\n"
                                 for i in range(start, min(n, start + 100_000))))
    return path


def published(out: str) -> int:
    storage = open_storage(out)
    return sum(q.published for q in read_state(storage, read_pointer(storage).source).queues.values())


def test_window_option_parses():
    assert parse_window("all") is None and parse_window(" ALL ") is None
    assert parse_window("16") == 16 and parse_window(DEFAULT_WINDOW) == DEFAULT_WINDOW
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="--window"):
            parse_window(bad)


def test_2m_prompts_raise_redis_memory_by_at_most_64_mb(make_redis_server, tmp_path):
    """500,000 batches: the plan in OUT, the default window in Redis (every batch in
    Redis was ~1 GB: bench/window.py, docs/BENCHMARKS.md)."""
    url = make_redis_server().url
    prompts = write_prompts(tmp_path / "p.jsonl", 2_000_000)
    client = redis.Redis.from_url(url)
    before = int(client.info("memory")["used_memory"])
    result = submit(prompts, str(tmp_path / "out"), model="/models/m", broker_url=url, batch_size=4,
                    feeds=str(tmp_path / "feeds"))
    grown = int(client.info("memory")["used_memory"]) - before
    assert result.total == 2_000_000
    assert result.batches == DEFAULT_WINDOW and result.unpublished == 500_000 - DEFAULT_WINDOW
    [queue] = result.queues
    assert client.llen(queue) == DEFAULT_WINDOW
    assert grown <= 64 * 2**20, f"{grown:,} bytes"
    # The whole plan is in OUT.
    manifest = read_manifest(open_storage(str(tmp_path / "out")))
    assert manifest.batches == 500_000
    assert sum(1 for _ in open_storage(str(tmp_path / "out")).list(layout.PLAN_PREFIX)) == manifest.plan_parts


def test_window_all_puts_every_batch_in_the_broker(make_redis_server, tmp_path):
    url = make_redis_server().url
    prompts = write_prompts(tmp_path / "p.jsonl", 400)
    result = submit(prompts, str(tmp_path / "out"), model="/models/m", broker_url=url, batch_size=4, window=None)
    [queue] = result.queues
    assert (result.batches, result.unpublished, redis.Redis.from_url(url).llen(queue)) == (100, 0, 100)
    assert read_pointer(open_storage(str(tmp_path / "out"))) is None  # nothing to feed


def test_the_default_window_needs_a_feeder(make_redis_server, tmp_path, monkeypatch):
    """On defaults a run larger than the window goes whole into the broker unless a feeds
    folder lists it for a feeder: a window with nobody to feed the rest would stall."""
    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    prompts = write_prompts(tmp_path / "p.jsonl", 4 * (DEFAULT_WINDOW + 10))
    monkeypatch.delenv("DIFFQ_FEEDS", raising=False)
    bare = submit(prompts, str(tmp_path / "bare"), model="/models/m", broker_url=url, batch_size=4)
    assert (bare.batches, bare.unpublished) == (DEFAULT_WINDOW + 10, 0)
    [queue] = bare.queues
    assert client.llen(queue) == DEFAULT_WINDOW + 10
    client.delete(queue)
    monkeypatch.setenv("DIFFQ_FEEDS", str(tmp_path / "feeds"))  # read fresh: settings are not cached
    fed = submit(prompts, str(tmp_path / "fed"), model="/models/m", broker_url=url, batch_size=4)
    assert (fed.batches, fed.unpublished) == (DEFAULT_WINDOW, 10)
    assert client.llen(queue) == DEFAULT_WINDOW
    assert len(list(open_storage(str(tmp_path / "feeds")).list())) == 1  # listed for the feeder


def test_the_feeder_keeps_the_window_and_marks_only_what_it_published(make_redis_server, tmp_path):
    """A second feeder beside the first, a feeder restarted from the marks: the window
    per run never grows, nothing is skipped; a cancelled run is not fed."""
    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    out = str(tmp_path / "out")
    small = str(tmp_path / "small")
    result = submit(write_prompts(tmp_path / "p.jsonl", 200), out, model="/models/m", broker_url=url,
                    batch_size=4, window=5)
    [queue] = result.queues
    assert (result.batches, result.unpublished, client.llen(queue)) == (5, 45, 5)
    # Nothing settled yet: feeders have no room, however many there are.
    publisher = CeleryPublisher(url)
    try:
        first, second = RunFeed(open_storage(out), publisher), RunFeed(open_storage(out), publisher)
        assert first.feed_once() == second.feed_once() == 0
        assert client.llen(queue) == 5
        # A small run on the same queue gets its own window at once.
        other = submit(write_prompts(tmp_path / "q.jsonl", 8), small, model="/models/m", broker_url=url,
                       batch_size=4, window=5)
        assert (other.batches, client.llen(queue)) == (2, 7)
        # Two feeders at most publish again what the other did, never skip: the marks
        # count what each published itself.
        cancel(out)
        assert first.feed_once() == 0 and first.cancelled and first.over()
    finally:
        publisher.close()
    assert published(out) == 5


def test_a_feeder_dying_between_publishing_and_marking_loses_nothing(make_redis_server, tmp_path):
    """The broker took the batches, the mark was never written: the next feeder
    publishes them again (the stored-batch guard makes the copies harmless), never skips."""
    from diffq.core.progress import ProgressLog

    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    out = str(tmp_path / "out")
    result = submit(write_prompts(tmp_path / "p.jsonl", 40), out, model="/models/m", broker_url=url,
                    batch_size=4, window=2)
    [queue] = result.queues
    storage = open_storage(out)
    first = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    log = ProgressLog(storage, writer="test")
    for envelope in first:  # both settle: room for two more
        batch = json.loads(base64.b64decode(envelope["body"]))[1]["batch"]
        log.add(batch["batch_id"], queue, [item["id"] for item in batch["items"]])
    log.flush()
    client.delete(queue)

    class DiesAfterPublishing(CeleryPublisher):
        def flush(self) -> None:
            super().flush()
            raise KeyboardInterrupt("killed before marking")

    dying = DiesAfterPublishing(url)
    try:
        with pytest.raises(KeyboardInterrupt):
            RunFeed(storage, dying).feed_once()
    finally:
        dying.close()
    assert client.llen(queue) == 2 and published(out) == 2  # in the broker, not marked
    publisher = CeleryPublisher(url)
    try:
        assert RunFeed(storage, publisher).feed_once() == 2  # the same two again
    finally:
        publisher.close()
    ids = [json.loads(raw)["headers"]["kwargsrepr"] for raw in client.lrange(queue, 0, -1)]  # run/batch
    assert len(ids) == 4 and len(set(ids)) == 2 and published(out) == 4


def run_feeder(out: str, broker: str, poll: float = 0.2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diffq", "feed", out, "--broker", broker, "--poll", str(poll)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished(out: str, workers, feeder: subprocess.Popen, total: int, timeout: float) -> None:
    """Until every item is done or failed and the feeder has ended; then both stopped."""
    try:
        final = wait_until(out, workers, lambda s: s.done + s.failed >= total, timeout=timeout)
        assert feeder.wait(timeout=120) == 0, feeder.stderr.read()
    finally:
        if feeder.poll() is None:
            feeder.kill()
        workers.stop(timeout=60)
    assert (final.done, final.failed) == (total, 0)


BROKERS = ["redis", "amqp", "sqs"]


@pytest.fixture
def broker(request, make_redis_server, tmp_path):
    """(broker URL, transport options, RabbitMQ API URL) of a private broker of each kind."""
    kind = request.param
    if kind == "redis":
        yield make_redis_server().url, None, None
    elif kind == "amqp":
        server = request.getfixturevalue("rabbitmq_server")
        url = server.make_vhost()
        yield url, None, server.api_url
        server.api("DELETE", "vhosts/" + url.rsplit("/", 1)[1])
    else:
        pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
        s3 = request.getfixturevalue("s3_server")
        yield (f"sqs://testing:testing@127.0.0.1:{s3.port}",
               {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-", "wait_time_seconds": 1,
                "polling_interval": 0.2}, None)


@pytest.mark.slow
@pytest.mark.parametrize("broker, total, window", [("redis", 20_000, 100), ("amqp", 400, 10), ("sqs", 400, 10)],
                         indirect=["broker"], ids=["redis", "amqp", "sqs"])
def test_a_windowed_run_completes_exactly_once_with_its_feeder_killed_twice(broker, total, window, tmp_path,
                                                                            monkeypatch):
    """20,000 items (400 on RabbitMQ and SQS), a small window, the feeder SIGKILLed
    twice mid-run (anywhere: between publishing and marking too), stand-in devices
    (bench/standin.py)."""
    from bench.standin import device_child_main, write_standin
    from diffq.worker.process import supervisor as supervisor_module

    url, options, _ = broker
    if options:  # the feeder process reads them as every diffq process does
        monkeypatch.setenv("DIFFQ_BROKER_TRANSPORT_OPTIONS", json.dumps(options))
    batch = 4
    model = str(write_standin(tmp_path / "standin"))
    prompts = write_prompts(tmp_path / "p.jsonl", total, "item {i} device_s=0.0")
    out = str(tmp_path / "out")
    result = submit(prompts, out, model=model, broker_url=url, batch_size=batch, height=64, width=64,
                    steps=1, format="jpeg", window=window)
    assert (result.batches, result.unpublished) == (window, total // batch - window)
    [queue] = result.queues
    client = redis.Redis.from_url(url) if url.startswith("redis") else None
    with mock.patch.object(supervisor_module, "child_main", device_child_main):
        workers = start_workers(url, [queue], model, n=2)
    feeder = run_feeder(out, url)
    try:
        for kill_after in (total // batch * 3 // 10, total // batch * 6 // 10):  # batches published
            deadline = time.monotonic() + 600
            while published(out) < kill_after:
                assert feeder.poll() is None, feeder.stderr.read()
                assert time.monotonic() < deadline, f"feeder stuck at {published(out)}"
                workers.poll()
                # The broker never holds more than the window of this run.
                assert client is None or client.llen(queue) <= window
                time.sleep(0.05)
            feeder.send_signal(signal.SIGKILL)
            feeder.wait()
            feeder = run_feeder(out, url)
    except BaseException:
        feeder.kill()
        workers.stop(timeout=60)
        raise
    finished(out, workers, feeder, total, timeout=900)
    storage = open_storage(out)
    assert not storage.exists(layout.FEEDER)  # the hand feeder's heartbeat went with its run's last batch
    records = list(iter_records(storage))
    ids = sorted(record.id for record in records)
    assert ids == [f"i{i:08d}" for i in range(total)]  # each item recorded once
    images = list(Path(out, layout.IMAGES_PREFIX).iterdir())
    assert len(images) == total
    assert {record.file_name for record in records} == {f"{layout.IMAGES_PREFIX}{p.name}" for p in images}
    assert published(out) == total // batch
    assert status(out).done == total


@pytest.mark.slow
@pytest.mark.parametrize("broker", BROKERS, indirect=True)
def test_the_backlog_counts_what_out_holds_and_the_feeder_finishes_the_run(broker, tiny_model, tmp_path,
                                                                          monkeypatch):
    """The broker holds the window; `diffq queues` and the backlog service report the
    whole backlog; a feeder beside a real worker finishes the run."""
    url, options, api = broker
    feeds = str(tmp_path / "feeds")
    monkeypatch.setenv("DIFFQ_FEEDS", feeds)
    total, batch, window = 48, 2, 3
    out = str(tmp_path / "run")
    result = submit(write_prompts(tmp_path / "p.jsonl", total), out, model=tiny_model, broker_url=url,
                    transport_options=options, batch_size=batch, steps=1, window=window)
    [queue] = result.queues
    assert (result.batches, result.unpublished) == (window, total // batch - window)
    assert waiting(feeds) == {queue: total // batch - window}
    [info] = [i for i in queue_report(url, [queue], timeout=0, transport_options=options, rabbitmq_api=api,
                                      unpublished=waiting(feeds)) if i.queue == queue]
    assert (info.depth, info.unpublished) == (window, total // batch - window)
    if options is None:  # the backlog service's listing (it takes the fleet's broker settings)
        backlog = Backlog(lambda: model_backlogs(url, api, waiting(feeds)))
        assert backlog.answer(None, queue)["backlog"] == total // batch
        assert backlog.answer(queue_slug(queue))["backlog"] == total // batch
    publisher = CeleryPublisher(url, options)
    feeder = Feeder(publisher, feeds)
    stop = threading.Event()
    thread = threading.Thread(target=feeder.serve, args=(stop, 0.2), daemon=True)
    thread.start()
    try:
        workers = start_workers(url, [queue], tiny_model, n=1, **({"transport_options": options} if options else {}))
        try:
            final = wait_until(out, workers, lambda s: s.done + s.failed >= total, timeout=300)
        finally:
            workers.stop(timeout=60)
    finally:
        stop.set()
        thread.join(timeout=30)
        publisher.close()
    assert (final.done, final.failed) == (total, 0)
    assert_run_complete(out, tmp_path / "p.jsonl", steps=1, model=tiny_model)
    assert waiting(feeds) == {}  # a run all published leaves the feeds folder
    assert feeder.unpublished() == {}


@pytest.mark.slow
def test_resume_goes_through_the_feeder(make_redis_server, tiny_model, tmp_path):
    """`resume` re-plans what is missing as a feed source of its own and publishes a
    window of it; `diffq feed` publishes the rest; the run finishes once."""
    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    total, batch, window = 40, 2, 4
    out = str(tmp_path / "run")
    prompts = write_prompts(tmp_path / "p.jsonl", total)
    result = submit(prompts, out, model=tiny_model, broker_url=url, batch_size=batch, steps=1, window=window)
    [queue] = result.queues
    client.delete(queue)  # the broker lost the window
    requeued = resume(out, url, window=window)
    assert (requeued.items, requeued.batches, requeued.unpublished) == (total, total // batch, total // batch - window)
    assert client.llen(queue) == window
    feeder = run_feeder(out, url)
    finished(out, start_workers(url, [queue], tiny_model, n=1), feeder, total, timeout=300)
    assert_run_complete(out, prompts, steps=1, model=tiny_model)


def test_the_feeder_signs_what_it_publishes_and_refills_as_batches_settle(make_redis_server, tmp_path, monkeypatch):
    """Credits (the sink's own progress log) make room; the batches that fill it are
    signed with DIFFQ_SIGNING_KEY, as submit's are; `diffq queues --feeds` counts the rest."""
    from typer.testing import CliRunner

    from diffq.app.cli import app
    from diffq.core.progress import ProgressLog
    from diffq.core.signing import HEADER, keys_from_settings

    monkeypatch.setenv("DIFFQ_SIGNING_KEY", "k1")
    url = make_redis_server().url
    client = redis.Redis.from_url(url)
    out, feeds = str(tmp_path / "out"), str(tmp_path / "feeds")
    result = submit(write_prompts(tmp_path / "p.jsonl", 40), out, model="/models/m", broker_url=url,
                    batch_size=4, window=3, feeds=feeds)
    [queue] = result.queues
    assert waiting(feeds) == {queue: 7}
    shown = CliRunner().invoke(app, ["queues", "--broker", url, "--feeds", feeds, "--timeout", "0"])
    assert shown.exit_code == 0, shown.output
    assert "in OUT" in shown.output and any(line.split()[:4] == [queue, "3", "0", "7"]
                                            for line in shown.output.splitlines())
    # A per-shape pool's trigger URL (app/fleet.py): queued + in OUT, over HTTP.
    server = serve(Backlog(lambda: model_backlogs(url, None, waiting(feeds))), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        query = urllib.parse.urlencode({"queue": queue})
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/backlog?{query}") as answer:
            assert json.loads(answer.read())["backlog"] == 10
    finally:
        server.shutdown()
        server.server_close()

    def taken() -> list[dict]:
        batches = []
        while (raw := client.rpop(queue)) is not None:  # kombu LPUSHes: the oldest at the tail
            envelope = json.loads(raw)
            body = json.loads(base64.b64decode(envelope["body"]))
            batches.append((body[1]["batch"], envelope["headers"][HEADER]))
        return batches

    keys = keys_from_settings()
    first = taken()
    assert len(first) == 3 and all(keys.problem(queue, batch, signature) is None for batch, signature in first)
    log = ProgressLog(open_storage(out), writer="test")
    for batch, _ in first[:2]:
        log.add(batch["batch_id"], queue, [item["id"] for item in batch["items"]])
    log.flush()
    publisher = CeleryPublisher(url)
    try:
        feeder = Feeder(publisher, feeds)
        assert feeder.pass_once() == 2 and feeder.unpublished() == {queue: 5}
    finally:
        publisher.close()
    second = taken()
    assert [b["batch_id"] for b, _ in second] == [f"{first[0][0]['batch_id'][:-7]}{i:07d}" for i in (3, 4)]
    assert all(keys.problem(queue, batch, signature) is None for batch, signature in second)
    assert published(out) == 5 and waiting(feeds) == {queue: 5}


@pytest.mark.parametrize("device", ["neuron", "cuda"])
def test_fleet_manifests_with_a_feeds_folder_scale_every_pool_on_the_whole_backlog(device):
    """Per-shape pools (Neuron, TPU) get a metrics-api trigger on their queue's backlog;
    the backlog service runs the feeder with the signing keys; all still valid."""
    from tests.test_infra import by_kind, render_cli, validate_manifest, worker_deployments

    docs = render_cli("--model", "m", "--shapes", "1024x1024,768x1344", "--batch-size", "1", "--device", device,
                      "--feeds", "s3://diffq-runs/feeds")
    for doc in docs:
        validate_manifest(doc)
    [service] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "diffq-backlog"]
    container = service["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["--feeds", "s3://diffq-runs/feeds"]
    assert {"DIFFQ_SIGNING_KEY", "DIFFQ_SIGNING_KEY_PREVIOUS"} <= {e["name"] for e in container["env"]}
    scaled = by_kind(docs, "ScaledObject")
    assert len(scaled) == len(worker_deployments(docs)) == (2 if device == "neuron" else 1)
    for so in scaled:
        backlog = [t for t in so["spec"]["triggers"] if t["type"] == "metrics-api"]
        assert len(backlog) == 1 and backlog[0]["metadata"]["valueLocation"] == "backlog"
        if device == "neuron":
            [queue] = so["metadata"]["annotations"]["diffq/queue"].split(",")
            assert backlog[0]["metadata"]["url"].endswith(f"/backlog?queue={queue}")
