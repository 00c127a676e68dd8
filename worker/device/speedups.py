"""A batch's speed-up on the loaded pipeline, through diffusers' own API.

The batch carries its canonical spec (core/speedups.py); before each call, on the
device's turn, the pipeline is set to it: `CacheMixin.enable_cache(config)` when the
cache differs from the last call's (`disable_cache` first: diffusers takes one), the
cache's state reset before every call (diffusers resets it only at the end of a call
that succeeded: after one that raised, the next image was off), and `set_attention_backend`. Nothing here caches or skips by hand.

A spec a device, compile mode or family cannot run is refused with the reason
(`refusal`): the backend table says what each compile mode offers, the family table
whether the pipeline opens a cache context at all, the scheme table (core/speedups.py
SCHEMES) on which devices a quantization scheme runs. A scheme is not set here per call:
it is the weights the pipeline was loaded with (worker/device/quantize.py).
"""

from __future__ import annotations

import dataclasses
import logging

from diffq.core.speedups import BATCH, CACHES, Speedup, parse
from diffq.worker.device import quantize

log = logging.getLogger(__name__)

DEFAULT_ATTENTION = "native"  # diffusers' default backend (torch's scaled_dot_product_attention)


class SpeedupUnsupported(ValueError):
    """A speed-up this worker cannot run (device, compile mode, family): no retry helps."""


def refusal(speedup: Speedup | None, backend, compile_mode: str, family, *, dtype: str | None = None,
            adapters: bool = False) -> str | None:
    """Why this worker cannot run `speedup` (at `dtype`, with LoRA adapters or not), or None."""
    if speedup is None:
        return None
    offered = backend.speedups_offered(compile_mode)
    if speedup.quant is not None:
        if reason := quantize.refusal(speedup.quant, backend, compile_mode, dtype):
            return reason
        if adapters:
            return ADAPTERS_OVER_QUANT.format(scheme=speedup.quant)
    if speedup.cache is not None:
        if not family.step_caches:
            return (f"{family.pipeline_class} ({family.name}) cannot run a step cache: "
                    f"{family.step_caches_missing}")
        if reason := family.cache_refusals.get(speedup.cache):
            return f"{speedup.cache} on {family.pipeline_class}: {reason}"
        if CACHES[speedup.cache].decides == BATCH and not backend.host_decisions:
            return (f"{speedup.cache} decides from the batch's data each step (a host sync and a data-dependent "
                    f"branch): on {backend.name} that is a graph break per step")
        if offered == "none":
            return (f"--compile {compile_mode} compiles the whole transformer: a cache's decision runs on the "
                    "host inside it (a torch.compiler.disable'd function, or PAB's and FasterCache's branch on the "
                    "timestep tensor: a graph break); use --compile regional or none")
        if offered == "whole-blocks" and not speedup.whole_blocks():
            return (f"{speedup.spec}: its hooks sit inside each block, which --compile {compile_mode} compiles "
                    "whole; use a mode that caches whole blocks (taylorseer:use_lite_mode=true, mag, ...) or "
                    "--compile none")
    if speedup.attention is not None and offered != "all":
        return (f"attention:{speedup.attention} under --compile {compile_mode}: switching the attention backend "
                "recompiles every block (docs/speedups.md), until dynamo's recompile limit; "
                "run it with --compile none")
    return None


# LoRA over quantized weights: peft wraps a torchao-quantized linear in its own layer
# (peft/tuners/lora/torchao.py, TorchaoLoraLinear) whose base stays quantized, but
# diffq's hot-swap scaffold (worker/device/adapters.py) is not shown to keep the graphs
# over it: refused until a test shows it.
ADAPTERS_OVER_QUANT = ("quant:{scheme} with LoRA adapters: a hot-swap is not shown to keep the compiled graphs over "
                       "quantized base weights; run the adapters at full precision, or the scheme without adapters")


def local_refusal(models, specs, device: str, compile_mode: str, adapters: bool = False) -> str | None:
    """Why one of `specs` cannot run on `device` under `compile_mode` for one of the
    local models (families read from their folders; hub ids: the worker says on load),
    before any worker starts."""
    from diffq.core.families import family_of
    from diffq.worker.device.backends import get_backend

    backend = get_backend(device)
    for model in models:
        family = family_of(model)
        for spec in specs:
            speedup = parse(spec)
            if family is None:  # a hub id: what needs no family is still refused here
                reason = speedup is not None and speedup.quant is not None and refusal(
                    Speedup(quant=speedup.quant), backend, compile_mode, None, adapters=adapters)
            else:
                reason = refusal(speedup, backend, compile_mode, family, adapters=adapters)
            if reason:
                return f"--speedup {spec}: {reason}"
    return None


