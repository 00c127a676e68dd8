"""The control plane at fleet size: Redis commands/s and Redis CPU for N workers serving
Q shape queues, with routing as it was (`before`) and as it is (`after`).

    python -m bench.fleet [--workers 10,100,1000] [--queues 1,10,100] [--scenario idle|busy]
                          [--modes before,after] [--seconds 5] [--procs 2] [--json FILE]
    python -m bench.fleet --real-worker --queues 1,10    # one real `diffq worker`, idle

Modes: `before`, every worker reads each served queue's depth every tick (a pipelined
LLEN per queue), lists the broker itself every 2 s (SCAN + LLEN) and, idle, blocks on
all its queues; `listing`, the fleet's shared listing (the transport table's
`shared_depths`) with idle workers still blocking everywhere; `after`, the listing,
and an idle worker blocks on the shapes it has compiled (worker/delivery/routing.py now).

What is real: one redis-server (diffq/testing/servers.py) with diffq's broker options (the
transport table, through `make_celery`), and for every simulated worker its own kombu
Redis connection with a kombu Consumer whose BRPOPs kombu's own poller
(MultiChannelPoller) sends and reads; worker/delivery/routing.py's `Router` and `Discovery` on
the 1 s timer (and after each batch), switching queues the way Celery's consumer does;
kombu's restore sweep (`QoS.restore_visible`, its mutex and ZRANGE) every
`unacked_restore_interval`; Celery's `Heart` publishing a heartbeat every 2 s through
Celery's event `Dispatcher`; worker/delivery/lease.py's `LeaseKeeper.renew_once` every
`lease_renew_s` on the broker's `held` of the real kombu QoS; in the busy scenario the
deliveries, acks and task events.

What is simulated: the process around them. The N workers are objects in --procs
processes, each process one event loop (like Celery's hub) over its workers' sockets.
A batch is held for --generate-s, as a solo-pool worker does (no timer of its runs
meanwhile), then acked and routed again; nothing is generated or stored. Celery's
remote-control pidbox (an idle PUBSUB subscription) and the event dispatcher's own
connection are left out, so a simulated worker holds 2-4 connections, a real one 6.

Time: a 2-core machine cannot drive 1,000 workers' Python at the real pace, so a
cell may run k times slower (every period, BRPOP timeout, visibility timeout and
batch time times k) and its counts are divided by the window / k: figures are per
real second. Redis's CPU with the fleet connected but silent (its cron, the idle
clients) is measured first and not multiplied by k. k starts from a model of the
clients' cost (--share) and doubles while the workers' timers run late (more than
LATE_S on average): `timer late ms` and `router ticks/s` (1.0 per worker when idle)
say that the clients kept up. All modes of a cell run at one k: Redis's CPU per
command falls as its pace rises (it serves several clients per wake-up), so a cell
run slower overstates its CPU, and only figures at one k compare.

Scenarios: `idle` — every queue empty (a fleet between runs), each worker serving all
Q queues (found earlier: queues stay served) and having compiled one of them; `busy`
— every queue holds a backlog and each worker takes batches, starting from all Q.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import json
import math
import multiprocessing
import os
import random
import select
import tempfile
import time
from collections import Counter
from pathlib import Path
from queue import Empty

from bench.common import redis_server

MODEL = "/models/fleet-bench"
WARM = 3.0  # simulated seconds before the window: every worker started and ticked once
BASELINE_S = 2.0
# A simulated worker's client time per second on this machine, µs (for a first k):
# ~3.5 round trips, and per-worker LLENs every queue each tick and half of them again
# when listing; a busy one about twice that. A cell whose timers ran late (LATE_S)
# is run again at 2k.
CLIENT_US = {"before": lambda queues: 1400 + 22 * queues, "listing": lambda queues: 1400,
             "after": lambda queues: 1400}
LATE_S = 0.05
# before: every worker reads every served queue's depth each tick (pipelined LLEN)
# and lists the broker itself (SCAN + LLEN every 2 s), and an idle one blocks on all
# its queues; listing: the fleet's shared listing, idle still blocking everywhere;
# after: the listing, and an idle worker blocks on the shapes it has compiled.
MODES = ("before", "listing", "after")


def shape_queues(count: int, model: str = MODEL) -> list[str]:
    """`count` distinct shape queues of one model (what discovery keeps)."""
    from diffq.core.contract import ShapeKey

    return [ShapeKey(model=model, height=256 + 16 * (i // 10), width=256 + 16 * (i % 10), batch_size=4,
                     max_sequence_length=512, cfg=False).queue for i in range(count)]


@dataclasses.dataclass(frozen=True)
class Cell:
    workers: int
    queues: int
    mode: str
    scenario: str
    dilate: int
    seconds: float  # simulated seconds in the window
    generate_s: float = 5.0

    @property
    def command(self) -> str:
        return (f"python -m bench.fleet --workers {self.workers} --queues {self.queues} --scenario {self.scenario} "
                f"--modes {self.mode} --seconds {self.seconds:g}")


def cell_transport(cell: Cell):
    """The Redis row as it is, or without the shared listing (before): every worker
    LLENs its served queues each tick and SCANs for new ones."""
    from diffq.core.brokers.redis import RedisBroker
    from diffq.core.transports import transport_for

    row = transport_for("redis://")
    unshared = type("UnsharedRedisBroker", (RedisBroker,), {"shared_depths": None})
    return row if cell.mode != "before" else dataclasses.replace(row, broker=unshared())


def listen_everywhere_when_idle() -> None:
    """This process's routing as it was before: nothing queued anywhere -> every queue."""
    from diffq.worker.delivery import routing

    choose = routing.choose_queues

    def before(served, compiled, depths, rng):
        idle = not any(depths.get(queue, 0) > 0 for queue in served)
        return set(served) if idle else choose(served, compiled, depths, rng)

    routing.choose_queues = before


