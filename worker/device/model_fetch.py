"""A model in object storage, fetched into the node-local cache (DIFFQ_MODEL_CACHE).

    fetched = fetch("s3://models/flux2-klein")   # -> Fetched(path=..., hit=False, ...)
    DiffusionPipeline.from_pretrained(fetched.path)

One cache entry per model URL and revision (core/model_store.py): a model changed
under the same prefix is another entry. Files are downloaded by the storage
libraries' own transfer managers (boto3's, with a TransferConfig; google-cloud-
storage's `transfer_manager`, threads), each to a part name, checked against its
listed size and the store's checksum, then renamed into place: a file at its name is
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
# A file bigger than this is fetched in ranged parts of this size (S3), several at once.
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
    place; the first corrupt file refuses the fetch, naming it."""

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
        os.replace(part, self.entry / file.key)
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
def _fetch_s3(storage, files: list[RemoteFile], entry: Path, threads: int, url: str) -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from botocore.exceptions import FlexibleChecksumError

    client = storage.client()
    heads = _s3_heads(storage, files, threads)
    # One pool for whole files and parts of big ones; bigger parts and I/O chunks than
    # the defaults (8 MiB, 256 KiB) cut per-request overhead (docs/BENCHMARKS.md).
    config = TransferConfig(max_concurrency=threads, multipart_threshold=PART_BYTES,
                            multipart_chunksize=PART_BYTES, io_chunksize=2**20, num_download_attempts=5)
    finisher = _Finisher(entry, url, threads, lambda f, part: _s3_problem(heads[f.key], part))
    with create_transfer_manager(client, config) as manager:
        # (s3transfer takes no If-Match: bytes of an upload since the HEAD below fail its
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
            finisher.pool.shutdown(cancel_futures=True)
            raise
    finisher.wait()


def _s3_heads(storage, files: list[RemoteFile], threads: int) -> dict[str, dict]:
    """Each file's stored checksum (full-object only) and, for a multipart ETag, its part size."""
    from botocore.exceptions import ClientError

    client = storage.client()

    def head(file: RemoteFile) -> tuple[str, dict]:
        name = storage.prefix + file.key
        try:  # the object listed, not one uploaded since: its checksums are the listed bytes'
            response = client.head_object(Bucket=storage.bucket_name, Key=name, ChecksumMode="ENABLED",
                                          **({"IfMatch": f'"{file.etag}"'} if file.etag else {}))
        except ClientError as exc:
            raise _changed(exc, storage.url, file) from exc
        # An ETag is an MD5 only without KMS or customer-key encryption.
        encrypted = response.get("ServerSideEncryption", "").startswith("aws:kms") or response.get("SSECustomerAlgorithm")
        info = {"etag": response.get("ETag", "").strip('"'), "checksums": {}, "etag_is_md5": not encrypted}
        full_object = response.get("ChecksumType") == "FULL_OBJECT"
        for algorithm in ("SHA256", "SHA1", "CRC32C", "CRC32"):
            value = response.get(f"Checksum{algorithm}")
            # A composite checksum ("-N", or a multipart object's without a type) is
            # over the parts: the ETag rule checks those.
            if value and "-" not in value and (full_object or "-" not in info["etag"]):
                info["checksums"][algorithm] = value
        if "-" in info["etag"] and not info["checksums"] and info["etag_is_md5"]:
            info["part_size"] = client.head_object(Bucket=storage.bucket_name, Key=name,
                                                   PartNumber=1)["ContentLength"]
        return file.key, info

    with ThreadPoolExecutor(threads, thread_name_prefix="diffq-head") as pool:
        return dict(pool.map(head, files))


def _changed(exc, url: str, file: RemoteFile) -> Exception:
    """A 412 (the object is no longer the one listed) as a refusal naming the file; any
    other client error as it is."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status == 412 or exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
        return FetchRefused(f"model {url}: file {file.key} changed since the model was listed; fetch again")
    return exc


def _s3_problem(info: dict, path: Path) -> str | None:
    for algorithm, expected in info["checksums"].items():
        got = _digest(path, algorithm)
        return None if got == expected else f"{algorithm} {got}, the store's {expected}"
    if not info["etag_is_md5"]:
        log.warning("%s: KMS-encrypted with no stored checksum: only its size is checked (upload it with "
                    "a checksum, e.g. boto3 >= 1.36's default CRC32)", path.name)
        return None
    etag = info["etag"]
    if "-" in etag:  # multipart: the MD5 of the parts' MD5s, then "-<parts>"
        parts = []
        with path.open("rb") as f:
            while chunk := f.read(info["part_size"]):
                parts.append(hashlib.md5(chunk).digest())
        got = f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"
    else:  # a single-part upload's ETag is the MD5 of its bytes
        got = _file_hash(path, hashlib.md5()).hexdigest()
    return None if got == etag else f"ETag {got}, the store's {etag}"


def _digest(path: Path, algorithm: str) -> str:
    if algorithm in ("SHA256", "SHA1"):
        raw = _file_hash(path, hashlib.new(algorithm.lower())).digest()
    elif algorithm == "CRC32":
        crc = 0
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                crc = zlib.crc32(chunk, crc)
        raw = crc.to_bytes(4, "big")
    else:
        raw = _crc32c(path)
    return base64.b64encode(raw).decode()


def _file_hash(path: Path, hasher):
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    return hasher


def _crc32c(path: Path) -> bytes:
    import google_crc32c

    checksum = google_crc32c.Checksum()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            checksum.update(chunk)
    return checksum.digest()


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
    used = sum(sizes.values()) + (_tree_size(keep) if keep.exists() else 0)
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
