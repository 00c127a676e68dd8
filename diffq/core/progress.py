"""The progress summary: which batches are done, in a few small objects.

Status cannot read one record file per batch at scale (125,000 objects for a
million items), so whoever writes a record also credits its batch in a progress
segment, `progress/<writer>-<n>.json` (schema: records.ProgressSegment):

    {"v": 1, "writer": "...", "queues": {"<queue>": [["<batch id>", 8],
                                                      ["<batch id>.s0", 4, ["<item id>", ...]]]}}

One writer (ProgressLog, in the sink) and one reader (ProgressSummary: status,
watch, the embedded runner); `reconcile` credits what records show but no
segment does.

A segment has one writer, so it is rewritten whole (an atomic put) each time it
grows; past SEGMENT_BYTES its writer starts the next one, which keeps each
rewrite small and lets readers skip sealed segments they have read.

A batch may be credited more than once (redeliveries, two copies of one batch):
readers union by batch id. A derived batch (an id with a '.', see layout.py)
carries a subset of its root batch's items and may overlap other batches of
that root, so its credit lists its item ids; a root batch's credit needs none.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from diffq.core import layout
from diffq.core.records import Credit, FailureRecord, ProgressSegment
from diffq.core.storage import Storage

SEGMENT_BYTES = 256 * 1024


def root_batch(batch_id: str) -> str:
    """The plan batch a (possibly derived) batch id comes from."""
    return batch_id.partition(".")[0]


def default_writer() -> str:
    # Unique per process and per log: a restarted worker never appends to (and so
    # never overwrites) a segment its previous life wrote.
    return layout.safe_name(f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")[:80]


class ProgressLog:
    """The writer: one writer's credits in one run folder. Not thread-safe: one thread per log."""

    def __init__(self, storage: Storage, writer: str | None = None):
        self.storage = storage
        self.writer = writer or default_writer()
        self._segment = 0
        self._start_segment()

    def _start_segment(self) -> None:
        self._queues: dict[str, list[Credit]] = {}
        self._batches: set[str] = set()
        self._bytes = 0
        self._dirty = False

    def add(self, batch_id: str, queue: str, item_ids: list[str]) -> None:
        """Credit a batch (in memory; `flush` stores it)."""
        if batch_id in self._batches:
            return
        if self._bytes >= SEGMENT_BYTES:
            self.flush()  # raises with the state unchanged, so a retry redoes this
            self._segment += 1
            self._start_segment()
        credit: Credit = (batch_id, len(item_ids), list(item_ids)) if "." in batch_id else (batch_id, len(item_ids))
        self._queues.setdefault(queue, []).append(credit)
        self._batches.add(batch_id)
        self._bytes += len(json.dumps(credit, separators=(",", ":"))) + 1
        self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        body = ProgressSegment(writer=self.writer, queues=self._queues).model_dump_json()
        self.storage.put_bytes(layout.progress_key(self.writer, self._segment), body.encode(),
                               content_type="application/json")
        self._dirty = False


def parse_segment(body: bytes) -> Iterator[tuple[str, str, int, list[str] | None]]:
    """(batch id, queue, items, item ids or None) for each credit in a segment."""
    for queue, credits in ProgressSegment.model_validate_json(body).queues.items():
        for credit in credits:
            yield credit[0], queue, credit[1], credit[2] if len(credit) > 2 else None


log = logging.getLogger(__name__)


class ProgressSummary:
    """The reader: done and failed counts of a run, refreshed from what changed."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._sizes: dict[str, int] = {}  # segment key -> size when read
        self._failures: dict[str, tuple[str, list[str]]] = {}  # key -> (batch id, item ids)
        # batch id -> (queue, items, item ids of a derived batch else None)
        self.batches: dict[str, tuple[str, int, list[str] | None]] = {}
        self.done = 0
        self.failed = 0
        self.done_per_queue: dict[str, int] = {}

    def refresh(self) -> ProgressSummary:
        """Read the segments and failures that changed and recount (a run with no
        segment yet has nothing done)."""
        with ThreadPoolExecutor(2) as pool:  # two listings, one round trip
            segments = pool.submit(lambda: list(self.storage.list_with_sizes(layout.PROGRESS_PREFIX)))
            failures = pool.submit(lambda: list(self.storage.list(layout.FAILURES_PREFIX)))
            segments, failures = segments.result(), failures.result()
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
        return self

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
    """
    summary = ProgressSummary(storage).refresh()
    missing = [batch_id for batch_id in recorded if batch_id not in summary.batches]
    if missing:
        writer = ProgressLog(storage, writer=f"reconcile-{secrets.token_hex(6)}")
        for batch_id in missing:
            queue, item_ids = recorded[batch_id]
            writer.add(batch_id, queue, item_ids)
        writer.flush()
        log.warning("credited %d recorded batches missing from the progress summary", len(missing))
    return len(missing)