class HandPoller:
    """Many connections' consumers on one epoll, driven by hand as Celery's hub drives one
    worker's: kombu's Redis poller (`MultiChannelPoller`, the transport's public `cycle`)
    registers a connection's BRPOP sockets on the poller it is given (`on_poll_init`) at
    its poll start (`on_poll_start`) and reads a ready one's reply (`handle_event`), which
    its consumers' callbacks receive. This is that poller (what kombu's eventio `_epoll`
    does: kombu's READ and ERR are epoll's IN and ERR), noting which worker's poll start
    registered each socket."""

    def __init__(self):
        self.epoll = select.epoll()
        self.starting = None  # (worker, its connection's cycle) while that poll start runs
        self._owners: dict[int, tuple[object, object]] = {}  # fd -> (worker, cycle)

    # -- the poller kombu's cycle registers on --
    def register(self, sock, events) -> int:
        fd = sock if isinstance(sock, int) else sock.fileno()
        with contextlib.suppress(FileExistsError):
            self.epoll.register(fd, events)
        self._owners[fd] = self.starting
        return fd

    def unregister(self, sock) -> None:
        fd = sock if isinstance(sock, int) else sock.fileno()
        self._owners.pop(fd, None)
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.epoll.unregister(fd)

    def poll(self, timeout):
        return self.epoll.poll(-1 if timeout is None else timeout)

    # -- the loop's --
    def add(self, connection) -> None:
        """The connection's cycle now registers on this poller (register_with_event_loop's part)."""
        connection.transport.cycle.on_poll_init(self)

    def start(self, connection, owner) -> None:
        """A poll start for the connection: its BRPOPs sent where none is outstanding."""
        cycle = connection.transport.cycle
        self.starting = (owner, cycle)
        try:
            cycle.on_poll_start()
        finally:
            self.starting = None

    def wait(self, timeout: float) -> list:
        """Poll up to `timeout` s and read each reply; the owner of each connection that
        had one (a BRPOP that timed out delivered nothing)."""
        woken = []
        for fd, event in self.poll(timeout) or ():
            entry = self._owners.get(fd)
            if entry is None:
                continue
            owner, cycle = entry
            with contextlib.suppress(Empty):  # the BRPOP timed out: nothing queued
                cycle.handle_event(fd, event)
            woken.append(owner)
        return woken


