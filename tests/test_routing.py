"""Compile-aware routing: a worker drains the shapes it has compiled before it takes
on a new one (so a fleet compiles each shape about once, not once per worker)."""

from __future__ import annotations

import json
import random

import pytest

from diffq.core.runfolder import iter_records
from diffq.producer.submit import submit
from diffq.core.storage import open_storage
from diffq.worker.routing import choose_queues
from tests.helpers import start_workers, wait_until

SERVED = ["a", "b", "c"]


def test_compiled_shapes_with_backlog_come_first():
    assert choose_queues(SERVED, {"a"}, {"a": 3, "b": 9, "c": 1}, random.Random(0)) == {"a"}
    assert choose_queues(SERVED, {"a", "b"}, {"a": 3, "b": 1, "c": 9}, random.Random(0)) == {"a", "b"}


def test_one_new_shape_at_a_time_when_compiled_ones_are_empty():
    picks = [choose_queues(SERVED, {"a"}, {"a": 0, "b": 5, "c": 5}, random.Random(seed)) for seed in range(50)]
    assert all(len(p) == 2 and "a" in p for p in picks)  # keeps listening on its compiled shape
    assert {frozenset(p - {"a"}) for p in picks} == {frozenset({"b"}), frozenset({"c"})}  # idle workers spread


def test_new_shapes_weighted_by_backlog_and_idle_listens_everywhere():
    picks = [choose_queues(SERVED, set(), {"b": 99, "c": 1}, random.Random(seed)) for seed in range(200)]
    assert sum(p == {"b"} for p in picks) > 150
    assert choose_queues(SERVED, {"a"}, {}, random.Random(0)) == set(SERVED)


@pytest.mark.slow
def test_worker_drains_each_shape_before_the_next(tmp_path, make_redis_server, tiny_model):
    server = make_redis_server()
    rows = [{"id": f"{h}-{i}", "prompt": f"p {i}", "height": h, "width": h} for h in (32, 48, 64) for i in range(8)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
    assert result.shapes == 3 and result.batches == 12
    supervisor = start_workers(server.url, sorted(result.queues), tiny_model, n=1, routing="compile-aware")
    try:
        wait_until(out, supervisor, lambda s: s.done >= 24, timeout=180)
    finally:
        supervisor.stop(timeout=60)
    batches = sorted({(r.generate_started_at, r.queue) for r in iter_records(open_storage(out))})
    order = [queue for _, queue in batches]
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert len(order) == 12 and switches == 2, order  # three contiguous runs, one per shape
