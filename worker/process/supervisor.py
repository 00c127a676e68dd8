"""The supervisor: one spawned, pinned process per device; restart; warm shutdown.

With --tp N the processes come in groups of N ranks (worker/device/tensor_parallel.py):
a group starts, dies and restarts as one unit.

The supervisor never imports torch and never touches a device, and children are
*spawned*, never forked: Neuron, TPU and CUDA runtimes cannot be re-initialised in
a forked child. SIGTERM is forwarded to every child, which finishes the batch in
hand within its drain timeout (or hands it back), stores it, and exits 0 (Celery's
warm shutdown, worker/delivery/celery_adapter.py); a second SIGTERM or
SIGINT kills. Children die with the supervisor (worker/observe/lifeline.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable
from multiprocessing import connection, resource_tracker

from diffq.worker.device import lora_modes
from diffq.worker.device.backends import Allocation, get_backend
from diffq.worker.process.child import child_main
from diffq.worker.delivery.spec import EXIT_FATAL, ChildSpec

log = logging.getLogger(__name__)

_spawn = multiprocessing.get_context("spawn")


@dataclass
class Child:
    spec: ChildSpec
    process: multiprocessing.process.BaseProcess | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


@dataclass
class Unit:
    """What restarts as one: a single worker, or every rank of a tensor-parallel group."""

    children: list[Child]
    restarts: int = 0
    next_start: float = 0.0
    fatal: bool = False
    finished: bool = False  # a --warmup-only unit that exited 0
    kill_at: float | None = None  # tearing down a broken group: SIGKILL what is left then

    @property
    def name(self) -> str:
        return self.children[0].spec.name


def plan_children(
    *,
    device: str,
    devices: list[int],
    broker_url: str,
    queues: list[str],
    name_prefix: str = "diffq",
    threads: int = 1,
    tp: int = 1,
    master_port: int = 29500,
    **spec_fields,
) -> list[ChildSpec]:
    """One child per device index, each pinned to it by the backend table.

    With tp > 1 the devices are cut into groups of `tp` consecutive devices; each
    group is one consumer whose ranks rendezvous on their own port.
    """
    if tp < 1 or len(devices) % tp:
        raise ValueError(f"--tp {tp} must divide the {len(devices)} devices given")
    backend = get_backend(device)
    generation = spec_fields.pop("generation", None)
    if generation is None and backend.detect_generation:
        generation = backend.detect_generation()
    # Every combination is checked against the backend table before anything starts.
    backend.check(compile=spec_fields.get("compile", "none"), offload=spec_fields.get("offload"),
                  devices=devices, tp=tp, generation=generation,
                  allow_fallback=spec_fields.get("allow_fallback", False))
    if isinstance(devices, Allocation):  # `--<option> auto`: say where the devices came from
        spec_fields.setdefault("allocation", devices.source)
    if generation:
        spec_fields["generation"] = generation
    # `--lora-mode auto` resolved once, here, with the profile where one was given (a
    # proven mode measured on this device), so every child and record names the same mode.
    compile_mode = spec_fields.get("compile", "none")
    spec_fields["lora_mode"] = lora_modes.resolve(
        backend, compile_mode, spec_fields.get("lora_mode", lora_modes.AUTO), spec_fields.pop("lora_profile", None),
        generation=generation, models=spec_fields.get("models") or spec_fields.get("serve_models") or None)[0]
    if any(spec_fields.get("adapter_layouts") or {}) and (
            reason := lora_modes.refusal(backend, compile_mode, spec_fields["lora_mode"], tp)):
        raise ValueError(reason)
    specs = []
    for group, start in enumerate(range(0, len(devices), tp)):
        slots = devices[start:start + tp]
        for rank, slot in enumerate(slots):
            name = f"{name_prefix}-{device}{slot}" if tp == 1 else f"{name_prefix}-{device}-tp{group}-r{rank}"
            membership = ({} if tp == 1 else
                          {"rank": rank, "world_size": tp, "group": group, "group_slots": slots,
                           "master_port": master_port + group})
            specs.append(ChildSpec(name=name, device=device, slot=slot, position=len(specs), threads=threads,
                                   broker_url=broker_url,
                                   queues=queues, **membership, **spec_fields))
    if specs:
        specs[0].warmup_shapes()  # an unserved --warmup size fails here, before spawning
        if tp > 1:
            for spec in specs[:tp]:
                spec.env()  # e.g. a TPU group whose topology is unknown fails here
            if specs[0].offload:
                raise ValueError("--offload cannot be combined with --tp: the group shards the model instead")
    return specs


class Supervisor:
    def __init__(self, specs: list[ChildSpec], *, restart: bool = True, max_backoff: float = 30.0,
                 group_grace: float = 60.0, spawning: Callable[[], AbstractContextManager] = nullcontext):
        self.children = [Child(spec) for spec in specs]
        units: dict[tuple, list[Child]] = {}
        for index, child in enumerate(self.children):
            key = ("group", child.spec.group) if child.spec.world_size > 1 else ("single", index)
            units.setdefault(key, []).append(child)
        self.units = [Unit(members) for members in units.values()]
        self.restart = restart
        self.max_backoff = max_backoff
        # How long rank 0 of a broken group gets to hand its batch back before SIGKILL.
        self.group_grace = group_grace
        self.deaths = 0
        # Each child's start (and restart) runs inside `spawning()`: `diffq run` hands the
        # child its stdout there.
        self.spawning = spawning
        self._stopping = False

    def _start(self, child: Child) -> None:
        with self.spawning():
            child.process = _spawn.Process(target=child_main, args=(child.spec.model_dump_json(),),
                                           name=child.spec.name)
            child.process.start()

    def start(self) -> None:
        for child in self.children:
            self._start(child)

    def poll(self) -> None:
        """Restart units that died, with backoff; give up on fatal exits."""
        now = time.monotonic()
        for unit in self.units:
            self._poll_unit(unit, now)

    def _poll_unit(self, unit: Unit, now: float) -> None:
        if unit.fatal or unit.finished or any(child.process is None for child in unit.children):
            return
        alive = [child for child in unit.children if child.alive]
        if len(alive) == len(unit.children):
            return
        if alive:
            self._tear_down(unit, alive, now)
            return
        unit.kill_at = None
        codes = [child.process.exitcode for child in unit.children]
        if all(code == 0 and child.spec.warmup_only for code, child in zip(codes, unit.children)):
            unit.finished = True
            return
        if unit.next_start == 0.0:
            self.deaths += 1
            if EXIT_FATAL in codes:
                unit.fatal = True
                log.error("%s exited with a fatal error; not restarting", unit.name)
                return
            if self._stopping or not self.restart:
                unit.next_start = float("inf")  # counted once, never restarted
                return
            backoff = min(self.max_backoff, 0.5 * 2 ** min(unit.restarts, 6))
            unit.next_start = now + backoff
            log.warning("%s died (exit %s); restarting in %.1fs", unit.name, codes, backoff)
        if now >= unit.next_start and not self._stopping:
            unit.restarts += 1
            unit.next_start = 0.0
            for child in unit.children:
                child.spec.restarts = unit.restarts
                self._start(child)

    def _tear_down(self, unit: Unit, alive: list[Child], now: float) -> None:
        """A rank died: the group cannot run without it. Rank 0 gets a warm stop so the
        batch in hand goes back to the broker; the other ranks hold nothing and are killed."""
        if unit.kill_at is None:
            unit.kill_at = now + self.group_grace
            log.warning("%s lost a rank; stopping the rest of the group", unit.name)
            for child in alive:
                os.kill(child.process.pid, signal.SIGTERM if child.spec.rank == 0 else signal.SIGKILL)
        elif now >= unit.kill_at:
            for child in alive:
                os.kill(child.process.pid, signal.SIGKILL)

    @property
    def all_fatal(self) -> bool:
        return all(unit.fatal for unit in self.units)

    @property
    def all_done(self) -> bool:
        """Every unit finished its warmup-only run or failed for good."""
        return all(unit.fatal or unit.finished for unit in self.units)

    def alive(self) -> int:
        return sum(1 for child in self.children if child.alive)

    def signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.alive:
                os.kill(child.process.pid, signum)

    @property
    def drain_timeout(self) -> float:
        """How long a warm stop waits before SIGKILL: the children's drain timeout (they
        hand back and exit by then) and a margin to store and exit."""
        return max((child.spec.drain_timeout_s for child in self.children), default=0.0) + 30.0

    def stop(self, timeout: float | None = None) -> None:
        """Warm shutdown: SIGTERM, wait up to `timeout` (default: the drain timeout) for
        the batches in hand, then kill."""
        timeout = self.drain_timeout if timeout is None else timeout
        self._stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.process is not None:
                child.process.join(max(0.0, deadline - time.monotonic()))
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            if child.process is not None:
                child.process.join(5)

    def own_pids(self) -> set[int]:
        pids = {child.process.pid for child in self.children if child.process is not None}
        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        return pids | ({tracker} if tracker else set())

    def serve_forever(self, poll_interval: float = 0.5) -> int:
        """Run until SIGTERM/SIGINT; forward it as a warm shutdown. Returns an exit code.

        The fleet supervisor (PID 1 of a worker container) also adopts and reaps the
        orphans of workers that were killed: their sink helpers, Inductor compile
        workers. Without it they stay zombies until the container ends."""
        stop_requests = []

        def on_signal(signum, _frame):
            stop_requests.append(signum)
            if len(stop_requests) > 1:
                self.signal_all(signal.SIGKILL)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            become_subreaper()
            self.start()
            while not stop_requests:
                self.poll()
                reap_orphans(self.own_pids())
                if self.all_fatal:
                    return EXIT_FATAL
                if self.all_done:
                    return EXIT_FATAL if any(unit.fatal for unit in self.units) else 0
                # Wake as soon as a child exits (a --warmup-only run is done then), else after poll_interval.
                connection.wait([child.process.sentinel for child in self.children if child.alive], poll_interval)
            self.stop()
            return 0
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Orphaned descendants come to this process instead of PID 1 (Linux only)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(own: set[int]) -> list[int]:
    """Reap exited children that are not our own workers (adopted orphans).

    Our workers are left to multiprocessing, which reads their exit codes; WNOWAIT
    peeks at the next exited child without reaping it, so one of ours still waiting
    for that ends this round (it is reaped by the next `poll`).
    """
    reaped = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid == 0 or info.si_pid in own:
            return reaped
        os.waitpid(info.si_pid, 0)
        reaped.append(info.si_pid)
