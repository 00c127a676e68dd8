"""A model in object storage, fetched into the node-local cache (DIFFQ_MODEL_CACHE).

    fetched = fetch("s3://models/flux2-klein")   # -> Fetched(path=..., hit=False, ...)
    DiffusionPipeline.from_pretrained(fetched.path)

One cache entry per model URL and revision (core/model_store.py): a model changed
under the same prefix is another entry. Each file is downloaded to a part name,
checked against its listed size and the store's checksum, then renamed into place.
S3: a file up to WHOLE_BYTES is one GET (If-Match its listed ETag), checked as its
bytes are written (no second read), with as many streams side by side as raise the
rate (_Streams); a bigger one goes to boto3's transfer manager (a TransferConfig of
PART_BYTES parts) and is checked after. GCS: google-cloud-storage's
`transfer_manager` (threads), checked after. A file at its name is
complete and verified, so a fetch killed part-way resumes with what is missing. The
`.complete` marker is written last; nothing loads an entry without it.

Two flocks per entry: `fetch` (held while fetching: the node's other processes wait
and then find the entry complete) and `use` (shared, held for the life of each
process that loaded the entry: eviction takes it exclusively, without waiting, so an
entry in use is never evicted).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diffq.core.contract import model_slug
from diffq.core.model_store import ModelListing, ModelStoreError, RemoteFile, list_model, model_storage
from diffq.core.settings import Settings, get_settings
from diffq.worker.delivery import faults

log = logging.getLogger("diffq.worker")

COMPLETE = ".complete"
PART_PREFIX = ".diffq-part-"
_HASH_CHUNK = 8 * 1024 * 1024
# A file bigger than this (GCS) or than WHOLE_BYTES (S3) is fetched in ranged parts of
# this size, several at once.
PART_BYTES = 64 * 1024 * 1024
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


def fetch(url: str, revision: str | None = None, *, settings: Settings | None = None) -> Fetched:
    """The model at `url` in the node-local cache, fetched unless an entry is complete.
    With `revision` (the run's pin), the store must still hold that revision."""
    settings = settings or get_settings()
    started = time.perf_counter()
    storage = model_storage(url, settings)
    listing = list_model(url, settings, storage)
    if revision is not None and listing.revision != revision:
        raise FetchRefused(f"model {url} changed since the run pinned it: revision {listing.revision} in the "
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
    for stale in entry.rglob(f"{PART_PREFIX}*"):  # a killed fetch's partial files
        stale.unlink(missing_ok=True)
    missing = [f for f in listing.files if not _in_place(entry, f)]
    if not missing:
        return ()
    fetcher = _fetch_s3 if storage.scheme == "s3" else _fetch_gcs
    fetcher(storage, missing, entry, settings.model_fetch_threads, listing.url)
    return tuple(f.key for f in missing)


def _in_place(entry: Path, file: RemoteFile) -> bool:
    # Only a verified file is renamed to its name, and the entry is one revision.
    path = entry / file.key
    return path.is_file() and path.stat().st_size == file.size


def _part(entry: Path, file: RemoteFile) -> Path:
    final = entry / file.key
    final.parent.mkdir(parents=True, exist_ok=True)
    return final.with_name(PART_PREFIX + final.name)


class _Finisher:
    """Checks each downloaded part (size, checksum) in a thread pool and renames it into
    place; the first corrupt file refuses the fetch, naming it. (S3's whole-object
    streams check as they write, and only `place`.)"""

    def __init__(self, entry: Path, url: str, threads: int, check):
        self.entry, self.url, self.check = entry, url, check
        self.pool = ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1)), thread_name_prefix="diffq-verify")
        self.futures = []
        self.done = 0
        self._count = threading.Lock()

    def submit(self, file: RemoteFile) -> None:
        self.futures.append(self.pool.submit(self._finish, file))

    def _finish(self, file: RemoteFile) -> None:
        part = _part(self.entry, file)
        size = part.stat().st_size
        if size != file.size:
            raise FetchRefused(f"model {self.url}: file {file.key} is {size} bytes, the store lists {file.size}")
        if problem := self.check(file, part):
            part.unlink(missing_ok=True)
            raise FetchRefused(f"model {self.url}: file {file.key} is corrupt: {problem}; not loaded")
        self.place(file)

    def place(self, file: RemoteFile) -> None:
        """A checked part renamed into place."""
        os.replace(_part(self.entry, file), self.entry / file.key)
        with self._count:
            self.done += 1
            faults.fetch_progress(self.done)

    def wait(self) -> None:
        try:
            for future in self.futures:
                future.result()
        finally:
            self.pool.shutdown(cancel_futures=True)


