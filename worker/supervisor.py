"""The supervisor: one spawned, pinned process per device; restart; warm shutdown.

The supervisor never imports torch and never touches a device, and children are
*spawned*, never forked: Neuron, TPU and CUDA runtimes cannot be re-initialised in
a forked child. SIGTERM is forwarded to every child, which finishes the batch in
hand, stores it, and exits (Celery's warm shutdown of the solo pool); a second
SIGTERM or SIGINT kills.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

from diffq.worker.process import EXIT_FATAL, ChildSpec, child_main

log = logging.getLogger(__name__)

_spawn = multiprocessing.get_context("spawn")


@dataclass
class Child:
    spec: ChildSpec
    process: multiprocessing.process.BaseProcess | None = None
    restarts: int = 0
    next_start: float = 0.0
    fatal: bool = False
    finished: bool = False  # a --warmup-only child that exited 0


def plan_children(
    *,
    device: str,
    devices: list[int],
    broker_url: str,
    queues: list[str],
    name_prefix: str = "diffq",
    threads: int = 1,
    **spec_fields,
) -> list[ChildSpec]:
    """One child per device index, each pinned to it by the backend table."""
    specs = [
        ChildSpec(name=f"{name_prefix}-{device}{slot}", device=device, slot=slot, threads=threads,
                  broker_url=broker_url, queues=queues, **spec_fields)
        for slot in devices
    ]
    if specs:
        specs[0].warmup_shapes()  # an unserved --warmup size fails here, before spawning
    return specs


class Supervisor:
    def __init__(self, specs: list[ChildSpec], *, restart: bool = True, max_backoff: float = 30.0):
        self.children = [Child(spec) for spec in specs]
        self.restart = restart
        self.max_backoff = max_backoff
        self.deaths = 0
        self._stopping = False

    def _start(self, child: Child) -> None:
        child.process = _spawn.Process(target=child_main, args=(child.spec.model_dump_json(),),
                                       name=child.spec.name)
        child.process.start()

    def start(self) -> None:
        for child in self.children:
            self._start(child)

    def poll(self) -> None:
        """Restart children that died, with backoff; give up on fatal exits."""
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if child.fatal or child.finished or proc is None or proc.is_alive():
                continue
            if proc.exitcode == 0 and child.spec.warmup_only:
                child.finished = True
                continue
            if child.next_start == 0.0:
                self.deaths += 1
                if proc.exitcode == EXIT_FATAL:
                    child.fatal = True
                    log.error("%s exited with a fatal error; not restarting", child.spec.name)
                    continue
                if self._stopping or not self.restart:
                    continue
                backoff = min(self.max_backoff, 0.5 * 2 ** min(child.restarts, 6))
                child.next_start = now + backoff
                log.warning("%s died (exit %s); restarting in %.1fs", child.spec.name, proc.exitcode, backoff)
            if now >= child.next_start and not self._stopping:
                child.restarts += 1
                child.next_start = 0.0
                self._start(child)

    @property
    def all_fatal(self) -> bool:
        return all(child.fatal for child in self.children)

    @property
    def all_done(self) -> bool:
        """Every child finished its warmup-only run or failed for good."""
        return all(child.fatal or child.finished for child in self.children)

    def alive(self) -> int:
        return sum(1 for c in self.children if c.process is not None and c.process.is_alive())

    def signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.process is not None and child.process.is_alive():
                os.kill(child.process.pid, signum)

    def stop(self, timeout: float = 600.0) -> None:
        """Warm shutdown: SIGTERM, wait up to `timeout` for the batches in hand, then kill."""
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

    def serve_forever(self, poll_interval: float = 0.5) -> int:
        """Run until SIGTERM/SIGINT; forward it as a warm shutdown. Returns an exit code."""
        stop_requests = []

        def on_signal(signum, _frame):
            stop_requests.append(signum)
            if len(stop_requests) > 1:
                self.signal_all(signal.SIGKILL)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            while not stop_requests:
                self.poll()
                if self.all_fatal:
                    return EXIT_FATAL
                if self.all_done:
                    return EXIT_FATAL if any(child.fatal for child in self.children) else 0
                time.sleep(poll_interval)
            self.stop()
            return 0
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
