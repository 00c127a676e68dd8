"""Benchmarks (`make bench`). They use the same real loopback servers as the tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private redis-server for one benchmark; yields its URL."""
    from tests.servers import RedisServer

    with RedisServer(workdir / "redis") as server:
        yield server.url


@contextlib.contextmanager
def s3_bucket(workdir: Path, bucket: str = "bench") -> Iterator[str]:
    """moto's S3 server with one bucket; the standard AWS_* variables point at it."""
    from tests.servers import S3Server

    with S3Server(workdir / "moto") as server:
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        server.make_bucket(bucket)
        yield f"s3://{bucket}"
