"""LoRA adapters on a loaded pipeline: one slot, hot-swapped in place, never a recompile.

The order is what keeps the graphs (diffusers PR 9453's hotswap, peft
`utils/hotswap.py`):
1. `enable_lora_hotswap(target_rank=…)` on the pipeline, before any adapter;
2. a zero "scaffold" adapter over the run's union of target modules at its padded
   rank (core/adapters.py, AdapterLayout), loaded the ordinary way: diffusers then
   calls peft's `prepare_model_for_compiled_hotswap`, which pads every LoRA weight to
   the rank and turns each scaling into a tensor;
3. the compile (PipelineHost._compile): the LoRA layers are in the graphs, their
   weights and scalings graph inputs (CPU and CUDA Inductor: tests/test_lora.py);
4. every adapter, and "no adapter" (the scaffold's zeros), hot-swapped in place
   (`load_lora_weights(…, adapter_name=SLOT, hotswap=True)`: same tensors, new values);
   a scale is written into the scaling tensors in place. diffusers' per-call
   `joint_attention_kwargs={"scale": …}` is never used: it writes a Python float over
   the tensor (peft `set_scale`), which recompiles.
diffq enforces 2 before 3: `install` refuses a transformer with a compiled module
anywhere in it. peft's own guard (`prepare_model_for_compiled_hotswap`, check_compiled)
looks only at the top module (`_orig_mod`, `_compiled_call_impl`), so it does not see
`compile_repeated_blocks`' per-block compile nor PipelineHost's regional one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffq.core.adapters import (AdapterError, AdapterLayout, Source, content_revision, inspect, local_file, source,
                                 weight_file)
from diffq.core.contract import AdapterRef

log = logging.getLogger(__name__)

# The one adapter name diffq gives peft: every adapter is swapped into this slot.
SLOT = "diffq"
# Adapters kept in host memory, by bytes of their tensors: a run's adapters are usually
# tens of MB each (FLUX.1 rank 16: ~40 MB in bf16), and batches of one adapter set
# arrive together, so a few suffice. (A count would let a few rank-128 adapters fill RAM.)
CACHE_BYTES = 2 * 1024**3


class AdapterOrderError(RuntimeError):
    """The scaffold must go in before any compile: after one, the graphs would not see it."""


class AdapterUnsupported(ValueError):
    """An adapter this worker cannot apply (no retry helps)."""


@dataclass
class Loaded:
    """One adapter in host memory: its LoRA weights and, per target module, the scaling
    diffusers would give it (alpha / rank) before the batch's scale."""

    state_dict: dict
    scalings: dict[str, float]
    nbytes: int


class AdapterCache:
    """A small LRU of adapters in host memory, by bytes."""

    def __init__(self, capacity: int = CACHE_BYTES):
        self.capacity = capacity
        self._held: OrderedDict[tuple[str, str | None], Loaded] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, ref: AdapterRef) -> Loaded:
        key = (ref.path, ref.revision)
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                self.hits += 1
                return self._held[key]
        loaded = _read(ref)
        with self._lock:
            self.misses += 1
            self._held[key] = loaded
            while len(self._held) > 1 and sum(one.nbytes for one in self._held.values()) > self.capacity:
                self._held.popitem(last=False)
        return loaded


def _read(ref: AdapterRef) -> Loaded:
    from safetensors.torch import load

    path = _local_path(ref)
    state_dict = load(_weights(ref, path))
    try:
        info = inspect(path)  # the producer's checks again, on the copy loaded
    except AdapterError as exc:
        raise AdapterUnsupported(f"adapter {exc.message}") from None
    alpha = info.config.get("lora_alpha")
    scalings = {module: (alpha if alpha is not None else rank) / rank for module, (rank, _, _) in info.modules.items()}
    return Loaded(state_dict=state_dict, scalings=scalings,
                  nbytes=sum(t.numel() * t.element_size() for t in state_dict.values()))


def _local_path(ref: AdapterRef) -> str:
    """The adapter's weights on this node, at the revision the run pinned: object storage
    through the node's model cache (worker/device/model_fetch.py, refused when changed),
    the Hub at the pinned commit, a local file or folder as it is."""
    from diffq.core.model_store import ModelStoreError, StoreUnreachable

    folder, name = weight_file(ref.path)
    where = source(ref.path)
    if where is Source.STORE:
        from diffq.worker.device.model_fetch import fetch

        try:
            return str(Path(fetch(folder, ref.revision, only=name).path) / name)
        except StoreUnreachable:
            raise  # not permanent: the batch is retried
        except ModelStoreError as exc:
            raise AdapterUnsupported(str(exc)) from None
    if where is Source.HUB:  # not tested here: no Hub
        from huggingface_hub import hf_hub_download

        return hf_hub_download(folder, name, revision=ref.revision)
    return str(local_file(folder) / name)


