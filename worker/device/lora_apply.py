"""The `fuse` and `compile` LoRA modes (lora_modes.py, the table), and the change check
every mode passes at a host's first set change."""

from __future__ import annotations

import logging
import time
import types
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import AdapterRef
from diffq.worker.device.adapters import AdapterCache, AdapterSlot, AdapterUnsupported, Loaded, canonical
from diffq.worker.device.lora_modes import bakes_weights

log = logging.getLogger(__name__)

# Sets whose compiled graphs `compile` keeps on a backend that bakes weights: each set's
# graphs hold their own copy of the targeted weights (Inductor's freezing folds them in as
# constants), so memory bounds it; a worker meets sets in runs (whole batches of a set).
KEPT_SETS = 4
# Dtypes a fuse can write a delta into as it is; anything else (int8, float8, a torchao
# tensor subclass) is quantized storage: fusing would mean re-quantizing (peft's
# TorchaoLoraLinear.merge calls torchao's quantize_ again, tuners/lora/torchao.py).
FUSABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LoraChangeUnseen(AdapterUnsupported):
    """A set change the device's output did not show: this worker serves no more adapters."""


# --- fuse -------------------------------------------------------------------------------


def quantized(weight: torch.Tensor) -> bool:
    return weight.dtype not in FUSABLE_DTYPES or type(weight.data) is not torch.Tensor


@dataclass
class FusedWeights:
    """`fuse`: the set's deltas in the base weights of the layout's targets, from pristine host copies."""

    layout: AdapterLayout
    cache: AdapterCache
    modules: dict[str, torch.nn.Module]
    pristine: dict[str, torch.Tensor]  # module name -> its weight as loaded, on the host
    current: tuple = ()  # the set the weights hold (canonical order)
    swaps: int = 0
    swap_seconds: float = 0.0
    _touched: set = field(default_factory=set)  # modules whose weights hold a delta now
    mode: str = "fuse"

    @classmethod
    def install(cls, pipe, layout: AdapterLayout, cache: AdapterCache, **_) -> FusedWeights:
        transformer = pipe.transformer
        modules = {target: transformer.get_submodule(target) for target in layout.targets}
        if held := [name for name, module in modules.items() if quantized(module.weight)]:
            raise AdapterUnsupported(
                f"--lora-mode {cls.mode} over quantized weights ({held[0]}: {modules[held[0]].weight.dtype}, "
                f"{type(modules[held[0]].weight.data).__name__}): fusing would re-quantize them on every set "
                f"change; use --lora-mode swap")
        started = time.perf_counter()
        pristine = {name: module.weight.detach().to("cpu", copy=True) for name, module in modules.items()}
        log.info("lora %s: pristine copies of %d module(s) in %.2fs", cls.mode, len(modules),
                 time.perf_counter() - started)
        return cls(layout=layout, cache=cache, modules=modules, pristine=pristine)

    @property
    def held(self) -> tuple[AdapterRef, ...]:
        return self.current

    def apply(self, pipe, adapters: tuple[AdapterRef, ...]) -> float:
        """This batch's set into the weights; the seconds it took (0 when they hold it)."""
        wanted = canonical(adapters)
        if wanted == self.current:
            return 0.0
        started = time.perf_counter()
        deltas: dict[str, torch.Tensor] = {}
        for ref in wanted:
            loaded = self.cache.get(ref, type(pipe))
            AdapterSlot.check_targets(self.layout, ref, loaded)
            for module, delta in _deltas(loaded, ref.scale):
                deltas[module] = deltas[module] + delta if module in deltas else delta
        with torch.no_grad():
            for module in self._touched | set(deltas):
                weight = self.modules[module].weight
                fused = self.pristine[module].to(weight.device, torch.float32)  # may be the copy itself
                if module in deltas:
                    fused = fused + deltas[module].to(weight.device)  # out of place: the copy stays pristine
                weight.copy_(fused)  # in place: the same parameter, cast to its dtype
        self._touched = set(deltas)
        self.current = wanted
        elapsed = time.perf_counter() - started
        self.swaps += 1
        self.swap_seconds += elapsed
        log.info("adapter %s fused in %.3fs", " + ".join(f"{ref.path} at scale {ref.scale:g}" for ref in wanted)
                 or "none", elapsed)
        return elapsed

    def stats(self) -> dict:
        return {"mode": self.mode, "swaps": self.swaps, "swap_seconds": round(self.swap_seconds, 4),
                "cache_hits": self.cache.hits, "cache_misses": self.cache.misses, "targets": len(self.modules)}


def _deltas(loaded: Loaded, scale: float):
    """Per target module its delta in float32: scale · (alpha / r) · B @ A, peft's
    `get_delta_weight` (tuners/lora/layer.py) for a Linear."""
    for module, (down, up) in loaded.pairs().items():
        yield module, (up.float() @ down.float()) * (loaded.scalings[module] * scale)


# --- compile ----------------------------------------------------------------------------


