"""Prometheus metrics of one worker process, served on its own port (base + slot).

The task code calls the small `observe_*` functions; nothing here imports torch.
Metrics live in a private registry so a process serves exactly its own series,
plus the standard process collector (memory, CPU, open files).

A labelled child is created at its first `.labels()`; a series that starts at its
post-event value hides that event from `rate()`/`increase()`, and a ratio whose
denominator has no series has no value. So the children this process knows it will
use are exported at 0 before any event: each queue's (and its shape's) when the
queue is served (`serving`: at start and at discovery), the refusal reasons
(`refusals`), the store stages (at import). prometheus_client's docs ("Labels":
"metrics with labels are not initialized when declared … call the .labels() method
alone") and Prometheus' ("Avoid missing metrics", instrumentation practices).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client import start_http_server

from diffq.core.records import DEGENERATE_CHECKS

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)

# Batches run from ~0.1 s (tiny CPU) to minutes (large models); compiles up to ~20 min.
BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
COMPILE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600)
UPLOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Busy ratio = generating seconds over the last BUSY_WINDOW seconds of wall time.
BUSY_WINDOW = 60.0

IMAGES = Counter("diffq_images", "Images generated", ["queue"], registry=REGISTRY)
BATCHES = Counter("diffq_batches", "Batches generated", ["queue"], registry=REGISTRY)
BATCH_SECONDS = Histogram("diffq_batch_seconds", "Generation seconds per batch", ["queue"],
                          buckets=BATCH_BUCKETS, registry=REGISTRY)
COMPILE_SECONDS = Histogram("diffq_compile_seconds", "Seconds of a batch that compiled a new graph",
                            ["shape"], buckets=COMPILE_BUCKETS, registry=REGISTRY)
COMPILES = Counter("diffq_compiles", "Graph compiles per shape", ["shape"], registry=REGISTRY)
RECOMPILES = Counter("diffq_recompiles",
                     "Graphs compiled for a shape already served (should stay 0 in steady state)",
                     ["shape"], registry=REGISTRY)
GRAPH_FALLBACKS = Counter("diffq_graph_fallbacks",
                          "Compiled-graph calls that failed on the device and re-ran uncompiled, op by op "
                          "(only with --allow-fallback; otherwise the batch fails)",
                          ["shape"], registry=REGISTRY)
UPLOAD_SECONDS = Histogram("diffq_upload_seconds", "Seconds to encode and store one batch",
                           buckets=UPLOAD_BUCKETS, registry=REGISTRY)
UPLOAD_BYTES = Counter("diffq_upload_bytes", "Bytes of images stored", registry=REGISTRY)
LORA_CHANGE_UNSEEN = Counter("diffq_lora_change_unseen",
                             "LoRA set changes the device's output did not show (the worker then serves no adapters)",
                             ["lora_mode"], registry=REGISTRY)
FAILURES = Counter("diffq_failures", "Items that failed after every retry", ["queue"], registry=REGISTRY)
# Per LoRA adapter set (its short digest, core/adapters.py set_digest; never a path),
# batches with adapters only: one set of twenty failing is 0.05 of its queue's items,
# under ItemsFailing's ratio, so DiffqAdapterSetFailing takes each set's own ratio.
SET_IMAGES = Counter("diffq_adapter_set_images", "Images generated per LoRA adapter set (short digest)",
                     ["adapter_set"], registry=REGISTRY)
SET_FAILURES = Counter("diffq_adapter_set_failures", "Items failed after every retry per LoRA adapter set",
                       ["adapter_set"], registry=REGISTRY)
# Distinct set labels one process exports at once; a set met while all are held counts
# under OTHER_SET. A worker lives for days across runs, so a label is let go once its set
# has been idle SET_LABEL_IDLE_S and a new set needs the slot (its two series removed;
# kept until then, so a set that comes back counts on). DiffqAdapterSetFailing looks back
# failure_window and waits failure_for (diffq/app/monitoring.py Thresholds: 15 + 10 min by
# default); a set idle past its window has no rate left to alert on, so twice that, at
# least an hour, drops nothing an alert still reads (tests/test_metrics.py holds it to the
# defaults). A set that comes back after its label went starts its series again at 0:
# Prometheus' rate() and increase() take the drop as a counter reset, as after a restart.
MAX_SET_LABELS = 32
OTHER_SET = "other"
SET_LABEL_IDLE_S = 3600.0
DEGENERATE = Counter("diffq_degenerate_images",
                     "Images a check found degenerate, by check (kind): nonfinite (NaN or infinite values) or "
                     "flat (one colour); --on-degenerate decides whether each failed or was stored flagged",
                     ["queue", "kind"], registry=REGISTRY)
# A worker's start: seconds to minutes (a first compile, a cold weights fetch).
START_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
START_PHASE_SECONDS = Histogram("diffq_start_phase_seconds",
                                "Seconds of each phase of a worker life's start (core/records.py START_PHASES)",
                                ["phase"], buckets=START_BUCKETS, registry=REGISTRY)
TIME_TO_FIRST_IMAGE = Histogram("diffq_time_to_first_image_seconds",
                                "Process start to the first batch stored", buckets=START_BUCKETS, registry=REGISTRY)
MODEL_FETCH_BYTES = Counter("diffq_model_fetch_bytes", "Bytes of models fetched from object storage",
                            ["hit"], registry=REGISTRY)
BUSY = Gauge("diffq_device_busy_ratio", "Share of recent wall time the device spent generating",
             registry=REGISTRY)
# What the fleet's alert rules (diffq/app/monitoring.py) watch beside the above.
UPLOAD_FAILURES = Counter("diffq_upload_failures",
                          "Stores into the run folder that failed (each try the sink retries, the batch handed "
                          "back, or retried without using an attempt)", ["stage"], registry=REGISTRY)
# Where a store fails: `try` (each failed try of the sink's retry loop, a batch's or
# the progress summary's: while storage stays down it keeps counting, where the sink
# would otherwise say nothing until it gives up, ten minutes on), `store`
# (the sink gave up, the batch handed back) or `lookup` (a run-folder read or write on
# the task's side, retried without an attempt).
STORE_STAGES = ("try", "store", "lookup")
for _stage in STORE_STAGES:
    UPLOAD_FAILURES.labels(_stage)
LEASE_LAPSES = Counter("diffq_lease_lapses", "Deliveries held past DIFFQ_MAX_HOLD_S and left to lapse",
                       registry=REGISTRY)
REDELIVERIES = Counter("diffq_redeliveries",
                       "Batches the broker delivered again (not retries): a holder lost them (a lost host's "
                     "lapsed lease) or handed them back",
                       ["queue"], registry=REGISTRY)
DEAD_LETTERS = Counter("diffq_dead_letters", "Deliveries this process dead-lettered, by reason", ["reason"],
                       registry=REGISTRY)
RESTARTS = Gauge("diffq_worker_restarts",
                 "Times the supervisor restarted this worker process (or its TP group) since the pod started",
                 registry=REGISTRY)


class BusyWindow:
    """Generating seconds in a sliding window, read at scrape time so idle decays to 0."""

    def __init__(self, window: float = BUSY_WINDOW):
        self.window = window
        self.started = time.monotonic()
        self.spans: deque[tuple[float, float]] = deque()  # (end, seconds)
        self.lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self.lock:
            self.spans.append((time.monotonic(), seconds))

    def ratio(self) -> float:
        now = time.monotonic()
        start = now - self.window
        with self.lock:
            while self.spans and self.spans[0][0] < start:
                self.spans.popleft()
            busy = sum(min(seconds, end - start) for end, seconds in self.spans)
        return min(1.0, busy / max(1e-9, min(self.window, now - self.started)))


_busy = BusyWindow()
BUSY.set_function(_busy.ratio)


def serving(queue: str, shape_label: str | None = None) -> None:
    """A queue this process serves from now on: its children (and its shape's, where
    known) exported at 0 before its first batch."""
    for metric in (IMAGES, BATCHES, BATCH_SECONDS, FAILURES, REDELIVERIES):
        metric.labels(queue)
    for kind in DEGENERATE_CHECKS:
        DEGENERATE.labels(queue, kind)
    if shape_label is not None:
        for metric in (COMPILES, COMPILE_SECONDS, RECOMPILES, GRAPH_FALLBACKS):
            metric.labels(shape_label)


def refusals(reasons) -> None:
    """The reasons this process may dead-letter a delivery for, exported at 0."""
    for reason in reasons:
        DEAD_LETTERS.labels(reason)


class _SetLabels:
    """The `adapter_set` label of a digest: itself while fewer than `most` sets are
    labelled (sets idle for `idle_s` let go first), else OTHER_SET."""

    def __init__(self, most: int = MAX_SET_LABELS, idle_s: float = SET_LABEL_IDLE_S, clock=time.monotonic):
        self.most = most
        self.idle_s = idle_s
        self.clock = clock
        self._last: dict[str, float] = {}  # labelled digest -> when last used
        self._lock = threading.Lock()

    def __call__(self, digest: str) -> str:
        with self._lock:
            now = self.clock()
            if digest not in self._last:
                if len(self._last) >= self.most:
                    self._let_go(now)
                if len(self._last) >= self.most:
                    return OTHER_SET
                # Both series from the first batch on: the alert's ratio needs its denominator.
                SET_IMAGES.labels(digest)
                SET_FAILURES.labels(digest)
            self._last[digest] = now
            return digest

    def _let_go(self, now: float) -> None:
        for digest in [d for d, last in self._last.items() if now - last > self.idle_s]:
            del self._last[digest]
            SET_IMAGES.remove(digest)
            SET_FAILURES.remove(digest)


set_label = _SetLabels()


def observe_batch(queue: str, items: int, generate_s: float, adapter_set: str | None = None) -> None:
    """After a batch generated (padding excluded from `items`)."""
    IMAGES.labels(queue).inc(items)
    if adapter_set is not None:
        SET_IMAGES.labels(set_label(adapter_set)).inc(items)
    BATCHES.labels(queue).inc()
    BATCH_SECONDS.labels(queue).observe(generate_s)
    _busy.add(generate_s)


def observe_store(seconds: float, nbytes: int) -> None:
    """After the sink stored a batch's images and record."""
    UPLOAD_SECONDS.observe(seconds)
    UPLOAD_BYTES.inc(nbytes)


