"""Compile-aware routing on a mixed-shape run: how many (worker, shape) compiles a
fleet of W workers does over S shapes, with Celery's round-robin vs diffq's routing.
Each worker compiles a shape the first time it takes a batch of it, so the count of
distinct (worker, queue) pairs in the records is the number of compiles.

    python -m bench.routing [--workers 2] [--shapes 4] [--batches 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.common import redis_server


def one_run(mode: str, server_url: str, model: str, workdir: Path, shapes: int, batches: int, workers: int) -> dict:
    from diffq.core.runfolder import iter_records
    from diffq.results.status import status
    from diffq.producer.submit import submit
    from diffq.core.storage import open_storage
    from diffq.worker.process.supervisor import Supervisor, plan_children

    sizes = [32 + 16 * i for i in range(shapes)]
    rows = [{"id": f"{mode}-{h}-{i}", "prompt": f"p {i}", "height": h, "width": h}
            for h in sizes for i in range(2 * batches)]
    prompts = workdir / f"{mode}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(workdir / mode)
    result = submit(prompts, out, model=model, broker_url=server_url, batch_size=2, steps=1)
    supervisor = Supervisor(plan_children(device="cpu", devices=list(range(workers)), broker_url=server_url,
                                          queues=sorted(result.queues), models=[model], routing=mode,
                                          loglevel="ERROR"))
    started = time.perf_counter()
    supervisor.start()
    try:
        while status(out).done < len(rows):
            supervisor.poll()
            time.sleep(0.2)
    finally:
        supervisor.stop(timeout=60)
    pairs = {(r.worker, r.queue) for r in iter_records(open_storage(out))}
    return {"routing": mode, "workers": workers, "shapes": shapes, "batches": len(rows) // 2,
            "shape_compiles": len(pairs), "seconds": round(time.perf_counter() - started, 1),
            "command": f"python -m bench.routing --workers {workers} --shapes {shapes} --batches {batches}"}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shapes", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="batches per shape")
    args = parser.parse_args(argv)
    from diffq.app.tiny import build_tiny_pipeline

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-routing-"))
    model = str(build_tiny_pipeline(workdir / "tiny"))
    rows = []
    with redis_server(workdir) as broker:
        for mode in ("round-robin", "compile-aware"):
            rows.append(one_run(mode, broker, model, workdir, args.shapes, args.batches, args.workers))
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
