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

from .base import BucketStorage, NotFound, StorageError, validate_prefix

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