def _weights(ref: AdapterRef, path: str) -> bytes:
    """The adapter's bytes; a local one whose content changed since the run pinned it is
    refused, as a changed model is (model_fetch.fetch)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise AdapterUnsupported(f"adapter {ref.path}: cannot read {path} ({exc})") from None
    if source(ref.path) is Source.LOCAL and ref.revision is not None and (
            now := content_revision(data)) != ref.revision:
        raise AdapterUnsupported(f"adapter {ref.path} changed since the run pinned it: revision {now} in the file, "
                                 f"{ref.revision} pinned; submit a new run for the new revision")
    return data


def compiled_modules(module: torch.nn.Module) -> list[str]:
    """Names of the modules under `module` that torch.compile has wrapped: `module.compile()`
    (`_compiled_call_impl`), a `torch.compile(module)` wrapper (`_orig_mod`), or a compiled
    `forward` (diffq's regional compile; dynamo marks the function `_torchdynamo_orig_callable`)."""
    found = []
    for name, sub in module.named_modules():
        if (getattr(sub, "_compiled_call_impl", None) is not None or hasattr(sub, "_orig_mod")
                or hasattr(sub.__dict__.get("forward"), "_torchdynamo_orig_callable")):
            found.append(name or "<root>")
    return found


def scaffold_state_dict(layout: AdapterLayout, transformer: torch.nn.Module) -> dict:
    """A zero LoRA over the layout's targets at its rank, in diffusers' format."""
    state_dict = {}
    for target in layout.targets:
        linear = transformer.get_submodule(target)
        weight = linear.weight
        state_dict[f"transformer.{target}.lora_A.weight"] = torch.zeros(layout.rank, linear.in_features,
                                                                       dtype=weight.dtype)
        state_dict[f"transformer.{target}.lora_B.weight"] = torch.zeros(linear.out_features, layout.rank,
                                                                       dtype=weight.dtype)
    return state_dict


@dataclass
class AdapterSlot:
    """One pipeline's hot-swap slot: its layout, what is in it, the swap times."""

    layout: AdapterLayout
    cache: AdapterCache
    current: AdapterRef | None = None  # None: the scaffold's zeros
    swaps: int = 0
    swap_seconds: float = 0.0
    _zeros: dict = field(default_factory=dict, repr=False)
    _scalings: dict = field(default_factory=dict, repr=False)  # module name -> peft's scaling tensors

    @classmethod
    def install(cls, pipe, layout: AdapterLayout, cache: AdapterCache) -> AdapterSlot:
        """Steps 1 and 2: before the transformer is compiled (refused after)."""
        transformer = pipe.transformer
        if compiled := compiled_modules(transformer):
            raise AdapterOrderError(f"the adapter scaffold must be loaded before compiling, but the transformer "
                                    f"has compiled modules ({', '.join(compiled[:3])}): its graphs would not "
                                    f"carry the LoRA layers")
        if getattr(transformer, "peft_config", None):
            raise AdapterOrderError(f"the transformer already has adapters ({', '.join(transformer.peft_config)}): "
                                    f"the scaffold must be the first")
        started = time.perf_counter()
        pipe.enable_lora_hotswap(target_rank=layout.rank)
        # The scaffold's own tensors become the slot's weights (diffusers loads with
        # low_cpu_mem_usage, assigning them), which every swap overwrites: "no adapter"
        # swaps in a second set of zeros.
        pipe.load_lora_weights(scaffold_state_dict(layout, transformer), adapter_name=SLOT)
        slot = cls(layout=layout, cache=cache, _zeros=scaffold_state_dict(layout, transformer))
        slot._scalings = {name: module.scaling for name, module in transformer.named_modules()
                          if isinstance(getattr(module, "scaling", None), dict) and SLOT in module.scaling}
        log.info("adapter scaffold: %d modules at rank %d in %.2fs", len(slot._scalings), layout.rank,
                 time.perf_counter() - started)
        return slot

    def apply(self, pipe, adapters: tuple[AdapterRef, ...]) -> float:
        """Step 4: this batch's adapter (or none) in the slot at its scale; the seconds it took."""
        if len(adapters) > 1:
            raise AdapterUnsupported(f"{len(adapters)} adapters in one batch: one adapter per batch is supported")
        ref = adapters[0] if adapters else None
        same = ref is not None and self.current is not None and (ref.path, ref.revision) == (
            self.current.path, self.current.revision)
        if ref == self.current:
            return 0.0
        started = time.perf_counter()
        if ref is None:
            self._swap(pipe, self._zeros)
        else:
            loaded = self.cache.get(ref)
            self._check_targets(ref, loaded)
            if not same:
                self._swap(pipe, loaded.state_dict)
            self._scale(loaded.scalings, ref.scale)
        self.current = ref
        elapsed = time.perf_counter() - started
        self.swaps += 1
        self.swap_seconds += elapsed
        log.info("adapter %s%s in %.3fs", ref.path if ref else "none",
                 f" at scale {ref.scale:g}" if ref else "", elapsed)
        return elapsed

    def _check_targets(self, ref: AdapterRef, loaded: Loaded) -> None:
        outside = sorted(set(loaded.scalings) - set(self.layout.targets))
        if outside:
            raise AdapterUnsupported(f"adapter {ref.path} targets {', '.join(outside[:3])}, outside the slot's "
                                     f"layout (the run's union of target modules): it would need a recompile")

    def _swap(self, pipe, state_dict: dict) -> None:
        # Modules of the slot this adapter does not target are zero-filled by peft's hotswap
        # (hotswap_adapter_from_state_dict, "missing keys"); a smaller rank is zero-padded.
        pipe.load_lora_weights(state_dict, adapter_name=SLOT, hotswap=True)

    def _scale(self, scalings: dict[str, float], scale: float) -> None:
        # In place, into the tensors peft made of the scalings: the graphs read them as inputs.
        with torch.no_grad():
            for module, base in scalings.items():
                self._scalings[module][SLOT].fill_(base * scale)

    def stats(self) -> dict:
        return {"swaps": self.swaps, "swap_seconds": round(self.swap_seconds, 4), "cache_hits": self.cache.hits,
                "cache_misses": self.cache.misses, "rank": self.layout.rank, "targets": len(self.layout.targets)}
