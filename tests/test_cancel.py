"""`diffq cancel OUT`: workers drop the run's remaining batches unseen; status counts
them as cancelled; nothing stored is touched; `diffq resume` un-cancels and finishes."""

from __future__ import annotations

import json
import time

import pytest
import redis
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.core import layout
from diffq.core.storage import open_storage
from diffq.producer.resume import RunCancelled, cancel, resume, retry_failed
from diffq.producer.submit import submit
from diffq.results.status import status
from tests.helpers import assert_run_complete, start_workers, wait_until

runner = CliRunner()


def write_prompts(path, n: int):
    path.write_text("".join(json.dumps({"id": f"c-{i:03d}", "prompt": f"cancel {i}"}) + "\n" for i in range(n)))
    return path


def drained(url: str, queues) -> bool:
    """Nothing left on the queues and nothing delivered but unacked (kombu's Redis
    `unacked` hash): every batch was taken and settled."""
    client = redis.Redis.from_url(url)
    return all(client.llen(q) == 0 for q in queues) and client.hlen("unacked") == 0


def wait_drained(url: str, queues, supervisor, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not drained(url, queues):
        assert time.monotonic() < deadline, "queues not drained"
        supervisor.poll()
        time.sleep(0.2)


def test_cancel_marks_and_status_counts(tmp_path, make_redis_server):
    server = make_redis_server()
    out = str(tmp_path / "run")
    result = submit(write_prompts(tmp_path / "p.jsonl", 10), out, model="/models/none", broker_url=server.url,
                    batch_size=4)
    assert status(out).pending == 10 and status(out).cancelled == 0
    assert cancel(out) is True and cancel(out) is False  # idempotent
    st = status(out)
    assert (st.done, st.failed, st.cancelled, st.pending) == (0, 0, 10, 0) and st.finished
    cli = runner.invoke(app, ["status", out, "--json"])
    data = json.loads(cli.stdout)
    assert data["cancelled"] == 10 and data["pending"] == 0
    assert data["done"] + data["failed"] + data["cancelled"] + data["pending"] == data["total"] == result.total
    with pytest.raises(RunCancelled, match="diffq resume"):
        retry_failed(out, server.url)
    missing = runner.invoke(app, ["cancel", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no diffq run" in missing.output


@pytest.mark.slow
def test_cancelled_run_is_dropped_unseen_then_resumed(tmp_path, make_redis_server, tiny_model):
    """Two runs on the same shape queue, the first cancelled: the worker takes the
    first run's batches (queued ahead) and drops them without generating anything,
    then serves the second; resume then finishes the first."""
    server = make_redis_server()
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    cancelled, other = str(tmp_path / "cancelled"), str(tmp_path / "other")
    first = submit(prompts, cancelled, model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
    kept = {key: open_storage(cancelled).get_bytes(key) for key in open_storage(cancelled).list("")}
    cli = runner.invoke(app, ["cancel", cancelled, "--broker", server.url])
    assert cli.exit_code == 0 and "cancelled" in cli.stdout and "20 messages" in cli.stdout, cli.output
    second = submit(prompts, other, model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
    queues = sorted(first.queues)
    assert sorted(second.queues) == queues
    supervisor = start_workers(server.url, queues, tiny_model, n=1)
    storage = open_storage(cancelled)
    try:
        st = wait_until(other, supervisor, lambda s: s.done + s.failed >= 40, timeout=240)
        assert (st.done, st.failed) == (40, 0)
        wait_drained(server.url, queues, supervisor)
        st = status(cancelled)
        assert (st.done, st.failed, st.cancelled, st.pending) == (0, 0, 40, 0)
        assert not list(storage.list("images/")) and not list(storage.list("records/"))
        after = {key: storage.get_bytes(key) for key in storage.list("")}
        assert {key: after[key] for key in kept} == kept  # nothing stored touched
        assert set(after) - set(kept) == {layout.CANCEL}
        assert supervisor.deaths == 0

        requeued = resume(cancelled, server.url)
        assert requeued.items == 40 and not storage.exists(layout.CANCEL)
        st = wait_until(cancelled, supervisor, lambda s: s.done + s.failed >= 40, timeout=240)
        assert (st.done, st.failed, st.cancelled) == (40, 0, 0)
    finally:
        supervisor.stop(timeout=60)
    assert_run_complete(cancelled, prompts, steps=1, model=tiny_model)


@pytest.mark.slow
def test_cancel_ends_an_embedded_run(tmp_path, tiny_model):
    """`diffq run` waits for every item; a cancel from elsewhere ends it once its
    workers have dropped what is queued, with the rest counted cancelled."""
    import threading

    from diffq.app.runner import run

    out = str(tmp_path / "run")
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("run", run(
        write_prompts(tmp_path / "p.jsonl", 300), out, model=tiny_model, batch_size=2, steps=1, progress=False)))
    thread.start()
    deadline = time.monotonic() + 240
    while not (storage_has(out, layout.MANIFEST) and status(out).done >= 2):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.2)
    cancel(out)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the embedded run did not end"
    result, st = results["run"], status(out)
    assert not result.ok and result.done == st.done < 300
    assert st.pending == 0 and st.done + st.failed + st.cancelled == 300


def storage_has(out: str, key: str) -> bool:
    return open_storage(out).exists(key)
