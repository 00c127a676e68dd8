"""The progress summary: which batches are done, in a few small objects.

Status cannot read one record file per batch at scale (125,000 objects for a
million items), so whoever writes a record also credits its batch in a progress
segment, `progress/<writer>-<n>.json` (schema: records.ProgressSegmentV2):

    {"v": 2, "writer": "...", "at": <when its writer last credited, Unix seconds>,
     "numbered": [{"queue": "<queue>", "prefix": "128x128-3f2a1c-", "width": 7, "items": 8,
                   "count": 12500, "start": 17, "gaps": "<packed>", "zlib": false}],
     "queues": {"<queue>": [["<batch id>.s0", 4, ["<item id>", ...]]]}}

One writer (ProgressLog, in the sink) and one reader (ProgressSummary: status,
watch, the embedded runner); `reconcile` credits what records show but no
segment does. Beside them, why storing fails, for the same readers: the sink's
trouble notes (`TroubleNote`) and what a reader sees itself (`storage_trouble`).

Plan batch ids end in a number, dense within their queue (`<prefix><index>`, see
producer/messages.py), so a plan batch's credit is its index: a segment packs a
writer's indexes per (queue, prefix, width, items) as the gaps between them,
base64 (`pack_indexes`): 2.7 bytes a batch with a thousand writers, less with
fewer, where v1 spelled out ~35. The reader keeps one array per (queue, prefix,
width), a byte per index saying how many items are credited there, so its memory
is a byte per plan batch whatever the number of writers or of redeliveries, and
recounting is a pass over those arrays.

A segment has one writer, so it is rewritten whole (an atomic put) each time it
grows, and each rewrite is longer than the last (readers find what changed from a
listing's sizes); past SEGMENT_BYTES its writer starts the next one, which keeps
each rewrite small and lets readers skip sealed segments they have read.

A batch may be credited more than once (redeliveries, two copies of one batch):
readers union by batch id (an index credited twice is one array cell). A derived
batch (an id with a '.', see layout.py) carries a subset of its root batch's items
and may overlap other batches of that root, so its credit lists its item ids, as
does a plan batch id not of the numbered form; v1 segments (every credit spelled
out) are still read, their plan batch ids folded into the same arrays.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
import zlib
from collections import deque
from collections.abc import Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import TypeAdapter

from diffq.core import layout
from diffq.core.records import AnyProgressSegment, Credit, FailureRecord, NumberedCredits, ProgressSegmentV2
from diffq.core.runfolder import failed_items
from diffq.core.storage import Storage

SEGMENT_BYTES = 64 * 1024
DECODERS = min(4, os.cpu_count() or 1)  # threads decoding segments as they are read
# What a numbered credit adds to a segment, for the roll-over estimate (2.7 bytes
# with gaps of 256 or more between a writer's batches; closer ones pack smaller).
NUMBERED_CREDIT_BYTES = 3
# The reader's array of a (queue, prefix, width) spans its lowest to highest index,
# a byte each: ids numbered beyond this are spelled out instead.
MAX_INDEX = 2**27 - 1
_SEGMENT: TypeAdapter = TypeAdapter(AnyProgressSegment)
_GAP_TYPES = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}  # bytes -> gap type

log = logging.getLogger(__name__)


def root_batch(batch_id: str) -> str:
    """The plan batch a (possibly derived) batch id comes from."""
    return batch_id.partition(".")[0]


def plan_number(batch_id: str) -> tuple[str, int, int] | None:
    """(prefix, width, index) of a plan batch id ending in digits, where
    `prefix + str(index).zfill(width)` spells it again; None for a derived id or one
    of another form."""
    if "." in batch_id:
        return None
    prefix = batch_id.rstrip("0123456789")
    digits = batch_id[len(prefix):]
    if not digits or len(digits) > 20:
        return None
    index = int(digits)
    return (prefix, len(digits), index) if index <= MAX_INDEX else None


def pack_indexes(indexes) -> tuple[int, int, str, bool]:
    """(start, count, packed gaps, whether zlib-compressed) of a set of indexes: the
    lowest, how many, and the gaps between them sorted, as little-endian integers of
    1, 2 or 4 bytes (as the largest gap needs), base64. Compressed only where that
    halves them: gaps between a thousand writers' batches shrink by a fifth, and
    inflating them would double a reader's time; runs of consecutive batches shrink
    to nothing."""
    values = np.unique(np.asarray(indexes, dtype=np.int64))
    gaps = np.diff(values)
    kind = next(kind for kind in _GAP_TYPES.values() if int(gaps.max(initial=0)) <= np.iinfo(kind).max)
    raw = gaps.astype(kind).tobytes()
    packed = zlib.compress(raw, 6)
    compressed = len(packed) < 0.5 * len(raw)
    return int(values[0]), len(values), base64.b64encode(packed if compressed else raw).decode(), compressed


def unpack_indexes(start: int, count: int, gaps: str, compressed: bool) -> np.ndarray:
    """`pack_indexes`' inverse: the indexes, sorted."""
    # b64decode without its copy of the text into bytes (a2b_base64 reads ASCII text as is).
    raw = binascii.a2b_base64(gaps)
    if compressed:
        raw = zlib.decompress(raw)
    kind = _GAP_TYPES.get(len(raw) // (count - 1)) if count > 1 else _GAP_TYPES[1]
    if kind is None or len(raw) != kind.itemsize * (count - 1):
        raise ValueError(f"{len(raw)} bytes of packed gaps are not 1, 2 or 4 × {count - 1}")
    gaps = np.frombuffer(raw, kind)
    if start + int(gaps.sum(dtype=np.int64)) > MAX_INDEX:
        raise ValueError(f"packed indexes past {MAX_INDEX}")
    # So int32 holds every index, and halves what crediting walks through.
    indexes = np.empty(count, np.int32)
    indexes[0] = start
    np.cumsum(gaps, dtype=np.int32, out=indexes[1:])
    indexes[1:] += start
    return indexes


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
        # (queue, prefix, width, items, adapter set, lora mode) -> indexes
        self._numbered: dict[tuple[str, str, int, int, str | None, str | None], list[int]] = {}
        self._queues: dict[str, list[Credit]] = {}
        self._sets: dict[str, tuple[str, str | None]] = {}  # spelled-out credits' adapter sets
        self._batches: set[str] = set()
        self._bytes = 0
        self._written = 0  # the size of this segment's last write
        self._dirty = False

    def add(self, batch_id: str, queue: str, item_ids: list[str], adapter_set: str | None = None,
            mode: str | None = None) -> None:
        """Credit a batch (in memory; `flush` stores it), with its adapter set's digest
        (core/adapters.py set_digest) and lora mode where it has adapters."""
        if batch_id in self._batches:
            return
        if self._bytes >= SEGMENT_BYTES:
            self.flush()  # raises with the state unchanged, so a retry redoes this
            self._segment += 1
            self._start_segment()
        number = plan_number(batch_id)
        if number is not None:
            prefix, width, index = number
            self._numbered.setdefault((queue, prefix, width, len(item_ids), adapter_set, mode), []).append(index)
            self._bytes += NUMBERED_CREDIT_BYTES
        else:
            credit: Credit = (batch_id, len(item_ids), list(item_ids)) if "." in batch_id else (batch_id, len(item_ids))
            self._queues.setdefault(queue, []).append(credit)
            self._bytes += len(json.dumps(credit, separators=(",", ":"))) + 1
            if adapter_set is not None:
                self._sets[batch_id] = (adapter_set, mode)
                self._bytes += len(batch_id) + len(adapter_set) + len(mode or "") + 12
        self._batches.add(batch_id)
        self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        numbered = []
        for (queue, prefix, width, items, adapter_set, mode), indexes in self._numbered.items():
            start, count, gaps, compressed = pack_indexes(indexes)
            numbered.append(NumberedCredits(queue=queue, prefix=prefix, width=width, items=items, count=count,
                                            start=start, gaps=gaps, zlib=compressed, set=adapter_set, mode=mode))
        body = ProgressSegmentV2(writer=self.writer, numbered=numbered, queues=self._queues, sets=self._sets,
                                 at=round(time.time(), 3)).model_dump_json()
        # Readers see a change by a listing's sizes alone, and a packed segment can
        # grow by a credit without growing: trailing spaces keep every rewrite longer.
        body = body.encode().ljust(self._written + 1)
        self.storage.put_bytes(layout.progress_key(self.writer, self._segment), body,
                               content_type="application/json")
        self._written = len(body)
        self._dirty = False


def parse_segment(body: bytes) -> Iterator[tuple[str, str, int, list[str] | None]]:
    """(batch id, queue, items, item ids or None) for each credit in a segment, v1 or v2
    (spelled out one by one: for tests and tools, not for counting)."""
    segment = _SEGMENT.validate_json(body)
    for numbered in getattr(segment, "numbered", ()):
        for index in unpack_indexes(numbered.start, numbered.count, numbered.gaps, numbered.zlib).tolist():
            yield f"{numbered.prefix}{index:0{numbered.width}d}", numbered.queue, numbered.items, None
    for queue, credits in segment.queues.items():
        for credit in credits:
            yield credit[0], queue, credit[1], credit[2] if len(credit) > 2 else None


def _decode(pair: tuple[str, bytes]) -> tuple[str, tuple[list, dict[str, list[Credit]], dict, float | None]]:
    """A segment's numbered credits unpacked ((queue, prefix, width), (items, adapter set,
    mode), indexes), its spelled-out ones and their adapter sets, and when it was written
    (None before segments said)."""
    key, body = pair
    segment = _SEGMENT.validate_json(body)
    numbered = [((n.queue, n.prefix, n.width), (n.items, n.set, n.mode),
                 unpack_indexes(n.start, n.count, n.gaps, n.zlib))
                for n in getattr(segment, "numbered", ())]
    return key, (numbered, segment.queues, getattr(segment, "sets", {}), getattr(segment, "at", None))


def _in_order(pool: ThreadPoolExecutor, work, items, window: int) -> Iterator:
    """pool.map with at most `window` results waiting: memory stays a few segments'."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(work, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


# What a credit says of its batch: (items, adapter set digest or None, lora mode or None).
Kind = tuple[int, str | None, str | None]


class _Numbered:
    """What is credited at each index of one (queue, prefix, width): a code per index (0:
    not credited), standing for one of the kinds seen (`kinds`: item count, adapter set,
    lora mode). A run has a few kinds, so a code is a byte; a run whose batches each name
    their own adapter set has as many kinds as batches, and the codes widen as they grow."""

    CHUNK = 1 << 16  # the array's start is a multiple of this
    # A code's widths, narrowest first. uint32 holds more kinds than MAX_INDEX holds
    # batches (more only by crediting the same indexes again and again with new kinds:
    # a kind is never forgotten); past it a credit is refused, never wrapped onto another
    # kind's code.
    WIDTHS = (np.uint8, np.uint16, np.uint32)

    def __init__(self) -> None:
        self.base = 0
        self.codes = np.zeros(0, self.WIDTHS[0])
        self.kinds: list[Kind] = [(0, None, None)]  # code -> kind
        self._code_of: dict[Kind, int] = {self.kinds[0]: 0}  # kind -> code: a credit's look-up, O(1)
        self._counts: list[int] | None = [0]  # code -> indexes holding it

    def _code(self, kind: Kind) -> int:
        code = self._code_of.get(kind)
        if code is None:
            code = len(self.kinds)
            if code > np.iinfo(self.codes.dtype).max:
                wider = next((width for width in self.WIDTHS if code <= np.iinfo(width).max), None)
                if wider is None:
                    raise ValueError(f"a credit of a kind past the {code - 1:,} kinds (item count, adapter set, "
                                     f"lora mode) one progress summary codes")
                self.codes = self.codes.astype(wider)
            self.kinds.append(kind)
            self._code_of[kind] = code
        return code

    def credit(self, indexes: np.ndarray, kind: Kind | int) -> None:
        """Credit a kind (or a plain item count) at each of these indexes (sorted)."""
        if isinstance(kind, int):
            kind = (kind, None, None)
        if not indexes.size:
            return
        low, high = int(indexes[0]), int(indexes[-1])
        if low < 0 or high > MAX_INDEX or kind[0] < 1:
            raise ValueError(f"a credit of {kind[0]} items at indexes {low}..{high}: outside what a segment holds")
        code = self._code(kind)
        end = self.base + self.codes.size
        if not self.codes.size or low < self.base or high >= end:
            base = low - low % self.CHUNK if not self.codes.size else min(self.base, low - low % self.CHUNK)
            # Grown geometrically, so a segment at a time costs amortised O(1) per index.
            size = max(high + 1, end) - base
            size = max(size, min(2 * self.codes.size, MAX_INDEX + 1 - base))
            grown = np.zeros(size, self.codes.dtype)
            grown[self.base - base:self.base - base + self.codes.size] = self.codes
            self.base, self.codes = base, grown
        self.codes[indexes - self.base if self.base else indexes] = code
        self._counts = None

    def has(self, index: int) -> bool:
        at = index - self.base
        return 0 <= at < self.codes.size and bool(self.codes[at])

    def counts(self) -> list[tuple[Kind, int]]:
        """(kind, batches credited with it), for each kind seen."""
        if self._counts is None:
            # np.bincount widens the codes it counts to 8 bytes each: a slice at a time,
            # so that copy stays a few MB, and one pass whatever the number of kinds.
            counts = np.zeros(len(self.kinds), np.int64)
            for start in range(0, self.codes.size, 16 * self.CHUNK):
                counts += np.bincount(self.codes[start:start + 16 * self.CHUNK], minlength=len(self.kinds))
            counts[0] = 0
            self._counts = counts.tolist()
        return list(zip(self.kinds[1:], self._counts[1:]))

    @property
    def done(self) -> int:
        return sum(kind[0] * count for kind, count in self.counts())


class ProgressSummary:
    """The reader: done and failed counts of a run, refreshed from what changed."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self._sizes: dict[str, int] = {}  # segment key -> size when read
        self._failures: dict[str, tuple[str, list[str]]] = {}  # key -> (batch id, item ids)
        self._failure_sets: dict[str, str | None] = {}  # key -> the failed batch's adapter set
        self._failed_roots: dict[str, set[str]] = {}  # root batch id -> item ids a failure names
        self._numbered: dict[tuple[str, str, int], _Numbered] = {}  # (queue, prefix, width)
        self._by_number: dict[tuple[str, int], list[_Numbered]] = {}  # (prefix, width): across queues
        self._plain: dict[str, tuple[str, int]] = {}  # plan batch id not numbered -> (queue, items)
        self._sets: dict[str, tuple[str, str | None]] = {}  # spelled-out batch or root -> (set, mode)
        self._derived: dict[str, str] = {}  # derived batch id -> its queue
        self._derived_roots: dict[str, tuple[str, set[str]]] = {}  # root -> (queue, item ids done)
        self.done = 0
        self.failed = 0
        self.done_per_queue: dict[str, int] = {}
        # Per adapter set digest (None: batches without adapters, and credits written
        # before credits named their set): items done, failed, and the lora modes seen.
        self.done_per_set: dict[str | None, int] = {}
        self.failed_per_set: dict[str | None, int] = {}
        self.modes_per_set: dict[str | None, set[str]] = {}
        # When an item was last done or failed (a segment's or a failure's time), as
        # written in OUT: whoever reads it, since whenever, sees the same. None: never.
        self.last_progress: float | None = None

    def _moved(self, at: float | None) -> None:
        if at is not None and (self.last_progress is None or at > self.last_progress):
            self.last_progress = at

    def refresh(self) -> ProgressSummary:
        """Read the segments and failures that changed and recount (a run with no
        segment yet has nothing done)."""
        with ThreadPoolExecutor(2) as pool:  # two listings, one round trip
            segments = pool.submit(lambda: list(self.storage.list_with_sizes(layout.PROGRESS_PREFIX)))
            failures = pool.submit(lambda: list(self.storage.list(layout.FAILURES_PREFIX)))
            segments, failures = segments.result(), failures.result()
        changed = [key for key, size in segments if key.endswith(".json") and self._sizes.get(key) != size]
        sizes = dict(segments)
        with ThreadPoolExecutor(DECODERS) as pool:
            # Decoding (inflating, summing gaps) leaves the GIL; crediting stays in this thread.
            for key, (numbered, spelled, sets, at) in _in_order(pool, _decode, self.storage.get_many(changed),
                                                                DECODERS * 2):
                self._sizes[key] = sizes[key]
                self._moved(at)
                for (queue, prefix, width), kind, indexes in numbered:
                    self._array(queue, prefix, width).credit(indexes, kind)
                for batch_id, (adapter_set, mode) in sets.items():
                    self._sets.setdefault(root_batch(batch_id), (adapter_set, mode))
                self._read_spelled(spelled)
        for key, body in self.storage.get_many(key for key in failures if key not in self._failures):
            failure = FailureRecord.model_validate_json(body)
            self._moved(failure.failed_at)
            self._failures[key] = (failure.batch_id, failure.item_ids)
            self._failure_sets[key] = failure.adapter_set
            self._failed_roots.setdefault(root_batch(failure.batch_id), set()).update(failure.item_ids)
        self._count()
        return self

    def _array(self, queue: str, prefix: str, width: int) -> _Numbered:
        array = self._numbered.get((queue, prefix, width))
        if array is None:
            array = self._numbered[(queue, prefix, width)] = _Numbered()
            self._by_number.setdefault((prefix, width), []).append(array)
        return array

    def _read_spelled(self, queues: dict[str, list[Credit]]) -> None:
        spelled: dict[tuple[str, str, int, int], list[int]] = {}  # v1's plan batches, folded in
        for queue, credits in queues.items():
            prefix, size, last_items, indexes = "", -1, 0, []  # the last numbered credit's, for the next
            for credit in credits:
                batch_id, items = credit[0], credit[1]
                # A v1 segment holds a queue's plan batches one after another: same prefix, width, items.
                if (len(batch_id) == size and items == last_items and batch_id.startswith(prefix)
                        and (digits := batch_id[len(prefix):]).isascii() and digits.isdigit()
                        and (index := int(digits)) <= MAX_INDEX):
                    indexes.append(index)
                elif "." in batch_id and len(credit) > 2:
                    if batch_id not in self._derived:
                        self._derived[batch_id] = queue
                        self._derived_roots.setdefault(root_batch(batch_id), (queue, set()))[1].update(credit[2])
                elif (number := plan_number(batch_id)) is not None:
                    prefix, size, last_items = number[0], len(batch_id), items
                    indexes = spelled.setdefault((queue, prefix, number[1], items), [])
                    indexes.append(number[2])
                else:
                    self._plain.setdefault(batch_id, (queue, items))
        for (queue, prefix, width, items), indexes in spelled.items():
            self._array(queue, prefix, width).credit(np.unique(np.asarray(indexes, dtype=np.int64)), items)

    def _covered(self, root: str) -> bool:
        """Whether a plan batch is credited whole."""
        number = plan_number(root)
        if number is None:
            return root in self._plain
        return any(array.has(number[2]) for array in self._by_number.get(number[:2], ()))

    def credited(self, batch_id: str) -> bool:
        """Whether this batch (plan or derived) has a credit."""
        return batch_id in self._derived if "." in batch_id else self._covered(batch_id)

    def settled(self, batch_id: str, item_ids: list[str]) -> bool:
        """Whether every item of this batch is done or failed (the feeder's look at what
        left the broker: a batch split or retried settles item by item)."""
        if self.credited(batch_id):
            return True
        root = root_batch(batch_id)
        done, failed = self._done_of(batch_id), self._failed_roots.get(root, ())
        return all(item in done or item in failed for item in item_ids)

    def _count(self) -> None:
        done_per_queue: dict[str, int] = {}
        for (queue, _, _), array in self._numbered.items():
            done_per_queue[queue] = done_per_queue.get(queue, 0) + array.done
        for queue, items in self._plain.values():
            done_per_queue[queue] = done_per_queue.get(queue, 0) + items
        uncovered = {root for root in self._derived_roots if not self._covered(root)}
        for root in uncovered:  # else the root's credit covers them all
            queue, ids = self._derived_roots[root]
            done_per_queue[queue] = done_per_queue.get(queue, 0) + len(ids)
        self.done_per_queue = done_per_queue
        self.done = sum(done_per_queue.values())
        self.failed = len(failed_items(self._failures.values(), self._done_of))
        self._count_sets(uncovered)

    def _count_sets(self, uncovered: set[str]) -> None:
        done: dict[str | None, int] = {}
        modes: dict[str | None, set[str]] = {}

        def add(adapter_set: str | None, mode: str | None, items: int) -> None:
            done[adapter_set] = done.get(adapter_set, 0) + items
            if mode:
                modes.setdefault(adapter_set, set()).add(mode)

        for array in self._numbered.values():
            for (items, adapter_set, mode), count in array.counts():
                if count:
                    add(adapter_set, mode, items * count)
        for batch_id, (_, items) in self._plain.items():
            add(*self._sets.get(batch_id, (None, None)), items)
        for root in uncovered:
            add(*self._sets.get(root, (None, None)), len(self._derived_roots[root][1]))
        by_set: dict[str | None, list[tuple[str, list[str]]]] = {}
        for key, failure in self._failures.items():
            by_set.setdefault(self._failure_sets.get(key), []).append(failure)
        self.done_per_set, self.modes_per_set = done, modes
        self.failed_per_set = {adapter_set: len(failed_items(failures, self._done_of))
                               for adapter_set, failures in by_set.items()}

    def _done_of(self, batch_id: str) -> Container[str]:
        """The items of this batch's root that credits show done."""
        root = root_batch(batch_id)
        if self._covered(root):
            return _EVERY_ITEM
        return self._derived_roots.get(root, ("", frozenset()))[1]


class _EveryItem:
    """What a plan batch credited whole holds: every one of its items is done."""

    def __contains__(self, item_id: object) -> bool:
        return True


_EVERY_ITEM = _EveryItem()


def reconcile(storage: Storage, recorded: dict[str, tuple[str, list[str]]]) -> int:
    """Credit every recorded batch the summary lacks; returns how many.

    `recorded` maps batch id -> (queue, item ids), from reading every record. A
    worker that died between record and credit is healed when its batch is
    delivered again; this covers a batch whose message was lost meanwhile. A
    record always means its batch is done, so crediting it is always right.
    """
    summary = ProgressSummary(storage).refresh()
    missing = [batch_id for batch_id in recorded if not summary.credited(batch_id)]
    if missing:
        writer = ProgressLog(storage, writer=f"reconcile-{secrets.token_hex(6)}")
        for batch_id in missing:
            queue, item_ids = recorded[batch_id]
            writer.add(batch_id, queue, item_ids)
        writer.flush()
        log.warning("credited %d recorded batches missing from the progress summary", len(missing))
    return len(missing)


# Storage trouble: why storing fails, told to whoever watches -----------------------
#
# The sink retries a failing store for minutes (worker/sink/store.py `_with_retry`); while it
# does, the user should see why, through a channel that still works when the store is
# what fails:
#   - a trouble note in OUT, `trouble/<writer>.json` (`TroubleNote`): written while a
#     writer's storing fails, deleted once it stores again. A store that refuses images
#     but takes a small file (a quota, a flaky object store) still gets it.
#   - a note in a local folder the embedded runner names (`LocalTroubleNote`, the
#     runner's broker folder): `diffq run` reads it even when OUT takes nothing.
#   - what a reader sees itself (`observed_trouble`): a local OUT whose disk has no
#     room left while items are pending is full, note or not.
# Shown only once storing has failed for longer than TROUBLE_AFTER_S: a blip is not news.

TROUBLE_AFTER_S = 60.0
TROUBLE_PREFIX = "trouble/"  # not under progress/: segment readers never see a note
# A writer in trouble rewrites its note at most this often (its `at`), on a retry.
TROUBLE_REFRESH_S = 30.0
# A note not rewritten for this long is from a writer that is gone (or whose notes fail
# too): not shown, `observed_trouble` covers what a reader can see for itself.
TROUBLE_STALE_S = 3 * TROUBLE_REFRESH_S
# A note is first written once storing has failed this long (a blip writes nothing).
TROUBLE_NOTE_AFTER_S = TROUBLE_AFTER_S / 2
# The local folder for notes, where a parent sets it (the embedded runner, for its
# workers and their sink helpers, which inherit it).
TROUBLE_DIR_ENV = "DIFFQ_TROUBLE_DIR"
# A local OUT's disk with less room than this, items pending: storage full.
FULL_BELOW_BYTES = 1 << 20
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_REFUSED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class Trouble:
    """Storing failing: why (`trouble_reason`), since when and last seen (wall clock)."""

    reason: str
    since: float
    at: float

    def failing_s(self, now: float) -> float:
        return max(0.0, now - self.since)

    def shown(self, now: float) -> bool:
        """Failing long enough to tell the user, and not a note left by a writer long gone."""
        return self.failing_s(now) > TROUBLE_AFTER_S and now - self.at < TROUBLE_STALE_S

    def message(self, now: float) -> str:
        return f"{self.reason} — waiting, {int(self.failing_s(now) // 60)} min"

    def to_json(self) -> bytes:
        return json.dumps({"reason": self.reason, "since": self.since, "at": self.at}).encode()

    @classmethod
    def from_json(cls, body: bytes) -> Trouble | None:
        try:
            data = json.loads(body)
            return cls(reason=str(data["reason"]), since=float(data["since"]), at=float(data["at"]))
        except (ValueError, KeyError, TypeError):
            return None


def trouble_reason(exc: BaseException) -> str:
    """What a store failure means to a user: "storage full: No space left on device",
    from the errno where the error (or one it was raised from) carries one."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        code = getattr(cause, "errno", None)
        if isinstance(cause, OSError) and isinstance(code, int) and code > 0:
            text = os.strerror(code)
            if code in _FULL_ERRNOS:
                return f"storage full: {text}"
            if code in _REFUSED_ERRNOS:
                return f"storage refused: {text}"
            if isinstance(cause, (ConnectionError, TimeoutError)):
                return f"storage unreachable: {text}"
            return f"storage failing: {text}"
        if isinstance(cause, (ConnectionError, TimeoutError)) or any(
                word in type(cause).__name__ for word in ("Connect", "Timeout", "Endpoint")):
            return f"storage unreachable: {_short(cause)}"
        cause = cause.__cause__ or cause.__context__
    return f"storage failing: {_short(exc)}"


def _short(exc: BaseException, most: int = 120) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= most else text[:most - 1] + "…"


class _Streak:
    """One run folder's failing stores in a row (the sink's writer thread only)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.reason = ""

    def fail(self, exc: BaseException, now: float) -> Trouble:
        if self.since is None:
            self.since = now
        self.reason = trouble_reason(exc)
        return Trouble(reason=self.reason, since=self.since, at=now)

    def clear(self) -> bool:
        """Whether there was trouble to clear."""
        was, self.since = self.since is not None, None
        return was


