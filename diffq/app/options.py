"""What the command line's commands share: consoles, option types, the generation options.

`cli.py` and every module under `commands/` import this (and never each other).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from diffq.app.choices import CompileMode, Device, Dtype
from diffq.core.layout import IMAGE_FORMATS
from diffq.worker import backends

err = Console(stderr=True, soft_wrap=True)
out = Console()


ImageFormat = Enum("ImageFormat", {name: name for name in IMAGE_FORMATS}, type=str)


class Routing(str, Enum):
    compile_aware = "compile-aware"
    round_robin = "round-robin"


class Fit(str, Enum):
    none = "none"
    resize = "resize"
    crop = "crop"


Prompts = Annotated[Path, typer.Argument(help="Prompt file: .jsonl, .csv, .txt or .parquet")]
Out = Annotated[str, typer.Option("--out", "-o", help="Run folder: path, file://, s3://bucket/prefix or gs://bucket/prefix")]
Model = Annotated[str, typer.Option("--model", "-m", help="Pipeline folder or Hugging Face model id")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Images per compiled batch")]
Steps = Annotated[int, typer.Option("--steps", min=1, help="Default num_inference_steps")]
Guidance = Annotated[float, typer.Option("--guidance-scale", min=0.0, help="Default guidance scale (> 1 turns CFG on)")]
SeqLen = Annotated[int, typer.Option("--max-sequence-length", min=1, help="Text tokens per prompt (padded)")]
Height = Annotated[int, typer.Option("--height", min=16, help="Default image height (multiple of 16, any with --size-buckets)")]
Width = Annotated[int, typer.Option("--width", min=16, help="Default image width (multiple of 16, any with --size-buckets)")]
Format = Annotated[ImageFormat, typer.Option("--format", help="Image file format")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Pipeline dtype (part of the shape key)")]
DeviceDtypeOpt = Annotated[Optional[Dtype], typer.Option("--dtype", help="Pipeline dtype (part of the shape key); default: the device's (bfloat16 on accelerators, float32 on cpu)")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Device kind, from the backend table")]
Compile = Annotated[CompileMode, typer.Option("--compile", help="none | full (whole transformer) | regional (repeated blocks) | defer-fuse (TPU only); checked against the device")]
CompileCache = Annotated[Optional[str], typer.Option("--compile-cache", help="Compile cache: a shared directory used in place, or s3://… / gs://… / file://… mirrored locally (pull before warmup, push after compiling)")]
Offload = Annotated[Optional[str], typer.Option("--offload", help="'model': enable_model_cpu_offload()")]
RunId = Annotated[Optional[str], typer.Option("--run-id", help="Run id (default: random)")]
SizeBucketsOpt = Annotated[Optional[str], typer.Option("--size-buckets", help="HxW[,HxW…] and/or a preset (aspect-1024, aspect-512, aspect-256): each row is generated at the bucket of nearest aspect ratio; requested sizes need not be multiples of 16")]
FitOpt = Annotated[Fit, typer.Option("--fit", help="With --size-buckets: store the bucket's image as is (none), resized to the requested size (resize), or scaled and centre-cropped to it (crop)")]
KeepColumns = Annotated[Optional[str], typer.Option("--keep-columns", help="CSV/Parquet columns a,b moved into each row's metadata (other unknown columns stay errors)")]
EmbedMetadata = Annotated[bool, typer.Option("--embed-metadata/--no-embed-metadata", help="Write prompt, seed, steps, ... into each image file (PNG text, EXIF UserComment)")]
SeedBase = Annotated[Optional[str], typer.Option("--seed-base", help="Derive item seeds from this instead of the run id (reproducible reruns)")]


def fail(message: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def columns(value: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in (value or "").split(",") if name.strip())


def check_compile(models: list[str], compile: str) -> None:
    """A compile mode a local model's family cannot take fails here, not in every child."""
    from diffq.core.families import FamilyError, compile_refusal

    try:
        reason = compile_refusal(models, compile)
    except FamilyError as exc:
        reason = str(exc)
    if reason:
        fail(reason)


def resolve_dtype(device: Device, dtype) -> str:
    """--dtype as given, else the device's default (the backend table's default_dtype)."""
    return dtype.value if dtype is not None else backends.get_backend(device.value).default_dtype


def devices_of(device: Device, workers: int, cores: str | None, chips: str | None, gpus: str | None) -> list[int]:
    # Which option lists this kind's devices is the backend table's business.
    backend = backends.get_backend(device.value)
    spec = {"--cores": cores, "--chips": chips, "--gpus": gpus}.get(backend.device_option)
    if spec == "auto":
        return backends.allocated_devices(backend)
    return backends.parse_devices(spec) if spec else list(range(workers))




Broker = Annotated[Optional[str], typer.Option("--broker", help="Broker URL (or DIFFQ_BROKER_URL)")]


@dataclass
class Generation:
    """The generation options `run`, `submit` and `plan` share, as their functions take them."""

    batch_size: int
    steps: int
    guidance_scale: float
    max_sequence_length: int
    height: int
    width: int
    format: ImageFormat
    dtype: Dtype | None
    size_buckets: str | None
    fit: Fit
    keep_columns: str | None
    embed_metadata: bool = True

    def kwargs(self, dtype: str | None = None) -> dict:
        chosen = dtype or self.dtype
        return dict(batch_size=self.batch_size, steps=self.steps, guidance_scale=self.guidance_scale,
                    max_sequence_length=self.max_sequence_length, height=self.height, width=self.width,
                    format=self.format.value, dtype=chosen if isinstance(chosen, str) else chosen.value,
                    size_buckets=self.size_buckets, fit=self.fit.value, embed_metadata=self.embed_metadata,
                    keep_columns=columns(self.keep_columns))


def _option(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def generation_options(*, dtype_from_device: bool = False, embed_metadata: bool = True):
    """Add the shared generation options to a command; it receives them as `generation`.

    dtype_from_device: `--dtype` defaults to the device's (the backend table), for
    commands that know their device; others default to float32.
    """
    shared = [
        _option("batch_size", BatchSize, 4), _option("steps", Steps, 4), _option("guidance_scale", Guidance, 1.0),
        _option("max_sequence_length", SeqLen, 64), _option("height", Height, 128), _option("width", Width, 128),
        _option("format", Format, ImageFormat.png),
        _option("dtype", *((DeviceDtypeOpt, None) if dtype_from_device else (DtypeOpt, Dtype("float32")))),
        _option("size_buckets", SizeBucketsOpt, None), _option("fit", FitOpt, Fit.none),
        _option("keep_columns", KeepColumns, None),
    ] + ([_option("embed_metadata", EmbedMetadata, True)] if embed_metadata else [])

    def decorate(command):
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "generation"]

        @functools.wraps(command)
        def with_generation(**kwargs):
            generation = Generation(**{p.name: kwargs.pop(p.name) for p in shared})
            return command(**kwargs, generation=generation)

        # Typer reads the options from the signature.
        with_generation.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared)
        return with_generation

    return decorate
