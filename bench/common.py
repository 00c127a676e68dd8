"""What several benchmarks share, in one module (it imports no other bench module, so
no benchmark's import can come back round to itself): the loopback servers they run
on, the goal table of a section, a process's peak RSS, a run's recorded defaults."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private redis-server for one benchmark; yields its URL."""
    from diffq.testing.servers import RedisServer

    with RedisServer(workdir / "redis") as server:
        yield server.url


@contextlib.contextmanager
def s3_bucket(workdir: Path, bucket: str = "bench") -> Iterator[str]:
    """moto's S3 server with one bucket; the standard AWS_* variables point at it."""
    from diffq.testing.servers import S3Server

    with S3Server(workdir / "moto") as server:
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        server.make_bucket(bucket)
        yield f"s3://{bucket}"


Goal = tuple[str, bool, str]  # what, met, the figure


def goal_table(checks: list[Goal]) -> list[str]:
    return ["| goal | met | measured |", "|---|---|---|",
            *(f"| {goal} | {'yes' if met else '**no**'} | {figure} |" for goal, met, figure in checks)]


def peak_rss_mb() -> float:
    """This process image's high-water RSS. (ru_maxrss would carry the parent's
    peak across fork + exec on Linux, and the bench parent has torch loaded.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_defaults(shape) -> dict:
    """A manifest's `defaults` as submit records them (records.RunDefaults' fields)."""
    return {"model": shape.model, "batch_size": shape.batch_size, "steps": 4, "guidance_scale": 1.0,
            "max_sequence_length": shape.max_sequence_length, "height": shape.height, "width": shape.width,
            "format": "png", "seed_base": "bench"}
