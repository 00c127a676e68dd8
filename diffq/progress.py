"""The progress summary: which batches are done, in a few small objects.

Status cannot read one record file per batch at scale (125,000 objects for a
million items), so whoever writes a record also credits its batch in a progress
segment, `progress/<writer>-<n>.json`:

    {"v": 1, "writer": "...", "queues": {"<queue>": [["<batch id>", 8],
                                                      ["<batch id>.s0", 4, ["<item id>", ...]]]}}

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
import os
import secrets
import socket
from collections.abc import Iterator

from diffq import layout
from diffq.storage import Storage

VERSION = 1
SEGMENT_BYTES = 256 * 1024


def root_batch(batch_id: str) -> str:
    """The plan batch a (possibly derived) batch id comes from."""
    return batch_id.partition(".")[0]


def default_writer() -> str:
    # Unique per process and per log: a restarted worker never appends to (and so
    # never overwrites) a segment its previous life wrote.
    return layout.safe_name(f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")[:80]


class ProgressLog:
    """One writer's credits in one run folder. Not thread-safe: one thread per log."""

    def __init__(self, storage: Storage, writer: str | None = None):
        self.storage = storage
        self.writer = writer or default_writer()
        self._segment = 0
        self._start_segment()

    def _start_segment(self) -> None:
        self._entries: dict[str, list[str]] = {}  # queue -> encoded credits
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
        entry = [batch_id, len(item_ids)]
        if "." in batch_id:
            entry.append(list(item_ids))
        encoded = json.dumps(entry, separators=(",", ":"))
        self._entries.setdefault(queue, []).append(encoded)
        self._batches.add(batch_id)
        self._bytes += len(encoded) + 1
        self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        queues = ",".join(f"{json.dumps(queue)}:[{','.join(entries)}]" for queue, entries in self._entries.items())
        body = f'{{"v":{VERSION},"writer":{json.dumps(self.writer)},"queues":{{{queues}}}}}'
        self.storage.put_bytes(layout.progress_key(self.writer, self._segment), body.encode(),
                               content_type="application/json")
        self._dirty = False


def parse_segment(body: bytes) -> Iterator[tuple[str, str, int, list[str] | None]]:
    """(batch id, queue, items, item ids or None) for each credit in a segment."""
    data = json.loads(body)
    for queue, entries in data["queues"].items():
        for entry in entries:
            yield entry[0], queue, entry[1], entry[2] if len(entry) > 2 else None
