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
    server = make_redis_server()
    out = str(tmp_path / "run")
    prompts = write_prompts(tmp_path / "p.jsonl", 60)
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
    queues = sorted(result.queues)
    supervisor = start_workers(server.url, queues, tiny_model, n=1)
    storage = open_storage(out)
    try:
        wait_until(out, supervisor, lambda s: s.done >= 4, timeout=240)
        cli = runner.invoke(app, ["cancel", out, "--broker", server.url])
        assert cli.exit_code == 0 and "cancelled" in cli.stdout, cli.output
        kept = {key: storage.get_bytes(key) for prefix in ("images/", "records/") for key in storage.list(prefix)}
        wait_drained(server.url, queues, supervisor)
        st = status(out)
        # A batch in hand at the cancel may still finish; every other one is dropped.
        assert st.pending == 0 and st.done + st.failed + st.cancelled == st.total == 60
        assert st.done < 60 and st.cancelled == 60 - st.done - st.failed
        after = {key: storage.get_bytes(key) for prefix in ("images/", "records/") for key in storage.list(prefix)}
        assert {key: after[key] for key in kept} == kept  # nothing stored touched
        assert len([k for k in after if k.startswith("images/")]) == st.done
        assert supervisor.deaths == 0

        requeued = resume(out, server.url)
        assert requeued.items == 60 - st.done and not storage.exists(layout.CANCEL)
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= 60, timeout=300)
        assert (st.done, st.failed, st.cancelled) == (60, 0, 0)
    finally:
        supervisor.stop(timeout=60)
    assert_run_complete(out, prompts, steps=1, model=tiny_model)


@pytest.mark.slow
def test_cancel_ends_an_embedded_run(tmp_path, tiny_model):
    """`diffq run` waits for every item; a cancel from elsewhere ends it once its
    workers have dropped what is queued, with the rest counted cancelled."""
    import threading

    from diffq.app.runner import run

    out = str(tmp_path / "run")
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("run", run(
        write_prompts(tmp_path / "p.jsonl", 80), out, model=tiny_model, batch_size=2, steps=1, progress=False)))
    thread.start()
    deadline = time.monotonic() + 240
    while not (storage_has(out, layout.MANIFEST) and status(out).done >= 2):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.2)
    cancel(out)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the embedded run did not end"
    result, st = results["run"], status(out)
    assert not result.ok and result.done == st.done < 80
    assert st.pending == 0 and st.done + st.failed + st.cancelled == 80


def storage_has(out: str, key: str) -> bool:
    return open_storage(out).exists(key)