@dataclass
class CompiledSets(FusedWeights):
    """`compile`: fused as `fuse`; on a backend that bakes weights, one compile per set."""

    mode: str = "compile"
    bakes: bool = False
    options: dict = field(default_factory=dict)
    compiles: int = 0  # sets given a fresh compile
    # set -> {(module, attribute): its compiled callable}, most recently used last
    _graphs: OrderedDict = field(default_factory=OrderedDict)
    _sites: list | None = None  # (module, attribute, the uncompiled callable)

    @classmethod
    def install(cls, pipe, layout: AdapterLayout, cache: AdapterCache, *, backend, compile_mode: str,
                **_) -> CompiledSets:
        fused = super().install(pipe, layout, cache)
        fused.bakes = bakes_weights(backend, compile_mode)
        fused.options = dict(backend.compile_options)
        log.info("lora compile: %s", "the backend bakes weights: one compile per adapter set" if fused.bakes
                 else "weights are graph inputs: every adapter set reuses the shape's graph")
        return fused

    def apply(self, pipe, adapters: tuple[AdapterRef, ...]) -> float:
        before = self.current
        elapsed = super().apply(pipe, adapters)
        if self.bakes and self.current != before:
            started = time.perf_counter()
            self._select(pipe, before)
            elapsed += time.perf_counter() - started
        return elapsed

    def _select(self, pipe, before: tuple) -> None:
        """The compiled callables of the set now fused: kept ones, or fresh ones (compiled
        on the next call). The first time, the host's own compile is the set before's."""
        if self._sites is None:
            self._sites = compiled_sites(pipe.transformer)
            self._graphs[before] = {(id(module), name): getattr(module, name) for module, name, _ in self._sites}
        if self.current not in self._graphs:
            copies: dict = {}  # one code copy per function: instances of a block class share it, as before
            self._graphs[self.current] = {(id(module), name): torch.compile(_fresh(original, copies), **self.options)
                                          for module, name, original in self._sites}
            self.compiles += 1
            while len(self._graphs) > KEPT_SETS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(self.current)
        chosen = self._graphs[self.current]
        for module, name, _ in self._sites:
            setattr(module, name, chosen[(id(module), name)])

    def stats(self) -> dict:
        return {**super().stats(), "bakes_weights": self.bakes, "set_compiles": self.compiles,
                "sets_kept": len(self._graphs)}


def compiled_sites(transformer: torch.nn.Module) -> list[tuple]:
    """Where the host compiled the transformer (PipelineHost._compile): a module's own
    `forward` (regional) or its `_compiled_call_impl` (`Module.compile`, full), each with
    the callable torch.compile wrapped (dynamo's `_torchdynamo_orig_callable`)."""
    sites = []
    for module in transformer.modules():
        for name, held in (("forward", module.__dict__.get("forward")),
                           ("_compiled_call_impl", getattr(module, "_compiled_call_impl", None))):
            original = getattr(held, "_torchdynamo_orig_callable", None)
            if original is not None:
                sites.append((module, name, original))
    return sites


def _fresh(bound, copies: dict):
    """`bound` over a copy of its function's code object. Dynamo keeps its compiled
    graphs per code object (torch/_dynamo/eval_frame.py, the frame's cache entries), so a
    copy starts with none: a new compile, next to the other sets' graphs rather than
    instead of them (`torch._dynamo.reset()` would drop every shape's and set's)."""
    func = bound.__func__
    if func not in copies:
        copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                  func.__closure__)
        copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
        copy.__dict__.update(func.__dict__)
        copies[func] = copy
    return types.MethodType(copies[func], bound.__self__)


# --- the change check -------------------------------------------------------------------


def effective(adapters) -> frozenset:
    """What a set changes in the weights: its adapters at a scale other than 0."""
    return frozenset((ref.path, ref.revision, ref.scale) for ref in adapters if ref is not None and ref.scale)


@dataclass(frozen=True)
class ChangeCheck:
    """One probe before and after a set change: its output moved past the probe's own
    run-to-run noise, as the new set says it must (it changes the weights)."""

    mode: str
    before: tuple
    after: tuple
    moved: float  # max abs difference of the probe's output, after vs before
    noise: float  # the same between two probes before the change

    @property
    def showed(self) -> bool:
        return self.moved > 2 * self.noise and self.moved > 0

    def reason(self) -> str:
        def named(refs) -> str:
            return " + ".join(f"{ref.path}@{ref.scale:g}" for ref in refs if ref is not None) or "none"

        return (f"--lora-mode {self.mode}: the change from {named(self.before)} to {named(self.after)} did not show "
                f"in the transformer's output on the probe (moved {self.moved:.3g}, noise {self.noise:.3g}): this "
                f"device's graphs do not read the weights this mode writes; this worker serves no more LoRA "
                f"adapters (--lora-mode compile compiles per set)")


def informative(before, after) -> bool:
    """A change the probe must see: the weights differ between the two sets."""
    return effective(before) != effective(after)
