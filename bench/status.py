"""`diffq status` at scale: a synthesised run folder of N items (records written as
workers write them: one record file per batch of 8), read locally and from S3.

    python -m bench.status [--items 1000000] [--s3-items 100000]
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


def synthesise(out: str, items: int) -> None:
    from diffq import layout
    from diffq.contract import RunManifest, ShapeKey, ShapeSummary
    from diffq.storage import open_storage

    storage = open_storage(out)
    shape = ShapeKey(model="/models/bench", height=128, width=128, batch_size=BATCH, max_sequence_length=64, cfg=False)
    manifest = RunManifest(run_id="bench", created_at=time.time(), source="bench.jsonl", out=storage.url,
                           total=items, batches=items // BATCH, plan_parts=0,
                           shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=items, batches=items // BATCH)],
                           defaults={}, diffq_version="bench")
    storage.put_bytes(layout.MANIFEST, manifest.model_dump_json().encode())

    def write(batch: int) -> None:
        lines = "".join(json.dumps({"file_name": f"images/i{batch * BATCH + k}.png", "id": f"i{batch * BATCH + k}",
                                    "prompt": "p", "seed": 1, "height": 128, "width": 128, "steps": 4,
                                    "guidance_scale": 1.0, "model": shape.model, "run_id": "bench",
                                    "batch_id": f"b{batch:07d}", "queue": shape.queue, "generate_s": 0.2,
                                    "finished_at": 0.0}) + "\n" for k in range(BATCH))
        storage.put_bytes(layout.record_key(f"b{batch:07d}"), lines.encode())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(write, range(items // BATCH)))


def timed_status(out: str, repeats: int = 3) -> tuple[float, int]:
    from diffq.producer.results import status

    times, done = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        done = status(out).done
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2], done


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--s3-items", type=int, default=100_000)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-status-"))
    rows = []
    out = str(workdir / "run")
    synthesise(out, args.items)
    seconds, done = timed_status(out)
    rows.append({"where": "local", "items": args.items, "record_files": args.items // BATCH, "done": done,
                 "status_s": round(seconds, 2), "command": f"python -m bench.status --items {args.items}"})
    print(json.dumps(rows[-1]), flush=True)
    if args.s3_items:
        with s3_bucket(workdir) as bucket:
            out = f"{bucket}/run"
            synthesise(out, args.s3_items)
            seconds, done = timed_status(out)
        rows.append({"where": "s3 (moto, loopback)", "items": args.s3_items, "record_files": args.s3_items // BATCH,
                     "done": done, "status_s": round(seconds, 2),
                     "command": f"python -m bench.status --s3-items {args.s3_items}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
