"""**The LoRA mode table**: how a worker puts a batch's adapter set into its pipeline
(`--lora-mode` on run, worker and qualify). Torch-free: the CLI and a worker's spec read
the choices from it; each row names where its applier lives (loaded on first use).

- `swap` (adapters.py `AdapterSlot`): a zero scaffold over the run's layout before the
  compile, each set hot-swapped into it; the graphs read the LoRA weights as inputs. Every
  row pays the scaffold's matmuls at the padded rank and K slots.
- `fuse` (lora_apply.py `FusedWeights`): no scaffold, no LoRA layer in the graph; a set's
  deltas (scale · alpha/r · B·A, summed over the set) written into the targeted base
  weights in place, each from a pristine host copy taken at load (never by subtracting
  the previous set: repeated bf16 round-offs would drift). A set change costs a weight
  write. Right wherever the compiled graph reads the weights as inputs (CPU and CUDA
  Inductor).
- `compile` (lora_apply.py `CompiledSets`): fused as `fuse` before the call, and one
  compiled graph per (shape, set). Where the graph reads weights as inputs a new set
  reuses it (nothing to compile); where the backend bakes the weights into its graph
  (`bakes_weights`: the backend table, or Inductor's freezing, the stand-in for Neuron and
  TPU), each set gets its own compile, a bounded number kept. Right anywhere.

What no table can promise is checked on the device (lora_apply.py `ChangeCheck`): at a
host's first set change a fixed small probe runs through the pipeline before and after,
and its output must move (PipelineHost._apply_adapters). A mode whose writes the graph
never reads is caught there, before any image is made with the wrong weights.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

from diffq.worker.device.backends import COMPILING_MODES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraMode:
    name: str
    # What installs it on a loaded pipeline, before the compile:
    # (pipe, layout, cache, *, backend, compile_mode) -> its applier (apply, held, stats).
    install: str
    graph: str  # what the compiled graph holds (help, qualify's report)
    needs_graph_inputs: bool  # right only where the graph reads the weights as inputs

    def installer(self):
        """The install function, its module imported now ("module:Class.method")."""
        module, _, path = self.install.partition(":")
        return functools.reduce(getattr, path.split("."), importlib.import_module(module))


LORA_MODES: dict[str, LoraMode] = {
    "swap": LoraMode("swap", "diffq.worker.device.adapters:AdapterSlot.install",
                     "a zero LoRA scaffold at the layout's rank and slots, each set hot-swapped in",
                     needs_graph_inputs=True),
    "fuse": LoraMode("fuse", "diffq.worker.device.lora_apply:FusedWeights.install",
                     "no LoRA layer: the set fused into the base weights", needs_graph_inputs=True),
    "compile": LoraMode("compile", "diffq.worker.device.lora_apply:CompiledSets.install",
                        "no LoRA layer: the set fused, one graph per (shape, set)", needs_graph_inputs=False),
}
# `auto`: the backend table's `lora` column per device and compile mode (swap on CPU and
# CUDA, compile on Neuron and TPU) unless a `qualify --lora` profile measured on the device
# proves a cheaper mode (`resolve`). Records and specs hold the resolved mode, never auto.
AUTO = "auto"
LORA_MODE_CHOICES = (AUTO, *LORA_MODES)
DEFAULT_LORA_MODE = AUTO


# What a LoRA profile is matched against (`resolve`): this host's own generation and
# installed versions, unless the caller names them (a fleet render: the pods').
HERE = "here"
PASSED_OVER = "the LoRA profile not applied: "


def installed_versions(backend) -> dict[str, str]:
    """torch, diffusers, peft and the backend's packages as installed here: what a LoRA
    profile records (qualify) and is matched against (`resolve`)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {p: v for p in ("torch", "diffusers", "peft", *backend.cache_packages) if (v := installed(p))}


def generation_here(backend) -> str | None:
    """The device generation on this host where the backend table can detect it (TPU)."""
    return backend.detect_generation() if backend.detect_generation else None