def cache_config(speedup: Speedup, pipe, steps: int):
    """The diffusers config object for a parsed cache, with what diffq fills itself."""
    import diffusers
    import torch

    row = CACHES[speedup.cache]
    values = {}
    for name, value in speedup.fields:
        kind = row.fields[name]
        if kind == "dtype":
            value = getattr(torch, value)
        elif kind == "preset":
            value = _PRESETS[(speedup.cache, name, value)]()
        values[name] = value
    if "num_inference_steps" in row.filled:
        values["num_inference_steps"] = steps
    if "current_timestep_callback" in row.filled:
        values["current_timestep_callback"] = lambda: pipe.current_timestep
    return getattr(diffusers, row.config)(**values)


def _flux_mag_ratios():
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    return FLUX_MAG_RATIOS


_PRESETS = {("mag", "mag_ratios", "flux"): _flux_mag_ratios}


@dataclasses.dataclass
class Applied:
    """What one pipeline is set to now."""

    cache: tuple | None = None  # (canonical spec, steps) of the cache on
    attention: str = DEFAULT_ATTENTION


class Speedups:
    """Sets each loaded pipeline to its batch's speed-up (one per PipelineHost)."""

    def __init__(self):
        self._applied: dict[int, Applied] = {}
        # The device's compute capability, read once (`check_device`) where a scheme needs one.
        self.capability: tuple[int, int] | None = None
        self._checked = False

    def check_device(self, backend) -> None:
        """At the worker's start (and before a first scheme loads): read what the scheme
        table checks of the device."""
        if not self._checked:
            self.capability = quantize.device_capability(backend)
            self._checked = True

    def scheme(self, spec: str | None, backend, compile_mode: str, *, dtype: str, adapters: bool) -> str | None:
        """The quantization scheme a batch's pipeline is loaded with (None: full precision),
        refused (SpeedupUnsupported) before anything loads where this worker cannot run it."""
        speedup = parse(spec)
        if speedup is None or speedup.quant is None:
            return None
        self.check_device(backend)
        reason = (refusal(Speedup(quant=speedup.quant), backend, compile_mode, None, dtype=dtype, adapters=adapters)
                  or quantize.capability_refusal(speedup.quant, backend, self.capability))
        if reason:
            raise SpeedupUnsupported(reason)
        return speedup.quant

    def prepare(self, spec: str | None, backend, compile_mode: str, family, *, dtype: str | None = None,
                adapters: bool = False) -> Speedup | None:
        """The parsed spec, refused (SpeedupUnsupported) where this worker cannot run it;
        off the device."""
        speedup = parse(spec)
        reason = refusal(speedup, backend, compile_mode, family, dtype=dtype, adapters=adapters)
        if reason:
            raise SpeedupUnsupported(reason)
        return speedup

    def forget(self, pipe) -> None:
        """A pipeline dropped (PipelineHost.release): its id may be reused by the next."""
        self._applied.pop(id(pipe), None)

    def apply(self, pipe, speedup: Speedup | None, steps: int) -> None:
        """On the device's turn, just before the call."""
        applied = self._applied.get(id(pipe))
        if speedup is None and applied is None:
            return  # full compute, never set otherwise: nothing to undo (nor a transformer to ask)
        transformer = pipe.transformer
        applied = self._applied.setdefault(id(pipe), Applied())
        wanted = (speedup.spec, steps) if speedup is not None and speedup.cache is not None else None
        if wanted != applied.cache:
            if applied.cache is not None:
                transformer.disable_cache()
                applied.cache = None
            if wanted is not None:
                transformer.enable_cache(cache_config(speedup, pipe, steps))
                applied.cache = wanted
        if applied.cache is not None:
            transformer._reset_stateful_cache()  # diffusers' own reset (CacheMixin)
        attention = (speedup.attention if speedup is not None else None) or DEFAULT_ATTENTION
        if attention != applied.attention:
            transformer.set_attention_backend(attention)
            applied.attention = attention