class Loop:
    """One process's event loop over its workers, as Celery's hub runs one worker's:
    kombu's poller registers BRPOPs at each poll start and reads replies on one epoll
    (`HandPoller`); timers run in between."""

    def __init__(self):
        self.polls = HandPoller()
        self.timers: list = []
        self.busy: list = []  # (until, seq, worker)
        self.dirty: set = set()  # workers whose cycle must re-register its BRPOP
        self._seq = 0
        self.window = (0.0, 0.0)
        self.late: list[float] = []  # how late each timer in the window ran, s

    def at(self, due: float, worker, fn, period: float, main: bool = True) -> None:
        """fn() at `due`, then every `period`; `main`: on the worker's main thread, so
        deferred while it holds a batch (solo pool), unlike the lease thread."""
        self._seq += 1
        heapq.heappush(self.timers, (due, self._seq, worker, fn, period, main))

    def hold(self, worker, until: float) -> None:
        self._seq += 1
        heapq.heappush(self.busy, (until, self._seq, worker))

    def run(self, until: float) -> None:
        while True:
            for worker in self.dirty:
                self.polls.start(worker.connection, worker)
            self.dirty.clear()
            now = time.time()
            if now >= until:
                return
            due = min([until] + [heap[0][0] for heap in (self.timers, self.busy) if heap])
            self.dirty.update(self.polls.wait(max(0.0, due - now)))
            now = time.time()
            while self.busy and self.busy[0][0] <= now:
                _, _, worker = heapq.heappop(self.busy)
                worker.finish()
                self.dirty.add(worker)
            while self.timers and self.timers[0][0] <= now:
                due, _, worker, fn, period, main = heapq.heappop(self.timers)
                if main and worker.holding is not None:  # the solo pool runs the batch: later
                    self.at(worker.holding + 1e-3, worker, fn, period, main)
                    continue
                if self.window[0] <= now < self.window[1]:
                    self.late.append(now - due)
                fn()
                self.dirty.add(worker)
                # kombu's call_repeatedly: `period` after this run, no catching up.
                self.at(now + period, worker, fn, period, main)


class SimTimer:
    """The timer Celery's Heart is given (call_repeatedly / cancel), on the loop."""

    def __init__(self, loop: Loop, worker, start: float):
        self.loop, self.worker, self.start = loop, worker, start

    def call_repeatedly(self, interval, fn, args=(), kwargs=None, priority=0):
        self.loop.at(self.start + random.uniform(0, interval), self.worker, lambda: fn(*args, **(kwargs or {})),
                     interval)

    def cancel(self, tref) -> None:
        pass


