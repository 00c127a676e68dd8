"""A worker process's runtime: its spec, pipelines, sink, run folders and batch line.

The batch task carries it (`task.runtime`, set up by worker/delivery/celery_adapter.py); a
batch's life (worker/delivery/tasks.py) reads everything it needs of the process from here.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, field

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import ShapeKey, shape_from_queue
from diffq.core.settings import get_settings
from diffq.core import layout
from diffq.core.storage import NotFound, Storage, open_storage
from diffq.core.transports import transport_for
from diffq.worker.delivery.admission import Admission
from diffq.worker.delivery.batches import BatchLine
from diffq.worker.delivery.failures import storage_trouble
from diffq.worker.delivery.lease import LeaseKeeper
from diffq.worker.device.pipeline_host import PipelineHost
from diffq.worker.delivery.dead_letters import REASONS
from diffq.worker.delivery.routing import Discovery, Router
from diffq.worker.sink.store import Sink
from diffq.worker.sink.helper import SinkProcess, make_sink
from diffq.worker.delivery.spec import ChildSpec, hostname
from diffq.worker.observe import metrics


class OutNotAllowed(PermissionError):
    pass


@dataclass
class Runtime:
    """A worker process's state: its spec, pipelines, sink, run folders, batch line."""

    spec: ChildSpec
    host: PipelineHost
    sink: Sink | SinkProcess = field(default_factory=make_sink)
    storages: dict[str, Storage] = field(default_factory=dict)
    line: BatchLine | None = None  # built on the sink when not given
    lease: LeaseKeeper | None = None  # while consuming (worker/delivery/celery_adapter.py)
    # The hooks on a batch's life (worker/delivery/hooks.py), in order; None: the defaults,
    # made on the first batch (worker/delivery/tasks.py). They keep per-process state (the
    # cancel marker last seen), so each runtime has its own.
    hooks: list | None = None
    # Set once the consumer has stopped fetching and handed back what it held.
    consuming_stopped: threading.Event = field(default_factory=threading.Event)
    # What a delivery must be to be taken (worker/delivery/admission.py); from the spec and
    # settings when not given.
    admission: Admission | None = None
    run_ids: dict[str, str] = field(default_factory=dict)  # run folder -> the run id its manifest names
    # run folder -> its manifest's pinned object-storage model revisions
    model_pins: dict[str, dict[str, str]] = field(default_factory=dict)
    run_models: dict[str, frozenset[str]] = field(default_factory=dict)  # run folder -> its manifest's models
    # run folder -> its manifest's LoRA layouts (model -> AdapterLayout)
    adapter_layouts: dict[str, dict[str, AdapterLayout]] = field(default_factory=dict)
    adapter_pins: dict[str, dict[str, str]] = field(default_factory=dict)  # run folder -> adapter path -> revision

    def __post_init__(self):
        if self.line is None:
            self.line = BatchLine(self.sink)
        if self.admission is None:
            self.admission = Admission.of(self.spec, get_settings())

    @classmethod
    def start(cls, spec: ChildSpec, group=None) -> Runtime:
        """The runtime of a worker process; its sink helper starts importing now, while
        the model loads."""
        rt = cls(spec=spec, host=PipelineHost(backend=spec.backend, compile_mode=spec.compile,
                                              offload=spec.offload, group=group, lora_mode=spec.lora_mode,
                                              checks=frozenset(spec.degenerate_policy)))
        transport = transport_for(spec.broker_url)
        discovery = Discovery(transport, spec.serve_models, spec.rabbitmq_api, dtypes=spec.backend.served_dtypes,
                              variants_of=spec.variants_of, layouts=spec.world_size == 1) if spec.discover else None
        if spec.routing == "compile-aware" or discovery is not None:
            rt.line.router = Router(spec.queues, rt.compiled_queues, transport, discovery=discovery,
                                    compile_aware=spec.routing == "compile-aware")
            rt.line.router.on_serve = rt.serving
        metrics.refusals(REASONS)
        rt.serving(spec.queues)
        return rt

    def serving(self, queues: list[str]) -> None:
        """Queues served from now on: their metric children at 0 (worker/observe/metrics.py)."""
        models = self.spec.models + self.spec.serve_models
        for queue in queues:
            shape = shape_from_queue(queue, models)
            metrics.serving(queue, shape.label if shape is not None else None)

    def compiled_queues(self) -> set[str]:
        return {shape.queue for shape in self.host.shapes_seen}

    @functools.cached_property
    def worker(self) -> str:
        """This process's name in records and logs (asked on every batch: made once)."""
        return f"{self.spec.name}@{hostname()}"

    def run_problem(self, storage: Storage, run_id: str) -> str | None:
        """Why a batch of run `run_id` may not write to `storage`, or None: only a run
        folder whose manifest names that run takes its batches (read once per folder;
        storage trouble reading it raises StorageTrouble: the batch waits, not refused)."""
        if storage.url not in self.run_ids:
            with storage_trouble():
                try:
                    raw = storage.get_bytes(layout.MANIFEST)
                except NotFound:
                    return f"{storage.url} holds no diffq run (no {layout.MANIFEST}): nothing is written there"
            try:
                manifest = json.loads(raw)
                self.model_pins[storage.url] = dict(manifest.get("model_revisions") or {})
                self.run_models[storage.url] = frozenset(
                    manifest.get("models") or [(manifest.get("defaults") or {}).get("model")]) - {None}
                self.adapter_layouts[storage.url] = {model: AdapterLayout.model_validate(value) for model, value
                                                     in (manifest.get("adapter_layouts") or {}).items()}
                self.adapter_pins[storage.url] = dict(manifest.get("adapter_revisions") or {})
                self.run_ids[storage.url] = str(manifest["run_id"])
            except (ValueError, KeyError, TypeError, AttributeError):  # pydantic's ValidationError too
                return f"{storage.url}/{layout.MANIFEST} is not a diffq run manifest"
        if self.run_ids[storage.url] != run_id:
            return f"run id {run_id!r} is not the id of the run in {storage.url}"
        return None

    def model_problem(self, storage: Storage, model: str) -> str | None:
        """Why this worker may not generate `model` for the run in `storage` (read by
        `run_problem` first), or None: a worker told no models loads only those its
        run's manifest names; an object-storage model the run pinned must be loaded at
        that revision. One not loaded yet is loaded at it, or refused then."""
        named = self.run_models.get(storage.url)
        if not self.admission.models and named and model not in named:
            return (f"model {model[:200]!r} is not one run {self.run_ids.get(storage.url)}'s manifest names, "
                    "and this worker was told no models (--model, --models, DIFFQ_ALLOWED_MODELS)")
        pinned = self.model_pins.get(storage.url, {}).get(model)
        if pinned is None:
            return None
        loaded = self.host.revisions.get(model)
        if loaded is None:
            self.host.pins[model] = pinned
            return None
        if loaded != pinned:
            return (f"model {model} is loaded at revision {loaded}, but run {self.run_ids.get(storage.url)} "
                    f"pinned {pinned}: a worker started for that revision must take its batches")
        return None

    def adapter_problem(self, storage: Storage, shape: ShapeKey, adapters: tuple = ()) -> str | None:
        """Why this worker may not serve a batch of `shape` with `adapters` for the run in
        `storage` (read by `run_problem` first), or None. The shape's layout must be its
        run manifest's, and each adapter one the manifest pinned, at that revision (as a
        model must be: a batch cannot make a worker load an adapter its run never named).
        Only checks: the pipeline is built (or built again) around the layout on the
        device's turn (PipelineHost._ready)."""
        layout = self.adapter_layouts.get(storage.url, {}).get(shape.model)
        if (layout.label if layout is not None else None) != shape.lora:
            return (f"shape {shape.queue} names LoRA layout {shape.lora}, but run {self.run_ids.get(storage.url)}'s "
                    f"manifest says {layout.label if layout is not None else 'none'} for {shape.model}")
        pins = self.adapter_pins.get(storage.url, {})
        for ref in adapters:
            if ref.path not in pins:
                return (f"adapter {ref.path[:200]!r} is not one run {self.run_ids.get(storage.url)}'s manifest "
                        "pins")
            if ref.revision != pins[ref.path]:
                return (f"adapter {ref.path[:200]!r} at revision {ref.revision}, but run "
                        f"{self.run_ids.get(storage.url)} pinned {pins[ref.path]}")
        if layout is None:
            return None
        if reason := self.host.adapter_refusal():
            return reason
        self.host.know_layout(layout)
        return None

    def storage_for(self, out: str) -> Storage:
        if out not in self.storages:
            # Admission refused anything outside the worker's runs or prefixes on
            # receipt; asked again here, for deliveries that came another way.
            if reason := self.admission.out_problem(out):
                raise OutNotAllowed(reason)
            self.storages[out] = open_storage(out)
        return self.storages[out]


def preload(rt: Runtime) -> None:
    rt.host.speedups.check_device(rt.host.backend)  # what a quantization scheme needs of it, at the start
    for model, layout_ in rt.spec.adapter_layouts.items():  # before the model loads and compiles
        rt.host.use_adapters(model, layout_)
    for model in rt.spec.models:
        for quant in rt.spec.schemes if rt.spec.schemes is not None else [None]:
            rt.host.pipeline(model, rt.spec.dtype, rt.host.quant_scheme(quant, rt.spec.dtype))