class TroubleNote:
    """The writer's side, one run folder: `failed(exc)` on every failed store,
    `stored()` on every one that succeeds. Notes are best effort: a note that cannot be
    written (the store takes nothing) is simply not there, and never raises.

    Notes go to OUT and, where `local` names a folder (the embedded runner's), there too."""

    def __init__(self, storage: Storage, writer: str | None = None, local: Path | str | None = None,
                 clock=time.time):
        self.storage = storage
        self.writer = writer or default_writer()
        self.key = f"{TROUBLE_PREFIX}{self.writer}.json"
        self.local = Path(local) / f"{self.writer}.json" if local else None
        self.clock = clock
        self._streak = _Streak()
        self._written_at: float | None = None  # when the note in OUT was last written
        self._in_out = False  # a note in OUT that has not been deleted yet
        self._reason = ""

    @property
    def trouble(self) -> Trouble | None:
        """The current streak, if storing is failing now."""
        if self._streak.since is None:
            return None
        return Trouble(reason=self._streak.reason, since=self._streak.since, at=self.clock())

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        trouble = self._streak.fail(exc, now)
        if trouble.failing_s(now) < TROUBLE_NOTE_AFTER_S:
            return
        if self.local is not None:
            _write_local(self.local, trouble.to_json())
        due = (self._written_at is None or now - self._written_at >= TROUBLE_REFRESH_S
               or trouble.reason != self._reason)
        if due:
            self._written_at, self._reason = now, trouble.reason  # tried: not again before the refresh
            try:
                self.storage.put_bytes(self.key, trouble.to_json(), content_type="application/json")
                self._in_out = True
            except Exception as note_exc:  # the store takes nothing: the local note and readers' eyes remain
                log.debug("trouble note not written to %s: %r", self.storage.url, note_exc)

    def stored(self) -> None:
        if not self._streak.clear() and not self._in_out:
            return
        self._written_at, self._reason = None, ""
        if self.local is not None:
            with contextlib.suppress(OSError):
                self.local.unlink(missing_ok=True)
        if self._in_out:
            try:
                self.storage.delete(self.key)
                self._in_out = False
            except Exception as note_exc:  # tried again on the next stored write
                log.debug("trouble note not deleted from %s: %r", self.storage.url, note_exc)


