"""LoRA adapters on a loaded pipeline: K slots, hot-swapped in place, never a recompile.

The order is what keeps the graphs (diffusers PR 9453's hotswap, peft
`utils/hotswap.py`):
1. `enable_lora_hotswap(target_rank=…)` on the pipeline, before any adapter;
2. a zero "scaffold" adapter per slot (the most adapters a set of the run stacks) over
   the run's union of target modules at its padded rank (core/adapters.py,
   AdapterLayout), loaded the ordinary way and all active: diffusers then
   calls peft's `prepare_model_for_compiled_hotswap`, which pads every LoRA weight to
   the rank and turns each scaling into a tensor;
3. the compile (PipelineHost._compile): the LoRA layers are in the graphs, their
   weights and scalings graph inputs (CPU and CUDA Inductor: tests/test_lora.py);
4. every adapter, and "no adapter" (the scaffold's zeros), hot-swapped in place into a slot
   (peft's `hotswap_adapter_from_state_dict`, which diffusers' `load_lora_weights(…,
   hotswap=True)` ends in, handed the weights keyed for the slot once: same tensors, new
   values);
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
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffq.core.adapters import (MAX_STACK, TRANSFORMER_PREFIX, AdapterLayout, Source, content_revision, local_file,
                                 source, weight_file)
from diffq.core.contract import AdapterRef
from diffq.worker.device.lora_files import AdapterUnsupported, convert

log = logging.getLogger(__name__)

# The adapter names diffq gives peft, one per slot (slot_names): every adapter is
# swapped into one of them. The first is the one-adapter runs' slot.
SLOT = "diffq"
SLOTS = (SLOT, *(f"stack{i}" for i in range(1, MAX_STACK)))  # below 10: no name inside another
# Adapters kept in host memory, by bytes of their tensors: a run's adapters are usually
# tens of MB each (FLUX.1 rank 16: ~40 MB in bf16), and batches of one adapter set
# arrive together, so a few suffice. (A count would let a few rank-128 adapters fill RAM.)
CACHE_BYTES = 2 * 1024**3


# The folder under the model cache that holds adapters fetched from the Hub.
HUB_FOLDER = "lora-hub"


class AdapterOrderError(RuntimeError):
    """The scaffold must go in before any compile: after one, the graphs would not see it."""


@dataclass
class Loaded:
    """One adapter in host memory: its LoRA weights (diffusers' format) and, per target
    module, the scaling diffusers would give it (alpha / rank) before the batch's scale;
    per slot, the weights keyed as peft names that slot's (converted once, `for_slot`)."""

    state_dict: dict
    scalings: dict[str, float]
    nbytes: int
    _per_slot: dict = field(default_factory=dict, repr=False)

    def pairs(self) -> dict[str, tuple]:
        """Per target module its (lora_A, lora_B) weights: down [r, in], up [out, r]."""
        found: dict[str, dict] = {}
        for key, tensor in self.state_dict.items():
            module, _, which = key[len(TRANSFORMER_PREFIX):-len(".weight")].rpartition(".")
            found.setdefault(module, {})[which] = tensor
        return {module: (parts["lora_A"], parts["lora_B"]) for module, parts in found.items()}

    def for_slot(self, name: str) -> dict:
        """The weights under the slot's peft keys (`<module>.lora_A.<slot>.weight`), as
        diffusers maps them for a hot-swap (loaders/peft.py, map_state_dict_for_hotswap);
        the tensors are shared, not copied."""
        if name not in self._per_slot:
            self._per_slot[name] = {key[len(TRANSFORMER_PREFIX):-len(".weight")] + f".{name}.weight": tensor
                                    for key, tensor in self.state_dict.items()}
        return self._per_slot[name]


class AdapterCache:
    """A small LRU of adapters in host memory, by bytes."""

    def __init__(self, capacity: int = CACHE_BYTES):
        self.capacity = capacity
        self._held: OrderedDict[tuple[str, str | None], Loaded] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, ref: AdapterRef, pipeline_class: type | None = None) -> Loaded:
        """The adapter in diffusers' layout; `pipeline_class` converts a file in another."""
        key = (ref.path, ref.revision)
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                self.hits += 1
                return self._held[key]
        loaded = _read(ref, pipeline_class)
        with self._lock:
            self.misses += 1
            self._held[key] = loaded
            while len(self._held) > 1 and sum(one.nbytes for one in self._held.values()) > self.capacity:
                self._held.popitem(last=False)
        return loaded