# S3 --------------------------------------------------------------------------------
# Files up to WHOLE_BYTES are fetched whole: one GET each, If-Match the listed ETag,
# read straight into a buffer, written and checked as the bytes arrive (no second read).
# Bigger files go to boto3's transfer manager in ranged parts of PART_BYTES, side by
# side, and are checked after. Streams run side by side, as many as pay (_Streams).
# Why 512 MiB: one stream of S3 or GCS carries ~100 MB/s, so a 512 MiB file alone is
# ~5 s; files side by side fill the link, the biggest go first so the last is short,
# and bigger files (a diffusers model's 5-10 GB shards) are split so that the tail
# stays short too. A ranged part costs a request and, on some servers (moto reads the
# whole object for each range), much more. Measured on loopback moto only
# (docs/BENCHMARKS.md); a real bucket from a node with real cores is still to measure.
WHOLE_BYTES = 512 * 1024 * 1024
_STREAM_CHUNK = 1024 * 1024  # fits the caches: 8 MiB measured slower (docs/BENCHMARKS.md)
_STREAM_ATTEMPTS = 5
# The cheapest stored checksum first: CRC32C ~4 GB/s, CRC32 ~1.5-5 GB/s, SHA1/SHA256
# ~2 GB/s with SHA extensions, MD5 ~0.8 GB/s per core (docs/BENCHMARKS.md).
_ALGORITHMS = ("CRC32C", "CRC32", "SHA1", "SHA256")


def _fetch_s3(storage, files: list[RemoteFile], entry: Path, threads: int, url: str) -> None:
    client = storage.client()
    whole = sorted((f for f in files if f.size <= WHOLE_BYTES), key=lambda f: -f.size)  # longest first
    big = [f for f in files if f.size > WHOLE_BYTES]
    heads = _s3_heads(storage, big, threads) if big else {}
    finisher = _Finisher(entry, url, threads, lambda f, part: _s3_problem(heads[f.key], part, f.key))
    try:
        if whole:
            _stream_s3(client, storage, whole, entry, threads, url, finisher)
        if big:
            _transfer_s3(client, storage, big, entry, threads, url, finisher)
    except BaseException:
        finisher.pool.shutdown(cancel_futures=True)
        raise
    finisher.wait()


def _transfer_s3(client, storage, files: list[RemoteFile], entry: Path, threads: int, url: str, finisher) -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from botocore.exceptions import FlexibleChecksumError

    # Ranged parts of PART_BYTES side by side; bigger parts and I/O chunks than the
    # defaults (8 MiB, 256 KiB) cut per-request overhead.
    config = TransferConfig(max_concurrency=threads, multipart_threshold=PART_BYTES,
                            multipart_chunksize=PART_BYTES, io_chunksize=2**20, num_download_attempts=5)
    with create_transfer_manager(client, config) as manager:
        # (s3transfer takes no If-Match: bytes of an upload since the HEAD fail its
        # checksums, and are refused as corrupt.)
        futures = [(f, manager.download(storage.bucket_name, storage.prefix + f.key, str(_part(entry, f))))
                   for f in files]
        try:
            for file, future in futures:
                try:
                    future.result()
                except FlexibleChecksumError as exc:  # botocore checked a stored checksum on the wire
                    raise FetchRefused(f"model {url}: file {file.key} is corrupt: {exc}; not loaded") from exc
                finisher.submit(file)
        except BaseException:
            for _, future in futures:
                future.cancel()
            raise


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