def _write_local(path: Path, body: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(body)
        os.replace(tmp, path)
    except OSError:  # that disk is full too: readers look at it themselves
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def recorded_troubles(storage: Storage) -> list[Trouble]:
    """The trouble notes in OUT (none when OUT cannot be listed: that is the reader's own trouble)."""
    try:
        keys = [key for key in storage.list(TROUBLE_PREFIX) if key.endswith(".json")]
        return [trouble for _, body in storage.get_many(keys) if (trouble := Trouble.from_json(body))]
    except Exception as exc:
        log.debug("trouble notes of %s not read: %r", storage.url, exc)
        return []


# A worker's model fetch leaves its line here while it runs ("fetching weights: 0.34 of
# 1.07 GB, retrying S3 (connection refused) for 0:20"; worker/device/fetch_patience.py).
FETCH_NOTE = "fetch-{pid}.txt"


def fetch_notes(folder: Path | str) -> list[str]:
    """The lines of the model fetches running on this node (`diffq run`'s bar)."""
    notes = []
    with contextlib.suppress(OSError):
        for path in sorted(Path(folder).glob(FETCH_NOTE.format(pid="*"))):
            if not _alive(path.stem.rpartition("-")[2]):
                continue  # a worker killed mid-fetch leaves its note behind: not a fetch now
            with contextlib.suppress(OSError):
                if note := path.read_text().strip():
                    notes.append(note)
    return notes


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def local_troubles(folder: Path | str) -> list[Trouble]:
    """The trouble notes in a local folder (`TroubleNote`'s `local`)."""
    troubles = []
    with contextlib.suppress(OSError):
        for path in Path(folder).glob("*.json"):
            with contextlib.suppress(OSError):
                if trouble := Trouble.from_json(path.read_bytes()):
                    troubles.append(trouble)
    return troubles


def observed_trouble(storage: Storage, pending: int, now: float | None = None) -> Trouble | None:
    """What a reader sees for itself: a local OUT on a disk with no room left while items
    are pending is full. Since when: the newest progress segment's time (the last batch
    stored), else the manifest's."""
    if pending <= 0:
        return None
    manifest = storage.local_path(layout.MANIFEST)
    if manifest is None:
        return None
    folder = manifest.parent
    try:
        if shutil.disk_usage(folder).free >= FULL_BELOW_BYTES:
            return None
    except OSError:
        return None
    now = time.time() if now is None else now
    times = []
    with contextlib.suppress(OSError):
        with os.scandir(folder / layout.PROGRESS_PREFIX) as entries:
            times = [entry.stat().st_mtime for entry in entries if entry.name.endswith(".json")]
    if not times:
        with contextlib.suppress(OSError):
            times = [manifest.stat().st_mtime]
    return Trouble(reason=f"storage full: {os.strerror(errno.ENOSPC)}", since=max(times, default=now), at=now)


def trouble_message(troubles: Iterable[Trouble | None], now: float | None = None) -> str | None:
    """What to tell the user: the longest-failing trouble shown now (`Trouble.shown`), or None."""
    now = time.time() if now is None else now
    shown = [trouble for trouble in troubles if trouble is not None and trouble.shown(now)]
    return min(shown, key=lambda trouble: trouble.since).message(now) if shown else None


def storage_trouble(storage: Storage, pending: int, now: float | None = None) -> str | None:
    """`status` and `watch`: why storing into OUT has been failing, from its notes and the
    reader's own look at a local OUT's disk; None when nothing is to be said."""
    if pending <= 0:
        return None
    now = time.time() if now is None else now
    return trouble_message([*recorded_troubles(storage), observed_trouble(storage, pending, now)], now)
