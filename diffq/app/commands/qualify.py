"""`diffq qualify`: one command that says whether a model runs right, and how fast, on a device."""

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from diffq.app.choices import CompileMode, Dtype
from diffq.app.options import (DEFAULT_LORA_MODE, Devices, LoraModeOpt, Model, device_options, fail,
                               generation_option, out)


def register(app: typer.Typer) -> None:
    from diffq.app.qualify import (BUDGET_PSNR, BUDGET_SSIM, DEFAULT_REPEATS, DEFAULT_SHAPE,
                                   GENERATION_DEFAULTS as GEN, MAX_CANDIDATES, REFERENCE, REFERENCE_MAX_PIXELS,
                                   Thresholds)

    limits = Thresholds()

    @app.command()
    @device_options(" to qualify (the first listed)", workers_help=None)
    def qualify(
        model: Model,
        compile: Annotated[CompileMode, typer.Option("--compile", help="none | full | regional | defer-fuse (TPU)")] = CompileMode.none,
        dtype: Annotated[Optional[Dtype], typer.Option("--dtype", help="Pipeline dtype (default auto: the backend's)")] = None,
        offload: Annotated[Optional[str], typer.Option("--offload", help="'model': enable_model_cpu_offload()")] = None,
        shapes: Annotated[Optional[str], typer.Option("--shapes", help=f"HxW[,HxW…] (default {DEFAULT_SHAPE[0]}x{DEFAULT_SHAPE[1]})")] = None,
        batch_size: generation_option("batch_size", note="Images per call", unset=GEN["batch_size"]) = None,
        steps: generation_option("steps", note="num_inference_steps", unset=GEN["steps"]) = None,
        guidance_scale: generation_option("guidance_scale", note="Guidance scale", unset=GEN["guidance_scale"]) = None,
        max_sequence_length: generation_option("max_sequence_length", note="Text tokens",
                                               unset=GEN["max_sequence_length"]) = None,
        prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompt file (.jsonl/.csv/.txt/.parquet): the first rows, with their seeds")] = None,
        reference: Annotated[str, typer.Option("--reference", help=f"'cpu' (the same pipeline, run as {REFERENCE}) or a DIR from --save-reference")] = "cpu",
        save_reference: Annotated[Optional[Path], typer.Option("--save-reference", help="Store this run's images and settings in DIR, for a later --reference DIR")] = None,
        report: Annotated[Optional[Path], typer.Option("--report", help="Write DIR/index.html (self-contained) and DIR/qualify.json")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object")] = False,
        price_per_device_hour: Annotated[Optional[float], typer.Option("--price-per-device-hour", min=0.0, help="Prints the cost per 1,000 images")] = None,
        min_psnr: Annotated[float, typer.Option("--min-psnr", help="Parity fails below this PSNR (dB)")] = limits.min_psnr,
        max_abs_diff: Annotated[int, typer.Option("--max-abs-diff", min=0, max=255, help="Parity fails above this absolute pixel difference")] = limits.max_abs_diff,
        repeats: Annotated[int, typer.Option("--repeats", min=1, help="Steady-state calls per shape after the first")] = DEFAULT_REPEATS,
        reference_max_pixels: Annotated[int, typer.Option("--reference-max-pixels", min=256, help="Larger shapes are compared at a reduced shape of the same aspect")] = REFERENCE_MAX_PIXELS,
        threads: Annotated[int, typer.Option("--threads", min=1, help="Torch threads of the device process (as --threads of diffq worker)")] = 1,
        compile_cache: Annotated[Optional[str], typer.Option("--compile-cache", help="Compile cache, as for diffq worker")] = None,
        speedups: Annotated[bool, typer.Option("--speedups", help="Also measure each speed-up and batch size the device offers, per shape, for speed and fidelity against full compute (docs/qualify.md)")] = False,
        profile: Annotated[Optional[Path], typer.Option("--profile", help="With --speedups: write FILE.json, per shape the fastest candidate within the budget (for --speedup FILE.json). With --lora alone: add the --lora-mode measured here to the LoRA profile FILE.json (for --lora-mode FILE.json: auto takes the cheapest mode that passed on this device)")] = None,
        budget_psnr: Annotated[float, typer.Option("--budget-psnr", min=0.0, help="With --speedups: a candidate below this PSNR (dB) against full compute is never chosen")] = BUDGET_PSNR,
        budget_ssim: Annotated[float, typer.Option("--budget-ssim", min=0.0, max=1.0, help="With --speedups: a candidate below this SSIM against full compute is never chosen")] = BUDGET_SSIM,
        max_candidates: Annotated[int, typer.Option("--max-candidates", min=1, help="With --speedups: candidates measured per shape, full compute included (the rest are listed, not measured)")] = MAX_CANDIDATES,
        max_batch_size: Annotated[Optional[int], typer.Option("--max-batch-size", min=1, help="With --speedups: batch sizes 1, 2, 4, ... up to this (default --batch-size); an out-of-memory stops there")] = None,
        lora: Annotated[Optional[list[str]], typer.Option("--lora", help="A,B[,C…] (repeatable): LoRA adapters, each PATH or PATH@SCALE, checked as submit checks them, then hot-swapped on the device after the measurement: a swap that compiles a graph fails; swap and scale-change times (docs/qualify.md)")] = None,
        lora_mode: LoraModeOpt = DEFAULT_LORA_MODE,
        lora_text_encoder: generation_option("lora_text_encoder", unset="refuse") = None,
        devices: Devices = None,
    ) -> None:
        """Qualify a device before you scale: compile vs steady state, recompiles, fallback ops, parity, memory.

        --speedups tunes the speed-ups too and says what that costs before it starts;
        --lora A,B checks that hot-swapping LoRA adapters compiles nothing.
        Exit code 1 when a check fails, 2 on bad input.
        """
        from diffq.app.options import err
        from diffq.app.qualify import QualifyError, SpeedupOptions, parse_shapes, qualify as run_qualify, render_text
        from diffq.core.settings import get_settings

        if not speedups:
            given = [name for name, value in (("--profile", None if lora else profile),
                                              ("--max-batch-size", max_batch_size)) if value is not None]
            if given:
                fail(f"{', '.join(given)} tune(s) speed-ups: add --speedups")
        if profile is not None and profile.suffix != ".json":
            fail(f"--profile {profile}: name it FILE.json (that is how --speedup tells a profile from a spec)")
        tuning = (SpeedupOptions(budget_psnr=budget_psnr, budget_ssim=budget_ssim, max_candidates=max_candidates,
                                 max_batch_size=max_batch_size, profile=profile) if speedups else None)
        try:
            result = run_qualify(
                model, device=devices.device.value, slot=devices.slots()[0], compile=compile.value,
                dtype=dtype.value if dtype else None, offload=offload,
                shapes=parse_shapes(shapes) if shapes else None, batch_size=batch_size, steps=steps,
                guidance_scale=guidance_scale, max_sequence_length=max_sequence_length, prompts_file=prompts,
                reference=reference, save_reference=save_reference, report_dir=report,
                price_per_device_hour=price_per_device_hour,
                thresholds=Thresholds(min_psnr=min_psnr, max_abs_diff=max_abs_diff,
                                      warn_margin_db=limits.warn_margin_db), threads=threads,
                compile_cache=compile_cache or get_settings().compile_cache, repeats=repeats,
                reference_max_pixels=reference_max_pixels, speedups=tuning,
                lora=[spec.strip() for given in lora for spec in given.split(",") if spec.strip()] if lora else None,
                lora_mode=lora_mode, lora_text_encoder=lora_text_encoder.value if lora_text_encoder else None,
                lora_profile=profile if lora and not speedups else None,
                announce=lambda line: err.print(line, highlight=False, markup=False, soft_wrap=True))
        except (QualifyError, ValueError) as exc:
            fail(str(exc))
        if as_json:
            sys.stdout.write(json.dumps(result) + "\n")
        else:
            out.print(render_text(result), highlight=False, markup=False, soft_wrap=True)
            if report:
                out.print(f"report: {report / 'index.html'}", highlight=False, markup=False, soft_wrap=True)
        if not result["passed"]:
            raise typer.Exit(1)
