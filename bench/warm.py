"""Warm start, whole process: a second worker on the same compile cache against a cold one.

The same command shape as bench/compile_cache.py (tiny pipeline, `diffq worker
--warmup-only`, one remote cache, each process with its own empty local mirror as
two hosts would have), timed from spawn to exit, and split by the worker's own
report: model load, warm-up (compile, or the cache load), and the rest (interpreter
and imports before the load, exit after the report); beside the wall time, the CPU
seconds of the process tree, steadier than wall time on a shared machine. Goal
(issue 29): warm ≤ 0.25 × cold, whole process. Beside them, the same worker with
`--compile none`: everything a start does but compile (interpreter, imports, model
load, sink helper, exit), the floor no compile cache can go below.

`--fresh-tmp` gives every process its own TMPDIR: Inductor keeps precompiled C++
headers under the temp dir, outside the compile cache, so only this shows a host
that never compiled before.

    python -m bench.warm [--compile full|regional] [--size 64] [--repeats 3] [--fresh-tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffq.app.tiny import build_tiny_pipeline
from diffq.core.contract import ShapeKey, queue_name

GOAL = 0.25


def start(model: str, queue: str, compile_mode: str, remote: str, local: Path, tmp: Path | None) -> dict:
    """One `diffq worker --warmup-only` process: its wall seconds and its warm report."""
    env = {**os.environ, **({"TMPDIR": str(tmp)} if tmp else {})}
    if tmp:
        tmp.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "diffq", "worker", "--broker", "memory://", "--model", model,
         "--queues", queue, "--compile", compile_mode, "--compile-cache", remote,
         "--compile-cache-local", str(local), "--warmup-only"],
        capture_output=True, text=True, check=True, env=env,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the process tree (what was reaped): on a shared machine, steadier than wall.
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    report = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event": "warm"'))
    cache = report["compile"]["cache"]
    return {"process_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_s": report["load_s"], "warmup_s": report["warmup_s"],
            "rest_s": round(wall - report["load_s"] - report["warmup_s"], 2),
            "fxgraph_hit": cache.get("fxgraph_cache_hit", 0), "fxgraph_miss": cache.get("fxgraph_cache_miss", 0),
            "autograd_hit": cache.get("autograd_cache_hit", 0),
            "pulled": report["cache"]["pulled"], "pushed": report["cache"]["pushed"]}


def pair(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="diffq-bench-warm-") as tmp:
        root = Path(tmp)
        model = str(build_tiny_pipeline(root / "model", family=args.family))
        queue = queue_name(ShapeKey(model=model, height=args.size, width=args.size, batch_size=1,
                                    max_sequence_length=16, cfg=False))
        remote = (root / "remote").as_uri()
        runs = {name: start(model, queue, mode, remote, root / f"host-{name}",
                            root / f"tmp-{name}" if args.fresh_tmp else None)
                for name, mode in (("cold", args.compile), ("warm", args.compile), ("eager", "none"))}
    return {**runs, "ratio": round(runs["warm"]["process_s"] / runs["cold"]["process_s"], 3),
            "cpu_ratio": round(runs["warm"]["cpu_s"] / runs["cold"]["cpu_s"], 3),
            "floor_ratio": round(runs["eager"]["process_s"] / runs["cold"]["process_s"], 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux2-klein", choices=("flux2-klein", "flux"))
    parser.add_argument("--size", type=int, default=64, help="height = width (multiple of 16)")
    parser.add_argument("--compile", default="full", choices=("full", "regional"))
    parser.add_argument("--repeats", type=int, default=3, help="cold/warm pairs, each on fresh caches")
    parser.add_argument("--fresh-tmp", action="store_true", help="a TMPDIR per process (a new host)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    pairs = [pair(args) for _ in range(args.repeats)]
    load_after = os.getloadavg()[0]
    median = {name: statistics.median(p[name]["process_s"] for p in pairs) for name in ("cold", "warm", "eager")}
    ratio = statistics.median(p["ratio"] for p in pairs)
    floor = statistics.median(p["floor_ratio"] for p in pairs)
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    result = {"family": args.family, "size": args.size, "compile": args.compile, "fresh_tmp": args.fresh_tmp,
              "pairs": pairs, "median_process_s": median, "median_ratio": ratio,
              "median_cpu_ratio": cpu_ratio, "median_floor_ratio": floor, "goal": GOAL,
              "load_average": [round(load_before, 2), round(load_after, 2)]}
    if args.json:
        print(json.dumps(result))
        return result
    print(f"{args.family} {args.size}x{args.size} b1, --compile {args.compile}, Inductor on CPU, "
          f"{'a TMPDIR per process' if args.fresh_tmp else 'one TMPDIR'}; load average {load_before:.1f} → {load_after:.1f}")
    print(f"{'':10} {'process s':>9} {'cpu s':>6} {'load s':>7} {'warmup s':>9} {'rest s':>7} {'fx hit/miss':>12} "
          f"{'aot hit':>8} {'pulled':>7} {'pushed':>7}")
    for index, p in enumerate(pairs):
        for name in ("cold", "warm", "eager"):
            r = p[name]
            print(f"{name} {index + 1:<5} {r['process_s']:9.1f} {r['cpu_s']:6.1f} {r['load_s']:7.1f} {r['warmup_s']:9.1f} {r['rest_s']:7.1f} "
                  f"{r['fxgraph_hit']:>5}/{r['fxgraph_miss']:<6} {r['autograd_hit']:8d} {r['pulled']:7d} {r['pushed']:7d}")
    ratios = ", ".join(f"{p['ratio']:.2f}" for p in pairs)
    print(f"warm/cold whole process, median of {len(pairs)} pairs ({ratios}): "
          f"{ratio:.2f} (goal ≤ {GOAL}): {'ok' if ratio <= GOAL else 'MISSED'}; CPU seconds {cpu_ratio:.2f}; "
          f"no compile at all / cold {floor:.2f}")
    return result


if __name__ == "__main__":
    main()
