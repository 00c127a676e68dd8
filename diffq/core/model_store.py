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
from diffq.core.storage import (BucketAccess, BucketStorage, RemoteFile, StorageError, is_bucket_url, open_storage,
                                validate_key)

INDEX = "model_index.json"  # a diffusers folder's root file
__all__ = ["INDEX", "ModelListing", "ModelStoreError", "RemoteFile", "StoreUnreachable", "is_model_url",
           "list_model", "model_storage", "revisions"]


class ModelStoreError(ValueError):
    """A model URL that holds no diffusers pipeline, or may not be used as it is."""


class StoreUnreachable(ModelStoreError):
    """The model's listing failed (the store or its credentials): may pass on a retry."""


def is_model_url(model: str) -> bool:
    """A model in object storage (s3://, gs://), not a local folder or a Hub id."""
    return is_bucket_url(model)


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
    # botocore's quick retries inside a call (3 attempts); the model fetch's own patience
    # waits out longer outages, logging each wait (worker/device/fetch_patience.py).
    access = BucketAccess(endpoint_url=settings.model_store_endpoint, profile=settings.model_store_profile,
                          max_attempts=3, credentials_file=settings.model_store_credentials)
    try:
        storage = open_storage(url, access)
    except StorageError as exc:
        raise ModelStoreError(f"model {url}: {exc}") from None
    if not isinstance(storage, BucketStorage):
        raise ModelStoreError(f"model {url}: not s3://bucket/prefix or gs://bucket/prefix ({storage.url})")
    return storage


def list_model(url: str, settings: Settings | None = None, storage: BucketStorage | None = None, *,
               only: str | None = None) -> ModelListing:
    """Every file under the model's prefix, with what the store says of it; raises
    ModelStoreError naming the URL when it cannot be listed or holds no pipeline.

    With `only` (a key under the prefix: a LoRA adapter's one file, core/adapters.py),
    that file alone: listed by its own name, and no pipeline required."""
    storage = storage or model_storage(url, settings)
    what = f"adapter {url.rstrip('/')}/{only}" if only else f"model {url}"
    try:
        files = tuple(storage.describe(only or ""))
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


def revisions(models: list[str], settings: Settings | None = None) -> dict[str, str]:
    """Each object-storage model's revision now (what a run pins); local and hub models
    are not listed."""
    return {model: list_model(model, settings).revision for model in models if is_model_url(model)}
