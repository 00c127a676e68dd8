"""A model in object storage: a diffusers folder under s3://bucket/prefix or
gs://bucket/prefix. Its listing (each file's size, the store's checksum, its object
version or generation) and the revision that pins it: `submit` records the revision
in the run manifest, a worker fetches that revision or refuses (worker/device/model_fetch.py).

The model bucket may have its own credentials (DIFFQ_MODEL_STORE_*, core/settings.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from diffq.core.settings import Settings, get_settings
from diffq.core.storage import StorageError, open_storage
from diffq.core.storage.base import BucketStorage, split_bucket_url, validate_key

MODEL_SCHEMES = ("s3://", "gs://")
INDEX = "model_index.json"  # a diffusers folder's root file


class ModelStoreError(ValueError):
    """A model URL that holds no diffusers pipeline, or may not be used as it is."""


class StoreUnreachable(ModelStoreError):
    """The model's listing failed (the store or its credentials): may pass on a retry."""


def is_model_url(model: str) -> bool:
    return model.startswith(MODEL_SCHEMES)


@dataclass(frozen=True)
class RemoteFile:
    key: str  # relative to the model's prefix
    size: int
    etag: str | None = None  # S3, quotes stripped
    version: str | None = None  # S3 VersionId (versioned buckets) or GCS generation
    md5: str | None = None  # GCS md5Hash (base64); composite objects have none
    crc32c: str | None = None  # GCS crc32c (base64)


@dataclass(frozen=True)
class ModelListing:
    url: str
    files: tuple[RemoteFile, ...]

    @property
    def revision(self) -> str:
        """A digest of the listing: every key, size, checksum and version. A model
        changed under the same prefix has another revision."""
        body = json.dumps([asdict(f) for f in sorted(self.files, key=lambda f: f.key)], sort_keys=True)
        return "sha256:" + hashlib.sha256(body.encode()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def model_storage(url: str, settings: Settings | None = None) -> BucketStorage:
    """The storage of a model URL, with the model bucket's own credentials where set."""
    settings = settings or get_settings()
    try:
        if url.startswith("s3://"):
            from diffq.core.storage.s3 import S3Storage

            # botocore's quick retries inside a call (3 attempts); the model fetch's own
            # patience waits out longer outages, logging each wait (worker/device/fetch_patience.py).
            return S3Storage(*split_bucket_url(url), endpoint_url=settings.model_store_endpoint,
                             profile=settings.model_store_profile, max_attempts=3)
        if url.startswith("gs://"):
            from diffq.core.storage.gcs import GCSStorage

            return GCSStorage(*split_bucket_url(url), credentials_file=settings.model_store_credentials)
        storage = open_storage(url)
    except StorageError as exc:
        raise ModelStoreError(f"model {url}: {exc}") from None
    raise ModelStoreError(f"model {url}: not s3://bucket/prefix or gs://bucket/prefix ({storage.url})")


def list_model(url: str, settings: Settings | None = None, storage: BucketStorage | None = None, *,
               only: str | None = None) -> ModelListing:
    """Every file under the model's prefix, with what the store says of it; raises
    ModelStoreError naming the URL when it cannot be listed or holds no pipeline.

    With `only` (a key under the prefix: a LoRA adapter's one file, core/adapters.py),
    that file alone: listed by its own name, and no pipeline required."""
    storage = storage or model_storage(url, settings)
    what = f"adapter {url.rstrip('/')}/{only}" if only else f"model {url}"
    try:
        files = tuple(_list_s3(storage, only or "") if storage.scheme == "s3" else _list_gcs(storage, only or ""))
    except Exception as exc:  # the client libraries' own errors, each different
        raise StoreUnreachable(f"{what}: listing failed: {exc}") from exc
    if only is not None:
        files = tuple(f for f in files if f.key == only)  # not `{only}.old` beside it
        if not files:
            raise ModelStoreError(f"{what}: no such file")
        return ModelListing(url=storage.url, files=files)
    for file in files:  # each key becomes a path in the node's cache: nothing may leave it
        try:
            validate_key(file.key)
        except ValueError as exc:
            raise ModelStoreError(f"model {url}: object {file.key!r} cannot be a file of a model folder: {exc}") from None
    if not any(f.key == INDEX for f in files):
        raise ModelStoreError(f"model {url} holds no diffusers pipeline (no {INDEX} under it)")
    return ModelListing(url=storage.url, files=files)


def _list_s3(storage, name: str = ""):
    client = storage.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket_name, Prefix=storage.prefix + name)
    for page in pages:
        for obj in page.get("Contents", ()):
            key = obj["Key"][len(storage.prefix):]
            if key and not key.endswith("/"):  # folder markers
                yield RemoteFile(key=key, size=obj["Size"], etag=obj.get("ETag", "").strip('"') or None)


def _list_gcs(storage, name: str = ""):
    for blob in storage.client().list_blobs(storage.bucket_name, prefix=storage.prefix + name):
        key = blob.name[len(storage.prefix):]
        if key and not key.endswith("/"):
            yield RemoteFile(key=key, size=blob.size, version=str(blob.generation), md5=blob.md5_hash,
                             crc32c=blob.crc32c)


def revisions(models: list[str], settings: Settings | None = None) -> dict[str, str]:
    """Each object-storage model's revision now (what a run pins); local and hub models
    are not listed."""
    return {model: list_model(model, settings).revision for model in models if is_model_url(model)}