class SimWorker:
    """One worker process as the broker sees it: its connection, consumer, router,
    lease keeper, restore sweep and heartbeat, on its process's loop."""

    def __init__(self, index: int, app, transport, queues: list[str], cell: Cell, loop: Loop, stats: dict):
        from diffq.core.settings import get_settings
        from diffq.worker.delivery.celery_adapter import HandConsumer
        from diffq.worker.delivery.lease import LeaseKeeper
        from diffq.worker.delivery.routing import Discovery, Router

        k = cell.dilate
        settings = get_settings()
        self.cell, self.loop, self.stats = cell, loop, stats
        self.connection = app.connection_for_read()
        self.connection.ensure_connection()
        busy = cell.scenario == "busy"
        self.compiled: set[str] = set() if busy else {queues[index % len(queues)]}
        self.holding: float | None = None
        self.message = None
        self.consumer = HandConsumer(self.connection, queues, on_message=self.received if busy else None)
        # The worker's loop polls on the process's poller (register_with_event_loop
        # does this with Celery's hub, and one restore sweep).
        loop.polls.add(self.connection)
        discovery = Discovery(transport, [MODEL])
        discovery.interval *= k
        self.router = Router(list(queues), lambda: self.compiled, transport, rng=random.Random(index),
                             discovery=discovery)
        self.router.interval *= k
        self.router.attach(self.consumer)
        self.lease = LeaseKeeper(transport.broker, self.connection.clone, lambda: transport.broker.held(self.consumer),
                                 period=settings.lease_renew_s * k, max_hold_s=settings.max_hold_s * k)
        if busy:  # its connection as in a steady state (opened at the first renewal, 15 s in)
            self.lease.channel()
        # Celery's event dispatcher (task events on: the transport row's `monitored`).
        self.events = app.events.Dispatcher(self.connection, hostname=f"sim-{index}@fleet", enabled=True)
        channel = self.consumer.task_consumer.channel
        self.sweep_period = channel.unacked_restore_interval  # dilated_options' already

    def start(self, at: float) -> None:
        """Begin at `at` (workers start at random moments, so their timers spread)."""
        from diffq.worker.delivery.celery_adapter import heart

        loop = self.loop
        beat = heart(self.events, SimTimer(loop, self, at), interval=2.0 * self.cell.dilate)
        loop.at(at, self, beat.start, math.inf)
        loop.at(at + random.uniform(0, self.router.interval), self, self.route, self.router.interval)
        loop.at(at + random.uniform(0, self.sweep_period), self, self.sweep, self.sweep_period)
        loop.at(at + random.uniform(0, self.lease.period), self, self.lease.renew_once, self.lease.period, main=False)
        loop.at(at, self, lambda: None, math.inf)  # the first BRPOP

    def route(self) -> None:
        self.router.update()
        if self.stats["window"][0] <= time.time() < self.stats["window"][1]:
            self.stats["router_ticks"] += 1

    def sweep(self) -> None:
        """kombu's maybe_restore_messages: the sweep of a connection with a consumer."""
        channel = self.consumer.task_consumer.channel
        if channel.active_queues:
            channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=channel.unacked_restore_throttle)

    def received(self, message) -> None:
        self.message = message
        self.holding = time.time() + self.cell.generate_s * self.cell.dilate
        self.compiled.add(message.delivery_info["routing_key"])
        for event in ("task-received", "task-started"):
            self.events.send(event, uuid=message.delivery_tag)
        self.loop.hold(self, self.holding)

    def finish(self) -> None:
        message, self.message, self.holding = self.message, None, None
        message.ack()
        self.events.send("task-succeeded", uuid=message.delivery_tag, runtime=self.cell.generate_s)
        self.stats["batches"] += 1
        self.route()  # right after each batch, as worker/delivery/batches.py does


def run_child(pipe, cell: Cell, url: str, indices: range, queues: list[str]) -> None:
    serve(pipe, cell, url, indices, queues)
    # No orderly close: cancelling Q queues on N connections takes longer than the run,
    # and the sockets close with the process all the same.
    os._exit(0)


def serve(pipe, cell: Cell, url: str, indices: range, queues: list[str]) -> None:
    """One process of the fleet: build its workers, wait for the start, run the loop."""
    from diffq.core.brokers.app import make_celery

    k = cell.dilate
    app = make_celery(url, dilated_options(k))
    transport = cell_transport(cell)
    if cell.mode != "after":
        listen_everywhere_when_idle()
    loop = Loop()
    stats = {"router_ticks": 0, "batches": 0, "window": (0.0, 0.0)}
    workers = [SimWorker(i, app, transport, queues, cell, loop, stats) for i in indices]
    pipe.send("ready")
    start, window, stop = pipe.recv()
    stats["window"] = loop.window = window
    for worker in workers:
        worker.start(start + random.uniform(0, 1.0 * k))
    loop.run(stop)
    pipe.send({"router_ticks": stats["router_ticks"], "batches": stats["batches"], "late": loop.late})


def dilated_options(k: int) -> dict:
    """The transport table's Redis options with every period k times longer."""
    from diffq.core.settings import get_settings
    from diffq.core.transports import transport_for

    options = transport_for("redis://").broker.options(get_settings())
    return {**options, "polling_interval": 1.0 * k, "visibility_timeout": options["visibility_timeout"] * k,
            "health_check_interval": 25 * k,  # kombu's default: redis-py PINGs a connection idle that long
            "unacked_restore_interval": options["unacked_restore_interval"] * k,
            "unacked_mutex_expire": options["unacked_mutex_expire"] * k}


