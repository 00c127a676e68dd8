"""A model in object storage, fetched into the node-local cache (DIFFQ_MODEL_CACHE).

    fetched = fetch("s3://models/flux2-klein")   # -> Fetched(path=..., hit=False, ...)
    DiffusionPipeline.from_pretrained(fetched.path)

One cache entry per model URL and revision (core/model_store.py): a model changed
under the same prefix is another entry. Each file is fetched into a part name in
pieces (byte ranges of PART_BYTES, or its multipart upload's parts where the check is
over parts), consecutive pieces one GET up to RUN_BYTES, as many streams side by side
as raise the rate (_Streams), each piece
hashed as it is written (no second read); each completed piece is recorded next to
the part file (`_Ranges`), so a cut, a worker restart or a SIGKILL resumes inside the
file. The whole file is checked against the store's checksum (worker/device/
store_checksums.py) before it is renamed into place. A file at its name is complete and
verified. A dropped connection, a timeout, a 5xx, SlowDown or a 429 is waited out, the
stream continuing from its last byte, for as long as DIFFQ_MODEL_FETCH_PATIENCE_S
(worker/device/fetch_patience.py); what cannot heal fails at once, naming the file.
The `.complete` marker is written last; nothing loads an entry without it.

Two flocks per entry: `fetch` (held while fetching: the node's other processes wait
and then find the entry complete) and `use` (shared, held for the life of each
process that loaded the entry: eviction takes it exclusively, without waiting, so an
entry in use is never evicted).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diffq.core.contract import model_slug
from diffq.core.model_store import (ModelListing, ModelStoreError, RemoteFile, StoreUnreachable, list_model,
                                    model_storage)
from diffq.core.settings import Settings, get_settings
from diffq.core.storage import BucketStorage
from diffq.worker.device import faults
from diffq.worker.device.fetch_patience import Patience, backoff, from_store, transient
from diffq.worker.device.store_checksums import Expectation, expectation

log = logging.getLogger("diffq.worker")

COMPLETE = ".complete"
PART_PREFIX = ".diffq-part-"
# A file is recorded in pieces of this size (or its upload's parts) as they come in: a
# piece in flight is what a restart fetches again. Why 64 MiB: one stream of S3 or GCS
# carries ~100 MB/s, so a piece is ~0.6 s of a stream, and 16 streams leave ~1 GB to
# fetch again after a SIGKILL at most (a cut within a process: nothing).
PART_BYTES = 64 * 1024 * 1024
# Consecutive pieces of one file are one GET up to this size: few requests (a ranged GET
# costs a request and, on some servers, much more: moto reads the whole object for each
# range), and still a big file's tail side by side. One stream of S3 or GCS carries
# ~100 MB/s: a run is ~5 s. Measured on loopback moto only (docs/BENCHMARKS.md).
RUN_BYTES = 512 * 1024 * 1024
# Each process keeps the `use` lock of every entry it loaded (fd) until it exits.
_IN_USE: dict[Path, int] = {}


class FetchRefused(ModelStoreError):
    """A model that may not be used: corrupt, changed since pinned, too big for the cache."""


@dataclass(frozen=True)
class Fetched:
    url: str
    revision: str
    path: str  # the local diffusers folder
    hit: bool
    bytes: int  # downloaded now (0 on a hit)
    seconds: float
    files: tuple[str, ...] = ()  # the keys downloaded now

    @property
    def mb_per_s(self) -> float:
        return round(self.bytes / 1e6 / self.seconds, 1) if self.seconds > 0 and self.bytes else 0.0

    def report(self) -> dict:
        return {"model": self.url, "revision": self.revision, "hit": self.hit, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "mb_per_s": self.mb_per_s}


def entry_name(url: str, revision: str) -> str:
    digest = hashlib.sha256(f"{url}\n{revision}".encode()).hexdigest()[:20]
    return f"{model_slug(url)}-{digest}"


def fetch(url: str, revision: str | None = None, *, settings: Settings | None = None,
          only: str | None = None) -> Fetched:
    """The model at `url` in the node-local cache, fetched unless an entry is complete.
    With `revision` (the run's pin), the store must still hold that revision. With
    `only`, the one file of that name under `url` (a LoRA adapter, core/adapters.py)."""
    settings = settings or get_settings()
    started = time.perf_counter()
    storage = model_storage(url, settings)
    listing = _list(url, settings, storage, only)
    if revision is not None and listing.revision != revision:
        what = f"adapter {url.rstrip('/')}/{only}" if only else f"model {url}"
        raise FetchRefused(f"{what} changed since the run pinned it: revision {listing.revision} in the "
                           f"store, {revision} pinned; submit a new run for the new revision")
    if clash := [f.key for f in listing.files if f.key == COMPLETE or Path(f.key).name.startswith(PART_PREFIX)]:
        raise FetchRefused(f"model {url}: {clash[0]} is a name the model cache keeps for itself")
    root = Path(settings.model_cache)
    root.mkdir(parents=True, exist_ok=True)
    entry = root / entry_name(listing.url, listing.revision)
    fetch_lock = _lock(entry.with_name(entry.name + ".fetch.lock"), fcntl.LOCK_EX)
    try:
        hit = (entry / COMPLETE).is_file()
        if hit:
            os.utime(entry / COMPLETE)  # least recently used: by the marker's mtime
            done: tuple[str, ...] = ()
            fetched = 0
        else:
            _make_room(root, listing.size, settings, keep=entry)
            done = _fetch_entry(storage, listing, entry, settings)
            fetched = sum(f.size for f in listing.files if f.key in set(done))
            _write_marker(entry, listing)
        _hold_in_use(entry)
    finally:
        os.close(fetch_lock)
    return Fetched(url=listing.url, revision=listing.revision, path=str(entry), hit=hit,
                   bytes=fetched, seconds=time.perf_counter() - started, files=done)


def _list(url: str, settings: Settings, storage, only: str | None = None) -> ModelListing:
    """The model's listing, waited out while the store cannot be reached."""
    patience = Patience(storage.service, url, settings.model_fetch_patience_s, total=0)
    sleeps = None
    try:
        while True:
            try:
                return list_model(url, settings, storage, only=only)
            except StoreUnreachable as exc:
                cause = exc.__cause__ or exc
                if transient(cause) is None:
                    raise
                sleeps = sleeps or backoff()
                patience.wait(cause, "the listing", sleeps)
    finally:
        patience.close()


def _lock(path: Path, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _hold_in_use(entry: Path) -> None:
    if entry not in _IN_USE:
        _IN_USE[entry] = _lock(entry.with_name(entry.name + ".use.lock"), fcntl.LOCK_SH)


def _write_marker(entry: Path, listing: ModelListing) -> None:
    tmp = entry / f"{PART_PREFIX}{COMPLETE}"
    tmp.write_text(json.dumps({"url": listing.url, "revision": listing.revision, "bytes": listing.size,
                               "files": len(listing.files), "at": time.time()}))
    os.replace(tmp, entry / COMPLETE)


def _fetch_entry(storage, listing: ModelListing, entry: Path, settings: Settings) -> tuple[str, ...]:
    """Download every file not already in place; the keys downloaded."""
    entry.mkdir(parents=True, exist_ok=True)
    missing = [f for f in listing.files if not _in_place(entry, f)]
    _clear_stale(entry, missing)
    if not missing:
        return ()
    store = _Store(storage, listing.url)
    resumed = sum(_Ranges.bytes_done(_part(entry, f)) for f in missing)
    patience = Patience(store.name, listing.url, settings.model_fetch_patience_s,
                        total=sum(f.size for f in missing), done=resumed)
    if resumed:
        log.warning("fetching weights: %.2f of %.2f GB already here from a fetch before; resuming", resumed / 1e9,
                    patience.total / 1e9)
    try:
        _fetch_files(store, missing, entry, settings.model_fetch_threads, patience)
    finally:
        patience.close()
    return tuple(f.key for f in missing)


def _in_place(entry: Path, file: RemoteFile) -> bool:
    # Only a verified file is renamed to its name, and the entry is one revision.
    path = entry / file.key
    return path.is_file() and path.stat().st_size == file.size


def _part(entry: Path, file: RemoteFile) -> Path:
    final = entry / file.key
    final.parent.mkdir(parents=True, exist_ok=True)
    return final.with_name(PART_PREFIX + final.name)


def _clear_stale(entry: Path, missing: list[RemoteFile]) -> None:
    """Remove a killed fetch's leftovers but the partial files of missing files whose
    completed ranges are recorded (their `.ranges`): those are resumed."""
    keep = set()
    for file in missing:
        part = _part(entry, file)
        if _Ranges.path(part).is_file():
            keep.update((part, _Ranges.path(part)))
    for stale in entry.rglob(f"{PART_PREFIX}*"):
        if stale not in keep:
            stale.unlink(missing_ok=True)


class _Ranges:
    """A partial file's completed pieces, kept next to it (`<part>.ranges`): the pieces
    (offset, length) it is fetched in, what check they serve, and each completed
    piece's digest. Rewritten (write, rename) after each piece: a cut, a restart or a
    SIGKILL keeps every completed piece, and their digests make the whole file's
    checksum without reading them again. (Not fsynced: a SIGKILL or a pod restart
    keeps the page cache; a node that loses power loses its node-local cache anyway.)"""

    def __init__(self, part: Path, layout: dict):
        self.part, self.layout = part, json.loads(json.dumps(layout))  # as it reads back: lists
        self.digests: dict[int, bytes] = {}
        self._lock = threading.Lock()
        try:
            saved = json.loads(self.path(part).read_text())
            if saved.get("layout") == self.layout and part.is_file():
                self.digests = {int(i): bytes.fromhex(d) for i, d in saved["done"].items()}
        except FileNotFoundError:
            pass  # a file not begun before
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            # A record cut short or unreadable: its pieces are fetched again, and said so.
            log.warning("fetching weights: %s: its record of completed pieces cannot be read (%s: %s); "
                        "fetching the file from its start", part.name.removeprefix(PART_PREFIX),
                        type(exc).__name__, exc)

    @staticmethod
    def path(part: Path) -> Path:
        return part.with_name(part.name + ".ranges")

    @classmethod
    def bytes_done(cls, part: Path) -> int:
        try:
            saved = json.loads(cls.path(part).read_text())
            pieces = saved["layout"]["pieces"]
            return sum(pieces[int(i)][1] for i in saved["done"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return 0

    def add(self, index: int, digest: bytes) -> int:
        """Piece `index` is complete; the number of pieces complete."""
        with self._lock:
            self.digests[index] = digest
            body = json.dumps({"layout": self.layout, "done": {i: d.hex() for i, d in self.digests.items()}})
            tmp = self.part.with_name(self.part.name + ".ranges.tmp")
            tmp.write_text(body)
            os.replace(tmp, self.path(self.part))
            return len(self.digests)

    def remove(self) -> None:
        self.path(self.part).unlink(missing_ok=True)


class _FileFetch:
    """One file: its check, its pieces, the partial file they are written into."""

    def __init__(self, file: RemoteFile, entry: Path, expect: Expectation, url: str):
        self.file, self.expect, self.url = file, expect, url
        self.final, self.part = entry / file.key, _part(entry, file)
        self.pieces = expect.pieces(file.size, PART_BYTES)
        self.ranges = _Ranges(self.part, {"size": file.size, "pieces": self.pieces, "kind": expect.kind,
                                          "algorithm": expect.algorithm})
        if not self.ranges.digests:
            self.part.unlink(missing_ok=True)  # bytes of another layout: none kept
        self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, file.size)

    def todo(self) -> list[int]:
        return [i for i in range(len(self.pieces)) if i not in self.ranges.digests]

    def piece_done(self, index: int, digest: bytes) -> bool:
        """True when it was the last piece: the file is checked and renamed into place."""
        if self.ranges.add(index, digest) < len(self.pieces):
            return False
        os.close(self.fd)
        self.fd = -1
        digests = [self.ranges.digests[i] for i in range(len(self.pieces))]
        size = self.part.stat().st_size
        if size != self.file.size:
            raise FetchRefused(f"model {self.url}: file {self.file.key} is {size} bytes, the store lists "
                               f"{self.file.size}")
        if problem := self.expect.problem(digests, self.pieces, self.part, self.file.key):
            self.part.unlink(missing_ok=True)
            self.ranges.remove()
            raise FetchRefused(f"model {self.url}: file {self.file.key} is corrupt: {problem}; not loaded")
        os.replace(self.part, self.final)
        self.ranges.remove()
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fetch_files(store, files: list[RemoteFile], entry: Path, threads: int, patience: Patience) -> None:
    """Every file's check looked up, then every missing piece fetched, the biggest files
    first, as many streams side by side as pay (_Streams); each file checked and renamed
    into place when its last piece is in."""
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="diffq-fetch")
    fetches: list[_FileFetch] = []
    try:
        expects = list(pool.map(lambda f: _patiently(patience, store, f, lambda: store.expectation(f)), files))
        fetches = [_FileFetch(f, entry, e, store.url) for f, e in zip(files, expects)]
        streams = _Streams(threads)
        counts = {"placed": 0, "pieces": 0}
        count_lock = threading.Lock()

        def piece_done(fetch: _FileFetch, index: int, digest: bytes) -> None:
            placed = fetch.piece_done(index, digest)
            with count_lock:
                counts["pieces"] += 1
                faults.fetch_piece(counts["pieces"])
                if placed:
                    counts["placed"] += 1
                    faults.fetch_progress(counts["placed"])

        def one(fetch: _FileFetch, run: list[int]) -> None:
            _fetch_run(store, fetch, run, patience, streams, piece_done)

        for fetch in fetches:  # every piece in already (a kill before the rename)
            if not fetch.todo():
                fetch.ranges.digests.pop(len(fetch.pieces) - 1)
        work = [(f, run) for f in sorted(fetches, key=lambda f: -f.file.size) for run in _runs(f)]
        futures = [pool.submit(one, f, run) for f, run in work]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for fetch in fetches:
            fetch.close()


def _patiently(patience: Patience, store, file: RemoteFile, call):
    """`call()`, waited out while it fails in a way that may heal."""
    sleeps = None
    while True:
        try:
            return call()
        except Exception as exc:
            _unless_it_may_heal(exc, store, file)
            sleeps = sleeps or backoff()
            patience.wait(exc, file.key, sleeps)


def _unless_it_may_heal(exc: Exception, store: _Store, file: RemoteFile) -> None:
    """Return when `exc` may heal (the caller waits and tries again); else raise what the
    fetch ends with: a refusal as it is, the store's answer as a refusal naming the file,
    anything else of this node's (a disk full, a bug) as it is."""
    if isinstance(exc, FetchRefused):
        raise exc
    if transient(exc) is None:
        if from_store(exc):
            raise store.refusal(exc, file) from exc
        raise exc


def _runs(fetch: _FileFetch) -> list[list[int]]:
    """The file's missing pieces as runs of consecutive pieces up to RUN_BYTES: one GET
    each (a file up to RUN_BYTES is one GET; a bigger one several side by side)."""
    runs: list[list[int]] = []
    for index in fetch.todo():
        length = fetch.pieces[index][1]
        last = runs[-1] if runs else None
        if (last and last[-1] == index - 1
                and sum(fetch.pieces[i][1] for i in last) + length <= max(RUN_BYTES, length)):
            last.append(index)
        else:
            runs.append([index])
    return runs


def _fetch_run(store, fetch: _FileFetch, run: list[int], patience: Patience, streams: _Streams, piece_done) -> None:
    """Consecutive pieces, one ranged GET, into their place in the partial file; each
    piece hashed as it is written and recorded (`piece_done`) as soon as it is in. A
    dropped stream continues from its last byte after a wait (Patience)."""
    start = fetch.pieces[run[0]][0]
    end = fetch.pieces[run[-1]][0] + fetch.pieces[run[-1]][1]
    at = 0  # which piece of the run is being hashed
    hasher = fetch.expect.hasher()
    into = 0  # bytes of that piece hashed
    got = 0
    sleeps, stalled_at = None, -1

    def next_piece() -> None:
        nonlocal at, hasher, into
        while at < len(run) and into == fetch.pieces[run[at]][1]:  # (a 0-byte piece is in at once)
            piece_done(fetch, run[at], hasher.digest() if hasher is not None else b"")
            at, hasher, into = at + 1, fetch.expect.hasher(), 0

    def sink(chunk: memoryview) -> None:
        nonlocal got, into
        n = len(chunk)
        if start + got + n > end:
            raise FetchRefused(f"model {store.url}: file {fetch.file.key}: the store sent more than asked for")
        written = 0
        while written < n:
            written += os.pwrite(fetch.fd, chunk[written:], start + got + written)
        got += n
        while len(chunk):
            take = min(len(chunk), fetch.pieces[run[at]][1] - into)
            if hasher is not None:
                hasher.update(chunk[:take])
            into += take
            chunk = chunk[take:]
            next_piece()
        patience.moved(n)
        streams.moved(n)

    next_piece()
    while start + got < end:
        try:
            with streams:
                store.read(fetch.file, start + got, end - 1, sink)
            if start + got < end:
                raise ConnectionResetError(f"the stream ended at {start + got} of {end} bytes")
        except Exception as exc:
            _unless_it_may_heal(exc, store, fetch.file)
            if got != stalled_at:  # bytes came since the last wait: the backoff starts over
                sleeps, stalled_at = backoff(), got
            patience.wait(exc, fetch.file.key, sleeps)


class _Streams:
    """How many whole-object GETs run at once. It starts at STREAMS_START and doubles
    while a doubling raises the bytes per second by a quarter or more (measured over
    STREAMS_WINDOW), up to `most`; when one does not, it goes back and stays. A real
    store gives each stream ~100 MB/s and wants many; an emulator or a small node is
    slower with more: neither is oversubscribed."""

    def __init__(self, most: int):
        self.most = max(1, most)
        self.limit = min(STREAMS_START, self.most)
        self.running = 0
        self.settled = self.limit >= self.most
        self.gate = threading.Condition()
        self.window_bytes = 0
        self.window_start = time.perf_counter()
        self.previous: tuple[int, float] | None = None  # (limit, bytes/s) of the window before

    def __enter__(self):
        with self.gate:
            self.gate.wait_for(lambda: self.running < self.limit)
            self.running += 1
        return self

    def __exit__(self, *exc):
        with self.gate:
            self.running -= 1
            self.gate.notify_all()

    def moved(self, n: int) -> None:
        """`n` bytes more: the count may change, and a stream over it pauses here
        (its connection idle, resumed by a Range if the store drops it)."""
        if self.settled and self.running <= self.limit:
            return
        with self.gate:
            if not self.settled:
                self._measure(n)
            if self.running > self.limit:  # after a step back: until another stream ends
                self.running -= 1
                self.gate.wait_for(lambda: self.running < self.limit)
                self.running += 1

    def _measure(self, n: int) -> None:
        self.window_bytes += n
        elapsed = time.perf_counter() - self.window_start
        if elapsed < STREAMS_WINDOW:
            return
        rate = self.window_bytes / elapsed
        log.debug("model fetch: %d streams, %.0f MB/s", self.limit, rate / 1e6)
        if self.previous and rate < self.previous[1] * 1.25:
            # The doubling did not pay: back to the count before, for good.
            self.limit = self.previous[0]
            self.settled = True
        else:
            self.previous = (self.limit, rate)
            self.limit = min(self.limit * 2, self.most)
            self.settled = self.limit >= self.most and self.previous[0] >= self.most
        self.window_bytes, self.window_start = 0, time.perf_counter()
        self.gate.notify_all()


STREAMS_START = 1
STREAMS_WINDOW = 0.25  # seconds


# The store ---------------------------------------------------------------------------
class _Store:
    """The model's bucket as the fetch reads it: the listed objects' checksums and ranged
    reads of exactly them (core/storage/: S3Storage, GCSStorage), and what a refusal says."""

    def __init__(self, storage: BucketStorage, url: str):
        self.storage, self.url, self.name = storage, url, storage.service

    def refusal(self, exc, file: RemoteFile) -> Exception:
        """A 412 (the object is no longer the one listed) as a refusal naming the file; a
        403, 404 or any other answer that cannot heal as a ModelStoreError naming it."""
        if self.storage.changed_since_listed(exc):
            return FetchRefused(f"model {self.url}: file {file.key} changed since the model was listed; fetch again")
        return ModelStoreError(f"model {self.url}: file {file.key}: {exc}")

    def expectation(self, file: RemoteFile) -> Expectation:
        stored = self.storage.stored_checksums(file)
        if stored.parts and sum(stored.parts) != file.size:
            raise FetchRefused(f"model {self.url}: file {file.key}: its parts add up to {sum(stored.parts)} bytes, "
                               f"the store lists {file.size}")
        return expectation(stored)

    def read(self, file: RemoteFile, first: int, last: int, sink) -> None:
        self.storage.read_pinned(file, first, last, sink)


# The size cap ------------------------------------------------------------------------
def _make_room(root: Path, needed: int, settings: Settings, keep: Path) -> None:
    """Evict least recently used entries, never one a process holds, until `needed`
    bytes fit under DIFFQ_MODEL_CACHE_MAX_GB."""
    if settings.model_cache_max_gb is None:
        return
    cap = int(settings.model_cache_max_gb * 1e9)
    if needed > cap:
        raise FetchRefused(f"model needs {needed / 1e9:.2f} GB, more than DIFFQ_MODEL_CACHE_MAX_GB "
                           f"({settings.model_cache_max_gb} GB)")
    entries = [p for p in root.iterdir() if p.is_dir() and p != keep]
    sizes = {p: _tree_size(p) for p in entries}
    used = sum(sizes.values())  # what `keep` holds already is part of `needed`
    for entry in sorted(entries, key=_last_used):
        if used + needed <= cap:
            return
        if _evict(entry):
            used -= sizes[entry]


def _last_used(entry: Path) -> float:
    marker = entry / COMPLETE
    return marker.stat().st_mtime if marker.exists() else 0.0  # incomplete ones go first


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _evict(entry: Path) -> bool:
    """Remove an entry that no process fetches or uses; False when one does."""
    locks = []
    try:
        for suffix in (".fetch.lock", ".use.lock"):
            locks.append(_lock(entry.with_name(entry.name + suffix), fcntl.LOCK_EX | fcntl.LOCK_NB))
        (entry / COMPLETE).unlink(missing_ok=True)  # first: never a marker over missing files
        shutil.rmtree(entry, ignore_errors=True)
        return True
    except BlockingIOError:
        return False
    finally:
        for fd in locks:
            os.close(fd)
