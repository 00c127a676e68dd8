"""Where outputs go: a local directory, s3://bucket/prefix or gs://bucket/prefix.

    store = open_storage("s3://bucket/run-1")
    store.put_bytes("images/0001.png", data, content_type="image/png")
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from urllib.request import url2pathname

from .base import (
    NotFound,
    Storage,
    StorageError,
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
    "GCSStorage",
    "LocalStorage",
    "NotFound",
    "S3Storage",
    "Storage",
    "StorageError",
    "join_url",
    "open_storage",
    "validate_key",
]

# 'scheme:' of two or more letters: a URL, not a Windows drive letter.
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
_SUPPORTED = "a local path, file:///abs/path, s3://bucket[/prefix] or gs://bucket[/prefix]"


def __getattr__(name: str):
    # boto3 and google-cloud-storage are slow to import (docs/BENCHMARKS.md): load on demand.
    if name == "S3Storage":
        from .s3 import S3Storage

        return S3Storage
    if name == "GCSStorage":
        from .gcs import GCSStorage

        return GCSStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """The Storage for a local path, file:///abs/path, s3://bucket[/prefix] or
    gs://bucket[/prefix]. Anything else raises StorageError naming the URL.

    Nothing is cached: each call returns a new object, whose client (if any) is
    created on first use.
    """
    url = os.fspath(url)
    if not url:
        raise StorageError(f"empty storage URL: expected {_SUPPORTED}")
    if not _SCHEME_RE.match(url):
        return LocalStorage(url)
    scheme = url.partition(":")[0].lower()
    if url[len(scheme):].startswith("://"):
        if scheme in ("s3", "gs"):
            bucket, prefix = split_bucket_url(url)
            if scheme == "s3":
                from .s3 import S3Storage

                return S3Storage(bucket, prefix)
            from .gcs import GCSStorage

            return GCSStorage(bucket, prefix)
        if scheme == "file":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise StorageError(
                    f"unsupported file URL {redact_url(url)!r}: expected file:///abs/path"
                )
            return LocalStorage(url2pathname(parts.path))
    raise StorageError(f"unsupported storage URL {redact_url(url)!r}: expected {_SUPPORTED}")

