"""`diffq status` at scale: a synthesised run folder of N items, read locally and from S3.

The folder holds what workers write (one record file per batch of 8, and each
worker process's progress segments crediting its batches, byte for byte what the
sink leaves), plus a few batches that failed, were split, and half failed again
(derived batches and failure files, the exact-count path that needs item ids).
Images are not written: status never reads them.

    python -m bench.status [--items 1000000] [--s3-items 100000] [--s3-summary-items 1000000]
                           [--workers 16] [--failed-batches 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import s3_bucket

BATCH = 8


def synthesise(out: str, items: int, workers: int = 16, failed_batches: int = 10,
               records: bool = True) -> tuple[int, int]:
    """Write the run folder; returns the (done, failed) items status must report."""
    from diffq.core import layout
    from diffq.core.contract import ShapeKey
    from diffq.core.progress import ProgressLog
    from diffq.core.records import FailureRecord, ImageRecord, RunManifest, ShapeSummary, jsonl
    from diffq.core.storage import open_storage

    storage = open_storage(out)
    shape = ShapeKey(model="/models/bench", height=128, width=128, batch_size=BATCH, max_sequence_length=64, cfg=False)
    batches = items // BATCH
    manifest = RunManifest(run_id="bench", created_at=time.time(), source="bench.jsonl", out=storage.url,
                           total=items, batches=batches, plan_parts=0,
                           shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=items, batches=batches)],
                           defaults={}, diffq_version="bench")
    storage.put_bytes(layout.MANIFEST, manifest.model_dump_json().encode())
    # Spread the failing batches over the run; each splits, its first half is done,
    # its second half fails.
    failing = {round(k * batches / failed_batches) for k in range(failed_batches)} if failed_batches else set()

    def item_ids(batch: int) -> list[str]:
        return [f"i{batch * BATCH + k}" for k in range(BATCH)]

    def done_batches() -> list[tuple[str, list[str]]]:
        out = []
        for batch in range(batches):
            ids = item_ids(batch)
            out.append((f"b{batch:07d}.s0", ids[:BATCH // 2]) if batch in failing else (f"b{batch:07d}", ids))
        return out

    done = done_batches()

    def write_record(pair: tuple[str, list[str]]) -> None:
        batch_id, ids = pair
        records = [ImageRecord(file_name=f"images/{i}.png", id=i, prompt="p", seed=1, height=128, width=128,
                               steps=4, guidance_scale=1.0, model=shape.model, run_id="bench", batch_id=batch_id,
                               queue=shape.queue, device="cpu:0", worker="w", generate_s=0.2,
                               generate_started_at=0.0, generate_ended_at=0.2, store_s=0.0, finished_at=0.0)
                   for i in ids]
        storage.put_bytes(layout.record_key(batch_id), jsonl(records), if_absent=True)

    def write_failure(batch: int) -> None:
        batch_id = f"b{batch:07d}.s1"
        storage.put_bytes(layout.failure_key(batch_id), FailureRecord(
            run_id="bench", batch_id=batch_id, item_ids=item_ids(batch)[BATCH // 2:], error="OOM",
            attempts=3, worker="w", failed_at=0.0).model_dump_json().encode(), if_absent=True)

    with ThreadPoolExecutor(32) as pool:
        if records:  # status never reads them; they only make moto's listings slower
            list(pool.map(write_record, done, chunksize=64))
        list(pool.map(write_failure, failing))
    # Batches go round-robin to the workers; each credits its own in its segments.
    # The sink rewrites a segment after every batch; the last rewrite is this.
    logs = [ProgressLog(storage, writer=f"bench-w{w:03d}") for w in range(workers)]
    for index, (batch_id, ids) in enumerate(done):
        logs[index % workers].add(batch_id, shape.queue, ids)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(ProgressLog.flush, logs))
    failed = len(failing) * (BATCH - BATCH // 2)
    return items - failed, failed


def timed_status(out: str, repeats: int = 3) -> tuple[float, int, int]:
    from diffq.results.status import status

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        st = status(out)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2], st.done, st.failed


def measure(where: str, out: str, items: int, command: str, **options) -> dict:
    from diffq.core import layout
    from diffq.core.storage import open_storage

    started = time.perf_counter()
    expected = synthesise(out, items, **options)
    synth_s = time.perf_counter() - started
    seconds, done, failed = timed_status(out)
    assert (done, failed) == expected, f"status says {(done, failed)}, the folder holds {expected}"
    segments = sum(1 for _ in open_storage(out).list(layout.PROGRESS_PREFIX))
    record_files = items // BATCH if options.get("records", True) else 0
    row = {"where": where, "items": items, "record_files": record_files, "progress_segments": segments,
           "done": done, "failed": failed, "status_s": round(seconds, 2), "synthesise_s": round(synth_s, 1),
           "command": command}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--s3-items", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=16, help="worker processes that wrote the run")
    parser.add_argument("--failed-batches", type=int, default=10, help="batches split with one half failed")
    parser.add_argument("--s3-summary-items", type=int, default=0,
                        help="also an S3 folder of this many items holding only what status reads (progress "
                             "segments, failures): writing 125,000 records into moto takes ~8 min per 1M items")
    args = parser.parse_args(argv)
    options = {"workers": args.workers, "failed_batches": args.failed_batches}
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-status-"))
    rows = []
    if args.items:
        rows.append(measure("local", str(workdir / "run"), args.items,
                            f"python -m bench.status --items {args.items}", **options))
    if args.s3_items:
        with s3_bucket(workdir) as bucket:
            rows.append(measure("s3 (moto, loopback)", f"{bucket}/run", args.s3_items,
                                f"python -m bench.status --s3-items {args.s3_items}", **options))
    if args.s3_summary_items:
        with s3_bucket(workdir) as bucket:
            rows.append(measure("s3 (moto), summary only", f"{bucket}/run", args.s3_summary_items,
                                f"python -m bench.status --s3-summary-items {args.s3_summary_items}",
                                records=False, **options))
    return rows


if __name__ == "__main__":
    main()
