"""What handing a batch's pixels to the sink helper costs, next to encoding them.

The worker's sink (worker/sink/helper.py) is given batches of H×W×3 uint8 arrays,
as the pipeline host makes them, the stand-in's photo-like images (bench/standin.py).
Per format and size, interleaved: the helper's CPU seconds per image (from /proc:
receiving the pixels, building the images, encoding, writing, the record and the
credit) with the pixels in shared-memory slots and through the socket, against the
bare encode + write of the same images in one thread here. The helper's CPU minus the
bare loop's is what the hand-off and the bookkeeping cost; CPU time, unlike wall time,
does not grow when other work shares the cores.

    python -m bench.handoff [--sizes 1024,512] [--formats png,jpeg,webp] [--batches 6] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.sink import cpu_seconds
from bench.standin import image_pool

MODES = ("shared memory", "socket")


def through_sink(out: str, size: int, fmt: str, batches: int, batch: int, shared_memory: bool) -> float:
    """Helper CPU seconds per image, after one warm batch."""
    import numpy as np

    from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
    from diffq.core.storage import open_storage
    from diffq.worker.sink.helper import SinkProcess

    pool = image_pool(size, size)
    arrays = list(np.stack([np.asarray(pool[n % len(pool)]) for n in range(batch)]))
    shape = ShapeKey(model="standin", height=size, width=size, batch_size=batch, max_sequence_length=64, cfg=False)
    params = BatchParams(num_inference_steps=1, guidance_scale=1.0, format=fmt)
    storage = open_storage(out)
    measures = {"device": "bench:0", "dtype": "uint8", "worker": "bench", "generate_s": 0.0,
                "generate_started_at": 0.0, "generate_ended_at": 0.0}
    sink = SinkProcess(shared_memory=shared_memory)
    try:
        cpu_started = None
        for index in range(batches + 1):
            message = BatchMessage(run_id="handoff", out=out, batch_id=f"b{index:04d}-{time.time_ns()}", shape=shape,
                                   params=params, items=[BatchItem(id=f"i{index}-{n}-{time.time_ns()}", prompt="p",
                                                                   seed=n) for n in range(batch)])
            handed = sink.submit(storage, message, arrays, measures)
            handed.credited.result(timeout=600)
            if index == 0:  # warm: the helper's imports, the first slot, the encoder tables
                cpu_started = cpu_seconds(sink._helper.process.pid)
        return (cpu_seconds(sink._helper.process.pid) - cpu_started) / (batches * batch)
    finally:
        sink.close()


def bare(out: str, size: int, fmt: str, images: int) -> float:
    """CPU seconds per image of encode + write in a bare loop (this thread)."""
    from diffq.core.layout import IMAGE_FORMATS
    from diffq.core.storage import open_storage
    from diffq.worker.sink.store import encode

    storage = open_storage(out)
    pool = image_pool(size, size)
    encode(pool[0], fmt)
    started = time.thread_time()
    for n in range(images):
        storage.put_bytes(f"bare/{n:05d}-{time.time_ns()}.{fmt}", encode(pool[n % len(pool)], fmt),
                          content_type=IMAGE_FORMATS[fmt].content_type, if_absent=True)
    return (time.thread_time() - started) / images


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,512")
    parser.add_argument("--formats", default="png,jpeg,webp")
    parser.add_argument("--batches", type=int, default=6, help="measured batches per mode and round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the least CPU is kept")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-handoff-"))
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for fmt in args.formats.split(","):
            measured: dict[str, list[float]] = {mode: [] for mode in ("bare", *MODES)}
            for round_ in range(args.rounds):
                measured["bare"].append(bare(str(workdir / f"bare-{size}-{fmt}"), size, fmt, args.batches * args.batch))
                for mode in MODES:
                    measured[mode].append(through_sink(str(workdir / f"{mode[:3]}-{size}-{fmt}-{round_}"), size, fmt,
                                                       args.batches, args.batch, mode == "shared memory"))
            # The least of the rounds: other work only ever adds (cache, memory bandwidth).
            best = {mode: min(values) for mode, values in measured.items()}
            row = {"size": size, "format": fmt, "bare_ms_per_image": round(1000 * best["bare"], 3),
                   **{f"helper_ms_per_image_{mode.replace(' ', '_')}": round(1000 * best[mode], 3) for mode in MODES},
                   "rounds": {mode: [round(1000 * v, 3) for v in values] for mode, values in measured.items()},
                   "load_average": round(os.getloadavg()[0], 2)}
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(rows))
    return rows


def render(rows: list[dict]) -> list[str]:
    lines = ["| size | format | bare encode + write, CPU ms / img | helper, shared memory | helper, socket "
             "| hand-off + bookkeeping, shared memory / socket (ms / img) | load |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        shm, sock = row["helper_ms_per_image_shared_memory"], row["helper_ms_per_image_socket"]
        lines.append(f"| {row['size']}² | {row['format']} | {row['bare_ms_per_image']:.2f} | {shm:.2f} | {sock:.2f} | "
                     f"{shm - row['bare_ms_per_image']:.2f} / {sock - row['bare_ms_per_image']:.2f} | "
                     f"{row['load_average']} |")
    return lines


if __name__ == "__main__":
    main()
