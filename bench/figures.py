"""The figures behind a few design choices that code comments used to quote.

    python -m bench.figures [--rows 20000] [--files 12500]

- prompt rows: orjson vs the standard json parser on short JSONL rows (producer/sources.py);
- local reads: run-folder record files read one after another (LocalStorage) vs
  through the object stores' 16-thread `get_many` (diffq/core/storage/local.py);
- client imports: seconds to import boto3 and google-cloud-storage in a fresh
  interpreter, why storage loads them on demand (diffq/core/storage/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _best(function, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def prompt_rows(rows: int) -> dict:
    import orjson

    lines = [json.dumps({"id": f"item-{i:07d}", "prompt": f"a photo of a red fox in the snow, take {i}",
                         "height": 1024, "width": 1024}) + "\n" for i in range(rows)]
    standard = _best(lambda: [json.loads(line) for line in lines])
    fast = _best(lambda: [orjson.loads(line) for line in lines])
    return {"figure": "short JSONL prompt rows parsed: time with json / time with orjson",
            "value": round(standard / fast, 2), "unit": "×",
            "command": f"python -m bench.figures --rows {rows}"}


def local_reads(files: int) -> dict:
    from diffq.core.records import ImageRecord, jsonl
    from diffq.core.storage import Storage, open_storage

    root = Path(tempfile.mkdtemp(prefix="diffq-bench-figures-"))
    storage = open_storage(str(root))
    record = ImageRecord(file_name="images/x.png", id="x", prompt="p" * 60, seed=1, height=128, width=128, steps=4,
                         guidance_scale=1.0, model="m", run_id="r", batch_id="b", queue="q", device="cpu:0",
                         worker="w", generate_s=0.1, generate_started_at=0.0, generate_ended_at=0.1, store_s=0.01,
                         finished_at=0.1)
    body = jsonl([record] * 8)
    keys = [f"records/b{i:07d}.jsonl" for i in range(files)]
    for key in keys:
        storage.put_bytes(key, body)

    # The object stores' get_many (16 threads, a bounded window) against the local one.
    pooled = _best(lambda: list(Storage.get_many(storage, keys)))
    sequential = _best(lambda: list(storage.get_many(keys)))
    return {"figure": f"{files:,} local record files read: time in threads (`Storage.get_many`) / "
                      "time one after another (`LocalStorage.get_many`)",
            "value": round(pooled / sequential, 2), "unit": "×", "command": f"python -m bench.figures --files {files}"}


def client_imports() -> list[dict]:
    rows = []
    for module in ("boto3", "google.cloud.storage"):
        code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
        seconds = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout) for _ in range(3)]
        rows.append({"figure": f"import {module}, fresh interpreter (median of 3)",
                     "value": round(statistics.median(seconds), 2), "unit": "s", "command": "python -m bench.figures"})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--files", type=int, default=12_500)
    args = parser.parse_args(argv)
    rows = [prompt_rows(args.rows), local_reads(args.files), *client_imports()]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
