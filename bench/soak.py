"""Soak: does a worker's memory creep over many batches? (issue 64)

Runs the worker's host side for N batches (default 20,000) in this process: each batch
over one of several LoRA adapter sets (more sets than the metrics label, so the `other`
cap is crossed), its images stored, recorded and credited by the real sink
(worker/sink/store.py: encode, put, progress log), its metrics observed as the batch
hook does (per queue and per set), and every `--refresh-every` batches the progress
summary refreshed as `status`, `watch` and the runner do. The process's RSS is sampled
every `--sample-every` batches; the report is the peak and the growth per 1,000 batches
after warm-up (a least-squares slope over the samples after the first quarter).

Not in it: the pipeline itself (its memory is the device's and is fixed once compiled)
and the backlog service over a simulated day (not built yet: see docs/BENCHMARKS.md).

    python -m bench.soak                 # 20,000 batches
    python -m bench.soak --quick         # 600 batches: a smoke run (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


def growth_per_1000(samples: list[tuple[int, float]], warmup: float = 0.25) -> float:
    """MB per 1,000 batches: the slope of RSS over batches after the first `warmup` of the run."""
    kept = [(b, mb) for b, mb in samples if b >= warmup * samples[-1][0]]
    if len(kept) < 2:
        return 0.0
    x, y = np.array([b for b, _ in kept], float), np.array([mb for _, mb in kept])
    return float(np.polyfit(x, y, 1)[0] * 1000)


def soak(out: str, batches: int, sets: int = 40, items: int = 2, side: int = 16, sample_every: int = 100,
         refresh_every: int = 50) -> dict:
    from diffq.core.adapters import set_digest
    from diffq.core.contract import AdapterRef, BatchItem, BatchMessage, BatchParams, ShapeKey
    from diffq.core.progress import ProgressSummary
    from diffq.core.storage import open_storage
    from diffq.worker.observe import metrics
    from diffq.worker.sink.store import Sink

    storage = open_storage(out)
    shape = ShapeKey(model="soak", height=side, width=side, batch_size=items, max_sequence_length=64, cfg=False)
    adapter_sets = [(AdapterRef(path=f"s3://loras/style-{n}.safetensors", revision=f"sha256:{n:032x}",
                                scale=1.0),) for n in range(sets)]
    params = [BatchParams(num_inference_steps=2, guidance_scale=1.0, adapters=refs) for refs in adapter_sets]
    digests = [set_digest(refs) for refs in adapter_sets]
    images = [np.full((side, side, 3), n, np.uint8) for n in range(items)]
    measures = {"device": "cpu:0", "worker": "soak", "generate_s": 0.01, "generate_started_at": 1.7e9,
                "generate_ended_at": 1.7e9 + 0.01, "lora_mode": "swap"}
    sink, summary = Sink(threads=2), ProgressSummary(storage)
    samples: list[tuple[int, float]] = [(0, rss_mb())]
    started = time.perf_counter()
    try:
        for b in range(batches):
            n = b % sets
            message = BatchMessage(run_id="soak", out=storage.url, batch_id=f"{shape.height}x{shape.width}-soak-{b:07d}",
                                   shape=shape, params=params[n],
                                   items=[BatchItem(id=f"i{b}-{k}", prompt="p", seed=k) for k in range(items)])
            handed = sink.submit(storage, message, images, measures)
            handed.stored.result(timeout=120)
            handed.credited.result(timeout=120)
            metrics.observe_batch(shape.queue, items, 0.01, digests[n])
            if (b + 1) % refresh_every == 0:
                summary.refresh()
            if (b + 1) % sample_every == 0:
                samples.append((b + 1, rss_mb()))
    finally:
        sink.close()
    summary.refresh()
    return {"batches": batches, "sets": sets, "done": summary.done,
            "done_per_set": len([d for d in summary.done_per_set if d]),
            "seconds": round(time.perf_counter() - started, 1), "rss_start_mb": round(samples[0][1], 1),
            "rss_peak_mb": round(max(mb for _, mb in samples), 1),
            "growth_mb_per_1000_batches": round(growth_per_1000(samples), 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--sets", type=int, default=40, help="adapter sets, round robin (past the 32-label cap)")
    parser.add_argument("--quick", action="store_true", help="600 batches: a smoke run")
    parser.add_argument("--out", help="run folder (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    batches = 600 if args.quick else args.batches
    workdir = Path(tempfile.mkdtemp(prefix="diffq-soak-"))
    try:
        result = soak(args.out or str(workdir / "run"), batches, sets=args.sets,
                      sample_every=max(10, batches // 200))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["command"] = "python -m bench.soak" + (" --quick" if args.quick else f" --batches {batches}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
