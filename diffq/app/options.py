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
from diffq.core.contract import FITS, BatchParams, ShapeKey
from diffq.core.layout import IMAGE_FORMATS
from diffq.worker import backends
from diffq.worker.spec import DEFAULT_DEGENERATE_POLICY, DEGENERATE_POLICIES

err = Console(stderr=True, soft_wrap=True)
out = Console()


ImageFormat = Enum("ImageFormat", {name: name for name in IMAGE_FORMATS}, type=str)


class Routing(str, Enum):
    compile_aware = "compile-aware"
    round_robin = "round-robin"


Fit = Enum("Fit", {name: name for name in FITS}, type=str)  # the contract's list
DegeneratePolicy = Enum("DegeneratePolicy", {name: name for name in DEGENERATE_POLICIES}, type=str)
DEFAULT_ON_DEGENERATE = DegeneratePolicy(DEFAULT_DEGENERATE_POLICY)


def contract_range(model, name: str) -> dict:
    """typer's min/max for an option from the contract field it fills, so `--steps 1200`
    is refused naming the option and its range, before any schema error."""
    import annotated_types as at

    bounds = {}
    for item in model.model_fields[name].metadata:
        if isinstance(item, at.Gt):
            bounds["min"] = item.gt + 1 if isinstance(item.gt, int) else item.gt
        elif isinstance(item, at.Ge):
            bounds["min"] = item.ge
        elif isinstance(item, at.Le):
            bounds["max"] = item.le
        elif isinstance(item, at.Lt):
            bounds["max"] = item.lt - 1
    return bounds