def _read(ref: AdapterRef, pipeline_class: type | None) -> Loaded:
    path = _local_path(ref)
    # The producer's checks again, on the copy loaded; in diffusers' layout, with each
    # module's scaling (worker/device/lora_files.py).
    converted = convert(ref, path, _weights(ref, path), pipeline_class)
    return Loaded(state_dict=converted.state_dict, scalings=converted.scalings,
                  nbytes=sum(t.numel() * t.element_size() for t in converted.state_dict.values()))


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
    if where is Source.HUB:  # tests/test_lora_hub.py: against a stand-in for the Hub
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        from diffq.core.settings import get_settings

        # Into a folder of the model cache per repo and commit, as a plain file: the Hub
        # cache's snapshot is a link into its blobs, which the header's local read refuses
        # as a key outside its folder (core/storage/local.py).
        into = Path(get_settings().model_cache) / HUB_FOLDER / folder / (ref.revision or "main")
        try:
            return hf_hub_download(folder, name, revision=ref.revision, local_dir=into)
        except LocalEntryNotFoundError:
            raise  # the Hub unreachable and no copy here: not permanent, the batch is retried
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
            # Gone, or never there (a gated repo included): no retry helps. Anything else
            # (a refused connection, a 5xx) is left to the batch's retries.
            raise AdapterUnsupported(f"adapter {ref.path}: {type(exc).__name__}: {exc}") from None
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


def canonical(adapters) -> tuple[AdapterRef, ...]:
    """A set in one order (by path and revision), whatever order a row wrote: the float
    sum of its deltas then runs in one order, so the same set gives the same pixels."""
    return tuple(sorted(adapters, key=lambda ref: (ref.path, ref.revision or "")))


def slot_names(slots: int) -> tuple[str, ...]:
    """The adapter names diffq gives peft, one per slot. None is a substring of another:
    peft's hot-swap zero-fills every model key that contains the swapped name
    (`hotswap_adapter_from_state_dict`, missing_keys), so `diffq` beside `diffq1` would
    clear slot 1 on every swap of slot 0."""
    return SLOTS[:slots]


