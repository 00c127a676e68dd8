"""The storage interface shared by the local, S3 and GCS backends, and key validation."""

from __future__ import annotations

import os
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAX_SEGMENT_BYTES = 255
#: Name prefix of in-flight temporary files; LocalStorage.list skips them.
TMP_PREFIX = ".diffq-tmp-"


class StorageError(Exception):
    """A storage operation failed; the message names the URL and key involved."""


class NotFound(StorageError, KeyError):
    """The key does not exist."""

    # KeyError.__str__ repr()s its argument; keep the plain message.
    __str__ = Exception.__str__


def validate_key(key: str) -> str:
    """Return `key` if it is a safe '/'-separated relative path, else raise ValueError.

    Rejecting '.', '..', empty segments, absolute paths, backslashes and control
    characters means no key can address anything outside the storage root, and a
    key means the same object on every backend (S3 would otherwise store 'a//b'
    and 'a/./b' as distinct objects that a filesystem folds together).
    """
    if not isinstance(key, str):
        raise ValueError(f"storage key must be a str, not {type(key).__name__}: {key!r}")
    if not key:
        raise ValueError("storage key must not be empty")
    if key.startswith("/"):
        raise ValueError(f"storage key must be relative, not absolute: {key!r}")
    if "\\" in key:
        raise ValueError(f"storage key must not contain a backslash: {key!r}")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in key):
        raise ValueError(f"storage key must not contain control characters: {key!r}")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(
                f"storage key must not contain empty, '.' or '..' segments: {key!r}"
            )
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise ValueError(
                f"storage key segment longer than {MAX_SEGMENT_BYTES} bytes: {key!r}"
            )
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: '' (everything) or a key, optionally ending in '/'.

    Prefixes match as plain string prefixes of keys, as on S3 and GCS: 'a/b'
    matches 'a/b/c' and 'a/bc'; use 'a/b/' for the "directory" only.
    """
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class Storage(ABC):
    """Objects under one root URL, addressed by keys relative to that root."""

    url: str
    #: Objects per listing request; lowered in tests to exercise pagination.
    page_size: int = 1000
    #: Shortest time between two writes of one object that the store sustains; the
    #: sink batches progress credits to respect it (worker/sink/store.py).
    min_rewrite_interval_s: float = 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def key_url(self, key: str) -> str:
        """The URL of one object, for messages and manifests."""
        return join_url(self.url, key)

    @abstractmethod
    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str | None = None,
        if_absent: bool = False,
    ) -> bool:
        """Write `data` atomically; with if_absent, only when `key` does not exist.

        Returns True when written, False when if_absent and the key existed.
        """

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object's content; raises NotFound."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from `start` (fewer at its end); raises NotFound.
        Object stores read only those bytes (a ranged GET): a file's header without the file."""
        return self.get_bytes(key)[start:start + length]

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys relative to the root, recursively, fetched page by page; unordered."""
        return (key for key, _ in self.list_with_sizes(prefix))

    @abstractmethod
    def list_with_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete `key`; a missing key is not an error."""

    @abstractmethod
    def download_file(self, key: str, local_path: str | Path) -> None:
        """Stream the object to `local_path` (parents created), replacing it atomically."""

    @abstractmethod
    def upload_file(
        self, local_path: str | Path, key: str, *, if_absent: bool = False
    ) -> bool:
        """Stream a local file to `key`; same return as put_bytes."""

    def get_many(
        self, keys: Iterable[str], max_workers: int = 16
    ) -> Iterator[tuple[str, bytes]]:
        """(key, content) pairs read in parallel threads, in completion order.

        At most 4 * max_workers reads are queued at a time, so `keys` may be a
        long lazy iterable. A missing key raises NotFound and cancels the rest.
        """
        window = 4 * max_workers
        keys_iter = iter(keys)
        end = object()
        with ThreadPoolExecutor(max_workers, thread_name_prefix="diffq-get") as pool:
            pending: dict[Future[bytes], str] = {}
            try:
                exhausted = False
                while True:
                    while not exhausted and len(pending) < window:
                        key = next(keys_iter, end)
                        if key is end:
                            exhausted = True
                            break
                        # Validate here so a bad key raises in the caller's thread.
                        validate_key(key)
                        pending[pool.submit(self.get_bytes, key)] = key
                    if not pending:
                        return
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        yield pending.pop(future), future.result()
            finally:
                for future in pending:
                    future.cancel()

    def local_path(self, key: str) -> Path | None:
        """The filesystem path of `key` when the storage is local, else None."""
        validate_key(key)
        return None


def join_url(url: str, *parts: str) -> str:
    """Append '/'-separated relative parts to a storage URL or local path.

    The joined parts must form a valid key, so the result never leaves `url`.
    """
    rel = "/".join(p.strip("/") for p in parts if p.strip("/"))
    if not rel:
        return url
    validate_key(rel)
    return url.rstrip("/") + "/" + rel


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, exclusive: bool = False) -> bool:
    """Write a file so that readers see either nothing/the old file or the whole new one.

    `write` fills a temporary file in the same directory, which is then renamed
    over `path`; with exclusive it is hard-linked instead, which fails atomically
    if `path` exists, so concurrent writers race safely (returns False then).
    No fsync: this guards against readers and crashed writers, not power loss.
    """
    tmp = path.parent / f"{TMP_PREFIX}{secrets.token_hex(8)}"
    # os.open with 0o666 keeps the umask's permissions (mkstemp would force 0600).
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileNotFoundError:  # the directory is made on the first write into it only
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,220}[A-Za-z0-9]")


