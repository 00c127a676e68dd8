"""Cold vs warm start of a worker against a shared compile cache (CPU, Inductor).

Two fresh `diffq worker --warmup-only` processes on a tiny pipeline, each with its
own empty local mirror of one remote cache (as two hosts would be): the first
compiles and pushes, the second pulls and should compile nothing. Goal: warm
compile ≤ 0.2 × cold.

    python bench/compile_cache.py [--family flux2-klein] [--size 64] [--compile full|regional] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffq.core.contract import ShapeKey, queue_name
from diffq.app.tiny import build_tiny_pipeline


def warm(model: str, queue: str, compile_mode: str, remote: str, local: Path) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "diffq", "worker", "--broker", "memory://", "--model", model,
         "--queues", queue, "--compile", compile_mode, "--compile-cache", remote,
         "--compile-cache-local", str(local), "--warmup-only"],
        capture_output=True, text=True, check=True,
    )
    wall = time.perf_counter() - started
    report = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event": "warm"'))
    return report, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux2-klein", choices=("flux2-klein", "flux"))
    parser.add_argument("--size", type=int, default=64, help="height = width (multiple of 16)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--compile", default="full", choices=("full", "regional"))
    parser.add_argument("--repeats", type=int, default=1, help="cold/warm pairs, each on fresh caches; the median pair is shown")
    args = parser.parse_args()

    pairs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="diffq-bench-") as tmp:
            root = Path(tmp)
            model = str(build_tiny_pipeline(root / "model", family=args.family))
            queue = queue_name(ShapeKey(model=model, height=args.size, width=args.size,
                                        batch_size=args.batch_size, max_sequence_length=16, cfg=False))
            remote = (root / "remote").as_uri()
            cold, cold_wall = warm(model, queue, args.compile, remote, root / "host-a")
            warm_, warm_wall = warm(model, queue, args.compile, remote, root / "host-b")
            pairs.append((warm_["compile"]["seconds"] / cold["compile"]["seconds"], cold, cold_wall, warm_, warm_wall))
    pairs.sort(key=lambda pair: pair[0])
    ratio, cold, cold_wall, warm_, warm_wall = pairs[len(pairs) // 2]
    print(f"{args.family} {args.size}x{args.size} b{args.batch_size}, --compile {args.compile}, Inductor on CPU"
          + (f" (median of {args.repeats} pairs: {', '.join(f'{pair[0]:.2f}' for pair in pairs)})" if args.repeats > 1 else ""))
    print(f"{'':6} {'compile s':>10} {'process s':>10} {'graphs':>7} {'cache hit/miss':>15} {'pulled':>7} {'pushed':>7}")
    for name, report, wall in (("cold", cold, cold_wall), ("warm", warm_, warm_wall)):
        cache = report["compile"]["cache"]
        hits = f"{cache.get('fxgraph_cache_hit', 0)}/{cache.get('fxgraph_cache_miss', 0)}"
        print(f"{name:6} {report['compile']['seconds']:10.1f} {wall:10.1f} {report['compile']['graphs']:7d} "
              f"{hits:>15} {report['cache']['pulled']:7d} {report['cache']['pushed']:7d}")
    print(f"warm/cold compile = {ratio:.2f} (goal ≤ 0.20): {'ok' if ratio <= 0.2 else 'MISSED'}")


if __name__ == "__main__":
    main()
