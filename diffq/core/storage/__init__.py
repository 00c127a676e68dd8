"""Where outputs go: a local directory, s3://bucket/prefix or gs://bucket/prefix.

    store = open_storage("s3://bucket/run-1")
    store.put_bytes("images/0001.png", data, content_type="image/png")
"""

from __future__ import annotations

import importlib
import os
import posixpath
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from urllib.request import url2pathname

from .base import (
    BucketAccess,
    BucketStorage,
    NotFound,
    RemoteFile,
    Storage,
    StorageError,
    StoredChecksums,
    join_url,
    redact_url,
    split_bucket_url,
    validate_key,
)
from .local import LocalStorage

if TYPE_CHECKING:
    from .gcs import GCSStorage
    from .s3 import S3Storage

__all__ = [
    "BucketAccess",
    "BucketStorage",
    "GCSStorage",
    "LocalStorage",
    "NotFound",
    "S3Storage",
    "Storage",
    "StorageError",
    "join_url",
    "RemoteFile",
    "StoredChecksums",
    "is_bucket_url",
    "normalise_prefix",
    "open_storage",
    "validate_key",
]

# 'scheme:' of two or more letters: a URL, not a Windows drive letter.
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
_SUPPORTED = "a local path, file:///abs/path, s3://bucket[/prefix] or gs://bucket[/prefix]"


# The object stores, by URL scheme: (module, class), imported when first used (boto3 and
# google-cloud-storage are slow to import, docs/BENCHMARKS.md).
BUCKET_STORES = {"s3": (".s3", "S3Storage"), "gs": (".gcs", "GCSStorage")}


def _bucket_class(scheme: str) -> type[BucketStorage]:
    module, name = BUCKET_STORES[scheme]
    return getattr(importlib.import_module(module, __name__), name)


def __getattr__(name: str):
    for scheme, (_, class_name) in BUCKET_STORES.items():
        if name == class_name:
            return _bucket_class(scheme)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _bucket_scheme(url: str) -> str | None:
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep and scheme.lower() in BUCKET_STORES else None


def is_bucket_url(url: str) -> bool:
    """Whether `url` names objects in a bucket (s3://, gs://), not a local folder."""
    return _bucket_scheme(url) is not None


def open_storage(url: str | os.PathLike[str], access: BucketAccess | None = None) -> Storage:
    """The Storage for a local path, file:///abs/path, s3://bucket[/prefix] or
    gs://bucket[/prefix]. Anything else raises StorageError naming the URL. `access`: a
    bucket reached with settings of its own (a model bucket's credentials).

    Nothing is cached: each call returns a new object, whose client (if any) is
    created on first use.
    """
    url = os.fspath(url)
    if not url:
        raise StorageError(f"empty storage URL: expected {_SUPPORTED}")
    if not _SCHEME_RE.match(url):
        return LocalStorage(url)
    if scheme := _bucket_scheme(url):
        store = _bucket_class(scheme)
        return store.with_access(*split_bucket_url(url), access) if access else store(*split_bucket_url(url))
    scheme = url.partition(":")[0].lower()
    if scheme == "file" and url[len(scheme):].startswith("://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise StorageError(
                f"unsupported file URL {redact_url(url)!r}: expected file:///abs/path"
            )
        return LocalStorage(url2pathname(parts.path))
    raise StorageError(f"unsupported storage URL {redact_url(url)!r}: expected {_SUPPORTED}")


def normalise_prefix(value: str, what: str = "prefix") -> str:
    """A prefix of run folders as storage spells it: s3://BUCKET[/path] and gs://BUCKET[/path]
    as their storage's URL, an absolute path without '..'; no trailing '/'. Raises
    ValueError naming `what` (an option: `--out-prefix`) and the bad value, redacted."""
    if scheme := _bucket_scheme(value):
        try:
            bucket, path = split_bucket_url(value)
        except StorageError as exc:
            raise ValueError(f"{what}: {exc}") from None  # the URL redacted
        return f"{scheme}://{bucket}" + (f"/{path}" if path else "")
    if "://" in value or not value.startswith("/"):
        raise ValueError(f"{what} {redact_url(value)}: expected s3://BUCKET[/path], gs://BUCKET[/path] "
                         f"or an absolute path")
    if ".." in value.split("/"):
        raise ValueError(f"{what} {value}: no '..' in a prefix")
    path = "/" + posixpath.normpath(value).lstrip("/")
    if path == "/":
        raise ValueError(f"{what} {value}: '/' is every folder; use --any-out to say so")
    return path
