"""Producer at scale: submit 100k and 1M prompts over 8 shapes to a private Redis.

Each size runs in a fresh process so its peak RSS is its own. Goals: ≥ 50,000
prompts/s, peak RSS ≤ 300 MB, memory flat in the number of prompts.

    python -m bench.producer [--sizes 100000,1000000] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import redis_server

SIZES = [(64, 64), (128, 128), (64, 128), (128, 64), (256, 256), (96, 96), (160, 160), (192, 192)]


def write_prompts(path: Path, n: int) -> Path:
    with path.open("w") as handle:
        for i in range(n):
            h, w = SIZES[i % len(SIZES)]
            handle.write(json.dumps({"id": f"i{i:08d}", "prompt": f"a photo of item {i} in style {i % 97}",
                                     "height": h, "width": w}) + "\n")
    return path


def one(prompts: str, broker: str, out: str, batch_size: int) -> dict:
    """Runs in its own process: submit, then report speed and this process's peak RSS."""
    from diffq.producer.submit import submit

    started = time.perf_counter()
    result = submit(prompts, out, model="/models/bench", broker_url=broker, batch_size=batch_size)
    seconds = time.perf_counter() - started
    import redis

    queued = sum(redis.Redis.from_url(broker).llen(q) for q in result.queues)
    return {"prompts": result.total, "shapes": result.shapes, "batches": result.batches, "queued": queued,
            "seconds": round(seconds, 2), "prompts_per_s": round(result.total / seconds),
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process image's high-water RSS. (ru_maxrss would carry the parent's
    peak across fork + exec on Linux, and the bench parent has torch loaded.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--one", nargs=3, metavar=("PROMPTS", "BROKER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one, args.batch_size)))
        return []

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-producer-"))
    rows = []
    with redis_server(workdir) as broker:
        for n in [int(s) for s in args.sizes.split(",")]:
            prompts = write_prompts(workdir / f"p{n}.jsonl", n)
            proc = subprocess.run([sys.executable, "-m", "bench.producer", "--batch-size", str(args.batch_size),
                                   "--one", str(prompts), broker, str(workdir / f"run{n}")],
                                  capture_output=True, text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["command"] = f"python -m bench.producer --sizes {n}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            import redis

            redis.Redis.from_url(broker).flushall()
    return rows


if __name__ == "__main__":
    main()
