"""The pipeline host: load a diffusers pipeline once, compile per shape, generate.

One host per worker process. A new shape on the same model reuses the loaded
pipeline (only the compiled graph is new); the batch is padded to the shape's
compiled batch size and the padding discarded, and every item gets its own
generator so its image does not depend on its neighbours in the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.core.families import Family, FamilyError, family_for_class
from diffq.core.records import DEGENERATE_CHECKS, FLAT_MAX_LEVELS
from diffq.worker.device import dynamo_quirks
from diffq.worker.device.adapters import (AdapterCache, AdapterOrderError,  # noqa: F401 (hooks: permanent errors)
                                          AdapterUnsupported)
from diffq.worker.device import faults, lora_modes
from diffq.worker.device.backends import COMPILING_MODES, DTYPES, Backend, GraphFallback, resolve
from diffq.worker.device.lora_apply import ChangeCheck, LoraChangeUnseen, informative
from diffq.worker.device.lora_modes import DEFAULT_LORA_MODE, LORA_MODES
from diffq.worker.device.models import local_model
from diffq.worker.device.quantize import quantize, weight_bytes
from diffq.worker.device.speedups import Speedups, SpeedupUnsupported  # noqa: F401 (hooks: a permanent error)


log = logging.getLogger(__name__)



def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' → torch.bfloat16, for the dtypes the contract defines."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose {', '.join(DTYPES)}")
    return getattr(torch, name)


class CompileUnsupported(ValueError):
    pass


class FamilyUnsupported(FamilyError):
    """A model outside the family table, or items its family cannot honour: no retry helps.
    `item_ids`: the refused items, when the others of the batch could go on."""

    def __init__(self, message: str, item_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.item_ids = item_ids


@dataclass
class Generated:
    images: list  # H×W×3 uint8 arrays (to_arrays)
    generate_s: float
    # This call compiled its shape: torch.compile's first call, or an eager backend's
    # first batch of the shape (it compiles each op on first use).
    compiled: bool
    # Extra record fields (a tensor-parallel group's agreement).
    record_extra: dict = field(default_factory=dict)
    # Compiled-graph calls the backend re-ran uncompiled during this call (--allow-fallback).
    graph_fallbacks: int = 0
    # Per item: the degenerate-image check its image failed (a DEGENERATE_CHECKS key), or None.
    degenerate: list = field(default_factory=list)
    # Wall clock when the call had the device and when it gave it up: the device's
    # idle gap between two batches is the next start minus this end.
    started_at: float = 0.0
    ended_at: float = 0.0
    # Graphs this call compiled for a shape already served (PipelineHost.recompiles).
    recompiled: int = 0
    # Graphs this call compiled, its shape's first or not (dynamo's unique_graphs): 0 in steady state.
    graphs: int = 0
    # Seconds this call's adapter hot-swap took (0 when the slot already held its adapter).
    adapter_swap_s: float = 0.0


class DeviceTurns:
    """One call on the device at a time, and a straight hand-over between calls.

    A thread leaving the device while another waits for it lets that one start its
    call before going on: it waits (GIL released) until the next thread holds the
    device, at most `HANDOVER_S`. Without this the leaving thread kept the GIL for its
    batch's hand-off to the sink, and the woken one, needing the GIL to start its
    call, waited on it: the device idled for the difference (docs/BENCHMARKS.md,
    "Between two device calls")."""

    HANDOVER_S = 0.002

    def __init__(self):
        self._lock = threading.Lock()
        self._count = threading.Lock()  # guards `_waiting`
        self._waiting = 0
        self._taken = threading.Event()

    def __enter__(self) -> DeviceTurns:
        with self._count:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        self._taken.set()
        return self

    def __exit__(self, *exc) -> None:
        self._taken.clear()
        with self._count:
            waiting = self._waiting
        self._lock.release()
        if waiting:
            self._taken.wait(self.HANDOVER_S)


@dataclass
class PipelineHost:
    backend: Backend
    compile_mode: str = "none"
    offload: str | None = None
    # (model, dtype, quantization scheme or None) -> pipeline: a scheme is the weights a
    # pipeline was loaded with (worker/device/quantize.py), so each is its own.
    _pipelines: dict = field(default_factory=dict)
    _families: dict = field(default_factory=dict)  # same key -> Family
    # Same key -> the transformer's weight bytes as stored (quantized where it is): image records say it.
    weight_bytes: dict = field(default_factory=dict)
    shapes_seen: set = field(default_factory=set)
    # (shape, quantization scheme) pairs called: a scheme's pipeline traces its own graphs.
    _traced: set = field(default_factory=set, repr=False, compare=False)
    # Per shape queue: seconds of the call that compiled it, and graphs it added.
    compile_seconds: dict = field(default_factory=dict)
    compile_graphs: dict = field(default_factory=dict)
    # Graphs compiled for a shape already served: must stay 0 in steady state.
    recompiles: int = 0
    # Per shape label: compiled-graph calls the backend re-ran uncompiled, op by op.
    graph_fallbacks: dict = field(default_factory=dict)
    # Called with the ShapeKey after a call compiled a new shape (cache push, metrics).
    on_compiled: list[Callable[[ShapeKey], None]] = field(default_factory=list)
    # Rank 0 of a tensor-parallel group (worker/device/tensor_parallel.py): each batch is
    # announced to the other ranks first and their images checked after. Other ranks
    # hold a group too, for sharded loading, but never announce.
    group: object = None
    # The degenerate-image checks run on every batch (DEGENERATE_CHECKS keys: the
    # worker's --on-degenerate policy names them); none by default, at no cost.
    checks: frozenset = frozenset()
    # Object-storage models: the revision each was loaded at (image records name it),
    # the revision a run pinned for one not loaded yet (worker/delivery/runtime.py), and each
    # fetch's report (bytes, seconds, cache hit), for the start's accounting.
    revisions: dict = field(default_factory=dict)
    pins: dict = field(default_factory=dict)
    fetches: list = field(default_factory=list)
    # One call on the device at a time. A worker runs two batch tasks (worker/
    # celery_adapter.py): the next batch is received and its call prepared while this
    # one runs, and waits here, so the device goes from one call to the next. (One
    # device thread that all calls are queued to was tried: the woken task thread then
    # contends with it for the GIL between two calls, a wider gap than this lock's.)
    _device: DeviceTurns = field(default_factory=DeviceTurns, repr=False, compare=False)
    # The device index of the first thread on the device (the loading one), and which
    # threads were bound to it since (Backend.thread_device).
    _device_index: int | None = field(default=None, repr=False, compare=False)
    _threads: threading.local = field(default_factory=threading.local, repr=False, compare=False)
    # Each pipeline set to its batch's speed-up before the call (worker/device/speedups.py).
    speedups: Speedups = field(default_factory=Speedups, repr=False, compare=False)
    # LoRA adapters (worker/device/adapters.py): per model the layout its scaffold is built
    # to (set before the model loads: `use_adapters`), per loaded pipeline its slot.
    adapter_layouts: dict = field(default_factory=dict)
    adapter_slots: dict = field(default_factory=dict, repr=False, compare=False)
    # label -> layout, for every layout a run this worker read declares (`know_layout`).
    known_layouts: dict = field(default_factory=dict, repr=False, compare=False)
    adapter_cache: AdapterCache = field(default_factory=AdapterCache, repr=False, compare=False)
    # How a set goes into a pipeline (lora_modes.py LORA_MODES: swap, fuse, compile);
    # `auto` resolves from the backend table when the host is made.
    lora_mode: str = DEFAULT_LORA_MODE
    # The change check (lora_modes.ChangeCheck), once per life at the first set change that
    # moves the weights; failed, the reason every later batch naming adapters fails with.
    change_check: ChangeCheck | None = None
    lora_refused: str | None = None

    def __post_init__(self):
        self.lora_mode = lora_modes.resolve(self.backend, self.compile_mode, self.lora_mode)[0]

    @property
    def compiles(self) -> bool:
        """Whether a new shape's first batch is compile time on this backend and mode."""
        return self.compile_mode in COMPILING_MODES or self.backend.eager_compiles

    def _on_this_thread(self) -> None:
        """Bind the calling thread to the device the pipelines live on, once per thread,
        where the current device is a per-thread setting."""
        if not self.backend.thread_device or getattr(self._threads, "bound", False):
            return
        if self._device_index is None:
            self._device_index = torch.accelerator.current_device_index()
        else:
            torch.accelerator.set_device_index(self._device_index)
        self._threads.bound = True

    def adapter_refusal(self) -> str | None:
        """Why this backend, compile mode, LoRA mode and group take no LoRA adapters (the
        backend table's `lora` column, lora_modes.refusal), or None."""
        return lora_modes.refusal(self.backend, self.compile_mode, self.lora_mode,
                                  self.group.world_size if self.group is not None else 1)

    def use_adapters(self, model: str, layout: AdapterLayout) -> None:
        """Serve LoRA adapters of `layout` on `model`: its scaffold goes in when the model
        loads, before it compiles (a preloading worker, qualify). Refused where
        lora_modes.refusal says so (no `lora` row, a --tp group), and for a model already loaded with
        another layout (its graphs are made); a batch naming another layout has its
        model loaded again around it on the device's turn (`_ready`)."""
        if reason := self.adapter_refusal():
            raise AdapterUnsupported(reason)
        self.known_layouts[layout.label] = layout
        if any(key[0] == model for key in self._pipelines) and self.adapter_layouts.get(model) != layout:
            raise AdapterOrderError(f"model {model} is loaded (and compiled) without this adapter layout; the "
                                    f"scaffold must go in before compiling: a new worker process serves it")
        self.adapter_layouts[model] = layout

    def know_layout(self, layout: AdapterLayout) -> None:
        """A layout a run's manifest declares: a batch whose shape names its label may
        come (the shape key carries only the label)."""
        self.known_layouts[layout.label] = layout

    def _wanted_layout(self, shape: ShapeKey) -> AdapterLayout | None:
        """The LoRA layout `shape`'s pipeline must be built around (None: any; a pipeline
        with a scaffold runs a batch without adapters with the scaffold's zeros)."""
        if shape.lora is None:
            return None
        current = self.adapter_layouts.get(shape.model)
        if current is not None and current.label == shape.lora:
            return current
        if (layout := self.known_layouts.get(shape.lora)) is None:
            raise AdapterUnsupported(f"shape {shape.label} names LoRA layout {shape.lora}, which no run this "
                                     "worker read declares")
        return layout

    def _ready(self, model: str, dtype: str, wanted: AdapterLayout | None, quant: str | None = None):
        """`model`'s pipeline, built around `wanted` where a layout is wanted: loaded now
        if it is not, loaded again around the scaffold if it was built around another
        (or none: a fleet worker preloads before any run names a layout). Called on the
        device's turn only, so no call of a pipeline being dropped is running, and the
        pipeline a call runs is the one whose slot it swaps."""
        if wanted is not None and self.adapter_layouts.get(model) != wanted:
            if reason := self.adapter_refusal():
                raise AdapterUnsupported(reason)
            loaded = [key for key in self._pipelines if key[0] == model]
            for key in loaded:
                self._pipelines.pop(key, None)
                self.adapter_slots.pop(key, None)
            self.shapes_seen -= {shape for shape in self.shapes_seen if shape.model == model}
            self._traced -= {seen for seen in self._traced if seen[0].model == model}
            if loaded:
                log.warning("model %s: loaded again for LoRA layout %s (its scaffold must go in before compiling)",
                            model, wanted.label)
            self.adapter_layouts[model] = wanted
        return self.pipeline(model, dtype, quant)

    def quant_scheme(self, quant: str | None, dtype: str) -> str | None:
        """`quant`, refused (SpeedupUnsupported) where this worker cannot run it: at a
        preloading worker's start, before anything loads."""
        spec = f"quant:{quant}" if quant is not None else None
        return self.speedups.scheme(spec, self.backend, self.compile_mode, dtype=self.backend.dtype_for(dtype),
                                    adapters=bool(self.adapter_layouts))

    def key(self, model: str, dtype: str, quant: str | None = None) -> tuple:
        """A loaded pipeline's key: an auto shape runs at the device's default dtype."""
        return (model, self.backend.dtype_for(dtype), quant)

    def pipeline(self, model: str, dtype: str, quant: str | None = None):
        """`model`'s pipeline at `dtype`, its transformer quantized by `quant` (a SCHEMES
        key) or not; loaded on first use."""
        self._on_this_thread()
        key = self.key(model, dtype, quant)
        if key not in self._pipelines:
            self._pipelines[key] = self._load(*key)
        return self._pipelines[key]

    def release(self, model: str, dtype: str, quant: str | None = None) -> bool:
        """Drop `model`'s pipeline at `dtype` and `quant` (and what is kept per pipeline),
        so its memory can serve another: qualify probes a quantization scheme at a batch
        size where full compute ran out of memory, one scheme's pipeline at a time. On
        the device's turn; its next use loads it again. Whether one was loaded."""
        key = self.key(model, dtype, quant)
        with self._device:
            pipe = self._pipelines.pop(key, None)
            if pipe is None:
                return False
            self.speedups.forget(pipe)  # keyed by id(): a later pipeline may reuse it
            for kept in (self._families, self.weight_bytes, self.adapter_slots):
                kept.pop(key, None)
            self._traced -= {seen for seen in self._traced if self.key(seen[0].model, seen[0].dtype, seen[1]) == key}
            del pipe
            free_device_memory()
        return True

    def _load(self, model: str, dtype: str, quant: str | None = None):
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()

        source, fetched = local_model(model, self.pins.get(model))
        if fetched is not None:
            self.revisions[model] = fetched.revision
            self.fetches.append(fetched.report())
        # The family decides every call argument, so a model outside the table is
        # refused before its weights are read.
        try:
            family = family_for_class(DiffusionPipeline.load_config(source)["_class_name"])
        except FamilyError as exc:
            raise FamilyUnsupported(f"model {model}: {exc}") from None
        started = time.perf_counter()
        sharded = {}
        if self.group is not None:
            from diffq.worker.device.tensor_parallel import sharded_components

            sharded = sharded_components(source, torch_dtype(dtype), self.group, family)
        pipe = DiffusionPipeline.from_pretrained(source, dtype=torch_dtype(dtype),
                                                 local_files_only=Path(source).is_dir(), **sharded)
        device = self.group.device if self.group is not None else self.backend.torch_device
        if self.offload == "model":
            pipe.enable_model_cpu_offload(device=device)
        elif sharded:
            # Sharded components already sit on this rank's device; move the rest.
            for name, component in pipe.components.items():
                if name not in sharded and hasattr(component, "to"):
                    component.to(device)
        else:
            pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        key = (model, dtype, quant)
        if quant is not None:  # on its device, before a scaffold and before any compile
            quantize(pipe.transformer, quant)
        self.weight_bytes[key] = weight_bytes(pipe.transformer)
        if (layout := self.adapter_layouts.get(model)) is not None:
            self.adapter_slots[key] = LORA_MODES[self.lora_mode].installer()(
                pipe, layout, self.adapter_cache, backend=self.backend, compile_mode=self.compile_mode)
        self._compile(pipe, family)
        self._families[key] = family
        log.info("loaded %s (%s) on %s in %.1fs", model, type(pipe).__name__,
                 self.backend.torch_device, time.perf_counter() - started)
        return pipe

    def _compile(self, pipe, family: type[Family]) -> None:
        if self.compile_mode not in COMPILING_MODES:
            return  # eager, or a call-time mode set by env (defer-fuse)
        dynamo_quirks.install()
        options = self.backend.compile_options
        if self.compile_mode == "full":
            pipe.transformer.compile(**options)
        elif self.compile_mode == "regional":
            check_compile_mode(family, self.compile_mode)
            # Each repeated block's own forward, not the module (diffusers'
            # compile_repeated_blocks compiles `_call_impl`, around the hooks a cache
            # puts on `forward`): a cache's hooks then wrap the compiled blocks, its
            # torch.compiler.disable'd decision outside every graph. The same graphs
            # as compile_repeated_blocks (one per block class; docs/speedups.md).
            blocks = set(pipe.transformer._repeated_blocks)
            for module in pipe.transformer.modules():
                if type(module).__name__ in blocks:
                    module.forward = torch.compile(module.forward, **options)
        else:
            raise CompileUnsupported(f"unknown compile mode '{self.compile_mode}'")

    def set_shape_budget(self, shapes: int) -> None:
        """Each shape is one graph; dynamo's default limit of 8 fails the 9th shape."""
        import torch._dynamo

        limit = max(8, 2 * shapes + 8)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * limit)

    def generate(self, shape: ShapeKey, params: BatchParams, items: list[BatchItem]) -> Generated:
        wanted = self._wanted_layout(shape)
        dtype = self.backend.dtype_for(shape.dtype)
        # Refused before anything loads: the scheme decides which pipeline the batch needs.
        quant = self.speedups.scheme(params.speedup, self.backend, self.compile_mode, dtype=dtype,
                                     adapters=bool(params.adapters or shape.lora))
        if quant is not None and self.group is not None:
            raise SpeedupUnsupported(f"quant:{quant} with --tp: a sharded transformer's weights are DTensors, which "
                                     "torchao's quantize_ is not shown to take; run the scheme without --tp")
        key = self.key(shape.model, shape.dtype, quant)
        if key not in self._pipelines or wanted is not None and self.adapter_layouts.get(shape.model) != wanted:
            with self._device:  # the first call of a model (or of its new layout) loads it
                self._ready(shape.model, shape.dtype, wanted, quant)
        # else loaded: the call is prepared off the device
        if len(items) > shape.batch_size:
            raise ValueError(f"{len(items)} items exceed the shape's batch size {shape.batch_size}")
        # Pad to the compiled batch size by repeating the last item: the graph never
        # sees a new batch dimension, and the extra images are dropped below.
        padded = items + [items[-1]] * (shape.batch_size - len(items))
        family = self._families[key]
        refused = [(item.id, reason) for item in items
                   if (reason := family.refusal(negative_prompt=item.negative_prompt,
                                                guidance_scale=params.guidance_scale))]
        if refused:
            raise FamilyUnsupported("; ".join(f"item {item_id}: field '{name}': {why}"
                                              for item_id, (name, why) in refused[:5]),
                                    item_ids=tuple(item_id for item_id, _ in refused))
        speedup = self.speedups.prepare(params.speedup, self.backend, self.compile_mode, family, dtype=dtype,
                                        adapters=bool(params.adapters or shape.lora))
        generators = [torch.Generator("cpu").manual_seed(item.seed) for item in padded]
        kwargs = family.call_kwargs(
            prompts=[item.prompt for item in padded],
            negative_prompts=[item.negative_prompt for item in padded],
            height=shape.height,
            width=shape.width,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            max_sequence_length=shape.max_sequence_length,
            generator=generators,
        )
        with self._device:
            # Taken on the device's turn: the other thread may have loaded it again meanwhile.
            pipe = self._ready(shape.model, shape.dtype, wanted, quant)
            started_at = time.time()
            new_shape = (shape, quant) not in self._traced
            if new_shape:
                self._traced.add((shape, quant))
                self.shapes_seen.add(shape)
                self.set_shape_budget(len(self._traced))
            leader = self.group is not None and self.group.leader
            if leader:
                self.group.announce(shape, params, items)
            graphs_before = graphs_compiled()
            fallbacks_before = fallback_count(self.backend.graph_fallback)
            # Its change check runs without a speed-up; under --lora-mode compile a new set's
            # graphs are compiled on this call, by design, not a recompile.
            swap_s, new_set = self._apply_adapters(pipe, key, shape, params, family)
            self.speedups.apply(pipe, speedup, params.num_inference_steps)
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    images, degenerate = checked_arrays(faults.degrade(pipe(**kwargs).images, padded), self.checks)
            except Exception:
                if leader:
                    self.group.agree(None)  # keep the other ranks in step
                raise
            elapsed = time.perf_counter() - started
            fallbacks = fallback_count(self.backend.graph_fallback) - fallbacks_before
            if fallbacks:
                self.graph_fallbacks[shape.label] = self.graph_fallbacks.get(shape.label, 0) + fallbacks
                log.warning("shape %s: %d compiled-graph call(s) failed on the device and re-ran uncompiled",
                            shape.label, fallbacks)
            record_extra = self.group.agree(images) if leader else {}
            if shape.model in self.revisions:
                record_extra = {**record_extra, "model_revision": self.revisions[shape.model]}
            if swap_s:
                record_extra = {**record_extra, "adapter_swap_s": round(swap_s, 4)}
            if shape.lora is not None:
                record_extra = {**record_extra, "lora_mode": self.lora_mode}
            if key in self.weight_bytes:  # measured at load (a stand-in pipeline has no transformer)
                record_extra = {**record_extra, "transformer_weight_bytes": self.weight_bytes[key]}
            ended_at = time.time()
            graphs = graphs_compiled() - graphs_before
            compiled = new_shape and self.compiles
            if compiled:
                self.compile_seconds[shape.queue] = elapsed
                self.compile_graphs[shape.queue] = graphs
            recompiled = 0 if compiled or new_set else graphs
            self.recompiles += recompiled
        if compiled:
            for callback in self.on_compiled:  # off the device: the next call may start meanwhile
                callback(shape)
        if recompiled:
            log.warning("shape %s compiled %d more graph(s) after its first batch", shape.label, recompiled)
        return Generated(images=images[: len(items)], generate_s=elapsed, compiled=compiled,
                         record_extra=record_extra, graph_fallbacks=fallbacks, degenerate=degenerate[: len(items)],
                         started_at=started_at, ended_at=ended_at, recompiled=recompiled, graphs=graphs,
                         adapter_swap_s=swap_s)

    def _apply_adapters(self, pipe, key: tuple, shape: ShapeKey, params: BatchParams, family: type[Family]) -> tuple[float, bool]:
        """The batch's adapter set into its pipeline (on the device's turn: a call may be
        running on the other thread) by the host's LoRA mode: the seconds it took, and
        whether the mode gave the set graphs of its own to compile. The first change in
        this life that moves the weights is checked on a probe first."""
        slot = self.adapter_slots.get(key)
        if slot is None:
            if params.adapters:
                raise AdapterUnsupported(f"model {key[0]} was loaded without an adapter slot: the scaffold "
                                         f"must go in before compiling (PipelineHost.use_adapters)")
            return 0.0, False
        if self.lora_refused is not None and params.adapters:
            raise AdapterUnsupported(self.lora_refused)
        before, compiles = slot.held, getattr(slot, "compiles", 0)
        if self.change_check is not None or not informative(before, params.adapters):
            return slot.apply(pipe, params.adapters), getattr(slot, "compiles", 0) > compiles
        self.speedups.apply(pipe, None, 1)  # the probe at full compute
        first = self._probe(pipe, shape, family)
        noise = float((self._probe(pipe, shape, family) - first).abs().max())
        swap_s = slot.apply(pipe, params.adapters)
        moved = float((self._probe(pipe, shape, family) - first).abs().max())
        self.change_check = ChangeCheck(mode=self.lora_mode, before=before, after=slot.held, moved=moved,
                                        noise=noise)
        if not self.change_check.showed:
            self.lora_refused = self.change_check.reason()
            slot.apply(pipe, before)  # back to the weights the graphs hold
            log.error("%s", self.lora_refused)
            raise LoraChangeUnseen(self.lora_refused)
        log.info("lora change check: %s moved the probe by %.3g (noise %.3g)", self.lora_mode, moved, noise)
        return swap_s, getattr(slot, "compiles", 0) > compiles

    def _probe(self, pipe, shape: ShapeKey, family: type[Family]) -> torch.Tensor:
        """The change check's probe: a fixed prompt and seeds at the shape (its compiled
        graphs), one step, the latents out (no decode)."""
        kwargs = family.call_kwargs(
            prompts=["a probe of the adapter weights"] * shape.batch_size, negative_prompts=[None] * shape.batch_size,
            height=shape.height, width=shape.width, num_inference_steps=1,
            guidance_scale=4.0 if shape.cfg else 1.0, max_sequence_length=shape.max_sequence_length,
            generator=[torch.Generator("cpu").manual_seed(seed) for seed in range(shape.batch_size)])
        with torch.inference_mode():
            return pipe(**{**kwargs, "output_type": "latent"}).images.float()

    def warmup(self, shapes: list[ShapeKey]) -> None:
        """Compile `shapes` before consuming, so no batch waits on a compile."""
        self.set_shape_budget(len(self.shapes_seen | set(shapes)))
        for shape in shapes:
            if (shape, None) in self._traced:
                continue
            # guidance_scale > 1 is what turns CFG on (and doubles the traced batch);
            # steps do not change the graph, so one is enough.
            params = BatchParams(num_inference_steps=1, guidance_scale=4.0 if shape.cfg else 1.0)
            items = [BatchItem(id=f"warmup-{i}", prompt="warmup", seed=i) for i in range(shape.batch_size)]
            found = [kind for kind in self.generate(shape, params, items).degenerate if kind]
            if found:  # a first sign of a miscompiled graph, before any batch is stored
                log.warning("warm-up of %s made %d degenerate image(s): %s", shape.label, len(found),
                            ", ".join(sorted(set(found))))
            log.info("warmed %s in %.1fs", shape.label, self.compile_seconds.get(shape.queue, 0.0))

    def compile_stats(self) -> dict:
        """Compile counts and seconds, for metrics and the warmup report."""
        from torch._dynamo.utils import counters

        return {
            "mode": self.compile_mode,
            "backend": self.backend.compile_backend if self.compile_mode in COMPILING_MODES else None,
            # Eager Neuron/TPU compile op by op: seconds are compile time all the same.
            "eager_compiles": self.backend.eager_compiles and self.compile_mode not in COMPILING_MODES,
            "shapes": len(self.compile_seconds),
            "graphs": graphs_compiled(),
            "recompiles": self.recompiles,
            "graph_fallbacks": dict(self.graph_fallbacks),
            "seconds": round(sum(self.compile_seconds.values()), 3),
            "per_shape": {queue: {"seconds": round(seconds, 3), "graphs": self.compile_graphs[queue]}
                          for queue, seconds in self.compile_seconds.items()},
            # Persistent-cache hits and misses (the compile cache at work): Inductor's
            # compiled graphs, and AOTAutograd's entries that skip re-tracing the joint graph.
            "cache": {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                      if "cache" in k},
        }

    def fallback_ops(self) -> list[str]:
        """Ops the backend ran on CPU instead of the device (Neuron reports them)."""
        if not self.backend.fallback_report:
            return []
        return [str(op) for op in resolve(self.backend.fallback_report)()]


