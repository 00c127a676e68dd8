"""Speed-ups a run asks for (`--speedup SPEC`): diffusers' step caches and attention
backends, declared once as data, and the one parser of a spec.

A spec is parts joined by `+`: a cache named as diffusers names its config class,
lower case without `CacheConfig` (`taylorseer`, `mag`, `firstblock`, ...), with that
class's own fields (`taylorseer:cache_interval=3,use_lite_mode=true`), a weight
quantization scheme (`quant:int8wo`, a row of `SCHEMES`: torchao applied to the
transformer at load, worker/device/quantize.py), and an attention backend
(`attention:_native_math`). A range is two numbers joined by `|`
(`spatial_attention_timestep_skip_range=100|800`). The canonical form (fields sorted,
values normalised) travels in every batch (`BatchParams.speedup`), lands in every
image record and its embedded provenance, and is what the worker applies through
diffusers' own API (worker/device/speedups.py): `CacheMixin.enable_cache`, state reset
before every call (a call that raised leaves state behind: measured), and
`set_attention_backend`.

Torch-free: the producer refuses a spec before anything is enqueued. Each row's facts
are read from diffusers 0.42.1 (`diffusers/hooks/*.py`); tests/test_speedups.py pins
the fields against the installed config classes, and docs/speedups.md has the
measurements behind `decides` and `whole_blocks`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# How a cache decides to skip:
#   static: a per-step schedule (step counters, precomputed ratios, the timestep):
#           the same for every image, whatever its batch neighbours;
#   batch:  a threshold over the whole batch's data (`.abs().mean()` over the batch
#           tensor, then `.item()`): an image depends on its neighbours, and each
#           step is a host sync and a data-dependent branch (a graph break on XLA
#           and Neuron). Offered only behind --unreproducible-speedup.
STATIC, BATCH = "static", "batch"

# Field kinds a string can carry.
INT, FLOAT, BOOL, DTYPE, RANGE = "int", "float", "bool", "dtype", "range"
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Cache:
    """One diffusers step cache, as diffq offers it."""

    config: str  # the diffusers config class
    source: str  # the diffusers file its facts come from
    fields: dict[str, str]  # field -> kind (INT, FLOAT, ...; "int?" may be "none")
    decides: str  # STATIC or BATCH
    # Its hooks wrap whole repeated blocks (or the transformer's output), so they run
    # around per-block compiled forwards; hooks inside a block break a compiled block.
    # A dict: whole blocks only with these field values.
    whole_blocks: bool | dict = True
    # Fields diffq fills itself: the call's step count, the pipeline's timestep.
    filled: tuple[str, ...] = ()
    # Fields a spec must give (a calibration diffq cannot guess), and named presets
    # for fields a string cannot carry (an array).
    required: tuple[str, ...] = ()
    presets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refused: str | None = None  # why diffq does not offer it at all


CACHES: dict[str, Cache] = {
    "taylorseer": Cache(
        "TaylorSeerCacheConfig", "diffusers/hooks/taylorseer_cache.py",
        {"cache_interval": INT, "disable_cache_before_step": INT, "disable_cache_after_step": "int?",
         "max_order": INT, "taylor_factors_dtype": DTYPE, "use_lite_mode": BOOL},
        # A call counter per module: (step - before - 1) % interval; predictions are
        # elementwise per item.
        STATIC,
        # Default mode hooks the attention modules inside each block; lite mode skips
        # whole blocks and predicts proj_out.
        whole_blocks={"use_lite_mode": True}),
    "mag": Cache(
        "MagCacheConfig", "diffusers/hooks/mag_cache.py",
        {"threshold": FLOAT, "max_skip_steps": INT, "retention_ratio": FLOAT, "mag_ratios": "preset"},
        # The accumulated error of precomputed per-step ratios (`.item()` only when calibrating).
        STATIC, filled=("num_inference_steps",), required=("mag_ratios",),
        presets={"mag_ratios": ("flux",)}),
    "pyramidattentionbroadcast": Cache(
        "PyramidAttentionBroadcastConfig", "diffusers/hooks/pyramid_attention_broadcast.py",
        {"spatial_attention_block_skip_range": "int?", "spatial_attention_timestep_skip_range": RANGE},
        # An iteration counter and the call's one scalar timestep.
        STATIC, whole_blocks=False, filled=("current_timestep_callback",)),
    "firstblock": Cache(
        "FirstBlockCacheConfig", "diffusers/hooks/first_block_cache.py",
        {"threshold": FLOAT},
        # The first block's residual change, `.abs().mean()` over the whole batch, `.item()`.
        BATCH),
    "sea": Cache(
        "SeaCacheConfig", "diffusers/hooks/sea_cache.py", {"threshold": FLOAT}, BATCH,
        refused="SeaCache needs the step, sigma and step count in the cache context, which FluxPipeline does "
                "not pass (pipelines/flux/pipeline_flux.py: cache_context(\"cond\")): it never skips"),
    "faster": Cache(
        "FasterCacheConfig", "diffusers/hooks/faster_cache.py", {}, STATIC, whole_blocks=False,
        refused="FasterCache splits the batch into unconditional and conditional halves and expects video-shaped "
                "tensors (BCFHW): it fails on Flux (diffusers/hooks/faster_cache.py)"),
    "textkv": Cache(
        "TextKVCacheConfig", "diffusers/hooks/text_kv_cache.py", {}, STATIC,
        refused="TextKVCache hooks only NucleusMoE image blocks: nothing to cache in the families diffq runs"),
}

ATTENTION = "attention"
# Attention backends a string may name are diffusers' `AttentionBackendName`s (the
# worker checks the name against the installed diffusers); these never run here:
# they fetch kernels from the Hugging Face Hub at first use.
ATTENTION_REFUSED_SUFFIX = "_hub"

QUANT = "quant"
# Quantization scheme kinds: what the linear layers compute in.
WEIGHT_ONLY, PER_ROW, PER_TENSOR = "weight-only", "per-row", "per-tensor"
# Where a scheme's torchao config class and the kernels its tensor subclass dispatches to live.
TORCHAO_CONFIGS = "torchao/quantization/quant_api.py"
INT8_TENSOR = "torchao/quantization/quantize_/workflows/int8/int8_tensor.py"
FLOAT8_TENSOR = "torchao/quantization/quantize_/workflows/float8/float8_tensor.py"
# Neuron and TPU: torchao's tensor subclasses reach the device as their inner int8 /
# float8 tensors and the ops above (torch._int_mm through torchao/kernel/intmm.py, an
# int8 -> float convert and mm). diffq has found no source of torch-neuronx or
# torch_tpu that lowers those for a torchao subclass, so both are refused as unknown
# rather than run on a guess (a refusal names this; a row gains the device with a
# cited source and a measured run).
UNKNOWN_ON_DEVICE = ("no {device} source diffq has read shows its compiler lowering torchao's {kind} tensor "
                     "subclass ({tensor}: {ops}); refused as unknown rather than run on a guess")


@dataclass(frozen=True)
class Scheme:
    """One weight quantization scheme: a torchao config applied to the transformer's
    linear layers when the model loads (before compile and before a LoRA scaffold)."""

    config: str  # the torchao config class (torchao.quantization)
    weights: str  # what the linear weights are stored as
    activations: str  # WEIGHT_ONLY, PER_ROW (dynamic, a scale per token) or PER_TENSOR (one per call)
    tensor: str  # the torchao file whose tensor subclass computes the linear layers
    ops: str  # what it dispatches to, for the reasons above
    # Per backend name: None runs, a string is why it does not; a backend not named is
    # refused as unknown (UNKNOWN_ON_DEVICE).
    devices: dict[str, str | None]
    # Per backend name: the least compute capability (major, minor), checked against the
    # device at the worker's start.
    capability: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The dtypes its weights may be quantized from (torchao asserts otherwise); () any.
    dtypes: tuple[str, ...] = ()


# Which modules every scheme touches, and why only those: every nn.Linear of the
# transformer (torchao's quantize_ with its default filter, `_is_linear`): the
# denoiser runs every step and holds the model's weights (FLUX.1's 12B of ~17B). The
# text encoders run once per prompt, not per step, and the VAE once per image, its
# convolutions (which these configs do not touch) decoding straight to the pixels:
# quantizing them would cost fidelity for little time or memory.
QUANTIZED_MODULES = "transformer: every nn.Linear (torchao quantize_'s default filter); text encoders and VAE stay"

SCHEMES: dict[str, Scheme] = {
    "int8wo": Scheme(
        "Int8WeightOnlyConfig", "int8, a float scale per output row", WEIGHT_ONLY, INT8_TENSOR,
        "an int8 -> compute-dtype convert and torch.mm, scaled per row",
        devices={"cpu": None, "cuda": None}),
    "int8dq": Scheme(
        "Int8DynamicActivationInt8WeightConfig", "int8, a float scale per output row", PER_ROW, INT8_TENSOR,
        "each token's activations quantized to int8 with its own scale, then torch._int_mm (torchao/kernel/intmm.py)",
        devices={"cpu": None, "cuda": None}),
    # One activation scale over the whole call's tensor: an image's activations are
    # rounded by a scale its batch neighbours set.
    "int8dq-tensor": Scheme(
        "Int8DynamicActivationInt8WeightConfig", "int8, one float scale per weight", PER_TENSOR, INT8_TENSOR,
        "the whole batch's activations quantized to int8 with one scale, then torch._int_mm",
        devices={"cpu": None, "cuda": None}),
    "fp8wo": Scheme(
        "Float8WeightOnlyConfig", "float8_e4m3fn, a float scale per output row", WEIGHT_ONLY, FLOAT8_TENSOR,
        "the weight dequantized to the compute dtype on every call, then F.linear",
        devices={"cpu": "no float8 arithmetic on CPU: torchao's Float8Tensor dequantizes each weight on every call "
                        f"({FLOAT8_TENSOR}, weight-only linear), paying a convert per layer per step for memory "
                        "alone; int8wo stores the same bytes and multiplies from them",
                 "cuda": None},
        capability={"cuda": (8, 9)}),
    "fp8dq": Scheme(
        "Float8DynamicActivationFloat8WeightConfig", "float8_e4m3fn, a float scale per output row", PER_ROW,
        FLOAT8_TENSOR, "each token's activations quantized to float8 with its own scale, then torch._scaled_mm",
        devices={"cpu": "no float8 matmul on CPU: torchao checks for CUDA compute capability 8.9, MI300 or XPU "
                        "before quantizing (torchao/float8/inference.py, _check_hardware_support)",
                 "cuda": None},
        capability={"cuda": (8, 9)},
        # torchao asserts it (quant_api.py: "PerRow quantization only works for bfloat16").
        dtypes=("bfloat16",)),
}

# The option that lets a batch-dependent cache run: its name says what it gives up.
UNREPRODUCIBLE_OPTION = "--unreproducible-speedup"


class SpeedupError(ValueError):
    """A spec diffq cannot parse or does not offer, said with the reason."""


@dataclass(frozen=True)
class Speedup:
    """A parsed spec: at most one cache (diffusers takes one) and one attention backend."""

    cache: str | None = None
    fields: tuple[tuple[str, object], ...] = ()  # sorted, values typed
    attention: str | None = None
    quant: str | None = None  # a SCHEMES key

    @property
    def spec(self) -> str:
        """The canonical spec: what batches carry and records say."""
        parts = []
        if self.cache:
            shown = ",".join(f"{name}={_show(value)}" for name, value in self.fields)
            parts.append(f"{self.cache}:{shown}" if shown else self.cache)
        if self.quant:
            parts.append(f"{QUANT}:{self.quant}")
        if self.attention:
            parts.append(f"{ATTENTION}:{self.attention}")
        return "+".join(parts)

    @property
    def batch_dependent(self) -> bool:
        return ((self.cache is not None and CACHES[self.cache].decides == BATCH)
                or (self.quant is not None and SCHEMES[self.quant].activations == PER_TENSOR))

    def whole_blocks(self) -> bool:
        """Its cache hooks whole blocks only (runs beside per-block compiled forwards)."""
        if self.cache is None:
            return True
        rule = CACHES[self.cache].whole_blocks
        if isinstance(rule, bool):
            return rule
        values = dict(self.fields)
        return all(values.get(name) == wanted for name, wanted in rule.items())


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "|".join(_show(v) for v in value)
    if value is None:
        return "none"
    return str(value)


def _value(cache: str, name: str, kind: str, text: str):
    where = f"{cache}:{name}"
    if kind == "preset":
        known = CACHES[cache].presets.get(name, ())
        if text not in known:
            raise SpeedupError(f"{where}: '{text}' is not a preset ({', '.join(known)})")
        return text
    if kind.endswith("?"):
        if text.lower() == "none":
            return None
        kind = kind[:-1]
    try:
        if kind == INT:
            return int(text)
        if kind == FLOAT:
            return float(text)
        if kind == BOOL:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind == DTYPE:
            if text not in DTYPE_NAMES:
                raise ValueError
            return text
        if kind == RANGE:
            low, high = text.split("|")
            return (int(low), int(high))
    except ValueError:
        raise SpeedupError(f"{where}: '{text}' is not {'a range LOW|HIGH' if kind == RANGE else 'a ' + kind}"
                           + (f" ({', '.join(DTYPE_NAMES)})" if kind == DTYPE else "")) from None
    raise SpeedupError(f"{where}: a spec cannot carry this field")


_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def parse(spec: str | None) -> Speedup | None:
    """The Speedup a spec asks for (None for none), refused with the reason where diffq
    does not offer it at all; which device, compile mode and family may run it is
    `refusal`'s to say."""
    if spec is None or not spec.strip() or spec.strip().lower() == "none":
        return None
    cache, fields, attention, quant = None, (), None, None
    for part in spec.strip().split("+"):
        name, _, body = part.strip().partition(":")
        name = name.strip().lower()
        if name == QUANT:
            scheme = body.strip().lower()
            if scheme not in SCHEMES:
                raise SpeedupError(f"quant: expected quant:SCHEME, one of {', '.join(SCHEMES)}; got '{part.strip()}'")
            if quant is not None:
                raise SpeedupError("quant is given twice: one scheme per transformer")
            quant = scheme
            continue
        if name == ATTENTION:
            backend = body.strip().lower()
            if not _NAME.fullmatch(backend or "-"):
                raise SpeedupError(f"attention: expected attention:BACKEND (e.g. attention:_native_math), got '{part}'")
            if backend.endswith(ATTENTION_REFUSED_SUFFIX):
                raise SpeedupError(f"attention:{backend} fetches its kernels from the Hugging Face Hub at first use; "
                                   "diffq workers load nothing they were not given")
            if attention is not None:
                raise SpeedupError("attention is given twice")
            attention = backend
            continue
        if name not in CACHES:
            raise SpeedupError(f"unknown speed-up '{name}': caches are {', '.join(sorted(CACHES))} "
                               f"(diffusers' config class, lower case, without CacheConfig), {QUANT}:SCHEME "
                               f"({', '.join(SCHEMES)}) or {ATTENTION}:BACKEND")
        row = CACHES[name]
        if row.refused:
            raise SpeedupError(f"{name}: {row.refused}")
        if cache is not None:
            raise SpeedupError(f"one cache at a time (CacheMixin.enable_cache takes one): {cache} and {name}")
        values = {}
        for pair in filter(None, (p.strip() for p in body.split(","))):
            key, eq, text = pair.partition("=")
            key = key.strip()
            if not eq:
                raise SpeedupError(f"{name}: '{pair}' is not FIELD=VALUE")
            if key in row.filled:
                raise SpeedupError(f"{name}:{key} is set by diffq from each batch")
            if key not in row.fields:
                raise SpeedupError(f"{name}: no field '{key}' (fields: {', '.join(row.fields)})")
            values[key] = _value(name, key, row.fields[key], text.strip())
        missing = [key for key in row.required if key not in values]
        if missing:
            raise SpeedupError(f"{name} needs {', '.join(f'{m}=' + '|'.join(row.presets.get(m, ('…',))) for m in missing)}"
                               " (a calibration diffq cannot guess)")
        cache, fields = name, tuple(sorted(values.items()))
    if cache is None and attention is None and quant is None:
        return None
    return Speedup(cache=cache, fields=fields, attention=attention, quant=quant)


def canonical(spec: str | None, *, unreproducible: bool = False) -> str | None:
    """The canonical spec for a run, or None; a batch-dependent cache is refused unless
    the user gave up reproducibility by name."""
    speedup = parse(spec)
    if speedup is None:
        return None
    if speedup.batch_dependent and not unreproducible:
        if speedup.quant is not None and SCHEMES[speedup.quant].activations == PER_TENSOR:
            raise SpeedupError(f"{QUANT}:{speedup.quant} quantizes each call's activations with one scale over the "
                               f"whole batch ({INT8_TENSOR}): an image would depend on its batch neighbours. "
                               f"Pass {UNREPRODUCIBLE_OPTION} to run it anyway (its records say so), or use a "
                               "per-row scheme")
        raise SpeedupError(f"{speedup.cache} decides from the whole batch ({CACHES[speedup.cache].source}: a "
                           "threshold over the batch tensor): an image would depend on its batch neighbours. "
                           f"Pass {UNREPRODUCIBLE_OPTION} to run it anyway (its records say so)")
    return speedup.spec
