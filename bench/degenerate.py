"""What the degenerate-image checks cost a batch (worker/device/pipeline_host.py checked_arrays).

The issue's workload on the tiny pipeline (bench/e2e.py WORKLOAD): the median
pipeline call per batch, and the 8-bit conversion of that call's real output tensor
with every check on against none, interleaved and repeated (a check's cost is far
below the pipeline call's own noise, so it is timed on its own). Beside it, the flat
check written as one `torch.aminmax` over each channel's pixels: why the code
reduces along memory in two passes instead.

    python -m bench.degenerate [--batches 8] [--repeats 400]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

from bench.e2e import WORKLOAD

COMMAND = "python -m bench.degenerate"


def _per_call(function, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=8, help="pipeline calls timed")
    parser.add_argument("--repeats", type=int, default=400, help="conversions timed per round (10 rounds)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # as a worker process runs (--threads 1)
    from diffq.app.tiny import build_tiny_pipeline
    from diffq.core.contract import BatchItem, BatchParams, ShapeKey
    from diffq.core.records import DEGENERATE_CHECKS
    from diffq.worker.device.backends import BACKENDS
    from diffq.worker.device.pipeline_host import PipelineHost, checked_arrays

    model = str(build_tiny_pipeline(Path(tempfile.mkdtemp(prefix="diffq-bench-degenerate-")) / "tiny"))
    every = frozenset(DEGENERATE_CHECKS)
    host = PipelineHost(backend=BACKENDS["cpu"], checks=every)
    shape = ShapeKey(model=model, height=WORKLOAD["height"], width=WORKLOAD["width"],
                     batch_size=WORKLOAD["batch_size"], max_sequence_length=WORKLOAD["max_sequence_length"],
                     cfg=False)
    params = BatchParams(num_inference_steps=WORKLOAD["steps"], guidance_scale=1.0)
    items = [BatchItem(id=f"i{n}", prompt=f"bench prompt {n}", seed=n) for n in range(shape.batch_size)]
    host.generate(shape, params, items)  # load + first call
    batch_s = statistics.median(host.generate(shape, params, items).generate_s for _ in range(args.batches))

    pipe = host.pipeline(model, shape.dtype)
    with torch.inference_mode():
        output = pipe(prompt=[item.prompt for item in items], height=shape.height, width=shape.width,
                      num_inference_steps=params.num_inference_steps, output_type="pt",
                      generator=[torch.Generator("cpu").manual_seed(item.seed) for item in items]).images
        pixels = output.float().mul(255).round().to(torch.uint8)
        timings: dict[str, list[float]] = {"none": [], "every": [], "8-bit": [], "flat": [], "aminmax": []}
        for _ in range(10):  # interleaved rounds: drift hits every variant alike
            timings["none"].append(_per_call(lambda: checked_arrays(output, frozenset()), args.repeats))
            timings["every"].append(_per_call(lambda: checked_arrays(output, every), args.repeats))
            timings["8-bit"].append(_per_call(lambda: checked_arrays(pixels, frozenset()), args.repeats))
            timings["flat"].append(_per_call(lambda: checked_arrays(pixels, frozenset({"flat"})), args.repeats))
            timings["aminmax"].append(_per_call(lambda: torch.aminmax(pixels.flatten(2), dim=2), args.repeats))
    best = {name: min(values) for name, values in timings.items()}  # least disturbed round
    checks_s = max(0.0, best["every"] - best["none"])
    label = f"{WORKLOAD['height']}², batch {WORKLOAD['batch_size']}, {WORKLOAD['steps']} steps"
    result = {
        "workload": label, "batch_s": batch_s, "checks_ms_per_batch": checks_s * 1e3,
        "checks_share_of_batch": checks_s / batch_s,
        "conversion_ms_unchecked": best["none"] * 1e3,
        # The flat check alone on 8-bit pixels (conversion to host arrays subtracted), and as one aminmax.
        "flat_ms": max(0.0, best["flat"] - best["8-bit"]) * 1e3, "flat_aminmax_ms": best["aminmax"] * 1e3,
        "torch": torch.__version__, "load_average": [round(x, 2) for x in os.getloadavg()],
        "command": f"{COMMAND} --batches {args.batches} --repeats {args.repeats}",
    }
    return result


def render(result: dict) -> list[str]:
    """The docs/BENCHMARKS.md section; `note`, where the result has one, says when and how it was measured."""
    when = result.get("note") or (f"Load average (1, 5, 15 min) when measured: "
                                  f"{' '.join(f'{x:.1f}' for x in result['load_average'])}."
                                  if result.get("load_average") else "")
    prose = (f"Tiny pipeline, {result['workload']}, one torch thread (torch {result['torch']}): every check on "
             "(non-finite before the 8-bit conversion, flat after) against none, on the pipeline's real output "
             f"(worker/device/pipeline_host.py `checked_arrays`). {when}")
    return [
        "## What the degenerate-image checks cost",
        "",
        # A number and its unit stay on one line.
        *(line.replace("\xa0", " ") for line in textwrap.wrap(prose.replace(" %", "\xa0%"), 92,
                                                               break_on_hyphens=False)),
        "",
        "| pipeline call s (median) | checks ms / batch | share of the batch | flat check ms "
        "| flat check as one aminmax ms | command |",
        "|---|---|---|---|---|---|",
        f"| {result['batch_s']:.3f} | {result['checks_ms_per_batch']:.3f} | {result['checks_share_of_batch']:.3%} | "
        f"{result['flat_ms']:.3f} | {result['flat_aminmax_ms']:.3f} | `{result['command']}` |",
        "",
    ]


if __name__ == "__main__":
    figures = main()
    print(json.dumps(figures, indent=1))
    print("\n".join(render(figures)))
