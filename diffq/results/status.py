"""`diffq status`: done / failed / cancelled / pending per shape, from the run folder alone.

Counts come from the workers' progress summary (diffq/core/progress.py). A
cancelled run (`diffq cancel`) has nothing pending: what is neither done nor
failed is cancelled (a batch in hand at the cancel still finishes, and moves from
cancelled to done).

While items are pending and storing into OUT has been failing for longer than a
minute, `trouble` says why ("storage full: No space left on device — waiting, 3
min"): from the trouble notes the workers' sinks leave in OUT, and from a look at a
local OUT's disk (diffq/core/progress.py `storage_trouble`).

With `by_adapter` (`status --by-adapter`), done / failed / pending per LoRA adapter
set, from the same progress summary (results/by_adapter.py `sets_from_summary`). A run
whose manifest lists no sets (submitted before they were listed) falls back to its
image records (images per set only; every record read) and says so in `adapter_note`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from diffq.core.feeds import RunFeedCounts, run_feed_counts
from diffq.core.progress import ProgressSummary, storage_trouble
from diffq.core.records import RunManifest
from diffq.core.runfolder import ItemSet, NotARun, first_records, read_cancel, read_manifest, read_records, record_keys
from diffq.core.storage import open_storage
from diffq.results.by_adapter import ByAdapter, SetCounts, sets_from_summary

__all__ = ["NotARun", "ShapeStatus", "Status", "make_status", "status"]


@dataclass
class ShapeStatus:
    total: int
    done: int = 0


@dataclass
class Status:
    out: str
    run_id: str
    total: int
    done: int
    failed: int
    shapes: dict[str, ShapeStatus] = field(default_factory=dict)
    cancelled: int = 0
    trouble: str | None = None  # why storing fails, once it has for over a minute
    # A windowed run's batches in the broker and in OUT, and whether a feeder is live.
    feed: RunFeedCounts | None = None
    adapter_sets: list[SetCounts] | None = None  # with `by_adapter`, from the progress summary
    by_adapter: ByAdapter | None = None  # with `by_adapter`, for a run without adapter_sets: from the records
    adapter_note: str | None = None  # with `by_adapter`: why the per-set view is not there, or partial

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed - self.cancelled

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def to_json(self) -> dict:
        data = asdict(replace(self, by_adapter=None, adapter_sets=None))
        data.pop("by_adapter")
        data.pop("adapter_sets")
        if self.adapter_sets is not None:
            data["adapter_sets"] = [row.to_json() for row in self.adapter_sets]
        data["pending"] = self.pending
        data["feed"] = self.feed.to_json() if self.feed else None
        if self.by_adapter is not None:
            data["by_adapter"] = self.by_adapter.to_json()
        return data


def make_status(url: str, manifest: RunManifest, progress: ProgressSummary, *, now: float | None = None) -> Status:
    """`now` (wall clock): the time the trouble's minutes count to (default: now)."""
    shapes = {s.queue: ShapeStatus(total=s.items, done=progress.done_per_queue.get(s.queue, 0))
              for s in manifest.shapes}
    cancelled = 0
    if read_cancel(progress.storage) is not None:
        cancelled = max(0, manifest.total - progress.done - progress.failed)
    pending = manifest.total - progress.done - progress.failed - cancelled
    feed = None
    if pending:  # failed items are not per queue: the batches in the broker are an estimate
        left = {s.queue: (max(0, s.items - shapes[s.queue].done), s.shape.batch_size) for s in manifest.shapes}
        feed = run_feed_counts(progress.storage, left) if not cancelled else None
    return Status(out=url, run_id=manifest.run_id, total=manifest.total,
                  done=progress.done, failed=progress.failed, shapes=shapes, cancelled=cancelled,
                  trouble=storage_trouble(progress.storage, pending, now), feed=feed)


def status(out: str, *, by_adapter: bool = False) -> Status:
    storage = open_storage(out)
    manifest = read_manifest(storage)
    progress = ProgressSummary(storage).refresh()
    result = make_status(storage.url, manifest, progress)
    if by_adapter:
        result.adapter_sets = sets_from_summary(manifest, progress)
        if result.adapter_sets is not None:
            if result.cancelled:
                result.adapter_note = "the run is cancelled: what is pending per set will not be made"
        else:  # no adapters, or submitted before manifests listed their sets: the records tell
            result.adapter_note = ("this run's manifest lists no adapter sets (no adapters, or submitted before diffq "
                                   "listed them): images per set from every image record; failed and pending per set "
                                   "unknown")
            result.by_adapter = ByAdapter()
            for new in first_records((records for _, records in read_records(storage, record_keys(storage))),
                                     ItemSet()):
                result.by_adapter.add(new)
    return result
