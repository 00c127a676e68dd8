"""`diffq status`: done / failed / cancelled / pending per shape, from the run folder alone.

Counts come from the workers' progress summary (diffq/core/progress.py); runs
without one yet read the records. A cancelled run (`diffq cancel`) has nothing
pending: what is neither done nor failed is cancelled (a batch in hand at the
cancel still finishes, and moves from cancelled to done).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from diffq.core.contract import RunManifest
from diffq.core.progress import ProgressSummary
from diffq.core.runfolder import NotARun, ProgressTracker, read_cancel, read_manifest
from diffq.core.storage import Storage, open_storage

__all__ = ["NotARun", "RunProgress", "ShapeStatus", "Status", "make_status", "status"]


class RunProgress:
    """What status and watch count from: the progress summary once the run has
    one; until then (nothing credited yet, or a run from before the summary)
    every record, read incrementally."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.summary = ProgressSummary(storage)
        self.source: ProgressSummary | ProgressTracker | None = None
        self._scan: ProgressTracker | None = None
        self.cancel: dict | None = None

    def refresh(self) -> None:
        self.cancel = read_cancel(self.storage)
        if self.summary.refresh():
            self.source = self.summary
            return
        if self._scan is None:
            self._scan = ProgressTracker(self.storage)
        self._scan.refresh()
        self.source = self._scan

    @property
    def done(self) -> int:
        return self.source.done

    @property
    def failed(self) -> int:
        return self.source.failed

    @property
    def done_per_queue(self) -> dict[str, int]:
        return self.source.done_per_queue


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

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed - self.cancelled

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def to_json(self) -> dict:
        data = asdict(self)
        data["pending"] = self.pending
        return data


def make_status(url: str, manifest: RunManifest, progress: RunProgress | ProgressTracker) -> Status:
    shapes = {s.queue: ShapeStatus(total=s.items, done=progress.done_per_queue.get(s.queue, 0))
              for s in manifest.shapes}
    cancelled = 0
    if getattr(progress, "cancel", None) is not None:
        cancelled = max(0, manifest.total - progress.done - progress.failed)
    return Status(out=url, run_id=manifest.run_id, total=manifest.total,
                  done=progress.done, failed=progress.failed, shapes=shapes, cancelled=cancelled)


def status(out: str) -> Status:
    storage = open_storage(out)
    manifest = read_manifest(storage)
    progress = RunProgress(storage)
    progress.refresh()
    return make_status(storage.url, manifest, progress)