@dataclass
class AdapterSlot:
    """One pipeline's hot-swap slots (the layout's K, `AdapterLayout.slots`): its layout,
    what each slot holds, the swap times.

    peft sums every active adapter's delta (lora/layer.py, Linear.forward: `result +
    lora_B(lora_A(x)) * scaling` per active adapter), so the K scaffold adapters are all
    active and a set of n <= K adapters fills slots 0..n-1, the rest zeros (adding a zero
    delta changes nothing). A set goes into the slots in a canonical order (by path and
    revision): the float sum then runs in one order whatever order a row wrote, so the
    same set gives the same pixels and, batch after batch, reuses the slots it holds."""

    layout: AdapterLayout
    cache: AdapterCache
    current: tuple = ()  # per slot its AdapterRef, None: the scaffold's zeros
    mode = "swap"  # the LoRA mode this is (lora_modes.py LORA_MODES)
    swaps: int = 0
    swap_seconds: float = 0.0
    _zeros: Loaded | None = field(default=None, repr=False)
    # What peft's swap reads of a config: only the scaling it writes (alpha / r), which
    # `_scale` overwrites; the scaffold's own (diffusers sets alpha = r without alphas).
    _config: object = field(default=None, repr=False)
    _scalings: dict = field(default_factory=dict, repr=False)  # module name -> peft's scaling tensors

    @property
    def names(self) -> tuple[str, ...]:
        return slot_names(self.layout.slots)

    @property
    def held(self) -> tuple[AdapterRef, ...]:
        """The set the slots hold."""
        return tuple(ref for ref in self.current if ref is not None)

    @classmethod
    def install(cls, pipe, layout: AdapterLayout, cache: AdapterCache, **_) -> AdapterSlot:
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
        names = slot_names(layout.slots)
        pipe.enable_lora_hotswap(target_rank=layout.rank)
        # The scaffold's own tensors become the slots' weights (diffusers loads with
        # low_cpu_mem_usage, assigning them), which every swap overwrites: "no adapter"
        # swaps in a second set of zeros.
        with warnings.catch_warnings():
            # Each slot after the first is a second adapter on purpose; peft warns of it
            # (tuners/tuners_utils.py BaseTuner.__init__: "Already found a `peft_config`
            # attribute in the model"), which would reach `diffq run`'s output.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute", category=UserWarning)
            for name in names:
                pipe.load_lora_weights(scaffold_state_dict(layout, transformer), adapter_name=name)
        if len(names) > 1:
            # diffusers prepares the model for compiled hot-swaps once, after the first
            # adapter (loaders/peft.py): the later slots' scalings are still floats, which a
            # scale change would recompile. peft's public preparation again turns them into
            # tensors (the ranks are the scaffold's already). All slots active, none scaled:
            # diffusers' set_adapters would write float scalings.
            from peft.utils.hotswap import prepare_model_for_compiled_hotswap

            transformer.set_adapter(list(names))
            prepare_model_for_compiled_hotswap(transformer, target_rank=layout.rank)
        from peft import LoraConfig

        slot = cls(layout=layout, cache=cache, current=(None,) * len(names),
                   _config=LoraConfig(r=layout.rank, lora_alpha=layout.rank),
                   _zeros=Loaded(state_dict=scaffold_state_dict(layout, transformer), scalings={}, nbytes=0))
        slot._scalings = {name: module.scaling for name, module in transformer.named_modules()
                          if isinstance(getattr(module, "scaling", None), dict) and names[0] in module.scaling}
        log.info("adapter scaffold: %d modules at rank %d, %d slot(s), in %.2fs", len(slot._scalings), layout.rank,
                 len(names), time.perf_counter() - started)
        return slot

    def apply(self, pipe, adapters: tuple[AdapterRef, ...]) -> float:
        """Step 4: this batch's adapters (or none) in the slots at their scales; the seconds it took."""
        names = self.names
        if len(adapters) > len(names):
            raise AdapterUnsupported(f"{len(adapters)} adapters in one batch, but the run's layout has "
                                     f"{len(names)} slot(s)")
        wanted = (*canonical(adapters), *(None,) * (len(names) - len(adapters)))
        if wanted == self.current:
            return 0.0
        started = time.perf_counter()
        for name, ref, held in zip(names, wanted, self.current):
            if ref == held:
                continue
            if ref is None:
                self._swap(pipe, name, self._zeros)
                continue
            loaded = self.cache.get(ref, type(pipe))
            self.check_targets(self.layout, ref, loaded)
            if held is None or (ref.path, ref.revision) != (held.path, held.revision):
                self._swap(pipe, name, loaded)
            self._scale(name, loaded.scalings, ref.scale)
        self.current = wanted
        elapsed = time.perf_counter() - started
        self.swaps += 1
        self.swap_seconds += elapsed
        log.info("adapter %s in %.3fs", " + ".join(f"{ref.path} at scale {ref.scale:g}" for ref in wanted if ref)
                 or "none", elapsed)
        return elapsed

    @staticmethod
    def check_targets(layout: AdapterLayout, ref: AdapterRef, loaded: Loaded) -> None:
        outside = sorted(set(loaded.scalings) - set(layout.targets))
        if outside:
            raise AdapterUnsupported(f"adapter {ref.path} targets {', '.join(outside[:3])}, outside the "
                                     f"layout (the run's union of target modules): it would need a recompile")

    def _swap(self, pipe, name: str, loaded: Loaded) -> None:
        # peft's own in-place swap, handed the weights converted once: what diffusers'
        # `load_lora_weights(..., hotswap=True)` calls at its end, without what it does per
        # call before (the format conversion, LoraConfig from a walk of the whole model's
        # state dict, offload hooks taken off and put back: nothing here changes modules).
        # Modules of the slot this adapter does not target are zero-filled
        # ("missing keys"); a smaller rank is zero-padded. The scalings it writes from the
        # config are overwritten by `_scale` (the targets') or multiply zeros (the rest).
        from peft.utils.hotswap import hotswap_adapter_from_state_dict

        hotswap_adapter_from_state_dict(pipe.transformer, loaded.for_slot(name), name, self._config)

    def _scale(self, name: str, scalings: dict[str, float], scale: float) -> None:
        # In place, into the tensors peft made of the scalings: the graphs read them as inputs.
        with torch.no_grad():
            for module, base in scalings.items():
                self._scalings[module][name].fill_(base * scale)

    def stats(self) -> dict:
        return {"mode": self.mode, "swaps": self.swaps, "swap_seconds": round(self.swap_seconds, 4), "cache_hits": self.cache.hits,
                "cache_misses": self.cache.misses, "rank": self.layout.rank, "targets": len(self.layout.targets),
                "slots": self.layout.slots}
