"""Nothing lost, nothing produced twice: worker kills, broker restarts, poison prompts,
resume and retry-failed — with real worker processes and a private Redis on loopback."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from diffq.producer.resume import resume, retry_failed
from diffq.results.status import status
from diffq.producer.submit import submit
from diffq.core.storage import open_storage
from tests.helpers import assert_run_complete, start_workers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def write_prompts(path, n, poison_at=()):
    rows = [{"id": f"i{i:04d}", "prompt": ("POISON " if i in poison_at else "") + f"prompt {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sigkill_workers_ten_times_loses_and_duplicates_nothing(tmp_path, redis_server, tiny_model):
    prompts = write_prompts(tmp_path / "p.jsonl", 400)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=redis_server, batch_size=8, steps=4)
    supervisor = start_workers(redis_server, list(result.queues), tiny_model)
    rng = random.Random(1234)
    kills = []
    try:
        while len(kills) < 10:
            time.sleep(rng.uniform(0.5, 2.0))
            supervisor.poll()
            alive = [c for c in supervisor.children if c.process is not None and c.process.is_alive()]
            if not alive:
                continue
            victim = rng.choice(alive)
            os.kill(victim.process.pid, signal.SIGKILL)
            kills.append((time.monotonic(), status(out).done))
            victim.process.join(5)
        st = wait_until(out, supervisor, lambda s: s.done >= 400, timeout=300)
    finally:
        supervisor.stop(timeout=60)
    assert len(kills) == 10 and supervisor.deaths >= 10
    assert (st.total, st.done, st.failed) == (400, 400, 0)
    assert_run_complete(out, prompts, steps=4, model=tiny_model)  # exactly once, all decode


def test_redis_restart_with_aof_loses_nothing(tmp_path, make_redis_server, tiny_model):
    server = make_redis_server(appendonly=True)
    broker = server.url
    prompts = write_prompts(tmp_path / "p.jsonl", 160)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=broker, batch_size=8, steps=4)
    supervisor = start_workers(broker, list(result.queues), tiny_model)
    try:
        wait_until(out, supervisor, lambda s: s.done >= 16, timeout=120)
        server.restart()
        st = wait_until(out, supervisor, lambda s: s.done >= 160, timeout=240)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (160, 0)
    assert_run_complete(out, prompts, steps=4, model=tiny_model)


def test_poison_prompt_fails_alone_then_retry_failed(tmp_path, redis_server, tiny_model, monkeypatch):
    monkeypatch.setenv("DIFFQ_FAULT_POISON", "POISON")
    monkeypatch.setenv("DIFFQ_TASK_MAX_RETRIES", "1")
    monkeypatch.setenv("DIFFQ_RETRY_BACKOFF_S", "0.1")
    prompts = write_prompts(tmp_path / "p.jsonl", 24, poison_at={5})
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=redis_server, batch_size=8, steps=2)
    supervisor = start_workers(redis_server, list(result.queues), tiny_model)
    try:
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= 24, timeout=180)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (23, 1)
    storage = open_storage(out)
    failures = [json.loads(storage.get_bytes(k)) for k in storage.list("failures/")]
    assert [f["item_ids"] for f in failures] == [["i0005"]]
    assert failures[0]["attempts"] == 2 and "POISON" in failures[0]["error"]

    # The fault is fixed: retry-failed re-enqueues that item alone, once.
    monkeypatch.delenv("DIFFQ_FAULT_POISON")
    requeued = retry_failed(out, redis_server)
    assert (requeued.items, requeued.batches) == (1, 1)
    supervisor = start_workers(redis_server, list(result.queues), tiny_model, n=1)
    try:
        st = wait_until(out, supervisor, lambda s: s.done >= 24, timeout=120)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (24, 0)
    assert_run_complete(out, prompts, steps=2, model=tiny_model)


def test_resume_reenqueues_exactly_what_is_missing(tmp_path, make_redis_server, tiny_model):
    server = make_redis_server()
    prompts = write_prompts(tmp_path / "p.jsonl", 20)
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=4, steps=2)
    # The broker loses everything (say, a Redis without persistence restarted).
    import redis

    redis.Redis.from_url(server.url).flushall()
    supervisor = start_workers(server.url, list(result.queues), tiny_model, n=1)
    try:
        assert resume(out, server.url).items == 20
        st = wait_until(out, supervisor, lambda s: s.done >= 20, timeout=120)
    finally:
        supervisor.stop(timeout=60)
    assert st.done == 20
    again = resume(out, server.url)
    assert (again.items, again.batches) == (0, 0)
    assert_run_complete(out, prompts, steps=2, model=tiny_model)


def test_s3_outage_delays_the_run_and_loses_nothing(tmp_path, s3_bucket, s3_server, redis_server, tiny_model,
                                                     monkeypatch):
    from tests.proxy import CuttableProxy

    proxy = CuttableProxy(s3_server.port)
    proxy.start()
    # Everything (producer, workers, status) reaches S3 through the proxy.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    result = submit(prompts, s3_bucket, model=tiny_model, broker_url=redis_server, batch_size=8, steps=4)
    supervisor = start_workers(redis_server, list(result.queues), tiny_model)
    try:
        wait_until(s3_bucket, supervisor, lambda s: s.done >= 16, timeout=120)
        proxy.cut()
        outage_s = 12.0  # the outage itself, not a wait for luck
        time.sleep(outage_s)
        supervisor.poll()
        proxy.start()
        st = wait_until(s3_bucket, supervisor, lambda s: s.done >= 120, timeout=240)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (120, 0)
    assert supervisor.deaths == 0
    assert_run_complete(s3_bucket, prompts, steps=4, model=tiny_model)
    proxy.cut()
