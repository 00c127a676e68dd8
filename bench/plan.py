"""`diffq plan` (the producer's validation pass) with and without size buckets.

Each case runs in a fresh process: CPU time of `plan()` per row and the process's
peak RSS. Cases: three tidy sizes without buckets, the same with buckets, and
random sizes 64..2047 (nearly all distinct) with buckets.

    python -m bench.plan [--rows 1000000] [--buckets aspect-1024]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import peak_rss_mb

TIDY = [(1024, 1024), (832, 1216), (1216, 832)]


def write_rows(path: Path, n: int, tidy: bool) -> Path:
    rng = random.Random(3)
    with path.open("w") as handle:
        for i in range(n):
            h, w = rng.choice(TIDY) if tidy else (rng.randrange(64, 2048), rng.randrange(64, 2048))
            handle.write(f'{{"prompt": "a photo of thing {i}", "height": {h}, "width": {w}}}\n')
    return path


def one(prompts: str, buckets: str | None) -> dict:
    from diffq.producer.submit import plan

    started = time.process_time()
    result = plan(prompts, model="/models/bench", batch_size=8, size_buckets=buckets or None)
    cpu = time.process_time() - started
    return {"rows": result.total, "buckets": buckets, "shapes": len(result.shapes),
            "distinct_requested": sum(s.requested_sizes for s in result.shapes),
            "cpu_us_per_row": round(cpu / result.total * 1e6, 2), "peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--buckets", default="aspect-1024")
    parser.add_argument("--one", nargs=2, metavar=("PROMPTS", "BUCKETS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] if args.one[1] != "-" else None)))
        return []
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-plan-"))
    tidy = write_rows(workdir / "tidy.jsonl", args.rows, tidy=True)
    varied = write_rows(workdir / "varied.jsonl", args.rows, tidy=False)
    rows = []
    try:
        for prompts, buckets in ((tidy, "-"), (tidy, args.buckets), (varied, args.buckets)):
            proc = subprocess.run([sys.executable, "-m", "bench.plan", "--one", str(prompts), buckets],
                                  capture_output=True, text=True, check=True)
            row = {"file": prompts.stem, **json.loads(proc.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