def redact_url(url: str) -> str:
    """`url` with anything that could be userinfo (before the last '@') hidden."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url


def split_bucket_url(url: str) -> tuple[str, str]:
    """'s3://bucket/a/b/' -> ('bucket', 'a/b'); raises StorageError naming the URL."""
    netloc, _, path = url.partition("://")[2].partition("/")
    if "@" in netloc:
        raise StorageError(
            f"credentials in storage URLs are not supported, use the environment: {redact_url(url)}"
        )
    if not _BUCKET_RE.fullmatch(netloc):
        raise StorageError(f"invalid bucket name in storage URL {redact_url(url)!r}")
    prefix = path.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ValueError as e:
            raise StorageError(f"invalid prefix in storage URL {redact_url(url)!r}: {e}") from None
    return netloc, prefix


@dataclass(frozen=True)
class RemoteFile:
    """One object as a bucket's listing describes it (`BucketStorage.describe`). A model's
    revision is a digest of these fields (core/model_store.py): their names and order are
    part of every pinned revision."""

    key: str  # relative to the storage's prefix
    size: int
    etag: str | None = None  # S3, quotes stripped
    version: str | None = None  # S3 VersionId (versioned buckets) or GCS generation
    md5: str | None = None  # GCS md5Hash (base64); composite objects have none
    crc32c: str | None = None  # GCS crc32c (base64)


@dataclass(frozen=True)
class StoredChecksums:
    """What a store keeps of one object to check its bytes by, as the store spells each
    value; the fetch picks the cheapest (worker/device/store_checksums.py `expectation`)."""

    full: dict[str, str] = field(default_factory=dict)  # algorithm -> checksum of the whole object
    composite: dict[str, str] = field(default_factory=dict)  # algorithm -> checksum of its parts' checksums
    etag_md5: str = ""  # an ETag that is an MD5 (of the object; "…-N": of its N parts' MD5s)
    parts: tuple[int, ...] = ()  # a multipart object's real part sizes, where the check is over parts
    none_note: str = ""  # why nothing but the size can be checked, where nothing is kept


@dataclass(frozen=True)
class BucketAccess:
    """A bucket reached with settings of its own (a model bucket's credentials): each store
    takes what applies to it."""

    endpoint_url: str | None = None  # S3
    profile: str | None = None  # S3: a named AWS profile
    max_attempts: int | None = None  # S3: botocore's attempts per call
    credentials_file: str | None = None  # GCS: a service-account JSON file


class BucketStorage(Storage):
    """Shared plumbing of the object-store backends: bucket/prefix and a lazy client.

    The client is created on first use, in the process that uses it: a storage
    object is cheap, picklable, and safe to create before a worker pool forks
    (a client inherited across fork would share its connection pool).

    Besides the Storage interface, what a model's fetch reads (worker/device/model_fetch.py):
    the listing with what the store keeps of each object (`describe`), its checksums
    (`stored_checksums`) and ranged reads of exactly the listed object (`read_pinned`).
    These raise the client library's own errors, unwrapped: the fetch tells an outage it
    waits out from a refusal by them (worker/device/fetch_patience.py).
    """

    scheme: str
    service: str  # the store's name in messages ("S3", "GCS")

    def __init__(self, bucket: str, prefix: str = ""):
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket_name = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.url = f"{self.scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
        self._client = None
        self._client_pid: int | None = None
        self._lock = threading.Lock()

    def _name(self, key: str) -> str:
        """The object name of `key` in the bucket."""
        return self.prefix + validate_key(key)

    @abstractmethod
    def _make_client(self): ...

    def _get_client(self):
        if self._client is None or self._client_pid != os.getpid():
            with self._lock:
                if self._client is None or self._client_pid != os.getpid():
                    self._client = self._make_client()
                    self._client_pid = os.getpid()
        return self._client

    def client(self):
        """The store's own client (boto3's, google-cloud-storage's), this process's."""
        return self._get_client()

    @classmethod
    @abstractmethod
    def with_access(cls, bucket: str, prefix: str, access: BucketAccess) -> BucketStorage:
        """The storage of bucket/prefix reached with `access`."""

    @abstractmethod
    def describe(self, name: str = "") -> Iterator[RemoteFile]:
        """Every object whose key starts with `name`, as the listing describes it (sizes,
        ETags, versions or generations, checksums); folder markers left out."""

    @abstractmethod
    def stored_checksums(self, file: RemoteFile) -> StoredChecksums:
        """What the store keeps of the listed object to check its bytes by."""

    @abstractmethod
    def read_pinned(self, file: RemoteFile, first: int, last: int, sink: Callable[[memoryview], None]) -> None:
        """Bytes `first`..`last` (inclusive) of exactly the listed object, handed to `sink`
        as they arrive (each view valid during the call only). A stream the store cuts
        returns early: the caller counts what arrived."""

    @abstractmethod
    def changed_since_listed(self, exc: BaseException) -> bool:
        """Whether `exc` says the object is no longer the one listed (a failed precondition)."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_client=None, _client_pid=None, _lock=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())