def redis_counters(client) -> tuple[dict[str, tuple[int, int]], float]:
    """(calls, µs) per command (INFO commandstats, without the INFO calls that read
    them) and the server's CPU seconds (used_cpu_sys + used_cpu_user)."""
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): (row["calls"], row["usec"]) for name, row in stats.items()
             if name != "cmdstat_info"}
    cpu = client.info("cpu")
    return calls, cpu["used_cpu_sys"] + cpu["used_cpu_user"]


def declare(url: str, queues: list[str], per_queue: int = 0) -> None:
    """Declare the queues (their bindings) once and put `per_queue` messages in each."""
    from diffq.core.brokers.app import make_celery
    from diffq.worker.delivery.celery_adapter import task_queue

    with make_celery(url).connection_for_write() as connection:
        producer = connection.Producer()
        for queue in queues:
            task_queue(queue)(connection.default_channel).declare()
            for n in range(per_queue):
                producer.publish({"n": n}, exchange=task_queue(queue).exchange, routing_key=queue, serializer="json")


def measure(cell: Cell, url: str, procs: int) -> dict:
    """One cell: N workers in `procs` processes; counters over the window, per real second."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    queues = shape_queues(cell.queues)
    batches = cell.workers * (WARM + cell.seconds) / cell.generate_s if cell.scenario == "busy" else 0
    declare(url, queues, math.ceil(2 * batches / cell.queues) + 2 if batches else 0)
    k = cell.dilate
    context = multiprocessing.get_context("fork")
    pipes, children = [], []
    share = math.ceil(cell.workers / procs)
    for first in range(0, cell.workers, share):
        ours, theirs = context.Pipe()
        indices = range(first, min(first + share, cell.workers))
        child = context.Process(target=run_child, args=(theirs, cell, url, indices, queues), daemon=True)
        child.start()
        pipes.append(ours)
        children.append(child)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    # What Redis spends per second with the fleet connected but silent (its cron,
    # the clients): not slowed down by k, so it is not multiplied by k either.
    _, cpu0 = redis_counters(client)
    time.sleep(BASELINE_S)
    idle_cpu = (redis_counters(client)[1] - cpu0) / BASELINE_S
    start = time.time() + 0.5
    window = (start + WARM * k, start + (WARM + cell.seconds) * k)
    for pipe in pipes:
        pipe.send((start, window, window[1] + 0.5))
    time.sleep(max(0.0, window[0] - time.time()))
    calls0, cpu0 = redis_counters(client)
    connected0 = client.info("stats")["total_connections_received"]
    time.sleep(max(0.0, window[1] - time.time()))
    calls1, cpu1 = redis_counters(client)
    connected = client.info("stats")["total_connections_received"] - connected0
    clients = client.info("clients")["connected_clients"] - 1
    counts = [pipe.recv() for pipe in pipes]
    late = sorted(t for c in counts for t in c["late"])
    for child in children:
        child.join(timeout=60)
    elapsed = window[1] - window[0]
    delta = {name: [(now - then) / elapsed * k for now, then in zip(calls1[name], calls0.get(name, (0, 0)))]
             for name in calls1}
    per_s = {name: round(rate, 1) for name, (rate, _) in sorted(delta.items(), key=lambda kv: -kv[1][0]) if rate > 0}
    total = sum(per_s.values())
    # The commands' own execution time, as a share of a core (the rest of Redis's CPU
    # is reading, parsing and replying, connections, blocking and timeouts).
    command_cpu = {name: round(usec / 1e4, 2) for name, (rate, usec) in delta.items() if rate > 0}
    ticks = sum(c["router_ticks"] for c in counts)
    return {
        "workers": cell.workers, "queues": cell.queues, "mode": cell.mode, "scenario": cell.scenario,
        "dilate": k, "seconds": cell.seconds, "generate_s": cell.generate_s,
        "commands_per_s": round(total), "per_worker_per_s": round(total / cell.workers, 2),
        "redis_cpu_pct": round(100 * (idle_cpu + ((cpu1 - cpu0) / elapsed - idle_cpu) * k), 1),
        "idle_cpu_pct": round(100 * idle_cpu, 2),
        "connections_per_worker": round(clients / cell.workers, 1),
        "new_connections_per_s": round(connected / elapsed * k, 1),
        "router_ticks_per_worker_s": round(ticks / cell.workers / cell.seconds, 2),
        # How late the workers' timers ran (simulated ms): the clients kept up if small.
        "timer_late_ms": round(1000 * sum(late) / max(1, len(late)) / k, 1),
        "batches_per_s": round(sum(c["batches"] for c in counts) / (WARM + cell.seconds), 1),
        "command_cpu_pct": round(sum(command_cpu.values()), 1),
        "by_command": per_s, "command_cpu_pct_by_command": command_cpu, "command": cell.command,
        "load_avg": round(os.getloadavg()[0], 1),
    }


def real_worker(url: str, queues: int, seconds: float, workdir: Path) -> dict:
    """One real `diffq worker` process (CPU, a tiny model, compile-aware routing),
    idle on `queues` empty shape queues: what the simulator's workers stand for."""
    import redis

    from diffq.app.tiny import build_tiny_pipeline
    from diffq.core.contract import ShapeKey
    from diffq.worker.process.supervisor import Supervisor, plan_children

    client = redis.Redis.from_url(url)
    client.flushall()
    client.config_resetstat()
    model = str(build_tiny_pipeline(workdir / "tiny"))
    names = [ShapeKey(model=model, height=32 + 16 * i, width=32, batch_size=1, max_sequence_length=64,
                      cfg=False).queue for i in range(queues)]
    supervisor = Supervisor(plan_children(device="cpu", devices=[0], broker_url=url, queues=names,
                                          models=[model], loglevel="ERROR"))
    supervisor.start()
    try:
        deadline = time.monotonic() + 300
        while redis_counters(client)[0].get("brpop", (0, 0))[0] < 3:  # consuming, its timers running
            assert time.monotonic() < deadline, "the worker did not start consuming"
            supervisor.poll()
            time.sleep(0.5)
        time.sleep(WARM)
        calls0, _ = redis_counters(client)
        time.sleep(seconds)
        calls1, _ = redis_counters(client)
        # Each connection by the last command it sent: what holds it.
        held = Counter(c["cmd"] for c in client.client_list() if c["cmd"] not in ("client|list", "info"))
    finally:
        supervisor.stop(timeout=60)
    per_s = {name: round((n - calls0.get(name, (0, 0))[0]) / seconds, 1) for name, (n, _) in calls1.items()}
    per_s = {name: rate for name, rate in sorted(per_s.items(), key=lambda kv: -kv[1]) if rate > 0}
    return {"workers": 1, "queues": queues, "mode": "real worker", "scenario": "idle", "seconds": seconds,
            "commands_per_s": round(sum(per_s.values()), 1), "per_worker_per_s": round(sum(per_s.values()), 2),
            "connections_per_worker": sum(held.values()), "connections_by_last_command": dict(held),
            "by_command": per_s,
            "command": f"python -m bench.fleet --real-worker --queues {queues} --seconds {seconds:g}",
            "load_avg": round(os.getloadavg()[0], 1)}