def _stream_s3(client, storage, files: list[RemoteFile], entry: Path, threads: int, url: str, finisher) -> None:
    streams = _Streams(threads)

    def one(file: RemoteFile) -> None:
        with streams:
            _get_whole(client, storage, file, _part(entry, file), url, streams.moved)
        finisher.place(file)

    with ThreadPoolExecutor(max(1, min(threads, len(files))), thread_name_prefix="diffq-fetch") as pool:
        futures = [pool.submit(one, f) for f in files]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _get_whole(client, storage, file: RemoteFile, part: Path, url: str, moved) -> None:
    """One object into `part`, checked against the store's checksum (the GET's own
    checksum headers) as its bytes are written; a dropped stream continues where it
    stopped (a Range, If-Match)."""
    import http.client

    from botocore.exceptions import ClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from urllib3.exceptions import HTTPError as Urllib3Error

    check = None
    buffer = bytearray(_STREAM_CHUNK)
    view = memoryview(buffer)
    got = 0
    name = storage.prefix + file.key
    with part.open("wb", buffering=0) as out:
        for attempt in range(1, _STREAM_ATTEMPTS + 1):
            args = {"Bucket": storage.bucket_name, "Key": name}
            if file.etag:  # the object listed, never one uploaded since
                args["IfMatch"] = f'"{file.etag}"'
            if got:
                args["Range"] = f"bytes={got}-"
            else:  # the stored checksums come with the bytes: no HEAD
                args["ChecksumMode"] = "ENABLED"
            try:
                response = client.get_object(**args)
                if check is None:
                    check = _Check(_s3_info(client, storage, file, response))
            except ClientError as exc:
                raise _changed(exc, url, file) from exc
            body = response["Body"]
            # Straight from the socket into the buffer (http.client's readinto), past
            # urllib3's and botocore's copies; botocore's own checksum pass is skipped:
            # the check below is the same one.
            raw = getattr(body, "_raw_stream", None)
            readinto = getattr(getattr(raw, "_fp", None), "readinto", None)
            try:
                while got < file.size:
                    if readinto is not None:
                        n = readinto(view)
                        chunk = view[:n]
                    else:
                        chunk = memoryview(body.read(_STREAM_CHUNK))
                        n = len(chunk)
                    if not n:
                        break
                    written = 0
                    while written < n:
                        written += out.write(chunk[written:])
                    check.update(chunk)
                    got += n
                    moved(n)
            except (OSError, http.client.HTTPException, Urllib3Error, BotoConnectionError) as exc:
                if attempt == _STREAM_ATTEMPTS:
                    raise
                log.info("%s: the stream stopped at %d of %d bytes (%s); continuing", file.key, got, file.size, exc)
                continue
            finally:
                (raw or body).close()
            if got >= file.size:
                break
    if got != file.size:
        raise FetchRefused(f"model {url}: file {file.key} is {got} bytes, the store lists {file.size}")
    if check and (problem := check.problem(file.key)):
        part.unlink(missing_ok=True)
        raise FetchRefused(f"model {url}: file {file.key} is corrupt: {problem}; not loaded")


def _s3_heads(storage, files: list[RemoteFile], threads: int) -> dict[str, dict]:
    """Each file's stored checksums (full-object or, for a multipart upload, composite:
    over its parts' checksums) and, for a multipart ETag, its part size."""
    client = storage.client()
    with ThreadPoolExecutor(threads, thread_name_prefix="diffq-head") as pool:
        return dict(zip((f.key for f in files), pool.map(lambda f: _s3_head(client, storage, f), files)))


def _s3_head(client, storage, file: RemoteFile) -> dict:
    from botocore.exceptions import ClientError

    name = storage.prefix + file.key
    try:  # the object listed, not one uploaded since: its checksums are the listed bytes'
        response = client.head_object(Bucket=storage.bucket_name, Key=name, ChecksumMode="ENABLED",
                                      **({"IfMatch": f'"{file.etag}"'} if file.etag else {}))
    except ClientError as exc:
        raise _changed(exc, storage.url, file) from exc
    return _s3_info(client, storage, file, response)


