"""What storing a batch beside generation costs the generating process.

One process, one pipeline, the issue's workload. Each round generates batches back
to back three ways, interleaved so drift hits all of them alike:
`none` (the raw loop: nothing stored), `thread` (the sink's encode/store threads in
the generating process, DIFFQ_SINK=thread) and `process` (the sink in its helper
process, the default). The figure is the median pipeline-call time per batch; the
GIL is what `thread` pays for (the tiny model's steps are Python-bound). The helper's
CPU time per batch (encode + store + record + credit) is what a worker adds on top
of the raw loop where no core is spare (2 workers on 2 cores).

    python -m bench.sink [--rounds 6] [--batches 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.e2e import WORKLOAD

MODES = ("none", "thread", "process")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=8, help="batches per mode per round")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
    from diffq.core.storage import open_storage
    from diffq.app.tiny import build_tiny_pipeline
    from diffq.worker.device.backends import BACKENDS
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.sink.store import Sink
    from diffq.worker.sink.helper import SinkProcess

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-sink-"))
    model = str(build_tiny_pipeline(workdir / "tiny"))
    host = PipelineHost(backend=BACKENDS["cpu"])
    shape = ShapeKey(model=model, height=WORKLOAD["height"], width=WORKLOAD["width"],
                     batch_size=WORKLOAD["batch_size"], max_sequence_length=WORKLOAD["max_sequence_length"],
                     cfg=False)
    params = BatchParams(num_inference_steps=WORKLOAD["steps"], guidance_scale=1.0)
    sinks = {"thread": Sink(), "process": SinkProcess()}
    sinks["process"].start()
    storage = open_storage(str(workdir / "out"))
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    counter = 0

    def batch() -> BatchMessage:
        items = [BatchItem(id=f"i{counter}-{n}", prompt=f"bench prompt {counter} {n}", seed=counter * 8 + n)
                 for n in range(shape.batch_size)]
        return BatchMessage(run_id="bench", out=storage.url, batch_id=f"b{counter}", shape=shape, params=params,
                            items=items)

    host.generate(shape, params, batch().items)  # load + first call
    helper_cpu = 0.0
    for _ in range(args.rounds):
        for mode in MODES:
            previous = None
            helper = sinks["process"]._helper.process.pid
            cpu_before = cpu_seconds(helper)
            for _ in range(args.batches):
                counter += 1
                message = batch()
                started = time.perf_counter()
                generated = host.generate(shape, params, message.items)
                seconds[mode].append(time.perf_counter() - started)
                if mode != "none":
                    if previous is not None:
                        previous.stored.result()  # the worker's back-pressure: one batch in the sink
                    previous = sinks[mode].submit(storage, message, generated.images, {
                        "device": "cpu:0", "worker": "bench", "generate_s": seconds[mode][-1],
                        "generate_started_at": time.time() - seconds[mode][-1], "generate_ended_at": time.time()})
            if previous is not None:
                previous.credited.result()
            if mode == "process":
                helper_cpu += cpu_seconds(helper) - cpu_before
    for sink in sinks.values():
        sink.close()
    base = statistics.median(seconds["none"])
    rows = [dict(sink=mode, batches=len(seconds[mode]), generate_s=round(statistics.median(seconds[mode]), 4),
                 slowdown=round(statistics.median(seconds[mode]) / base, 3),
                 helper_cpu_ms_per_batch=(round(1000 * helper_cpu / len(seconds[mode]), 1)
                                          if mode == "process" else None),
                 command=f"python -m bench.sink --rounds {args.rounds} --batches {args.batches}")
            for mode in MODES]
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