def dilation(workers: int, queues: int, mode: str, scenario: str, procs: int, share: float) -> int:
    """A first k: the simulated workers' client time within `share` of each process's core."""
    busy = 2 if scenario == "busy" else 1
    return max(1, math.ceil(busy * workers * CLIENT_US[mode](queues) / (procs * share * 1e6)))


def render(rows: list[dict]) -> list[str]:
    """docs/BENCHMARKS.md's "Control plane at fleet size" (under "Scale")."""
    if not rows:
        return []
    loads = [r["load_avg"] for r in rows]
    real = [r for r in rows if r["mode"] == "real worker"]
    rows = [r for r in rows if r["mode"] != "real worker"]
    by = {(r["scenario"], r["workers"], r["queues"], r["mode"]): r for r in rows}
    # before and after side by side (one k per cell); the listing alone in a table of its own.
    modes = [m for m in ("before", "after") if any(r["mode"] == m for r in rows)]
    lines = ["### Control plane at fleet size", "",
             "What N idle or busy workers ask of one Redis (`python -m bench.fleet`, a real redis-server and",
             "the real routing, discovery, lease, restore-sweep and heartbeat code for every simulated",
             "worker; docs/fleet.md \"How many workers one Redis serves\"). Commands/s from `INFO commandstats`",
             "(commands inside kombu's Lua scripts included), Redis CPU from `INFO cpu` (sys + user, % of one",
             "core), both per real second; k: the cell ran k× slower and its counts were scaled back (Redis",
             "spends more CPU per command at a slower pace, so CPU at k > 1 is an upper bound; a cell's modes",
             "share one k); `late`: the simulated workers' mean timer lateness (ms), small when the clients",
             "kept up. `before`: every worker LLENs each served queue every second, SCANs every 2 s and,",
             "idle, blocks on every queue; `after`: the fleet's shared listing, and an idle worker blocks on",
             "the shapes it compiled. Load average of the (2-core, shared) machine during these runs: "
             f"{min(loads)}–{max(loads)}.", ""]
    for scenario in ("idle", "busy"):
        cells = sorted({(w, q) for (sc, w, q, _) in by if sc == scenario})
        if not cells:
            continue
        lines += [f"**{scenario}**" + (" (every queue empty; each worker serves all of them, compiled one)"
                                      if scenario == "idle" else " (every queue holds work; batches of "
                                      f"{rows[0].get('generate_s', 5.0):g} s)"), "",
                  "| workers | queues | " + " | ".join(f"{m} commands/s | {m} per worker | {m} Redis CPU %"
                                                      for m in modes) + " | k | late ms | command |",
                  "|---|---|" + "---|---|---|" * len(modes) + "---|---|---|"]
        for workers, queues in cells:
            cell = [by.get((scenario, workers, queues, m)) for m in modes]
            figures = " | ".join(f"{r['commands_per_s']:,} | {r['per_worker_per_s']} | {r['redis_cpu_pct']}"
                                 if r else " | | " for r in cell)
            present = [r for r in cell if r]
            command = present[0]["command"].replace(f"--modes {present[0]['mode']}", "--modes " + ",".join(modes))
            paces = "/".join(sorted({str(r["dilate"]) for r in present}))
            lines.append(f"| {workers:,} | {queues} | {figures} | {paces} | "
                         f"{'/'.join(str(r['timer_late_ms']) for r in present)} | `{command}` |")
        lines.append("")
    if not rows:
        return lines
    listing = [r for r in rows if r["mode"] == "listing"]
    if listing:
        lines += ["The listing alone (`--modes listing`: idle workers still block on every queue), its own k:", "",
                  "| workers | queues | commands/s | per worker | Redis CPU % | k | late ms | command |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['workers']:,} | {r['queues']} | {r['commands_per_s']:,} | {r['per_worker_per_s']} | "
                  f"{r['redis_cpu_pct']} | {r['dilate']} | {r['timer_late_ms']} | `{r['command']}` |" for r in listing]
        lines.append("")
    big = max(rows, key=lambda r: (r["scenario"] == "idle", r["workers"], r["queues"]))
    lines += [f"Commands/s by command, idle, {big['workers']:,} workers × {big['queues']} queues:", "",
              "| mode | commands/s by command |", "|---|---|"]
    for m in [m for m in MODES if m in modes or listing and m == "listing"]:
        r = by.get(("idle", big["workers"], big["queues"], m))
        if r:
            lines.append(f"| {m} | " + ", ".join(f"{name} {rate:,.0f}" for name, rate in r["by_command"].items()
                                                 if rate >= 1) + " |")
    lines.append("")
    if real:
        lines += ["One real `diffq worker` process (CPU, a tiny model, compile-aware routing, named queues: with",
                  "one queue there is nothing to route), idle, beside the simulated workers' mix above:", "",
                  "| queues | commands/s | by command | Redis connections (by last command) | command |",
                  "|---|---|---|---|---|"]
        for r in real:
            held = ", ".join(f"{name} {n}" for name, n in r.get("connections_by_last_command", {}).items())
            mix = ", ".join(f"{name} {rate}" for name, rate in r["by_command"].items())
            lines.append(f"| {r['queues']} | {r['commands_per_s']} | {mix} | {r['connections_per_worker']} ({held}) | "
                         f"`{r['command']}` |")
        lines.append("")
    return lines