def _s3_info(client, storage, file: RemoteFile, response: dict) -> dict:
    """What a HEAD or GET (ChecksumMode=ENABLED) of the listed object says of its
    checksums; for a multipart ETag, its part size (a HEAD of part 1)."""
    name = storage.prefix + file.key
    # An ETag is an MD5 only without KMS or customer-key encryption.
    encrypted = response.get("ServerSideEncryption", "").startswith("aws:kms") or response.get("SSECustomerAlgorithm")
    info = {"etag": response.get("ETag", "").strip('"'), "checksums": {}, "composite": {},
            "etag_is_md5": not encrypted}
    multipart = "-" in info["etag"]
    full_object = response.get("ChecksumType") == "FULL_OBJECT"
    for algorithm in _ALGORITHMS:
        value = response.get(f"Checksum{algorithm}")
        if not value:
            continue
        if "-" not in value and (full_object or not multipart):
            info["checksums"][algorithm] = value
        elif multipart and not full_object:
            # A multipart upload's checksum of its parts' checksums ("…-N"; moto
            # leaves out the "-N" and the type).
            info["composite"][algorithm] = value
    if multipart and not info["checksums"] and (info["composite"] or info["etag_is_md5"]):
        # (No If-Match: moto compares it with the part's own ETag. A part size of a newer
        # upload fails the check below: refused as corrupt, never loaded.)
        info["part_size"] = client.head_object(Bucket=storage.bucket_name, Key=name,
                                               PartNumber=1)["ContentLength"]
    return info


