"""Broker memory of a submitted run: every batch in Redis, or a window (producer/feed.py).

Submits `--rows` short prompts at batch size 4 to a private redis-server, once with
`window=None` (`--window all`, every batch a Celery message in Redis) and once with
the default window, each to a fresh OUT and a flushed Redis, and reports Redis's
`used_memory` growth (bytes per item) and the producer's rows/s for each
(docs/BENCHMARKS.md "Broker memory").

    python -m bench.window [--rows 2000000] [--all-rows 200000] [--json FILE]

`--all-rows`: the count for `--window all` (2M rows of it is ~1 GB of Redis; the
bytes per item do not depend on the count).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import redis_server

BATCH = 4


def write_prompts(path: Path, rows: int) -> Path:
    with path.open("w") as handle:
        for start in range(0, rows, 100_000):
            handle.write("".join(json.dumps({"id": f"i{i:08d}", "prompt": f"a photo of item {i}"}) + "\n"
                                 for i in range(start, min(rows, start + 100_000))))
    return path


def used_memory(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("memory")["used_memory"])


def measure(url: str, prompts: Path, out: str, window: int | None) -> dict:
    import redis

    from diffq.producer.submit import submit

    redis.Redis.from_url(url).flushall()
    before = used_memory(url)
    started = time.perf_counter()
    result = submit(prompts, out, model="/models/bench", broker_url=url, batch_size=BATCH, window=window)
    seconds = time.perf_counter() - started
    grown = used_memory(url) - before
    return {"window": "all" if window is None else window, "rows": result.total, "batches_published": result.batches,
            "batches_in_out": result.unpublished, "redis_bytes": grown,
            "redis_bytes_per_item": round(grown / result.total, 1), "seconds": round(seconds, 1),
            "rows_per_s": round(result.total / seconds)}


def main(argv: list[str] | None = None) -> list[dict]:
    from diffq.producer.feed import DEFAULT_WINDOW

    parser = argparse.ArgumentParser(prog="python -m bench.window", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--all-rows", type=int, default=200_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="diffq-bench-window-") as tmp:
        work = Path(tmp)
        with redis_server(work) as url:
            for count, window in ((args.all_rows, None), (args.rows, DEFAULT_WINDOW)):
                prompts = write_prompts(work / f"p{count}.jsonl", count)
                row = measure(url, prompts, str(work / f"out-{window}-{count}"), window)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
