"""Exact progress from the progress segments and failure files, without the records.

Counting is per root batch (see diffq/progress.py): a credited plan batch means
all its items are done, and every batch derived from it carries a subset of them;
without it, the root's derived batches are counted by the union of their item
ids. Items failed are the failure files' items not done, which by the same rule
needs only the credits of each failure's root. So status reads the segments
(a few hundred small objects for a million items) and the failure files, and
never a record.

Reads are incremental, for watch: failure files never change, sealed segments
never change, and a segment that grew has a new size, so a refresh reads only
what is new.
"""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor

from diffq import layout
from diffq.contract import FailureRecord
from diffq.progress import ProgressLog, parse_segment, root_batch
from diffq.storage import Storage

log = logging.getLogger(__name__)


class ProgressSummary:
    def __init__(self, storage: Storage):
        self.storage = storage
        self._sizes: dict[str, int] = {}  # segment key -> size when read
        self._failures: dict[str, tuple[str, list[str]]] = {}  # key -> (batch id, item ids)
        # batch id -> (queue, items, item ids of a derived batch else None)
        self.batches: dict[str, tuple[str, int, list[str] | None]] = {}
        self.done = 0
        self.failed = 0
        self.done_per_queue: dict[str, int] = {}

    def refresh(self) -> bool:
        """Read what changed and recount; False when the run folder has no progress
        segments (nothing credited yet, or a run from before them)."""
        with ThreadPoolExecutor(2) as pool:  # two listings, one round trip
            segments = pool.submit(lambda: list(self.storage.list_with_sizes(layout.PROGRESS_PREFIX)))
            failures = pool.submit(lambda: list(self.storage.list(layout.FAILURES_PREFIX)))
            segments, failures = segments.result(), failures.result()
        if not segments:
            return False
        changed = [key for key, size in segments if key.endswith(".json") and self._sizes.get(key) != size]
        sizes = dict(segments)
        for key, body in self.storage.get_many(changed):
            self._sizes[key] = sizes[key]
            for batch_id, queue, items, ids in parse_segment(body):
                self.batches.setdefault(batch_id, (queue, items, ids))
        for key, body in self.storage.get_many(key for key in failures if key not in self._failures):
            failure = FailureRecord.model_validate_json(body)
            self._failures[key] = (failure.batch_id, failure.item_ids)
        self._count()
        return True

    def _count(self) -> None:
        done_per_queue: dict[str, int] = {}
        derived: dict[str, tuple[str, set[str]]] = {}  # root -> (queue, item ids done)
        for batch_id, (queue, items, ids) in self.batches.items():
            if ids is None:
                done_per_queue[queue] = done_per_queue.get(queue, 0) + items
            else:
                derived.setdefault(root_batch(batch_id), (queue, set()))[1].update(ids)
        for root, (queue, ids) in derived.items():
            if root not in self.batches:  # else the root's credit covers them all
                done_per_queue[queue] = done_per_queue.get(queue, 0) + len(ids)
        failed: set[str] = set()
        for batch_id, item_ids in self._failures.values():
            root = root_batch(batch_id)
            if root in self.batches:
                continue
            done = derived.get(root, ("", set()))[1]
            failed.update(item for item in item_ids if item not in done)
        self.done_per_queue = done_per_queue
        self.done = sum(done_per_queue.values())
        self.failed = len(failed)


def reconcile(storage: Storage, recorded: dict[str, tuple[str, list[str]]]) -> int:
    """Credit every recorded batch the summary lacks; returns how many.

    `recorded` maps batch id -> (queue, item ids), from reading every record. A
    worker that died between record and credit is healed when its batch is
    delivered again; this covers a batch whose message was lost meanwhile. A
    record always means its batch is done, so crediting it is always right.
    Runs without progress segments are left alone: status reads their records.
    """
    summary = ProgressSummary(storage)
    if not summary.refresh():
        return 0
    missing = [batch_id for batch_id in recorded if batch_id not in summary.batches]
    if missing:
        writer = ProgressLog(storage, writer=f"reconcile-{secrets.token_hex(6)}")
        for batch_id in missing:
            queue, item_ids = recorded[batch_id]
            writer.add(batch_id, queue, item_ids)
        writer.flush()
        log.warning("credited %d recorded batches missing from the progress summary", len(missing))
    return len(missing)