Prompts = Annotated[Path, typer.Argument(help="Prompt file: .jsonl, .csv, .txt or .parquet")]
Out = Annotated[str, typer.Option("--out", "-o", help="Run folder: path, file://, s3://bucket/prefix or gs://bucket/prefix")]
Model = Annotated[str, typer.Option("--model", "-m", help="Pipeline folder or Hugging Face model id")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", **contract_range(ShapeKey, "batch_size"), help="Images per compiled batch")]
Steps = Annotated[int, typer.Option("--steps", **contract_range(BatchParams, "num_inference_steps"), help="Default num_inference_steps")]
Guidance = Annotated[float, typer.Option("--guidance-scale", **contract_range(BatchParams, "guidance_scale"), help="Default guidance scale (> 1 turns CFG on)")]
SeqLen = Annotated[int, typer.Option("--max-sequence-length", **contract_range(ShapeKey, "max_sequence_length"), help="Text tokens per prompt (padded)")]
Height = Annotated[int, typer.Option("--height", **{**contract_range(ShapeKey, "height"), "min": 16}, help="Default image height (multiple of 16, any with --size-buckets)")]
Width = Annotated[int, typer.Option("--width", **{**contract_range(ShapeKey, "width"), "min": 16}, help="Default image width (multiple of 16, any with --size-buckets)")]
Format = Annotated[ImageFormat, typer.Option("--format", help="Image file format")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Pipeline dtype, part of the shape key: auto (each worker runs its device's default: bfloat16 on neuron, tpu, cuda; float32 on cpu) or a pinned dtype")]
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


# --- which devices: one option per device list the backend table names ------------------


def _device_lists() -> dict[str, backends.Backend]:
    """--cores, --chips, --gpus ... -> the backend listing its devices with it."""
    lists: dict[str, backends.Backend] = {}
    for backend in backends.BACKENDS.values():
        if backend.device_option != "--workers":
            lists.setdefault(backend.device_option, backend)
    return lists


def _param_name(option: str) -> str:
    return option.removeprefix("--").replace("-", "_")


@dataclass
class Devices:
    """--device, --workers and the device lists, as a command receives them (`devices`)."""

    device: Device
    workers: int
    lists: dict[str, str | None]  # "--cores" -> "0-7" (None: not given)

    @property
    def backend(self) -> backends.Backend:
        return backends.get_backend(self.device.value)

    def slots(self) -> list[int]:
        """The devices to run on: the kind's own list (or `auto`), else --workers processes."""
        backend = self.backend
        spec = self.lists.get(backend.device_option)
        if spec == "auto":
            return backends.allocated_devices(backend)
        return backends.parse_devices(spec) if spec else list(range(self.workers))

    def given(self) -> list[str]:
        """The options given other than their defaults (for commands that start no workers)."""
        return (["--device"] if self.device.value != "cpu" else []) + (["--workers"] if self.workers != 1 else []) \
            + [option for option, value in self.lists.items() if value]


def device_params(what: str, workers_help: str | None = "Worker processes (cpu)") -> list[inspect.Parameter]:
    """--device, --workers (unless None) and the device lists, help from the table."""
    params = [_option("device", DeviceOpt, Device("cpu"))]
    if workers_help:
        params.append(_option("workers", Annotated[int, typer.Option("--workers", "-w", min=1, help=workers_help)], 1))
    for option, backend in _device_lists().items():
        auto = (f", or auto (those the device plugin allocated: {' else '.join(s.env for s in backend.allocation)})"
                if backend.allocation else "")
        params.append(_option(_param_name(option), Annotated[Optional[str], typer.Option(
            option, help=f"{backend.device_noun}{what}, e.g. 0-3{auto}")], None))
    return params


def build_devices(device: Device, workers: int = 1, **lists: str | None) -> Devices:
    return Devices(device=device, workers=workers,
                   lists={option: lists.get(_param_name(option)) for option in _device_lists()})


def device_options(what: str = ", one process each", workers_help: str | None = "Worker processes (cpu)"):
    """Add --device, --workers and the table's device lists; the command receives `devices`."""
    return option_group("devices", device_params(what, workers_help), build_devices)


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
    dtype: Dtype
    size_buckets: str | None
    fit: Fit
    keep_columns: str | None
    embed_metadata: bool = True

    def kwargs(self) -> dict:
        return dict(batch_size=self.batch_size, steps=self.steps, guidance_scale=self.guidance_scale,
                    max_sequence_length=self.max_sequence_length, height=self.height, width=self.width,
                    format=self.format.value, dtype=self.dtype.value,
                    size_buckets=self.size_buckets, fit=self.fit.value, embed_metadata=self.embed_metadata,
                    keep_columns=columns(self.keep_columns))


# The generation defaults, shared by run, submit, plan and `fleet manifests`: a fleet
# rendered without options watches the queues a submit without options fills.
DEFAULT_BATCH_SIZE = 4
DEFAULT_SEQ_LEN = 64
DEFAULT_GUIDANCE = 1.0


def _option(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def option_group(target: str, params: list[inspect.Parameter], build):
    """Add `params` to a command's options; the command receives `build(**their values)`
    as its `target` argument. Typer reads the options from the signature; groups stack."""

    def decorate(command):
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != target]
        names = [p.name for p in params]

        @functools.wraps(command)
        def with_group(**kwargs):
            group = build(**{name: kwargs.pop(name) for name in names})
            return command(**kwargs, **{target: group})

        with_group.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + params)
        return with_group

    return decorate


@dataclass
class LocalWorkers:
    """The worker options of the commands that start their own workers (run, resume)."""

    devices: Devices
    compile: CompileMode
    compile_cache: str | None
    offload: str | None
    warmup: str | None
    threads: int
    allow_fallback: bool
    on_degenerate: DegeneratePolicy

    def kwargs(self) -> dict:
        """As the embedded runner takes them (diffq/app/runner.py LocalWorkers)."""
        return dict(devices=self.devices.slots(), device=self.devices.device.value, compile=self.compile.value,
                    compile_cache=self.compile_cache, offload=self.offload,
                    warmup=[w for w in (self.warmup or "").split(",") if w], threads=self.threads,
                    allow_fallback=self.allow_fallback, on_degenerate=self.on_degenerate.value)

    def given(self) -> list[str]:
        """Options given other than their defaults."""
        return self.devices.given() + [name for name, value in (
            ("--compile", self.compile.value != "none"), ("--compile-cache", self.compile_cache),
            ("--offload", self.offload), ("--warmup", self.warmup), ("--threads", self.threads != 1),
            ("--allow-fallback", self.allow_fallback),
            ("--on-degenerate", self.on_degenerate != DEFAULT_ON_DEGENERATE)) if value]


Warmup = Annotated[Optional[str], typer.Option("--warmup", help="Compile before consuming: 'auto' (every shape served) or HxW[,HxW…]")]
Threads = Annotated[int, typer.Option("--threads", min=1, help="Torch threads per worker process")]
OnDegenerate = Annotated[DegeneratePolicy, typer.Option("--on-degenerate", help="What becomes of a degenerate image: flag (default: non-finite values fail the item, a flat image is stored flagged in its record), fail (both fail the item, not stored), ignore (no checks)")]
AllowFallback = Annotated[bool, typer.Option("--allow-fallback", help="--compile full|regional on neuron: let a compiled graph that fails at run time re-run uncompiled, op by op (many times slower; counted in metrics, records and the warm-up report) instead of failing the batch")]


def local_worker_options():
    """Add the local workers' options (devices, compile, offload, warmup, threads); the
    command receives them as `local`."""
    device_part = device_params(", one worker process each")
    names = [p.name for p in device_part]
    params = device_part + [_option("compile", Compile, CompileMode("none")), _option("compile_cache", CompileCache, None),
                            _option("offload", Offload, None), _option("warmup", Warmup, None),
                            _option("threads", Threads, 1), _option("allow_fallback", AllowFallback, False),
                            _option("on_degenerate", OnDegenerate, DEFAULT_ON_DEGENERATE)]

    def build(**values) -> LocalWorkers:
        devices = build_devices(**{name: values.pop(name) for name in names})
        return LocalWorkers(devices=devices, **values)

    return option_group("local", params, build)


def generation_options(*, embed_metadata: bool = True):
    """Add the shared generation options to a command; it receives them as `generation`."""
    shared = [
        _option("batch_size", BatchSize, DEFAULT_BATCH_SIZE), _option("steps", Steps, 4),
        _option("guidance_scale", Guidance, DEFAULT_GUIDANCE), _option("max_sequence_length", SeqLen, DEFAULT_SEQ_LEN), _option("height", Height, 128), _option("width", Width, 128),
        _option("format", Format, ImageFormat.png),
        _option("dtype", DtypeOpt, Dtype("auto")),
        _option("size_buckets", SizeBucketsOpt, None), _option("fit", FitOpt, Fit.none),
        _option("keep_columns", KeepColumns, None),
    ] + ([_option("embed_metadata", EmbedMetadata, True)] if embed_metadata else [])

    return option_group("generation", shared, Generation)