def observe_compile(shape_label: str, seconds: float) -> None:
    """After the batch that compiled a new shape (`Generated.compiled`)."""
    COMPILE_SECONDS.labels(shape_label).observe(seconds)
    COMPILES.labels(shape_label).inc()


def observe_recompile(shape_label: str, graphs: int = 1) -> None:
    """When a shape already served compiled again (`PipelineHost.recompiles` grew)."""
    RECOMPILES.labels(shape_label).inc(graphs)


def observe_graph_fallback(shape_label: str, calls: int) -> None:
    """When compiled-graph calls of a shape re-ran uncompiled (`Generated.graph_fallbacks`)."""
    GRAPH_FALLBACKS.labels(shape_label).inc(calls)


def observe_lora_change_unseen(lora_mode: str) -> None:
    """When a worker's change check did not see a set change (worker/device/lora_apply.py):
    from then on it fails every batch naming adapters."""
    LORA_CHANGE_UNSEEN.labels(lora_mode).inc()


def observe_failure(queue: str, n: int, adapter_set: str | None = None) -> None:
    """After a failure record for `n` items was written."""
    FAILURES.labels(queue).inc(n)
    if adapter_set is not None:
        SET_FAILURES.labels(set_label(adapter_set)).inc(n)


def observe_degenerate(queue: str, kind: str, n: int = 1) -> None:
    """After a batch in which a check found `n` degenerate images of this kind."""
    DEGENERATE.labels(queue, kind).inc(n)


