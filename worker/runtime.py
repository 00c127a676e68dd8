"""A worker process's runtime: its spec, pipelines, sink, run folders and batch line.

The batch task carries it (`task.runtime`, set up by worker/celery_adapter.py); a
batch's life (worker/tasks.py) reads everything it needs of the process from here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from diffq.core.storage import Storage, open_storage
from diffq.core.transports import transport_for
from diffq.worker.batches import BatchLine
from diffq.worker.lease import LeaseKeeper
from diffq.worker.pipeline_host import PipelineHost
from diffq.worker.routing import Discovery, Router
from diffq.worker.sink import Sink
from diffq.worker.sink_process import SinkProcess, make_sink
from diffq.worker.spec import ChildSpec, hostname


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
    lease: LeaseKeeper | None = None  # while consuming (worker/celery_adapter.py)
    # The hooks on a batch's life (worker/hooks.py), in order; None: the defaults,
    # made on the first batch (worker/tasks.py). They keep per-process state (the
    # cancel marker last seen), so each runtime has its own.
    hooks: list | None = None
    # Set once the consumer has stopped fetching and handed back what it held.
    consuming_stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.line is None:
            self.line = BatchLine(self.sink)

    @classmethod
    def start(cls, spec: ChildSpec, group=None) -> Runtime:
        """The runtime of a worker process; its sink helper starts importing now, while
        the model loads."""
        rt = cls(spec=spec, host=PipelineHost(backend=spec.backend, compile_mode=spec.compile,
                                              offload=spec.offload, group=group,
                                              checks=frozenset(spec.degenerate_policy)))
        transport = transport_for(spec.broker_url)
        discovery = Discovery(transport, spec.serve_models, spec.rabbitmq_api,
                              dtypes=spec.backend.served_dtypes) if spec.discover else None
        if spec.routing == "compile-aware" or discovery is not None:
            rt.line.router = Router(spec.queues, rt.compiled_queues, transport, discovery=discovery,
                                    compile_aware=spec.routing == "compile-aware")
        return rt

    def compiled_queues(self) -> set[str]:
        return {shape.queue for shape in self.host.shapes_seen}

    @property
    def worker(self) -> str:
        return f"{self.spec.name}@{hostname()}"

    def storage_for(self, out: str) -> Storage:
        if out not in self.storages:
            # Check the normalised URL (resolved path, no '..'), on a path boundary:
            # '/data/runs-evil' is not under '/data/runs'.
            storage = open_storage(out)
            allowed = [prefix.rstrip("/") for prefix in self.spec.allowed_out_prefixes]
            if allowed and not any(storage.url == p or storage.url.startswith(p + "/") for p in allowed):
                raise OutNotAllowed(f"run folder {storage.url} is outside this worker's allowed prefixes")
            self.storages[out] = storage
        return self.storages[out]


def preload(rt: Runtime) -> None:
    for model in rt.spec.models:
        rt.host.pipeline(model, rt.spec.dtype)
