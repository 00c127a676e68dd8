"""Speed-ups through diffq: does `diffq run --speedup SPEC` pass diffusers' own
speed-up through undiminished?

On one tiny pipeline (the many-step Flux family, 28 steps), the same prompts, seeds
and batches two ways, interleaved:

- diffq: `diffq run` with and without `--speedup SPEC`, one worker; the median
  `generate_s` its records show per batch (the first batch of each run, the load and
  first call, left out), and the whole process's wall time;
- bare: the pipeline called in this process on the same padded batches, one generator
  per item as diffq makes them, with `transformer.enable_cache(config)` for the cached
  calls and, for a `quant:` scheme, a second copy of the pipeline whose transformer
  torchao's `quantize_` quantized with the scheme's config; the median call time.

A `quant:` row also shows the transformer's stored bytes (its records'
`transformer_weight_bytes`) against full precision's: on CPU there is no device memory
to report, and a process's peak RSS holds the text encoders and VAE as well.

The figure that matters is each ratio, cached over uncached, and the gap between
diffq's and the bare pipeline's (goal: within 0.05). The tiny transformer is a small
part of a step (text encoders and the VAE are the rest), so the ratio here is far
from what a real model shows; on a real model the transformer is nearly all of it.

    python -m bench.speedups [--family flux] [--items 32] [--size 128] [--steps 28] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffq.app.tiny import build_tiny_pipeline

GOAL = 0.05
SPECS = ("taylorseer:cache_interval=3", "taylorseer:cache_interval=3,use_lite_mode=true",
         "mag:mag_ratios=flux,threshold=0.06")
QUANT_SPECS = ("quant:int8wo", "quant:int8dq")


def prompts(count: int) -> list[dict]:
    return [{"id": f"p{i:04d}", "prompt": f"a small red house by a lake, study {i}", "seed": 1000 + i}
            for i in range(count)]


def diffq_run(model: str, rows: list[dict], root: Path, spec: str | None, args) -> dict:
    """One `diffq run`: wall seconds and the median generate_s of its batches (the first left out)."""
    from diffq.core.runfolder import iter_records

    from diffq.core.storage import open_storage

    source = root / "prompts.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = root / f"run-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "diffq", "run", str(source), "--model", model, "--out", str(out),
               "--workers", "1", "--batch-size", str(args.batch), "--steps", str(args.steps), "--height",
               str(args.size), "--width", str(args.size), "--no-progress"] + (["--speedup", spec] if spec else [])
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    batches, weights = {}, set()
    for record in iter_records(open_storage(str(out))):
        batches[record.batch_id] = (record.generate_started_at, record.generate_s, record.speedup)
        weights.add(record.transformer_weight_bytes)
    calls = [seconds for _, seconds, _ in sorted(batches.values())][1:]
    assert all(recorded == spec for *_, recorded in batches.values()), "the records say another speed-up"
    (weight_bytes,) = weights
    return {"process_s": round(wall, 2), "generate_s": round(statistics.median(calls), 4), "batches": len(calls),
            "weight_bytes": weight_bytes}


class Bare:
    """The pipeline in this process: each batch uncached and with each cache, interleaved."""

    def __init__(self, model: str, rows: list[dict], specs: tuple[str, ...], args):
        import torch
        from diffusers import DiffusionPipeline

        from diffq.core.speedups import parse

        torch.set_num_threads(1)  # as a diffq worker's default --threads 1
        self.args, self.specs = args, specs
        self.configs = {spec: parse(spec) for spec in specs}
        # One pipeline per quantization scheme (None: full precision), as a worker holds them.
        self.pipes = {}
        for quant in {None, *(speedup.quant for speedup in self.configs.values())}:
            pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            if quant is not None:
                from torchao.quantization import quantize_

                from diffq.worker.device.quantize import torchao_config

                quantize_(pipe.transformer, torchao_config(quant))
            self.pipes[quant] = pipe
        self.pipe = self.pipes[None]
        self.times: dict[str | None, list[float]] = {None: [], **{spec: [] for spec in specs}}
        self.batches = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]
        self.call(self.batches[0])  # warm

    def call(self, batch: list[dict]) -> float:
        import torch

        args = self.args
        padded = batch + [batch[-1]] * (args.batch - len(batch))
        generators = [torch.Generator("cpu").manual_seed(row["seed"]) for row in padded]
        started = time.perf_counter()
        with torch.inference_mode():
            self.pipe(prompt=[row["prompt"] for row in padded], height=args.size, width=args.size,
                      num_inference_steps=args.steps, guidance_scale=1.0, max_sequence_length=64,
                      generator=generators, output_type="pt")
        return time.perf_counter() - started

    def round(self) -> None:
        from diffq.worker.device.speedups import cache_config

        for batch in self.batches:
            for spec in (None, *self.specs):
                speedup = self.configs.get(spec)
                self.pipe = self.pipes[speedup.quant if speedup is not None else None]
                cached = speedup is not None and speedup.cache is not None
                if cached:
                    self.pipe.transformer.enable_cache(cache_config(speedup, self.pipe, self.args.steps))
                self.times[spec].append(self.call(batch))
                if cached:
                    self.pipe.transformer.disable_cache()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="flux")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--specs", default=";".join(SPECS + QUANT_SPECS), help="';'-separated specs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    specs = tuple(s for s in args.specs.split(";") if s)
    rows = prompts(args.items)
    with tempfile.TemporaryDirectory(prefix="diffq-speedups-") as tmp:
        root = Path(tmp)
        model = str(build_tiny_pipeline(root / "model", family=args.family))
        runs: dict[str | None, list[dict]] = {None: [], **{spec: [] for spec in specs}}
        load = os.getloadavg()[0]
        bare_pipe = Bare(model, rows, specs, args)
        for _ in range(args.repeats):  # interleaved: a drifting machine drifts for both
            for spec in (None, *specs):
                runs[spec].append(diffq_run(model, rows, root, spec, args))
            bare_pipe.round()
        bare = bare_pipe.times
    base_diffq = statistics.median(r["generate_s"] for r in runs[None])
    base_bare = statistics.median(bare[None])
    rows_out = []
    for spec in specs:
        diffq_ratio = statistics.median(r["generate_s"] for r in runs[spec]) / base_diffq
        bare_ratio = statistics.median(bare[spec]) / base_bare
        rows_out.append({
            "spec": spec, "diffq_ratio": round(diffq_ratio, 3), "bare_ratio": round(bare_ratio, 3),
            "gap": round(diffq_ratio - bare_ratio, 3), "within_goal": abs(diffq_ratio - bare_ratio) <= GOAL,
            "diffq_generate_s": round(statistics.median(r["generate_s"] for r in runs[spec]), 4),
            "bare_call_s": round(statistics.median(bare[spec]), 4),
            "process_s": round(statistics.median(r["process_s"] for r in runs[spec]), 2),
            "weight_bytes": runs[spec][0]["weight_bytes"],
        })
    result = {"family": args.family, "size": args.size, "batch": args.batch, "steps": args.steps,
              "items": args.items, "repeats": args.repeats, "goal": GOAL,
              "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
              "uncached": {"diffq_generate_s": round(base_diffq, 4), "bare_call_s": round(base_bare, 4),
                           "process_s": round(statistics.median(r["process_s"] for r in runs[None]), 2),
                           "weight_bytes": runs[None][0]["weight_bytes"]},
              "rows": rows_out}
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(render(result)))
    return result


def render(result: dict, heading: bool = True) -> list[str]:
    if not result:
        return []
    base = result["uncached"]
    lines = (["## Speed-ups through diffq", ""] if heading else []) + [
             f"`python -m bench.speedups --family {result['family']} --repeats {result['repeats']}`: tiny {result['family']}, "
             f"{result['size']}², batch {result['batch']}, {result['steps']} steps, {result['items']} items, one "
             "worker; `diffq run --speedup SPEC` against `diffq run` (median `generate_s` of the records, the "
             "first batch of each run left out) beside the bare pipeline called in one process on the same "
             "padded batches with `enable_cache` (median call), interleaved. Load average "
             f"{result['load_average'][0]} → {result['load_average'][1]} (2 cores).", "",
             f"Uncached: diffq {base['diffq_generate_s']:.3f} s a batch, bare {base['bare_call_s']:.3f} s a call, "
             f"whole `diffq run` {base['process_s']:.1f} s.", "",
             "| speed-up | diffq sped-up / full | bare sped-up / full | gap | within 0.05 | "
             "diffq s a batch | bare s a call | whole `diffq run` s | transformer weights / full |",
             "|---|---|---|---|---|---|---|---|---|"]
    full_bytes = base.get("weight_bytes")
    for row in result["rows"]:
        weights = (f"{row['weight_bytes'] / full_bytes:.3f}" if row.get("weight_bytes") and full_bytes else "-")
        lines.append(f"| `{row['spec']}` | {row['diffq_ratio']:.3f} | {row['bare_ratio']:.3f} | {row['gap']:+.3f} | "
                     f"{'yes' if row['within_goal'] else 'no'} | {row['diffq_generate_s']:.3f} | "
                     f"{row['bare_call_s']:.3f} | {row['process_s']:.1f} | {weights} |")
    lines += ["", "The tiny transformer is a small part of a step here (text encoders and the VAE are most of "
              "a call), so the ratios are far from a real model's, where the transformer is nearly all of it; "
              "what this shows is how much of diffusers' own speed-up a diffq run keeps. "
              "Fidelity on random weights shows the mechanism, not a model's real quality loss "
              "(docs/speedups.md).", ""]
    return lines


if __name__ == "__main__":
    main()
