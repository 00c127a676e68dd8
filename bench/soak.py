"""Soak: does a worker's memory creep over many batches? (issue 64)

Runs the worker's host side for N batches (default 20,000) in this process: each batch
over one of several LoRA adapter sets (more sets than the metrics label, so the `other`
cap is crossed), its images stored, recorded and credited by the real sink
(worker/sink/store.py: encode, put, progress log), its metrics observed as the batch
hook does (per queue and per set), and every `--refresh-every` batches the progress
summary refreshed as `status`, `watch` and the runner do. The process's RSS is sampled
every `--sample-every` batches; the report is the peak and the growth per 1,000 batches
after warm-up (a least-squares slope over the samples after the first quarter).

Then the backlog service's run metrics (diffq/app/run_metrics.py, the collector its
/metrics serves) over a simulated day of scrapes (`--scrapes`, default 5,760: one per
15 s): a run starts every simulated hour and is credited a few batches a scrape, leaves
the feeds listing finished after three hours, and every fourth one leaves unfinished
and then has its folder deleted (an abandoned run); RSS per 1,000 scrapes the same way.

Not in it: the pipeline itself (its memory is the device's and is fixed once compiled).

    python -m bench.soak                 # 20,000 batches, a day of scrapes
    python -m bench.soak --quick         # 600 batches, 600 scrapes: a smoke run
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


def backlog_soak(root: str, scrapes: int, every_s: float = 15.0, sample_every: int = 50) -> dict:
    from prometheus_client import generate_latest

    from bench.common import run_defaults
    from diffq.app.run_metrics import RunMetrics, registry
    from diffq.core import layout
    from diffq.core.contract import ShapeKey
    from diffq.core.progress import ProgressLog
    from diffq.core.records import RunManifest, ShapeSummary
    from diffq.core.storage import open_storage

    shape = ShapeKey(model="soak", height=64, width=64, batch_size=4, max_sequence_length=64, cfg=False)
    per_hour, life_scrapes, batches = int(3600 / every_s), int(3 * 3600 / every_s), 2000
    listed: dict[str, tuple] = {}  # out -> (log, next batch, scrape it started, abandoned)
    clock = [1.7e9]
    metrics = RunMetrics(runs=lambda: list(listed), clock=lambda: clock[0])
    reg = registry(metrics)
    samples: list[tuple[int, float]] = [(0, rss_mb())]
    started, runs = time.perf_counter(), 0
    for n in range(scrapes):
        clock[0] += every_s
        if n % per_hour == 0:
            out = str(Path(root) / f"run-{runs}")
            storage = open_storage(out)
            storage.put_bytes(layout.MANIFEST, RunManifest(
                run_id=f"soak-{runs}", created_at=clock[0], source="soak.jsonl", out=storage.url,
                total=batches * 4, batches=batches, plan_parts=0,
                shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=batches * 4, batches=batches)],
                defaults=run_defaults(shape), diffq_version="soak").model_dump_json().encode())
            listed[out] = (ProgressLog(storage, writer="w"), 0, n, runs % 4 == 3)
            runs += 1
        for out, (log, at, since, abandoned) in list(listed.items()):
            rate = max(1, batches // life_scrapes + 1)
            take = min(batches - at, rate // 2 if abandoned else rate)  # an abandoned run never finishes
            for index in range(at, at + take):
                log.add(f"soak-{index:05d}", shape.queue, ["x"] * 4)
            if take:
                log.flush()
            listed[out] = (log, at + take, since, abandoned)
            if n - since >= life_scrapes:
                del listed[out]  # leaves the feeds listing: finished, or abandoned and deleted
                if abandoned:
                    shutil.rmtree(out, ignore_errors=True)
        generate_latest(reg)
        if (n + 1) % sample_every == 0:
            samples.append((n + 1, rss_mb()))
    return {"scrapes": scrapes, "runs": runs, "runs_held": len(metrics._runs),
            "seconds": round(time.perf_counter() - started, 1), "rss_start_mb": round(samples[0][1], 1),
            "rss_peak_mb": round(max(mb for _, mb in samples), 1),
            "growth_mb_per_1000_scrapes": round(growth_per_1000(samples), 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--sets", type=int, default=40, help="adapter sets, round robin (past the 32-label cap)")
    parser.add_argument("--scrapes", type=int, default=5760, help="backlog scrapes, 15 s apart (a day: 5,760)")
    parser.add_argument("--quick", action="store_true", help="600 batches and 600 scrapes: a smoke run")
    parser.add_argument("--out", help="run folder (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    batches = 600 if args.quick else args.batches
    workdir = Path(tempfile.mkdtemp(prefix="diffq-soak-"))
    try:
        result = {"worker": soak(args.out or str(workdir / "run"), batches, sets=args.sets,
                                 sample_every=max(10, batches // 200))}
        scrapes = 600 if args.quick else args.scrapes
        if scrapes:
            result["backlog"] = backlog_soak(str(workdir / "backlog"), scrapes, sample_every=max(10, scrapes // 200))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["command"] = "python -m bench.soak" + (" --quick" if args.quick else f" --batches {batches}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