def to_arrays(images) -> list:
    """The pipeline's images (output_type="pt": B×3×H×W floats in [0, 1], where they were
    made) as H×W×3 uint8 arrays on the host (`checked_arrays` without checks)."""
    return checked_arrays(images, frozenset())[0]


def checked_arrays(images, checks: frozenset) -> tuple[list, list]:
    """The pipeline's images as H×W×3 uint8 arrays on the host, and per image the first
    of `checks` (DEGENERATE_CHECKS keys, in that order) it failed, or None.

    The scaling runs where the tensor is (on an accelerator, on the device) with the
    float32 arithmetic of diffusers' own to-PIL step, so the pixels are the same; the
    host receives one 8-bit copy, which the sink hands on without holding the GIL
    (PIL images would be packed and unpacked under it: docs/BENCHMARKS.md).

    The checks run there too, as batched reductions (no loop over images): "nonfinite"
    before the 8-bit conversion (which would turn NaN into black), "flat" after it;
    their flags come to the host as one small tensor. Their cost per batch is in
    docs/BENCHMARKS.md (bench/degenerate.py)."""
    if not isinstance(images, torch.Tensor):  # a pipeline that ignores output_type: as it made them, unchecked
        images = list(images)
        return images, [None] * len(images)
    flags = {}
    if images.dtype != torch.uint8:  # already 8-bit: nothing to scale, and nothing non-finite
        images = images.float()
        if "nonfinite" in checks:
            # A sum is finite exactly when every value is (values in [0, 1] cannot
            # overflow it), and, unlike isfinite().all(), it is one vectorised pass.
            flags["nonfinite"] = ~torch.isfinite(images.sum(dim=(1, 2, 3)))
        images = images.mul(255).round().to(torch.uint8)
    hwc = images.permute(0, 2, 3, 1).contiguous()  # what the host receives
    if "flat" in checks:
        # Each channel's max and min, so a flat colour is flat too: over the rows, then
        # over each row's pixels, both passes along memory (one pass over interleaved
        # channels, or torch.aminmax, is several times slower on CPU: bench/degenerate.py).
        b, h, w, c = hwc.shape
        rows = hwc.view(b, h, w * c)
        high = rows.amax(1).view(b, w, c).amax(1)
        low = rows.amin(1).view(b, w, c).amin(1)
        flags["flat"] = (high - low).amax(1) <= FLAT_MAX_LEVELS
    arrays = list(hwc.cpu().numpy())
    found = [None] * len(arrays)
    if flags:
        order = [kind for kind in DEGENERATE_CHECKS if kind in flags]
        for index, row in enumerate(torch.stack([flags[kind] for kind in order], 1).cpu().tolist()):
            found[index] = next((kind for kind, hit in zip(order, row) if hit), None)
    return arrays, found


