"""What the command line's commands share: consoles, option types, the generation options.

`cli.py` and every module under `commands/` import this (and never each other).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console

from diffq.app.choices import DEFAULT_LORA_MODE, LORA_MODE_HELP, CompileMode, Device, Dtype
from diffq.core.contract import bounds
from diffq.core.options import GenerationOptions
from diffq.producer.feed import DEFAULT_WINDOW
from diffq.worker.api import backends
from diffq.worker.api import DEFAULT_DEGENERATE_POLICY, DEGENERATE_POLICIES

err = Console(stderr=True, soft_wrap=True)
out = Console()


class Routing(str, Enum):
    compile_aware = "compile-aware"
    round_robin = "round-robin"


DegeneratePolicy = Enum("DegeneratePolicy", {name: name for name in DEGENERATE_POLICIES}, type=str)
DEFAULT_ON_DEGENERATE = DegeneratePolicy(DEFAULT_DEGENERATE_POLICY)


def contract_range(model, name: str, metadata=None) -> dict:
    """typer's min/max for an option from the contract field it fills, so `--steps 1200`
    is refused naming the option and its range, before any schema error."""
    metadata = model.model_fields[name].metadata if metadata is None else metadata
    low, high = bounds(Annotated[(int, *metadata)]) if metadata else (None, None)
    return ({"min": low} if low is not None else {}) | ({"max": high} if high is not None else {})


Prompts = Annotated[Path, typer.Argument(help="Prompt file: .jsonl, .csv, .txt or .parquet")]
Out = Annotated[str, typer.Option("--out", "-o", help="Run folder: path, file://, s3://bucket/prefix or gs://bucket/prefix")]
Model = Annotated[str, typer.Option("--model", "-m", help="Pipeline folder, Hugging Face model id, or s3://BUCKET/PREFIX / gs://BUCKET/PREFIX (fetched once per node into DIFFQ_MODEL_CACHE)")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Pipeline dtype, part of the shape key: auto (each worker runs its device's default: bfloat16 on neuron, tpu, cuda; float32 on cpu) or a pinned dtype")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Device kind, from the backend table")]
Compile = Annotated[CompileMode, typer.Option("--compile", help="none | full (whole transformer) | regional (repeated blocks) | defer-fuse (TPU only); checked against the device")]
CompileCache = Annotated[Optional[str], typer.Option("--compile-cache", help="Compile cache: a shared directory used in place, or s3://… / gs://… / file://… mirrored locally (pull before warmup, push after compiling)")]
def _lora_mode(value: str) -> str:
    from diffq.worker.api import lora_modes

    if value in lora_modes.LORA_MODE_CHOICES or value.endswith(".json"):
        return value
    raise typer.BadParameter(f"{value!r}: choose {', '.join(lora_modes.LORA_MODE_CHOICES)} or a qualify --lora "
                             f"profile FILE.json")


LoraModeOpt = Annotated[str, typer.Option("--lora-mode", help=LORA_MODE_HELP, callback=_lora_mode)]
Offload = Annotated[Optional[str], typer.Option("--offload", help="'model': enable_model_cpu_offload()")]
RunId = Annotated[Optional[str], typer.Option("--run-id", help="Run id (default: random)")]
SeedBase = Annotated[Optional[str], typer.Option("--seed-base", help="Derive item seeds from this instead of the run id (reproducible reruns)")]


def fail(message: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


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
Window = Annotated[str, typer.Option("--window", help=(
    f"Batches of the run each shape queue holds in the broker at once; the feeder publishes the rest "
    f"from OUT as they drain (`diffq fleet backlog --feeds`, `diffq feed OUT`). 'all': every batch now. "
    f"'auto' (default): {DEFAULT_WINDOW} where a feeds folder is set (--feeds, DIFFQ_FEEDS), else all"))]
Feeds = Annotated[Optional[str], typer.Option("--feeds", help="Feeds folder (path, s3://, gs://; or DIFFQ_FEEDS): where runs with batches still in OUT are listed for the fleet's feeder")]


# The generation options `run`, `submit` and `plan` share: the core model, declared
# once (diffq/core/options.py); a command receives one as `generation`.
Generation = GenerationOptions
# Short forms, the one thing the command line adds to a generation option.
SHORT_FLAGS = {"batch_size": "-b"}


def generation_params(fields=None) -> list[inspect.Parameter]:
    """One typer option per generation option (or those of `fields`), from the model:
    `--name-with-dashes`, its default, its help, its bounds, its choices."""
    params = []
    for name, info in GenerationOptions.model_fields.items():
        if fields is not None and name not in fields:
            continue
        flag = "--" + name.replace("_", "-")
        annotation, default = info.annotation, info.default
        if choices := _choices(name, annotation):
            annotation, default = choices, choices(default)
            option = typer.Option(flag, help=info.description)
        elif annotation is bool:
            option = typer.Option(f"{flag}/--no-{flag[2:]}", help=info.description)
        elif name == "keep_columns":  # a,b on the command line
            annotation, default = Optional[str], None
            option = typer.Option(flag, help=info.description)
        elif typing.get_origin(annotation) is tuple:  # repeatable: --lora A --lora B
            annotation, default = Optional[list[str]], None
            option = typer.Option(flag, help=info.description)
        elif words := _words_beside_int(annotation):  # e.g. --batch-size 4 | auto
            bounded, words = words
            annotation, default = str, str(default)
            option = typer.Option(flag, *([SHORT_FLAGS[name]] if name in SHORT_FLAGS else []), help=info.description,
                                  metavar="INTEGER|" + "|".join(words), parser=_int_or_words(bounded, words))
        else:
            if typing.get_origin(annotation) is typing.Union or type(annotation).__name__ == "UnionType":
                annotation = Optional[str]
            option = typer.Option(flag, *([SHORT_FLAGS[name]] if name in SHORT_FLAGS else []),
                                  **contract_range(GenerationOptions, name), help=info.description)
        params.append(_option(name, Annotated[annotation, option], default))
    return params


def generation_option(name: str, *, note: str | None = None, unset: object = None):
    """One generation option alone, for a command that is not a run (qualify, `fleet
    manifests`): its flag, short flag, bounds and help from the model (core/options.py),
    an `INT | auto` option as its int; `note`: what it means to this command, in place
    of the model's help. With `unset` (what the command uses when it is not given) the
    option is Optional and its help says that default."""
    info = GenerationOptions.model_fields[name]
    annotation, limits = info.annotation, contract_range(GenerationOptions, name)
    if words := _words_beside_int(annotation):
        limits, annotation = words[0], int
    elif choices := _choices(name, annotation):  # the command receives the Enum: `.value` is the word
        annotation = choices
    help = (note or info.description) + (f" (default {unset})" if unset is not None else "")
    option = typer.Option("--" + name.replace("_", "-"), *([SHORT_FLAGS[name]] if name in SHORT_FLAGS else []),
                          **limits, help=help)
    return Annotated[annotation if unset is None else Optional[annotation], option]


def _choices(name: str, annotation) -> type[Enum] | None:
    """A `Literal[words]` field as the Enum typer offers as choices, else None."""
    if typing.get_origin(annotation) is not Literal:
        return None
    return Enum(name.title().replace("_", ""), {c: c for c in typing.get_args(annotation)}, type=str)


def _words_beside_int(annotation):
    """(the int's bounds, the words) of a `BoundedInt | Literal[words]` field, else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    members = typing.get_args(annotation)
    words = [w for m in members if typing.get_origin(m) is Literal for w in typing.get_args(m)]
    ints = [m for m in members if m is int or typing.get_origin(m) is Annotated and typing.get_args(m)[0] is int]
    if not words or len(ints) != 1:
        return None
    metadata = [item for info in typing.get_args(ints[0])[1:] for item in getattr(info, "metadata", [info])]
    return contract_range(None, "", metadata), tuple(words)


def _int_or_words(bounds: dict, words: tuple[str, ...]):
    def parse(value):
        if isinstance(value, int) or value in words:
            return value
        try:
            number = int(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is neither an integer nor {' or '.join(words)}") from None
        low, high = bounds.get("min"), bounds.get("max")
        if (low is not None and number < low) or (high is not None and number > high):
            raise typer.BadParameter(f"{number} is not in the range {low}<=x<={high}")
        return number

    return parse


def _generation(**values) -> GenerationOptions:
    try:
        return GenerationOptions.of(**{name: value.value if isinstance(value, Enum) else value
                                       for name, value in values.items()})
    except ValueError as exc:
        fail(str(exc))


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
    lora_mode: str = DEFAULT_LORA_MODE

    def kwargs(self) -> dict:
        """As the embedded runner takes them (diffq/app/runner.py LocalWorkers)."""
        return dict(devices=self.devices.slots(), device=self.devices.device.value, compile=self.compile.value,
                    compile_cache=self.compile_cache, offload=self.offload,
                    warmup=[w for w in (self.warmup or "").split(",") if w], threads=self.threads,
                    allow_fallback=self.allow_fallback, on_degenerate=self.on_degenerate.value,
                    lora_mode=self.lora_mode)

    def given(self) -> list[str]:
        """Options given other than their defaults."""
        return self.devices.given() + [name for name, value in (
            ("--compile", self.compile.value != "none"), ("--compile-cache", self.compile_cache),
            ("--offload", self.offload), ("--warmup", self.warmup), ("--threads", self.threads != 1),
            ("--allow-fallback", self.allow_fallback),
            ("--on-degenerate", self.on_degenerate != DEFAULT_ON_DEGENERATE),
            ("--lora-mode", self.lora_mode != DEFAULT_LORA_MODE)) if value]


Warmup = Annotated[Optional[str], typer.Option("--warmup", help="Compile before consuming: 'auto' (every shape served) or HxW[,HxW…]")]
Threads = Annotated[int, typer.Option("--threads", min=1, help="Torch threads per worker process")]
OnDegenerate = Annotated[DegeneratePolicy, typer.Option("--on-degenerate", help="What becomes of a degenerate image: flag (default: non-finite values fail the item, a flat image is stored flagged in its record), fail (both fail the item, not stored), ignore (no checks)")]
AllowFallback = Annotated[bool, typer.Option("--allow-fallback", help="neuron: let a compiled graph that fails at run time re-run uncompiled, op by op (--compile full|regional; counted in metrics, records and the warm-up report), and an eager op that fails on the device re-run on the CPU (any mode; listed in the fallback ops), instead of failing the batch (many times slower)")]


def local_worker_options():
    """Add the local workers' options (devices, compile, offload, warmup, threads); the
    command receives them as `local`."""
    device_part = device_params(", one worker process each")
    names = [p.name for p in device_part]
    params = device_part + [_option("compile", Compile, CompileMode("none")), _option("compile_cache", CompileCache, None),
                            _option("offload", Offload, None), _option("warmup", Warmup, None),
                            _option("threads", Threads, 1), _option("allow_fallback", AllowFallback, False),
                            _option("on_degenerate", OnDegenerate, DEFAULT_ON_DEGENERATE),
                            _option("lora_mode", LoraModeOpt, DEFAULT_LORA_MODE)]

    def build(**values) -> LocalWorkers:
        devices = build_devices(**{name: values.pop(name) for name in names})
        return LocalWorkers(devices=devices, **values)

    return option_group("local", params, build)


def generation_options(*, embed_metadata: bool = True):
    """Add the shared generation options to a command; it receives them as `generation`."""
    fields = [name for name in GenerationOptions.model_fields if embed_metadata or name != "embed_metadata"]
    return option_group("generation", generation_params(fields), _generation)
