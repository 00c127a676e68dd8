"""Speed-ups a run asks for (`--speedup SPEC`): diffusers' step caches and attention
backends, declared once as data, and the one parser of a spec.

A spec is parts joined by `+`: a cache named as diffusers names its config class,
lower case without `CacheConfig` (`taylorseer`, `mag`, `firstblock`, ...), with that
class's own fields (`taylorseer:cache_interval=3,use_lite_mode=true`), and an
attention backend (`attention:_native_math`). A range is two numbers joined by `|`
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

    @property
    def spec(self) -> str:
        """The canonical spec: what batches carry and records say."""
        parts = []
        if self.cache:
            shown = ",".join(f"{name}={_show(value)}" for name, value in self.fields)
            parts.append(f"{self.cache}:{shown}" if shown else self.cache)
        if self.attention:
            parts.append(f"{ATTENTION}:{self.attention}")
        return "+".join(parts)

    @property
    def batch_dependent(self) -> bool:
        return self.cache is not None and CACHES[self.cache].decides == BATCH

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
    cache, fields, attention = None, (), None
    for part in spec.strip().split("+"):
        name, _, body = part.strip().partition(":")
        name = name.strip().lower()
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
                               f"(diffusers' config class, lower case, without CacheConfig), or {ATTENTION}:BACKEND")
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
    if cache is None and attention is None:
        return None
    return Speedup(cache=cache, fields=fields, attention=attention)


def canonical(spec: str | None, *, unreproducible: bool = False) -> str | None:
    """The canonical spec for a run, or None; a batch-dependent cache is refused unless
    the user gave up reproducibility by name."""
    speedup = parse(spec)
    if speedup is None:
        return None
    if speedup.batch_dependent and not unreproducible:
        raise SpeedupError(f"{speedup.cache} decides from the whole batch ({CACHES[speedup.cache].source}: a "
                           "threshold over the batch tensor): an image would depend on its batch neighbours. "
                           f"Pass {UNREPRODUCIBLE_OPTION} to run it anyway (its records say so)")
    return speedup.spec