def check_compile_mode(family: type[Family], compile_mode: str) -> None:
    """Refuse a compile mode the family cannot take (`diffq run` checks before spawning)."""
    if reason := family.compile_refusal(compile_mode):
        raise CompileUnsupported(reason)


class _Announcements(logging.Handler):
    """Counts the log records in which a backend announces re-running a compiled graph uncompiled."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.message):
            self.count += 1


_ANNOUNCEMENTS: dict[tuple[str, str], _Announcements] = {}


def fallback_count(fallback: GraphFallback | None) -> int:
    """How many fallbacks the backend announced in this process so far (its log line is
    the only sign: backends.py, GraphFallback)."""
    if fallback is None:
        return 0
    key = (fallback.logger, fallback.message)
    if key not in _ANNOUNCEMENTS:
        _ANNOUNCEMENTS[key] = _Announcements(fallback.message)
        logger = logging.getLogger(fallback.logger)
        logger.addHandler(_ANNOUNCEMENTS[key])
        if not logger.isEnabledFor(logging.WARNING):
            logger.setLevel(logging.WARNING)  # a quieter --loglevel must not hide one from the count
    return _ANNOUNCEMENTS[key].count


def free_device_memory() -> None:
    """Collect what was dropped and hand the device's cached blocks back, where the
    backend keeps a cache (none on the CPU)."""
    import gc

    gc.collect()
    try:
        torch.accelerator.empty_cache()
    except Exception:  # noqa: BLE001 - no accelerator (CPU), or one without a cache to empty
        pass


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