@functools.lru_cache(maxsize=64)
def _say_once(message: str) -> None:
    """Logged once a process: a fleet render and a worker's planning resolve many times."""
    log.warning(message)


def resolve(backend, compile_mode: str, lora_mode: str, profile=None, *, generation=HERE, models=None,
            versions=HERE) -> tuple[str, str]:
    """The LoRA mode `lora_mode` means on this device and compile mode, and why: a named
    mode is itself; `auto` is the profile's proven mode where it was measured on this
    device, generation, compile mode, model (`models`, where known) and versions
    (diffq/core/profile.py LoraProfile.mismatch; `versions` None: not checked), else the
    backend table's, the reason the profile was passed over said and logged."""
    if lora_mode != AUTO:
        return lora_mode, "asked"
    passed_over = ""
    if profile is not None:
        generation = generation_here(backend) if generation == HERE else generation
        versions = installed_versions(backend) if versions == HERE else versions
        where = {"generation": generation, "models": models, "versions": versions}
        if (proven := profile.lora_mode_for(backend.name, compile_mode, **where)) is not None:
            return proven
        passed_over = (f"; {PASSED_OVER}" +
                       (profile.mismatch(backend.name, compile_mode, **where) or "no mode passed its check in it"))
        _say_once(f"--lora-mode auto: {passed_over.removeprefix('; ')}")
    facts = backend.lora_facts(compile_mode)
    if facts is None:  # adapters are refused there (`refusal`); a mode is still named
        return "compile", f"--device {backend.name} --compile {compile_mode}: no row in the backend table{passed_over}"
    return facts.mode, (f"the backend table (--device {backend.name} --compile {compile_mode}): {facts.why}"
                        f"{passed_over}")


def bakes_weights(backend, compile_mode: str) -> bool:
    """Whether this backend and compile mode may bake the weights into the compiled graph:
    the backend table does not know them to be graph inputs (its `lora` column), or
    Inductor's freezing is on, which folds parameters into the compiled code when it runs
    without grad (torch/_inductor/compile_fx.py, `config.freezing and not
    torch.is_grad_enabled()`; a pipeline call runs under inference mode)."""
    if compile_mode not in COMPILING_MODES and not backend.eager_compiles:
        return False
    import torch._inductor.config

    known = backend.lora_facts(compile_mode)
    return known is None or not known.graph_inputs or bool(torch._inductor.config.freezing)


# Why a tensor-parallel group takes no adapters: its ranks hold shards of the transformer's
# weights (tensor_parallel.py), while swap's scaffold, fuse's pristine copies and deltas
# and the change check's probe are built over whole, unsharded weights on one device.
TP_REFUSAL = ("LoRA adapters on a tensor-parallel group (--tp {tp}): each rank holds a shard of the weights, and "
              "the LoRA modes (swap's scaffold, fuse and compile's deltas, the change check) write whole weights on "
              "one device; serve adapters from single-device workers (--tp 1)")


def refusal(backend, compile_mode: str, lora_mode: str, tp: int = 1) -> str | None:
    """Why `lora_mode` (resolved) cannot serve adapters on this device, compile mode and
    tensor-parallel degree, or None. Refused: a compile mode the backend table has no `lora`
    row for, and a --tp group. Not refused: compile is right anywhere, and a swap or fuse
    where the table does not know the weights to be graph inputs is checked at the first set
    change (the change check), never trusted blind."""
    if lora_mode not in LORA_MODES:
        return f"--lora-mode {lora_mode}: choose {', '.join(LORA_MODE_CHOICES)}"
    if tp > 1:
        return TP_REFUSAL.format(tp=tp)
    if backend.lora_facts(compile_mode) is None:
        return (f"LoRA adapters on --device {backend.name} --compile {compile_mode}: the backend table has no "
                f"LoRA row for this compile mode")
    return None
