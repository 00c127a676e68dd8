"""The time stamps a stand-in worker writes between two device calls (bench only).

The instrumentation half of bench/phases.py, on its own so that the stand-in
(bench/standin.py) and the profiled sink helper (bench/profiled_sink.py) can load it
without the measuring half, which drives bench/device.py. With
`DIFFQ_BENCH_PHASES=<folder>` in its environment, `install` wraps the steps a batch
passes through so each logs a time stamp on entry and exit, to
`<folder>/<pid>.stamps` (written out by `flush` while the device runs).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

ENV = "DIFFQ_BENCH_PHASES"
PROFILE_SINK = "DIFFQ_BENCH_PROFILE_SINK"  # set: the sink helper runs under cProfile (bench/profiled_sink.py)
DEVICE = "device"  # the label of the stand-in's pipeline call

_stamps: list[tuple[float, str]] = []
_lock = threading.Lock()
_out = None


def stamp(label: str) -> None:
    if _out is not None:  # from any thread: one list, in time order
        with _lock:
            _stamps.append((time.perf_counter(), label))


def flush() -> None:
    """Write what was stamped so far (called inside the device call, off the gap)."""
    if _out is None or not _stamps:
        return
    with _lock:
        taken = list(_stamps)
        _stamps.clear()
    lines = "".join(f"{t:.7f} {label}\n" for t, label in taken)
    _out.write(lines)
    _out.flush()


def _wrap(owner, name: str, label: str) -> bool:
    """Stamp `label>` / `label<` around `owner.name`; False where it has no such attribute."""
    # Its own attribute (classmethods stay classmethods), else the inherited function.
    original = owner.__dict__.get(name) or getattr(owner, name, None)
    if original is None:
        return False
    kind = type(original) if isinstance(original, (classmethod, staticmethod)) else None
    function = original.__func__ if kind else original

    @functools.wraps(function)
    def stamped(*args, **kwargs):
        stamp(label + ">")
        try:
            return function(*args, **kwargs)
        finally:
            stamp(label + "<")

    setattr(owner, name, kind(stamped) if kind else stamped)
    return True


# (module, attribute path where the caller looks it up, label), in the order a batch meets them.
STEPS = [
    ("diffq.core.brokers.embedded", "EmbeddedTransport.drain_events", "poll"),
    ("diffq.core.brokers.embedded", "EmbeddedChannel._get", "read message"),
    ("kombu.messaging", "Consumer._receive_callback", "decode message"),
    ("diffq.worker.delivery.celery_adapter", "BatchRequest.execute_using_pool", "celery request"),
    ("diffq.worker.delivery.celery_adapter", "generate_batch", "task"),
    ("diffq.worker.delivery.batches", "BatchLine.received", "received"),
    ("diffq.core.contract", "BatchMessage.from_json_payload", "validate message"),
    ("diffq.worker.process.runtime", "Runtime.storage_for", "storage"),
    ("diffq.worker.delivery.hooks", "Cancel.on_received", "cancel check"),
    ("diffq.worker.delivery.hooks", "Metrics.before_generate", "metrics before"),
    ("diffq.worker.device.pipeline_host", "PipelineHost.generate", "host call"),
    ("diffq.worker.device.pipeline_host", "DeviceTurns.__enter__", "take device"),
    ("diffq.worker.device.pipeline_host", "checked_arrays", "8-bit arrays + checks"),
    ("diffq.worker.device.pipeline_host", "DeviceTurns.__exit__", "leave device"),
    ("diffq.worker.delivery.hooks", "Metrics.after_generate", "metrics after"),
    ("diffq.worker.delivery.tasks", "set_aside_degenerate", "checks"),
    ("diffq.worker.delivery.batches", "BatchLine.store", "line store"),
    ("diffq.worker.sink.helper", "SinkProcess.submit", "sink submit"),
    ("diffq.worker.delivery.tasks", "finish", "finish"),
    ("diffq.worker.delivery.batches", "BatchLine.ack", "ack"),
    ("diffq.worker.delivery.batches", "BatchLine.settle", "settle"),
]


def install() -> None:
    """In the worker process, before Celery starts: wrap the steps (no-op without ENV)."""
    global _out
    folder = os.environ.get(ENV)
    if not folder or _out is not None:
        return
    import importlib

    Path(folder).mkdir(parents=True, exist_ok=True)
    _out = open(Path(folder) / f"{os.getpid()}.stamps", "w")
    for module, path, label in STEPS:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not _wrap(owner, name, label):
            _out.write(f"# not found: {module}:{path}\n")  # the code moved: that step shows in its neighbours
    if os.environ.get(PROFILE_SINK):
        from diffq.worker.sink.helper import SinkProcess

        SinkProcess.HELPER_MODULE = "bench.profiled_sink"
