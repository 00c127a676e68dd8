"""Run-level metrics on the backlog service's /metrics: what `diffq status` and
`diffq queues` say, for Prometheus' alert rules (diffq/app/monitoring.py).

Per run (the runs the feeds folder lists, and any seen there until it has nothing
pending): items done / failed / cancelled / pending from the progress summary, the
batches it still holds in OUT per queue, and when an item was last done or failed:
the progress summary's time (its segments' and failure records' own, as written in
OUT), the manifest's `created_at` for a run that never moved. Nothing of it lives in
this service's memory, so a restarted service reports every stall at its age. Per queue: batches in the broker and waiting in OUT; the dead letters; the
feeder's last pass and last publish.

Each run's `ProgressSummary` is kept between scrapes, so a scrape re-reads only the
progress segments that grew (the summaries make a run of 100M items a few MB:
docs/BENCHMARKS.md). A part that cannot be read (the broker away, a run folder
gone) is left out of that scrape and logged; the rest is still answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from diffq.core import layout
from diffq.core.progress import ProgressSummary
from diffq.core.records import RunManifest
from diffq.core.runfolder import read_manifest
from diffq.core.storage import Storage, open_storage

log = logging.getLogger(__name__)

STATES = ("done", "failed", "cancelled", "pending")


@dataclass
class _Run:
    storage: Storage
    manifest: RunManifest
    summary: ProgressSummary

    @property
    def moved_at(self) -> float:
        """When an item was last done or failed; the run's creation if none ever was."""
        return max(self.summary.last_progress or 0.0, self.manifest.created_at)


class RunMetrics(Collector):
    """A prometheus-client collector, read at scrape time.

    `runs()`: the run folders to report (the feeds folder's); `queues()`: the broker's
    `QueueInfo` rows (diffq/app/queues.py, `unpublished` filled in); `feeder`: the
    service's Feeder (producer/feed.py), whose `last_pass` / `last_publish` it reports."""

    def __init__(self, runs: Callable[[], Iterable[str]], queues: Callable[[], list] | None = None,
                 feeder=None, clock: Callable[[], float] = time.time):
        self._list_runs = runs
        self._queues = queues
        self._feeder = feeder
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()  # scrapes come on the server's threads

    def _refresh(self) -> list[tuple[str, _Run, object]]:
        from diffq.producer.feed import read_pointer, read_state
        from diffq.results.status import make_status

        try:
            listed = list(self._list_runs())
        except Exception as exc:  # the feeds folder away: report the runs already known
            log.warning("run metrics: listing runs: %s: %s", type(exc).__name__, exc)
            listed = []
        now = self._clock()
        seen = []
        for out in dict.fromkeys(listed + list(self._runs)):
            try:
                run = self._runs.get(out)
                if run is not None and out not in listed and not run.storage.exists(layout.MANIFEST):
                    # Left the listing and its folder deleted: not held (and read) for ever. An
                    # unlisted run still there stays until nothing is pending (its stall alerts).
                    del self._runs[out]
                    continue
                if run is None:
                    storage = open_storage(out)
                    run = self._runs[out] = _Run(storage, read_manifest(storage), ProgressSummary(storage))
                status = make_status(run.storage.url, run.manifest, run.summary.refresh(), now=now)
                pointer = read_pointer(run.storage)
                waiting = ({queue: fed.unpublished for queue, fed in read_state(run.storage, pointer.source).queues.items()}
                           if pointer is not None and not status.cancelled else {})
            except Exception as exc:
                log.warning("run metrics: %s: %s: %s", out, type(exc).__name__, exc)
                continue
            seen.append((out, run, status, waiting))
            if status.finished and out not in listed:
                del self._runs[out]  # reported once more, finished
        return seen

    def collect(self):
        items = GaugeMetricFamily("diffq_run_items", "Items of a run by state (as `diffq status` counts them)",
                                  labels=["run", "out", "state"])
        moved = GaugeMetricFamily("diffq_run_last_progress_timestamp_seconds",
                                  "When an item of the run was last done or failed (as written in OUT; "
                                  "its creation if none was)",
                                  labels=["run", "out"])
        waiting = GaugeMetricFamily("diffq_run_batches_waiting",
                                    "Batches of a windowed run still in OUT for the feeder, per queue",
                                    labels=["run", "out", "queue"])
        with self._lock:
            runs = self._refresh()
        for out, run, status, held in runs:
            for state in STATES:
                items.add_metric([status.run_id, out, state], getattr(status, state))
            moved.add_metric([status.run_id, out], run.moved_at)
            for queue, n in sorted(held.items()):
                waiting.add_metric([status.run_id, out, queue], n)
        yield from (items, moved, waiting)
        yield from self._queue_metrics()
        if self._feeder is not None:
            for name, attr, text in (("diffq_feeder_last_pass_timestamp_seconds", "last_pass",
                                      "When the feeder last finished a pass over its runs"),
                                     ("diffq_feeder_last_publish_timestamp_seconds", "last_publish",
                                      "When the feeder last published a batch")):
                value = getattr(self._feeder, attr, None)
                if value is not None:
                    yield GaugeMetricFamily(name, text, value=value)

    def _queue_metrics(self):
        from diffq.app.queues import DEAD_LETTERS

        if self._queues is None:
            return
        try:
            report = self._queues()
        except Exception as exc:  # the broker away: no queue series this scrape
            log.warning("run metrics: the broker: %s: %s", type(exc).__name__, exc)
            return
        batches = GaugeMetricFamily("diffq_queue_batches",
                                    "Batches of a shape queue: in the broker, or still in OUT for the feeder",
                                    labels=["queue", "where"])
        dead = GaugeMetricFamily("diffq_dead_letters_queued", "Messages workers refused, in diffq.dead")
        for info in report:
            if info.queue == DEAD_LETTERS:
                dead.add_metric([], info.depth)
                continue
            batches.add_metric([info.queue, "broker"], info.depth)
            batches.add_metric([info.queue, "out"], info.unpublished)
        yield from (batches, dead)


def registry(collector: RunMetrics) -> CollectorRegistry:
    """A registry of the collector alone (no process series: the service's own are not the fleet's)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
