"""Broker memory of a submitted run: every batch in Redis, or a window (producer/feed.py).

Submits short prompts at batch size 4 to a private redis-server: `--all-rows` with
`window=None` (`--window all`, every batch a Celery message in Redis) and with the
default window, then `--rows` with the default window, each to a fresh OUT and a
flushed Redis, and reports Redis's
`used_memory` growth (bytes per item) and the producer's rows/s for each
(docs/BENCHMARKS.md "Broker memory").

    python -m bench.window [--rows 2000000] [--all-rows 200000] [--json docs/scale_window.json]

`--all-rows`: the count for `--window all` (2M rows of it is ~1 GB of Redis; the
bytes per item do not depend on the count).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.common import redis_server

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
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result = submit(prompts, out, model="/models/bench", broker_url=url, batch_size=BATCH, window=window)
    seconds = time.perf_counter() - started
    grown = used_memory(url) - before
    return {"window": "all" if window is None else window, "rows": result.total, "batches_published": result.batches,
            "batches_in_out": result.unpublished, "redis_bytes": grown,
            "redis_bytes_per_item": round(grown / result.total, 1), "seconds": round(seconds, 1),
            "rows_per_s": round(result.total / seconds), "load": f"{load:.1f}–{os.getloadavg()[0]:.1f}"}


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
            cases = dict.fromkeys(((args.all_rows, None), (args.all_rows, DEFAULT_WINDOW), (args.rows, DEFAULT_WINDOW)))
            for count, window in cases:
                prompts = write_prompts(work / f"p{count}.jsonl", count)
                row = measure(url, prompts, str(work / f"out-{window}-{count}"), window)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


# The Scale section's part (docs/BENCHMARKS.md), from the rows `--json` keeps.
SCALE_JSON = Path(__file__).resolve().parents[1] / "docs" / "scale_window.json"
GOAL_BYTES = 64 * 2**20  # issue 43: 2M prompts (500k batches) raise Redis by at most this


def _saved(rows: list[dict] | None) -> list[dict]:
    if rows is None:
        return json.loads(SCALE_JSON.read_text()) if SCALE_JSON.exists() else []
    return rows


def scale_section(rows: list[dict] | None = None) -> list[str]:
    """"Broker memory: a window, not the whole run" (under "Scale"): prose, table, goal."""
    from bench.common import goal_table

    rows = _saved(rows)
    if not rows:
        return []
    lines = ["### Broker memory: a window, not the whole run", "",
             "Redis's `used_memory` growth for one `diffq submit` of short prompts at batch size 4 to a private",
             "redis-server, and the producer's rows/s (validation, plan parts to a local OUT, publishing), wall",
             "clock on 2 cores shared with other sessions (load: the 1-minute load average before–after).",
             "`all` is `--window all` (every batch a Celery message in Redis, as before issue 43); 4096 the",
             "default window per run and shape queue (producer/feed.py): the rest stays in OUT's plan until",
             "the feeder publishes it, so Redis holds the same ~8 MB at any run size.", "",
             "| window | rows | batches in Redis | batches in OUT | Redis bytes | bytes per item | seconds | rows/s "
             "| load | command |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['window']} | {r['rows']:,} | {r['batches_published']:,} | {r['batches_in_out']:,} | "
              f"{r['redis_bytes']:,} | {r['redis_bytes_per_item']} | {r['seconds']} | {r['rows_per_s']:,} | "
              f"{r.get('load', '?')} | `python -m bench.window --rows {rows[-1]['rows']} --all-rows {rows[0]['rows']}` |"
              for r in rows]
    return [*lines, "", *goal_table(scale_goals(rows)), ""]


def scale_goals(rows: list[dict] | None = None) -> list[tuple[str, bool, str]]:
    rows = [r for r in _saved(rows) if r["window"] != "all" and r["rows"] >= 2_000_000]
    if not rows:
        return []
    worst = max(rows, key=lambda r: r["redis_bytes"])
    return [("2M prompts (500k batches) submitted raise Redis's used_memory by ≤ 64 MB",
             worst["redis_bytes"] <= GOAL_BYTES,
             f"{worst['redis_bytes'] / 2**20:.1f} MiB at {worst['rows']:,} rows, window {worst['window']}")]


if __name__ == "__main__":
    main()
