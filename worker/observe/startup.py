"""A worker life's time to its first image: each start phase timed once, from the
process start to the first batch stored (core/records.py START_PHASES).

`begin` at the top of the child, `phase` at the end of each phase, `first_batch` when
the first batch is handed to the sink: once it is stored, one log line, the
Prometheus histograms (worker/observe/metrics.py) and a `WorkerStart` in that batch's run
folder, which `diffq report` reads. One clock per process: a process is one life.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future

from diffq.core import layout
from diffq.core.records import START_PHASES, WorkerStart

log = logging.getLogger("diffq.worker")


def _process_started() -> float:
    """The process's start on the wall clock (Linux: its start time since boot), else now."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as system:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: starttime
            boot = next(float(line.split()[1]) for line in system if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartClock:
    def __init__(self, worker: str):
        self.worker = worker
        self.began_at = _process_started()
        self.phases: dict[str, float] = {}
        self.fetches: list[dict] = []
        # What the process did before `begin` (the interpreter, diffq's own imports)
        # counts as imports, the first phase.
        self._mark = min(self.began_at, time.time())
        self._first = False

    def phase(self, name: str, seconds: float | None = None) -> None:
        """End phase `name`: the seconds since the last mark, or `seconds` (a phase
        measured inside another, the weights fetch within the load)."""
        now = time.time()
        if seconds is None:
            seconds, self._mark = now - self._mark, now
        self.phases[name] = self.phases.get(name, 0.0) + round(max(0.0, seconds), 3)

    def first_batch(self, storage, credited: Future, worker: str, device: str, fetches: list[dict]) -> None:
        """The first batch handed to the sink: the start is accounted once it is stored.
        `fetches`: the object-storage models fetched so far (worker/device/model_fetch.py)."""
        if self._first:
            return
        self._first = True
        self.worker, self.fetches = worker, list(fetches)
        if "weights_fetch" not in self.phases:  # fetched by the first batch, not the warm start
            self.phases["weights_fetch"] = round(sum(f["seconds"] for f in self.fetches), 3)

        def stored(future: Future) -> None:
            # Off the thread that settles the sink's futures: a PUT of its own must not delay
            # them. Not a daemon: a worker that exits now still writes it (the exit joins it).
            if not future.cancelled() and future.exception() is None:
                threading.Thread(target=self._done, args=(storage, device), name="diffq-first-image").start()

        credited.add_done_callback(stored)

    def _done(self, storage, device: str) -> None:
        from diffq.worker.observe import metrics

        if "load" in self.phases and "weights_fetch" in self.phases:  # the load's own seconds
            self.phases["load"] = round(max(0.0, self.phases["load"] - self.phases["weights_fetch"]), 3)
        self.phase("first_batch_stored")
        now = time.time()
        start = WorkerStart(worker=self.worker, pid=os.getpid(), device=device, began_at=round(self.began_at, 3),
                            first_image_at=round(now, 3), time_to_first_image_s=round(now - self.began_at, 3),
                            phases={p: self.phases.get(p, 0.0) for p in START_PHASES}, fetches=self.fetches)
        log.info(json.dumps({"event": "first_image", **start.model_dump(mode="json")}))
        metrics.observe_start(start.phases, start.time_to_first_image_s, start.fetches)
        try:
            storage.put_bytes(layout.start_key(self.worker, start.pid, start.began_at),
                              start.model_dump_json().encode(), content_type="application/json")
        except Exception as exc:  # the accounting is worth less than the images: never fail a batch for it
            log.warning("could not store the worker start in %s: %s", storage.url, exc)


_CLOCK: StartClock | None = None


def begin(worker: str) -> StartClock:
    global _CLOCK
    _CLOCK = StartClock(worker)
    return _CLOCK


def clock() -> StartClock | None:
    return _CLOCK
