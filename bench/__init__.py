"""Benchmarks (`make bench`). They use the same real loopback servers as the tests."""

from __future__ import annotations

from bench.common import redis_server, s3_bucket

__all__ = ["redis_server", "s3_bucket"]