def _changed(exc, url: str, file: RemoteFile) -> Exception:
    """A 412 (the object is no longer the one listed) as a refusal naming the file; any
    other client error as it is."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status == 412 or exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
        return FetchRefused(f"model {url}: file {file.key} changed since the model was listed; fetch again")
    return exc


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)  # releases the GIL over 5 KiB

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


class _Crc32c:
    def __init__(self):
        import google_crc32c

        self.checksum = google_crc32c.Checksum()

    def update(self, data) -> None:
        self.checksum.update(bytes(data))  # it takes read-only buffers only

    def digest(self) -> bytes:
        return self.checksum.digest()


def _hasher(algorithm: str):
    if algorithm == "CRC32":
        return _Crc32()
    if algorithm == "CRC32C":
        return _Crc32c()
    return hashlib.new(algorithm.lower())  # SHA1, SHA256, MD5: release the GIL over 2 KiB


class _Check:
    """The store's checksum of one S3 object, computed over its bytes in order: the
    cheapest stored full-object checksum, else the stored composite one (over each
    part's), else the ETag (a single-part upload's MD5, or a multipart upload's MD5 of
    its parts' MD5s), else none (KMS with no stored checksum: the size only)."""

    def __init__(self, info: dict):
        self.etag = info["etag"]
        self.part_size = None
        self.parts: list[bytes] = []
        if full := next(((a, info["checksums"][a]) for a in _ALGORITHMS if a in info["checksums"]), None):
            self.kind, (self.algorithm, self.expected) = "full", full
        elif composite := next(((a, info["composite"][a]) for a in _ALGORITHMS if a in info.get("composite", {})),
                               None):
            self.kind, (self.algorithm, self.expected) = "composite", composite
            self.part_size = info["part_size"]
        elif info["etag_is_md5"]:
            self.kind, self.algorithm, self.expected = "etag", "MD5", self.etag
            if "-" in self.etag:
                self.part_size = info["part_size"]
        else:
            self.kind = None
        self.hasher = _hasher(self.algorithm) if self.kind else None
        self.left = self.part_size

    def update(self, data: memoryview) -> None:
        if self.hasher is None:
            return
        if not self.part_size:
            self.hasher.update(data)
            return
        while len(data):
            take = min(len(data), self.left)
            self.hasher.update(data[:take])
            self.left -= take
            data = data[take:]
            if not self.left:
                self.parts.append(self.hasher.digest())
                self.hasher, self.left = _hasher(self.algorithm), self.part_size

    def problem(self, name: str) -> str | None:
        if self.kind is None:
            log.warning("%s: KMS-encrypted with no stored checksum: only its size is checked (upload it with "
                        "a checksum, e.g. boto3 >= 1.36's default CRC32)", name)
            return None
        if self.part_size and self.left < self.part_size:  # the last, shorter part
            self.parts.append(self.hasher.digest())
        if not self.part_size:
            raw = self.hasher.digest()
        else:
            combined = _hasher(self.algorithm)
            combined.update(b"".join(self.parts))
            raw = combined.digest()
        if self.kind == "etag":
            got = raw.hex() + (f"-{len(self.parts)}" if self.part_size else "")
            return None if got == self.expected else f"ETag {got}, the store's {self.expected}"
        got = base64.b64encode(raw).decode()
        if self.kind == "composite":
            value, _, count = self.expected.partition("-")
            got += f"-{len(self.parts)}"
            ok = got.partition("-")[0] == value and (not count or int(count) == len(self.parts))
        else:
            ok = got == self.expected
        return None if ok else f"{self.algorithm} {got}, the store's {self.expected}"


def _s3_problem(info: dict, path: Path, key: str) -> str | None:
    """The check of a file already on disk (one the transfer manager wrote)."""
    check = _Check(info)
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(view):
            check.update(view[:n])
    return check.problem(key)


def _file_hash(path: Path, hasher):
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    return hasher


def _crc32c(path: Path) -> bytes:
    import google_crc32c

    return _file_hash(path, google_crc32c.Checksum()).digest()


# GCS -------------------------------------------------------------------------------
def _fetch_gcs(storage, files: list[RemoteFile], entry: Path, threads: int, url: str) -> None:
    from google.cloud.storage import transfer_manager

    bucket = storage.client().bucket(storage.bucket_name)

    def blob(file: RemoteFile):
        # The listed generation: exactly the revision listed, even if a newer one lands.
        return bucket.blob(storage.prefix + file.key, generation=int(file.version) if file.version else None)

    finisher = _Finisher(entry, url, threads, _gcs_problem)
    small = [f for f in files if f.size <= PART_BYTES]
    # Small files side by side, one stream each; a big one in chunks of PART_BYTES side by side.
    results = transfer_manager.download_many([(blob(f), str(_part(entry, f))) for f in small], max_workers=threads,
                                             worker_type=transfer_manager.THREAD, raise_exception=False)
    for file, result in zip(small, results):
        _gcs_outcome(file, result, url)
        finisher.submit(file)
    for file in (f for f in files if f.size > PART_BYTES):
        try:
            transfer_manager.download_chunks_concurrently(blob(file), str(_part(entry, file)), chunk_size=PART_BYTES,
                                                          max_workers=threads, worker_type=transfer_manager.THREAD,
                                                          crc32c_checksum=False)  # checked below, like the rest
        except Exception as exc:
            _gcs_outcome(file, exc, url)
        finisher.submit(file)
    finisher.wait()


def _gcs_outcome(file: RemoteFile, result, url: str) -> None:
    """A download's exception: a corrupt file refused by name, anything else raised."""
    if not isinstance(result, Exception):
        return
    from google.resumable_media.common import DataCorruption

    if isinstance(result, DataCorruption):
        raise FetchRefused(f"model {url}: file {file.key} is corrupt: {result}; not loaded") from result
    raise result


def _gcs_problem(file: RemoteFile, path: Path) -> str | None:
    if file.crc32c:
        got = base64.b64encode(_crc32c(path)).decode()
        return None if got == file.crc32c else f"crc32c {got}, the store's {file.crc32c}"
    if file.md5:
        got = base64.b64encode(_file_hash(path, hashlib.md5()).digest()).decode()
        return None if got == file.md5 else f"md5 {got}, the store's {file.md5}"
    return None  # the store offers no checksum: the size was checked


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
