"""Compile-aware routing: a worker drains the shapes it has compiled before it takes
on a new one (so a fleet compiles each shape about once, not once per worker)."""

from __future__ import annotations

import json
import random
import time

import pytest

from bench.fleet import redis_counters, shape_queues
from diffq.core.runfolder import iter_records
from diffq.producer.submit import submit
from diffq.core.storage import open_storage
from diffq.worker.delivery.celery_adapter import HandConsumer
from diffq.worker.delivery.routing import choose_queues
from tests.helpers import start_workers, wait_until

SERVED = ["a", "b", "c"]


def test_compiled_shapes_with_backlog_come_first():
    assert choose_queues(SERVED, {"a"}, {"a": 3, "b": 9, "c": 1}, random.Random(0)) == {"a"}
    assert choose_queues(SERVED, {"a", "b"}, {"a": 3, "b": 1, "c": 9}, random.Random(0)) == {"a", "b"}


def test_one_new_shape_at_a_time_when_compiled_ones_are_empty():
    picks = [choose_queues(SERVED, {"a"}, {"a": 0, "b": 5, "c": 5}, random.Random(seed)) for seed in range(50)]
    assert all(len(p) == 2 and "a" in p for p in picks)  # keeps listening on its compiled shape
    assert {frozenset(p - {"a"}) for p in picks} == {frozenset({"b"}), frozenset({"c"})}  # idle workers spread


def test_new_shapes_weighted_by_backlog():
    picks = [choose_queues(SERVED, set(), {"b": 99, "c": 1}, random.Random(seed)) for seed in range(200)]
    assert sum(p == {"b"} for p in picks) > 150


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


def test_an_idle_worker_listens_on_the_shapes_it_compiled():
    """Nothing queued: blocking on every queue would cost the broker per queue and idle
    worker; work for a compiled shape still starts at once, a new shape's next tick."""
    assert choose_queues(SERVED, {"a"}, {}, random.Random(0)) == {"a"}
    assert choose_queues(SERVED, {"a", "z"}, {"b": 0}, random.Random(0)) == {"a"}
    # Nothing compiled (or nothing served compiled): everywhere, as a new worker starts.
    assert choose_queues(SERVED, set(), {}, random.Random(0)) == set(SERVED)
    assert choose_queues(SERVED, {"z"}, {}, random.Random(0)) == set(SERVED)


# --- the control plane at fleet size: routers on a real Redis ------------------------
# Routers drive the stand-in consumer bench/fleet.py's simulator drives (the Celery
# adapter's HandConsumer: a real kombu Consumer switched the way Celery switches
# queues). A router's interval is also the shared listing's max age; tests that count
# commands use an hour, so the listing taken at the first tick is the one read until
# the end.

class Fleet:
    """Routers of one fleet, each with its own broker connection, on one Redis."""

    def __init__(self, url: str):
        import redis

        from diffq.core.brokers.app import make_celery

        self.app = make_celery(url)
        self.client = redis.Redis.from_url(url)
        self.connections = []

    def router(self, queues, compiled=(), *, transport=None, discover_models=None, interval=3600.0,
               seed=0):
        from diffq.core.transports import transport_for
        from diffq.worker.delivery.routing import Discovery, Router

        transport = transport or transport_for("redis://")
        connection = self.app.connection_for_read()
        self.connections.append(connection)
        consumer = HandConsumer(connection, list(queues))
        compiled = set(compiled)
        discovery = Discovery(transport, discover_models) if discover_models is not None else None
        router = Router(list(queues), lambda: compiled, transport, rng=random.Random(seed), discovery=discovery)
        router.interval = interval
        router.attach(consumer)
        return router

    def push(self, queue: str, n: int = 1) -> None:
        self.client.lpush(queue, *[b"{}"] * n)

    def calls(self) -> dict[str, int]:
        return {name: calls for name, (calls, _) in redis_counters(self.client)[0].items()}

    def commands(self, run) -> dict[str, int]:
        """The Redis commands `run()` issues, by name (INFO commandstats deltas)."""
        before = self.calls()
        run()
        after = self.calls()
        return {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}

    def close(self) -> None:
        for connection in self.connections:
            connection.release()


@pytest.fixture
def fleet(make_redis_server):
    """A private Redis (its command counts are this test's alone) and routers on it."""
    fleet = Fleet(make_redis_server().url)
    yield fleet
    fleet.close()


def consuming(router) -> set[str]:
    return router.consumer.consuming()


def ticks(router, n: int = 10):
    return lambda: [router.update() for _ in range(n)]


@pytest.mark.parametrize("state", ["idle", "backlog everywhere"])
def test_a_router_tick_costs_the_same_whatever_the_number_of_queues(make_redis_server, state):
    """Per tick: one GET of the shared listing, plus (while another shape has work) an
    LLEN per compiled shape; the number of served queues does not enter. Without the
    shared listing (the broker's `shared_depths` off) every served queue is
    LLENed each tick."""
    import dataclasses

    from diffq.core.transports import transport_for

    from tests.helpers import patched

    row = transport_for("redis://")
    per_tick = {}
    for count in (2, 60):
        fleet = Fleet(make_redis_server().url)
        try:
            queues = shape_queues(count)
            if state != "idle":
                for queue in queues:
                    fleet.push(queue, 3)
            router = fleet.router(queues, compiled=queues[:1])
            router.update()  # takes the listing and switches queues once
            per_tick[count] = fleet.commands(ticks(router))
            old = fleet.router(queues, compiled=queues[:1],
                               transport=dataclasses.replace(row, broker=patched(row.broker, shared_depths=None)))
            old.update()
            assert fleet.commands(ticks(old)).get("llen", 0) == 10 * count
        finally:
            fleet.close()
    assert per_tick[2] == per_tick[60]
    expected = {"get": 10} if state == "idle" else {"get": 10, "llen": 10}
    assert per_tick[60] == expected


