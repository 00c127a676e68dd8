"""`diffq status`: done / failed / cancelled / pending per shape, from the run folder alone.

Counts come from the workers' progress summary (diffq/core/progress.py). A
cancelled run (`diffq cancel`) has nothing pending: what is neither done nor
failed is cancelled (a batch in hand at the cancel still finishes, and moves from
cancelled to done).

While items are pending and storing into OUT has been failing for longer than a
minute, `trouble` says why ("storage full: No space left on device — waiting, 3
min"): from the trouble notes the workers' sinks leave in OUT, and from a look at a
local OUT's disk (diffq/core/progress.py `storage_trouble`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from diffq.core.feeds import RunFeedCounts, run_feed_counts
from diffq.core.progress import ProgressSummary, storage_trouble
from diffq.core.records import RunManifest
from diffq.core.runfolder import NotARun, read_cancel, read_manifest
from diffq.core.storage import open_storage

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

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed - self.cancelled

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def to_json(self) -> dict:
        data = asdict(self)
        data["pending"] = self.pending
        data["feed"] = self.feed.to_json() if self.feed else None
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


def status(out: str) -> Status:
    storage = open_storage(out)
    manifest = read_manifest(storage)
    return make_status(storage.url, manifest, ProgressSummary(storage).refresh())