def goals(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """For docs/BENCHMARKS.md's goals table: an idle worker's cost without its queues."""
    idle = [r for r in rows if r["scenario"] == "idle" and r["mode"] in ("before", "after")]
    if not idle:
        return []
    workers = max(r["workers"] for r in idle)
    by = {(r["mode"], r["queues"]): r for r in idle if r["workers"] == workers}
    few, many = min(q for _, q in by), max(q for _, q in by)
    after = [by.get(("after", q)) for q in (few, many)]
    if None in after:
        return []
    before = [by.get(("before", q)) for q in (few, many)]
    figure = (f"{workers:,} idle workers, {few} → {many} queues: {after[0]['per_worker_per_s']} → "
              f"{after[1]['per_worker_per_s']} commands/s and {after[0]['redis_cpu_pct']} → "
              f"{after[1]['redis_cpu_pct']} % Redis CPU")
    if None not in before:
        figure += (f" (before: {before[0]['per_worker_per_s']} → {before[1]['per_worker_per_s']}, "
                   f"{before[0]['redis_cpu_pct']} → {before[1]['redis_cpu_pct']} %)")
    flat = after[1]["per_worker_per_s"] <= 1.1 * after[0]["per_worker_per_s"] \
        and after[1]["redis_cpu_pct"] <= 1.25 * after[0]["redis_cpu_pct"]
    return [("control plane: an idle worker's Redis commands and CPU do not grow with its queues", flat, figure)]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--queues", default="1,10,100")
    parser.add_argument("--scenario", default="idle", choices=["idle", "busy"])
    parser.add_argument("--modes", default="before,after", help=f"of {', '.join(MODES)}")
    parser.add_argument("--seconds", type=float, default=5.0, help="simulated seconds measured per cell")
    parser.add_argument("--generate-s", type=float, default=5.0, help="busy: seconds a worker holds each batch")
    parser.add_argument("--procs", type=int, default=2, help="processes the simulated workers share")
    parser.add_argument("--share", type=float, default=0.5, help="share of a core each process may count on")
    parser.add_argument("--dilate", type=int, help="force the slow-down factor k (default: from --share, "
                                                   "doubled while the timers run late)")
    parser.add_argument("--real-worker", action="store_true",
                        help="measure one real `diffq worker` process idle on each --queues count instead")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-fleet-"))
    with redis_server(workdir) as url:
        for queues in map(int, args.queues.split(",")) if args.real_worker else ():
            rows.append(real_worker(url, queues, args.seconds, workdir))
            print(json.dumps(rows[-1]), flush=True)
        for workers in map(int, args.workers.split(",")) if not args.real_worker else ():
            for queues in map(int, args.queues.split(",")):
                modes = args.modes.split(",")
                # One k for the cell's modes: Redis's CPU per command depends on the pace
                # (a busier Redis serves several clients per wake-up), so compare at one pace.
                k = args.dilate or max(dilation(workers, queues, m, args.scenario, args.procs, args.share)
                                       for m in modes)
                while True:
                    cells = [measure(Cell(workers, queues, mode, args.scenario, k, args.seconds, args.generate_s),
                                     url, args.procs) for mode in modes]
                    for row in cells:
                        print(json.dumps(row), flush=True)
                    if args.dilate or max(row["timer_late_ms"] for row in cells) <= 1000 * LATE_S:
                        break
                    k *= 2  # the clients fell behind: slower
                rows += cells
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
