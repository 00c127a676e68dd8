"""`diffq status`: done / failed / cancelled / pending per shape, from the run folder alone.

Counts come from the workers' progress summary (diffq/core/progress.py). A
cancelled run (`diffq cancel`) has nothing pending: what is neither done nor
failed is cancelled (a batch in hand at the cancel still finishes, and moves from
cancelled to done).

While items are pending and storing into OUT has been failing for longer than a
minute, `trouble` says why ("storage full: No space left on device — waiting, 3
min"): from the trouble notes the workers' sinks leave in OUT, and from a look at a
local OUT's disk (diffq/core/progress.py `storage_trouble`).

With `by_adapter` (`status --by-adapter`), the images per LoRA adapter set and the
graphs compiled per shape, from the image records (results/by_adapter.py): every
record is read, so it costs what `report` does on a big run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from diffq.core.feeds import RunFeedCounts, run_feed_counts
from diffq.core.progress import ProgressSummary, storage_trouble
from diffq.core.records import RunManifest
from diffq.core.runfolder import ItemSet, NotARun, first_records, read_cancel, read_manifest, read_records, record_keys
from diffq.core.storage import open_storage
from diffq.results.by_adapter import ByAdapter

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
    by_adapter: ByAdapter | None = None  # with `by_adapter`

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed - self.cancelled

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def to_json(self) -> dict:
        data = asdict(replace(self, by_adapter=None))
        data.pop("by_adapter")
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
    result = make_status(storage.url, manifest, ProgressSummary(storage).refresh())
    if by_adapter:
        result.by_adapter = ByAdapter()
        for new in first_records((records for _, records in read_records(storage, record_keys(storage))), ItemSet()):
            result.by_adapter.add(new)
    return result
