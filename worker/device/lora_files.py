"""A LoRA file as people have it, in diffusers' layout on the worker: converted once per revision.

The producer told the file's layout from its key names and checked what it could
torch-free (core/adapters.py `FILE_LAYOUTS`, `inspect`); here the weights are read and,
where the layout is not diffusers' own, converted:
- a raw PEFT save: `base_model.model.` swapped for `transformer.` (diffusers would send
  any `base_model` key to its fal-kontext converter, which assumes FLUX.1-dev's blocks);
- kohya (with or without ComfyUI's `diffusion_model.`), XLabs: the pipeline class's
  public `lora_state_dict` (diffusers loaders/lora_pipeline.py
  `FluxLoraLoaderMixin.lora_state_dict` → loaders/lora_conversion_utils.py), which folds
  kohya's alphas into the weights and splits a fused qkv over its projections.
A conversion is cached beside the model cache (`DIFFQ_MODEL_CACHE/lora-converted/`),
keyed by the file's path and pinned revision: a worker's later start, and every other
worker process on the node, reads it back instead of converting again.

What came out is compared with what went in: every target module the producer mapped
from the file's keys must be in the conversion, so nothing a converter drops silently
is lost without a word. A text-encoder part runs nowhere: the producer refused it
unless the ref says "drop", and it is left out here before converting.

Each module's scaling is the one diffusers and peft would give it (peft
`utils/hotswap.py` hotswap_adapter_from_state_dict, `tuners/lora/layer.py`
update_layer): alpha / r, or alpha / √r with `use_rslora`, per module from the file's
config (`alpha_pattern`, `rank_pattern`) or its network alphas; alpha = r (scaling 1)
for a file that says nothing, as diffusers derives it (utils/peft_utils.py get_peft_kwargs).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from diffq.core.adapters import (ALPHA_SUFFIX, FILE_LAYOUTS, PEFT_PREFIX, TEXT_ENCODER_PREFIXES, TRANSFORMER_PREFIX,
                                 AdapterError, AdapterInfo, check_text_encoder, content_revision, inspect)
from diffq.core.contract import AdapterRef

log = logging.getLogger("diffq.worker")

# The folder under the model cache that holds converted adapters.
CONVERTED_FOLDER = "lora-converted"


class AdapterUnsupported(ValueError):
    """An adapter this worker cannot apply (no retry helps)."""


# What a bad file makes diffusers' converters raise (loaders/lora_conversion_utils.py):
# ValueError mostly; KeyError and IndexError on a key or block the file lacks; TypeError;
# AssertionError on its shapes and key names; NotImplementedError on a key they do not
# handle. Only these fail the batch for good: anything else (MemoryError, a torch
# allocator's RuntimeError or OOM, a bug) is not the file's fault and stays retryable
# (a tensor shape mismatch, a RuntimeError too, then fails after its retries, named).
CONVERTER_FAULTS = (KeyError, ValueError, TypeError, IndexError, AssertionError, NotImplementedError)


@dataclass(frozen=True)
class Converted:
    """An adapter in diffusers' layout: its transformer's LoRA weights and, per target
    module, the scaling diffusers would give it before the batch's scale."""

    state_dict: dict[str, torch.Tensor]
    scalings: dict[str, float]
    layout: str


def convert(ref: AdapterRef, path: str, data: bytes, pipeline_class: type | None) -> Converted:
    """The adapter at `path` (its bytes `data`, at the revision the run pinned) in
    diffusers' layout, checked again as the producer checked it; `pipeline_class`
    (the loaded pipeline's) converts a layout diffusers converts."""
    from diffq.core.families import FamilyError, family_for_class

    try:
        family = family_for_class(pipeline_class.__name__) if pipeline_class is not None else None
    except FamilyError:
        family = None
    try:
        info = inspect(path, family=family)
        check_text_encoder(info, ref.text_encoder)
    except AdapterError as exc:
        raise AdapterUnsupported(f"adapter {exc.message}") from None
    layout = FILE_LAYOUTS[info.layout]
    if layout.converter == "diffusers":
        if pipeline_class is None:
            raise AdapterUnsupported(f"adapter {ref.path}: a {info.layout} file, converted by a pipeline class, "
                                     f"but none was given")
        state_dict, alphas = _cached(ref, info, data, lambda: _by_diffusers(_load(ref, data), info, pipeline_class))
    else:
        state_dict = {TRANSFORMER_PREFIX + key.removeprefix(PEFT_PREFIX) if layout.converter == "prefix" else key:
                      tensor for key, tensor in _load(ref, data).items() if not key.startswith(TEXT_ENCODER_PREFIXES)}
        alphas = {key[len(TRANSFORMER_PREFIX):-len(ALPHA_SUFFIX)]: float(state_dict.pop(key))
                  for key in [k for k in state_dict if k.endswith(ALPHA_SUFFIX)]}
    _check_all_in(ref, info, state_dict)
    return Converted(state_dict=state_dict, scalings=scalings(info, state_dict, alphas), layout=info.layout)


