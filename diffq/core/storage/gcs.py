"""Storage in a Google Cloud Storage bucket."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.exceptions import GoogleAuthError
from google.cloud import storage
from google.cloud.storage.exceptions import InvalidResponse
from google.cloud.storage.retry import DEFAULT_RETRY

from .base import (BucketAccess, BucketStorage, NotFound, RemoteFile, StorageError, StoredChecksums, atomic_write,
                   validate_prefix)

# google-cloud-storage uploads files larger than this in resumable sessions.
_RESUMABLE_THRESHOLD = 8 * 1024 * 1024
_FAILURES = (gexc.GoogleAPIError, GoogleAuthError, InvalidResponse, requests.RequestException)


class GCSStorage(BucketStorage):
    """Objects under gs://bucket/prefix.

    With STORAGE_EMULATOR_HOST set (fake-gcs-server), the client is anonymous and
    its project is GOOGLE_CLOUD_PROJECT or "diffq-local"; otherwise it uses the
    application default credentials.

    Every call passes retry=DEFAULT_RETRY (exponential backoff from 1 s up to
    60 s, for 120 s in all, on connection errors, 408, 429 and 5xx). The library
    retries uploads only when they carry a precondition; retrying the plain
    uploads here is safe too because each one rewrites the whole object with the
    same bytes.
    """

    scheme = "gs"
    service = "GCS"
    # GCS sustains about one write per second to the same object name (more gets 429s).
    min_rewrite_interval_s = 1.0

    def __init__(self, bucket: str, prefix: str = "", *, credentials_file: str | None = None):
        super().__init__(bucket, prefix)
        # A service-account JSON file instead of the application default credentials
        # (a bucket with its own credentials: models).
        self.credentials_file = credentials_file

    def _make_client(self):
        if self.credentials_file and not os.environ.get("STORAGE_EMULATOR_HOST"):
            client = storage.Client.from_service_account_json(
                self.credentials_file, project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
        elif os.environ.get("STORAGE_EMULATOR_HOST"):
            client = storage.Client(
                project=os.environ.get("GOOGLE_CLOUD_PROJECT", "diffq-local"),
                credentials=AnonymousCredentials(),
            )
        else:
            client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
        session = client._http
        if not getattr(session, "is_mtls", False):
            # requests keeps 10 connections per host; get_many runs 16 threads.
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=32)
            session.mount("https://", adapter)
            session.mount("http://", adapter)
        return client

    @classmethod
    def with_access(cls, bucket, prefix, access: BucketAccess):
        return cls(bucket, prefix, credentials_file=access.credentials_file)

    # -- a model's fetch: the listing, the checksums and ranged reads of the listed generation --

    def describe(self, name=""):
        for blob in self._get_client().list_blobs(self.bucket_name, prefix=self.prefix + name):
            key = blob.name[len(self.prefix):]
            if key and not key.endswith("/"):
                yield RemoteFile(key=key, size=blob.size, version=str(blob.generation), md5=blob.md5_hash,
                                 crc32c=blob.crc32c)

    def stored_checksums(self, file):
        """GCS keeps a crc32c of every object (composite ones too) and an md5 of most: both
        come with the listing, no request."""
        full = {name: value for name, value in (("CRC32C", file.crc32c), ("MD5", file.md5)) if value}
        return StoredChecksums(full=full, none_note="the store lists no checksum")

    def read_pinned(self, file, first, last, sink):
        """A ranged download of the listed generation (exactly the revision listed, even if a
        newer one lands), each chunk handed on as it arrives."""
        blob = self._get_client().bucket(self.bucket_name).blob(
            self._name(file.key), generation=int(file.version) if file.version else None)
        # retry=None: a failure comes back to the caller, whose stream continues from its last byte.
        blob.download_to_file(_Sink(sink), start=first, end=last, raw_download=True, checksum=None, retry=None)

    def changed_since_listed(self, exc):
        return isinstance(exc, gexc.GoogleAPICallError) and exc.code == 412

    def _blob(self, key: str) -> storage.Blob:
        name = self._name(key)  # validate before touching the client
        return self._get_client().bucket(self.bucket_name).blob(name)

    @contextmanager
    def _errors(self, op: str, key: str):
        try:
            yield
        except gexc.NotFound as e:
            raise NotFound(f"{op}: no object {self.key_url(key)}") from e
        except _FAILURES as e:
            raise StorageError(f"GCS {op} {self.key_url(key)} failed: {e}") from e

    def put_bytes(self, key, data, *, content_type=None, if_absent=False):
        blob = self._blob(key)
        with self._errors("put", key):
            try:
                blob.upload_from_string(
                    data,
                    content_type=content_type or "application/octet-stream",
                    # Generation 0 means "no live object": an atomic create-only write.
                    if_generation_match=0 if if_absent else None,
                    retry=DEFAULT_RETRY,
                )
            except gexc.PreconditionFailed:
                return False
        return True

    def get_bytes(self, key):
        blob = self._blob(key)
        with self._errors("get", key):
            return blob.download_as_bytes(retry=DEFAULT_RETRY)

    def get_range(self, key, start, length):
        if length <= 0:
            return b""
        blob = self._blob(key)
        with self._errors("get", key):
            # `end` is inclusive (google-cloud-storage Blob.download_as_bytes).
            return blob.download_as_bytes(start=start, end=start + length - 1, retry=DEFAULT_RETRY)

    def exists(self, key):
        blob = self._blob(key)
        with self._errors("exists", key):
            return blob.exists(retry=DEFAULT_RETRY)

    def list_with_sizes(self, prefix=""):
        return self._list(validate_prefix(prefix))

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        with self._errors("list", prefix + "*"):
            blobs = self._get_client().list_blobs(
                self.bucket_name,
                prefix=self.prefix + prefix,
                page_size=self.page_size,
                retry=DEFAULT_RETRY,
            )
            for blob in blobs:
                key = blob.name[len(self.prefix):]
                # Skip "folder" placeholders that consoles and some tools create.
                if key and not key.endswith("/"):
                    yield key, blob.size

    def delete(self, key):
        blob = self._blob(key)
        try:
            with self._errors("delete", key):
                blob.delete(retry=DEFAULT_RETRY)
        except NotFound:
            pass

    def download_file(self, key, local_path):
        blob = self._blob(key)
        with self._errors("download", key):
            atomic_write(
                Path(local_path), lambda f: blob.download_to_file(f, retry=DEFAULT_RETRY)
            )

    def upload_file(self, local_path, key, *, if_absent=False):
        blob = self._blob(key)
        with self._errors("upload", key):
            # Files over 8 MiB go up as resumable uploads; skip sending a big one
            # that is already there (the precondition still settles races).
            if if_absent and os.stat(local_path).st_size > _RESUMABLE_THRESHOLD and blob.exists(
                retry=DEFAULT_RETRY
            ):
                return False
            try:
                blob.upload_from_filename(
                    str(local_path),
                    if_generation_match=0 if if_absent else None,
                    retry=DEFAULT_RETRY,
                )
            except gexc.PreconditionFailed:
                return False
        return True


class _Sink:
    """A file object for google-cloud-storage's download that hands each chunk on."""

    def __init__(self, sink):
        self.sink = sink

    def write(self, data) -> int:
        self.sink(memoryview(data))
        return len(data)
