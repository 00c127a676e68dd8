"""Storage in an S3 bucket (AWS, or any S3-compatible server such as MinIO)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .base import BucketAccess, BucketStorage, NotFound, RemoteFile, StorageError, StoredChecksums, validate_prefix

# botocore's standard retry mode waits rand(0, 1) * min(0.05 s * 2**i, 20 s)
# before retry i on connection errors and 5xx. Ten attempts add up to 12.8 s on
# average, too little to ride out an object store that is down for ~30 s; 15
# attempts wait 63 s on average and more than 32 s in 99% of cases.
# Caveat: standard (and adaptive) mode also spends a per-client retry quota of
# 500 tokens, 14 per retried connection error or 5xx, so during an outage only
# ~35 retries are granted across all threads sharing the client; after that
# calls fail at once until successes refill it. AWS_RETRY_MODE=legacy has no
# quota (but uncapped rand * 2**i delays: AWS_MAX_ATTEMPTS=8 waits 64 s on average).
DEFAULT_MAX_ATTEMPTS = 15
# S3 allows at most 10,000 parts per multipart upload.
_MAX_PARTS = 10_000
# AWS answers 409 ConditionalRequestConflict when a conditional write races
# another one in flight, and asks clients to retry; botocore does not.
_CONFLICT_RETRIES = 5
# The checksums S3 can keep of an object (botocore's S3 model: ChecksumAlgorithm), each
# in a HEAD's `Checksum<NAME>` field when asked with ChecksumMode=ENABLED.
CHECKSUM_ALGORITHMS = ("CRC64NVME", "CRC32C", "CRC32", "XXHASH3", "XXHASH64", "XXHASH128",
                       "SHA1", "SHA256", "SHA512", "MD5")
# A pinned read's chunk: fits the caches (8 MiB measured slower, docs/BENCHMARKS.md).
_STREAM_CHUNK = 1024 * 1024


def _status(e: ClientError) -> int | None:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(e: ClientError) -> str:
    return e.response.get("Error", {}).get("Code", "")


class S3Storage(BucketStorage):
    """Objects under s3://bucket/prefix.

    The endpoint comes from the standard AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    environment (boto3 reads them itself) unless `endpoint_url` is given.
    Retries are botocore's own: mode from `retry_mode`, else AWS_RETRY_MODE, else
    "standard"; attempts from `max_attempts`, else AWS_MAX_ATTEMPTS, else
    DEFAULT_MAX_ATTEMPTS. (A botocore Config overrides those two variables, so
    they are read here.) `profile`: a named AWS profile instead of the default chain.
    """

    scheme = "s3"
    service = "S3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        max_attempts: int | None = None,
        retry_mode: str | None = None,
        profile: str | None = None,
    ):
        super().__init__(bucket, prefix)
        self.endpoint_url = endpoint_url
        self.profile = profile  # a named profile: a bucket with its own credentials (models)
        self.max_attempts = max_attempts or int(
            os.environ.get("AWS_MAX_ATTEMPTS") or DEFAULT_MAX_ATTEMPTS
        )
        self.retry_mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or "standard"
        # Defaults: 8 MiB threshold and parts, 10 threads per transfer. "classic": with
        # awscrt installed (boto3[crt], for CRC64NVME) boto3 may otherwise switch to its
        # CRT transfer manager on its own, which takes none of these settings.
        self.transfer_config = TransferConfig(preferred_transfer_client="classic")

    def _make_client(self):
        config = Config(
            # "total_max_attempts" counts the first try, as AWS_MAX_ATTEMPTS does;
            # Config's "max_attempts" would count retries only.
            retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
            max_pool_connections=32,
            # botocore's 60 s connect timeout, times 15 attempts, would hang a
            # worker for 15 minutes on an unreachable (not refusing) endpoint.
            connect_timeout=5,
            read_timeout=60,
        )
        # A session per client: boto3's default session is not thread-safe.
        return boto3.session.Session(profile_name=self.profile).client(
            "s3", endpoint_url=self.endpoint_url, config=config
        )

    @classmethod
    def with_access(cls, bucket, prefix, access: BucketAccess):
        return cls(bucket, prefix, endpoint_url=access.endpoint_url, profile=access.profile,
                   max_attempts=access.max_attempts)

    # -- a model's fetch: the listing, the checksums and ranged reads of the listed object --

    def describe(self, name=""):
        pages = self._get_client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket_name, Prefix=self.prefix + name)
        for page in pages:
            for obj in page.get("Contents", ()):
                key = obj["Key"][len(self.prefix):]
                if key and not key.endswith("/"):  # folder markers
                    yield RemoteFile(key=key, size=obj["Size"], etag=obj.get("ETag", "").strip('"') or None)

    def _pinned(self, file: RemoteFile) -> dict:
        args = {"Bucket": self.bucket_name, "Key": self._name(file.key)}
        if file.etag:  # the object listed, never one uploaded since
            args["IfMatch"] = f'"{file.etag}"'
        return args

    def stored_checksums(self, file):
        """A HEAD of the listed object (ChecksumMode=ENABLED) and, where the check is over
        parts, each part's real size (a HEAD with PartNumber=N per part: S3 leaves
        GetObjectAttributes' parts out exactly for the ETag rule, moto always)."""
        client = self._get_client()
        head = client.head_object(**self._pinned(file), ChecksumMode="ENABLED")
        if not self.over_parts(head):
            return self.checksums_of(head)
        count = int(head["ETag"].strip('"').rpartition("-")[2])
        # (No If-Match: moto compares it with the part's own ETag. Part sizes of a newer
        # upload fail the check: refused as corrupt, never loaded.)
        name = self._name(file.key)
        parts = tuple(client.head_object(Bucket=self.bucket_name, Key=name, PartNumber=n)["ContentLength"]
                      for n in range(1, count + 1))
        return self.checksums_of(head, parts)

    @staticmethod
    def checksums_of(head: dict, parts: tuple[int, ...] = ()) -> StoredChecksums:
        """What a HEAD (ChecksumMode=ENABLED) says S3 keeps: full-object and composite
        checksums, and the ETag where it is an MD5 (not with KMS or customer-key encryption)."""
        etag = head.get("ETag", "").strip('"')
        encrypted = head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm")
        multipart = "-" in etag
        full_object = head.get("ChecksumType") == "FULL_OBJECT"
        full, composite = {}, {}
        for algorithm in CHECKSUM_ALGORITHMS:
            value = head.get(f"Checksum{algorithm}")
            if not value:
                continue
            if algorithm == "CRC64NVME" or ("-" not in value and (full_object or not multipart)):
                full[algorithm] = value  # CRC64NVME is full-object only
            elif multipart and not full_object:
                # A multipart upload's checksum of its parts' checksums ("…-N"; moto leaves
                # out the "-N" and the type).
                composite[algorithm] = value
        return StoredChecksums(full=full, composite=composite, etag_md5="" if encrypted else etag,
                               parts=parts if multipart else (),
                               none_note="KMS-encrypted with no stored checksum (upload it with a checksum, "
                                         "e.g. boto3 >= 1.36's default CRC32)")

    @classmethod
    def over_parts(cls, head: dict) -> bool:
        """Whether the check is over parts (their sizes needed): a multipart object with no
        full-object checksum, checked by a composite one or its ETag."""
        checksums = cls.checksums_of(head)
        multipart = "-" in head.get("ETag", "")
        return multipart and not checksums.full and bool(checksums.composite or checksums.etag_md5)

    def read_pinned(self, file, first, last, sink):
        """One ranged GET (If-Match the listed ETag), read straight from the socket into a
        buffer (http.client's readinto), past urllib3's and botocore's copies of each chunk.
        That reaches two private names, read here only: botocore's StreamingBody keeps the
        urllib3 response as `_raw_stream` (botocore/response.py:55, 1.44) and urllib3's
        HTTPResponse keeps http.client's as `_fp` (urllib3/response.py:794, 2.8); without
        them (another release) the body's public read() is used."""
        response = self._get_client().get_object(**self._pinned(file), Range=f"bytes={first}-{last}")
        body = response["Body"]
        raw = getattr(body, "_raw_stream", None)
        readinto = getattr(getattr(raw, "_fp", None), "readinto", None)
        view = memoryview(bytearray(_STREAM_CHUNK))
        left = last - first + 1
        try:
            while left > 0:
                if readinto is not None:
                    n = readinto(view[:min(left, _STREAM_CHUNK)])
                    chunk = view[:n]
                else:
                    chunk = memoryview(body.read(min(left, _STREAM_CHUNK)))
                    n = len(chunk)
                if not n:
                    return
                sink(chunk)
                left -= n
        finally:
            (raw or body).close()

    def changed_since_listed(self, exc):
        return isinstance(exc, ClientError) and (_status(exc) == 412 or _code(exc) == "PreconditionFailed")

    @contextmanager
    def _errors(self, op: str, key: str):
        try:
            yield
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise NotFound(f"{op}: no object {self.key_url(key)}") from e
            raise StorageError(f"S3 {op} {self.key_url(key)} failed: {e}") from e
        except BotoCoreError as e:
            raise StorageError(f"S3 {op} {self.key_url(key)} failed: {e}") from e

    def _conditional(self, call: Callable[[], object]) -> bool:
        """Run an If-None-Match write: True if written, False if the key existed."""
        attempt = 0
        while True:
            try:
                call()
                return True
            except ClientError as e:
                if _status(e) == 412:
                    return False
                attempt += 1
                if _code(e) != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES:
                    raise
            time.sleep(0.05 * 2**attempt)

    def put_bytes(self, key, data, *, content_type=None, if_absent=False):
        args = {"Bucket": self.bucket_name, "Key": self._name(key), "Body": data}
        if content_type:
            args["ContentType"] = content_type
        client = self._get_client()
        with self._errors("put", key):
            if if_absent:
                return self._conditional(lambda: client.put_object(IfNoneMatch="*", **args))
            client.put_object(**args)
            return True

    def get_bytes(self, key):
        name = self._name(key)
        with self._errors("get", key):
            response = self._get_client().get_object(Bucket=self.bucket_name, Key=name)
            return response["Body"].read()

    def get_range(self, key, start, length):
        if length <= 0:
            return b""
        name = self._name(key)
        with self._errors("get", key):
            response = self._get_client().get_object(Bucket=self.bucket_name, Key=name,
                                                     Range=f"bytes={start}-{start + length - 1}")
            return response["Body"].read()

    def exists(self, key):
        name = self._name(key)
        try:
            with self._errors("head", key):
                self._get_client().head_object(Bucket=self.bucket_name, Key=name)
        except NotFound:
            return False
        return True

    def list_with_sizes(self, prefix=""):
        return self._list(validate_prefix(prefix))

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        paginator = self._get_client().get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket_name,
            Prefix=self.prefix + prefix,
            PaginationConfig={"PageSize": self.page_size},
        )
        with self._errors("list", prefix + "*"):
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self.prefix):]
                    # Skip "folder" markers that consoles and some tools create.
                    if key and not key.endswith("/"):
                        yield key, obj["Size"]

    def delete(self, key):
        name = self._name(key)
        with self._errors("delete", key):
            self._get_client().delete_object(Bucket=self.bucket_name, Key=name)

    def download_file(self, key, local_path):
        name = self._name(key)
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        # s3transfer writes to a temporary file beside local_path and renames it.
        with self._errors("download", key):
            self._get_client().download_file(
                self.bucket_name, name, str(local_path), Config=self.transfer_config
            )

    def upload_file(self, local_path, key, *, if_absent=False):
        name = self._name(key)
        size = os.stat(local_path).st_size
        client = self._get_client()
        with self._errors("upload", key):
            if not if_absent:
                client.upload_file(
                    str(local_path), self.bucket_name, name, Config=self.transfer_config
                )
                return True
            if size < self.transfer_config.multipart_threshold:
                with open(local_path, "rb") as f:

                    def put():
                        f.seek(0)  # botocore rewinds within a call, not across calls
                        client.put_object(
                            Bucket=self.bucket_name, Key=name, Body=f, IfNoneMatch="*"
                        )

                    return self._conditional(put)
            # Skip sending a big file that is already there; the conditional
            # completion below still settles races.
            if self.exists(key):
                return False
            return self._upload_multipart_if_absent(Path(local_path), name, size)

    def _upload_multipart_if_absent(self, path: Path, name: str, size: int) -> bool:
        # s3transfer cannot pass If-None-Match to CompleteMultipartUpload, so
        # this is a plain multipart upload with a conditional completion.
        client = self._get_client()
        part_size = max(self.transfer_config.multipart_chunksize, -(-size // _MAX_PARTS))
        upload_id = client.create_multipart_upload(Bucket=self.bucket_name, Key=name)[
            "UploadId"
        ]

        def upload_part(number: int) -> dict:
            with path.open("rb") as f:
                f.seek((number - 1) * part_size)
                body = f.read(part_size)
            response = client.upload_part(
                Bucket=self.bucket_name, Key=name, UploadId=upload_id,
                PartNumber=number, Body=body,
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        try:
            with ThreadPoolExecutor(self.transfer_config.max_concurrency) as pool:
                parts = list(pool.map(upload_part, range(1, -(-size // part_size) + 1)))
            written = self._conditional(
                lambda: client.complete_multipart_upload(
                    Bucket=self.bucket_name, Key=name, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, IfNoneMatch="*",
                )
            )
        except BaseException:
            self._abort(name, upload_id)
            raise
        if not written:
            # A refused completion leaves the parts stored (and billed).
            self._abort(name, upload_id)
        return written

    def _abort(self, name: str, upload_id: str) -> None:
        try:
            self._get_client().abort_multipart_upload(
                Bucket=self.bucket_name, Key=name, UploadId=upload_id
            )
        except (ClientError, BotoCoreError):
            pass  # a bucket lifecycle rule is the backstop for orphaned parts