def _load(ref: AdapterRef, data: bytes) -> dict[str, torch.Tensor]:
    """The file's tensors; a file whose header was fine but whose body is not (cut short,
    damaged) fails its batch for good, naming the adapter."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    # The file's own faults: its header or body (SafetensorError), a dtype torch lacks
    # (KeyError), a tensor torch.frombuffer refuses (ValueError); not an allocation failing.
    except (SafetensorError, KeyError, ValueError) as exc:
        raise AdapterUnsupported(f"adapter {ref.path}: its weights cannot be read ({type(exc).__name__}: "
                                 f"{exc})") from None


def _by_diffusers(state_dict: dict, info: AdapterInfo, pipeline_class: type) -> tuple[dict, dict]:
    """The pipeline class's public converter; its text-encoder part left out first (the
    producer refused it unless the ref says drop). `lora_state_dict` returns a tuple
    (state dict, alphas) where the class honours `return_alphas`, else the state dict."""
    text = set(info.text_encoder_keys)
    try:
        out = pipeline_class.lora_state_dict({k: v for k, v in state_dict.items() if k not in text},
                                             return_alphas=True)
    except CONVERTER_FAULTS as exc:
        raise AdapterUnsupported(f"adapter {info.path}: {pipeline_class.__name__}.lora_state_dict could not "
                                 f"convert this {info.layout} file ({type(exc).__name__}: {exc})") from None
    converted, network_alphas = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    alphas = {key.removeprefix(TRANSFORMER_PREFIX).removesuffix(ALPHA_SUFFIX): float(value)
              for key, value in (network_alphas or {}).items()}
    # The converter may hand one down weight to several projections (a fused qkv):
    # copies, so the file can be saved and each slot's weights stand alone.
    return {key: value.contiguous().clone() for key, value in converted.items()
            if key.startswith(TRANSFORMER_PREFIX)}, alphas


def _cached(ref: AdapterRef, info: AdapterInfo, data: bytes, make) -> tuple[dict, dict]:
    """A conversion from the node's cache, or made now and kept there."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from diffq.core.settings import get_settings

    revision = ref.revision or content_revision(data)
    key = hashlib.sha256(f"{ref.path}\n{revision}".encode()).hexdigest()[:32]
    file = Path(get_settings().model_cache) / CONVERTED_FOLDER / f"{key}-{info.layout}.safetensors"
    if file.is_file():
        try:
            state_dict = load_file(str(file))
        except (SafetensorError, OSError) as exc:  # a damaged copy of ours: converted again below
            log.warning("lora %s: the cached conversion %s cannot be read (%s); converting again", ref.path, file, exc)
            return _convert_and_keep(ref, file, revision, make)
        alphas = {k[:-len(ALPHA_SUFFIX)]: float(state_dict.pop(k)) for k in [k for k in state_dict
                                                                           if k.endswith(ALPHA_SUFFIX)]}
        return state_dict, alphas
    return _convert_and_keep(ref, file, revision, make)


def _convert_and_keep(ref: AdapterRef, file: Path, revision: str, make) -> tuple[dict, dict]:
    from safetensors.torch import save

    from diffq.core.storage.base import atomic_write

    state_dict, alphas = make()
    file.parent.mkdir(parents=True, exist_ok=True)
    kept = {**state_dict, **{f"{module}{ALPHA_SUFFIX}": torch.tensor(alpha) for module, alpha in alphas.items()}}
    atomic_write(file, lambda out: out.write(save(kept, metadata={"path": ref.path, "revision": revision})))
    return state_dict, alphas


def _check_all_in(ref: AdapterRef, info: AdapterInfo, state_dict: dict) -> None:
    got = {key[len(TRANSFORMER_PREFIX):].rpartition(".lora_")[0] for key in state_dict}
    if missing := sorted(info.targets - got):
        raise AdapterUnsupported(f"adapter {ref.path}: the {info.layout} conversion dropped {len(missing)} of "
                                 f"{len(info.targets)} target modules ({', '.join(missing[:3])}); refused rather "
                                 f"than run without them")
    if extra := sorted(got - info.targets):
        raise AdapterUnsupported(f"adapter {ref.path}: the {info.layout} conversion targets modules the file's keys "
                                 f"did not name ({', '.join(extra[:3])})")


def scalings(info: AdapterInfo, state_dict: dict, alphas: dict[str, float]) -> dict[str, float]:
    """Per target module, peft's scaling for it: alpha / r, or alpha / √r (use_rslora)."""
    from peft.utils.other import get_pattern_key  # peft's own matching of rank_pattern / alpha_pattern keys

    config = info.config
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    out = {}
    for module in info.targets:
        rank = state_dict[f"{TRANSFORMER_PREFIX}{module}.lora_A.weight"].shape[0]
        if config:
            r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), config.get("r", rank))
            alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config.get("lora_alpha", r))
        else:
            r, alpha = rank, alphas.get(module, rank)
        out[module] = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    return out