def test_the_fleet_lists_the_broker_once_per_interval(fleet):
    """Twenty routers read one listing: one SCAN (and one LLEN per queue) for all of
    them, taken by the first; the others only GET it."""
    queues = shape_queues(8)
    for n, queue in enumerate(queues):
        fleet.push(queue, n + 1)
    routers = [fleet.router(queues, compiled=queues[i % 8:i % 8 + 1], seed=i) for i in range(20)]
    counted = fleet.commands(lambda: [router.update() for router in routers])
    assert counted["scan"] == 1 and counted["get"] == 20
    # Each kept draining its compiled shape (it has work), chosen on the listing's depths.
    assert [consuming(router) for router in routers] == [{queues[i % 8]} for i in range(20)]


def test_a_listing_older_than_the_interval_is_taken_again(fleet):
    """New work on a shape nobody compiled is seen once the listing is retaken (at most
    one interval later), and the fleet retakes it at most once per interval."""
    queues = shape_queues(3)
    fleet.push(queues[0], 2)
    interval = 0.2
    routers = [fleet.router(queues, compiled=[queues[0]], interval=interval, seed=i) for i in range(3)]
    for router in routers:
        router.update()
    assert all(consuming(router) == {queues[0]} for router in routers)
    fleet.client.delete(queues[0])  # drained elsewhere: an idle worker keeps its compiled shape
    fleet.push(queues[2], 5)
    started, scans = time.monotonic(), fleet.calls().get("scan", 0)
    while not all(consuming(router) == {queues[0], queues[2]} for router in routers):
        assert time.monotonic() - started < 30, [consuming(router) for router in routers]
        for router in routers:
            router.update()
        time.sleep(0.01)  # pacing only: the condition is polled, not waited for
    elapsed = time.monotonic() - started
    assert 1 <= fleet.calls()["scan"] - scans <= elapsed / interval + 1


@pytest.mark.parametrize("seed", range(4))
def test_a_stale_listing_never_decides_for_a_compiled_shape(fleet, seed):
    """What a stale listing would get wrong is read exactly: the compiled shape drained
    since the listing (take a new shape now), or filled since (keep draining it: no
    compile of a new shape). The choice equals choose_queues on Redis's depths now."""
    a, b, c, d = queues = shape_queues(4)
    fleet.push(a, 2)
    fleet.push(b, 4)
    fleet.push(c, 1)
    drained = fleet.router(queues, compiled=[a], seed=seed)
    drained.update()  # the listing, read until the end: a 2, b 4, c 1, no d
    assert consuming(drained) == {a}
    fleet.client.delete(a)
    drained.update()
    assert consuming(drained) == choose_queues(queues, {a}, {a: 0, b: 4, c: 1, d: 0}, random.Random(seed)) \
        and len(consuming(drained)) == 2

    fleet.push(d, 2)
    filled = fleet.router(queues, compiled=[d], seed=seed)
    filled.update()
    assert consuming(filled) == {d}  # the listing has no d, Redis has 2

def test_discovering_routers_find_queues_in_the_shared_listing(fleet):
    """Discovery reads the same listing: the worker's models' shape queues only (not
    another model's, not the dead letters), with no SCAN of a second worker's own."""
    from diffq.core.brokers.base import DEAD_LETTERS

    mine, theirs = shape_queues(3, "/models/mine"), shape_queues(2, "/models/theirs")
    for queue in mine + theirs + [DEAD_LETTERS]:
        fleet.push(queue)
    first = fleet.router([], discover_models=["/models/mine"])
    first.update()
    # Nothing compiled yet, three shapes with work: it takes on one of them.
    assert first.served == sorted(mine) and len(consuming(first)) == 1 and consuming(first) < set(mine)
    second = fleet.router([], discover_models=["/models/mine"], seed=1)
    counted = fleet.commands(second.update)
    assert second.served == sorted(mine) and "scan" not in counted


def test_a_failed_listing_read_keeps_the_known_queues(caplog):
    """A broker hiccup reading the shared listing is a failed listing: what is served
    stays, it is said once until a read works, and the next read discovers again."""
    import dataclasses

    from diffq.core.transports import transport_for
    from diffq.worker.delivery.routing import Discovery, Router

    known, later = shape_queues(2)
    answers = iter([ConnectionError("broker hiccup"), ConnectionError("again"), {known: 0, later: 4}])

    def shared_depths(connection, prefix, max_age):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    from tests.helpers import patched

    row = transport_for("redis://")
    fake = dataclasses.replace(row, broker=patched(row.broker, shared_depths=shared_depths))
    router = Router([known], set, fake, discovery=Discovery(fake), compile_aware=False)
    assert router.shared(None, set()) == {} and router.shared(None, set()) == {}
    assert router.served == [known] and caplog.text.count("listing failed") == 1
    assert router.shared(None, set()) == {known: 0, later: 4} and router.served == [known, later]