def observe_upload_failure(stage: str) -> None:
    """A store that failed, at one of STORE_STAGES."""
    UPLOAD_FAILURES.labels(stage).inc()


def observe_lease_lapse() -> None:
    LEASE_LAPSES.inc()


def observe_redelivery(queue: str) -> None:
    REDELIVERIES.labels(queue).inc()


def observe_dead_letter(reason: str) -> None:
    DEAD_LETTERS.labels(reason).inc()


def observe_restarts(restarts: int) -> None:
    RESTARTS.set(restarts)


def follower() -> None:
    """A tensor-parallel rank that follows its leader: the group's device time is the
    leader's series; a follower's 0 would pull a pool's mean busy ratio down."""
    REGISTRY.unregister(BUSY)


def start_server(port: int, addr: str) -> int:
    """Serve /metrics from a daemon thread; returns the bound port (0 picks a free one)."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server.server_port


def observe_start(phases: dict[str, float], total_s: float, fetches: list[dict]) -> None:
    for phase, seconds in phases.items():
        START_PHASE_SECONDS.labels(phase).observe(seconds)
    TIME_TO_FIRST_IMAGE.observe(total_s)
    for fetched in fetches:
        MODEL_FETCH_BYTES.labels(str(fetched["hit"]).lower()).inc(fetched["bytes"])
