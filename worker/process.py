"""One worker process per device: its spec, its environment, and its entry point.

`child_main` runs in a *spawned* child. It sets the pinning environment from the
backend table before anything imports torch (Neuron and TPU read it once, during
`import torch`), then starts a Celery solo-pool worker on the spec's queues.
This module itself must stay torch-free: the supervisor imports it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import socket
import sys
import time
import warnings

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffq.core.contract import ShapeKey
from diffq.worker.backends import Backend, Placement, get_backend
from diffq.worker.compile_cache import CachePlan, CacheSync, plan_cache
from diffq.worker.routing import shape_from_queue

log = logging.getLogger("diffq.worker")

# Exit code for a child that can never succeed (bad model, bad option): the
# supervisor must not restart it in a loop.
EXIT_FATAL = 3


class ChildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    device: str = "cpu"
    slot: int = 0  # the device index this process is pinned to
    threads: int = 1
    broker_url: str
    transport_options: dict = Field(default_factory=dict)
    queues: list[str]
    compile: str = "none"
    offload: str | None = None
    compile_cache: str | None = None
    # Where a remote (URL) compile cache is mirrored on this host; default under /tmp.
    compile_cache_local: str | None = None
    # 'auto' (every served shape) or HxW sizes: compiled before consuming.
    warmup: list[str] = Field(default_factory=list)
    # compile-aware: drain already-compiled shapes before taking a new one.
    routing: Literal["compile-aware", "round-robin"] = "compile-aware"
    # Compile, push the cache, print a JSON report and exit 0 (bake a cache in CI).
    warmup_only: bool = False
    # Debug hook: write the environment as seen before `import torch` to this file.
    env_report: str | None = None
    # Loaded before consuming, so a missing model fails the process at once.
    models: list[str] = Field(default_factory=list)
    dtype: str = "float32"
    allowed_out_prefixes: list[str] = Field(default_factory=list)
    loglevel: str = "WARNING"
    # Tensor-parallel group membership (worker/tensor_parallel.py). world_size 1 is
    # an independent worker; otherwise rank 0 consumes and the others follow it.
    rank: int = 0
    world_size: int = 1
    group: int = 0  # index of the group on this host
    group_slots: list[int] = Field(default_factory=list)  # the group's devices, in rank order
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Device generation where launch facts differ by it (TPU: v5e, v5p, v6e, v7).
    generation: str | None = None

    @field_validator("warmup")
    @classmethod
    def _warmup_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if entry != "auto" and not re.fullmatch(r"\d+x\d+", entry):
                raise ValueError(f"warmup entry '{entry}' is neither 'auto' nor HxW (e.g. 1024x1024)")
        return entries

    @property
    def backend(self) -> Backend:
        return get_backend(self.device)

    @property
    def cache(self) -> CachePlan:
        return plan_cache(self.compile_cache, self.backend, self.compile_cache_local)

    def placement(self) -> Placement:
        return Placement(slot=self.slot, threads=self.threads, rank=self.rank,
                         group_slots=tuple(self.group_slots) if self.world_size > 1 else (),
                         master_addr=self.master_addr, master_port=self.master_port,
                         generation=self.generation)

    def env(self) -> dict[str, str]:
        """What this child adds to its environment before `import torch` (the backend table's)."""
        backend = self.backend
        env = backend.env(self.placement())
        env.update(backend.mode_env.get(self.compile, {}))
        env.update(self.cache.env)
        env["DIFFQ_WORKER_NAME"] = self.name
        return env

    def unset_env(self) -> tuple[str, ...]:
        """What this child removes from the environment it inherited (e.g. torchrun's, when single)."""
        return self.backend.unset(self.placement())

    def warmup_shapes(self) -> list[ShapeKey]:
        """The served shapes to compile before consuming; an HxW no queue serves is an error."""
        if not self.warmup:
            return []
        served = [s for s in (shape_from_queue(q, self.models) for q in self.queues) if s is not None]
        if "auto" in self.warmup:
            return served
        shapes = []
        for entry in self.warmup:
            height, width = (int(x) for x in entry.split("x"))
            matching = [s for s in served if (s.height, s.width) == (height, width)]
            if not matching:
                raise ValueError(f"--warmup {entry}: no served queue of the loaded model has that size")
            shapes += [s for s in matching if s not in shapes]
        return shapes

    def plan(self) -> dict:
        backend = self.backend
        cache = self.cache
        return {
            "name": self.name,
            "device": backend.torch_device,
            "slot": self.slot,
            "env": self.env(),
            "unset": list(self.unset_env()),
            "queues": self.queues,
            "dtype": self.dtype,
            "compile": self.compile,
            "compile_backend": backend.compile_backend,
            "compile_options": backend.compile_options if self.compile in ("full", "regional") else None,
            "cache_env": backend.cache_env,
            "cache_dir": cache.local_dir,
            "cache_remote": cache.remote,
            "warmup": [shape.queue for shape in self.warmup_shapes()],
            "dist_backend": backend.dist_backend,
            **({"group": self.group, "rank": self.rank, "world_size": self.world_size,
                "consumes": self.rank == 0} if self.world_size > 1 else {}),
        }


def hostname() -> str:
    return socket.gethostname()


# Library chatter (per-process load bars, torchvision fallbacks) would drown the
# run's own output when N workers start at once.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _write_env_report(path: str) -> None:
    report = {"env": dict(os.environ), "torch_imported": "torch" in sys.modules, "pid": os.getpid()}
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def warm_start(spec: ChildSpec) -> dict:
    """Load models, sync the compile cache and compile the warmup shapes; before consuming.

    Runs after `import torch` and `build_worker_app`. Returns a JSON-able report.
    """
    from diffq.worker.tasks import preload, runtime

    host = runtime().host
    started = time.perf_counter()
    cache = spec.cache
    sync = CacheSync(cache.remote, cache.local_dir) if cache.remote else None
    if sync:
        try:
            sync.pull()
        except Exception as exc:  # a missing cache costs compile time, not the worker
            log.warning("compile cache pull from %s failed: %s", cache.remote, exc)
    preload(spec)
    loaded = time.perf_counter()
    host.warmup(spec.warmup_shapes())
    if sync:
        try:
            sync.push()
        except Exception as exc:  # another worker will compile it: not fatal
            log.warning("compile cache push to %s failed: %s", cache.remote, exc)
        host.on_compiled.append(lambda _shape: sync.push_in_background())
    return {
        "worker": spec.name,
        "load_s": round(loaded - started, 3),
        "warmup_s": round(time.perf_counter() - loaded, 3),
        "compile": host.compile_stats(),
        "cache": {"dir": cache.local_dir, "remote": cache.remote,
                  "pulled": sync.pulled if sync else 0, "pushed": sync.pushed if sync else 0},
        "fallback_ops": host.fallback_ops(),
    }


def child_main(spec_json: str) -> None:
    spec = ChildSpec.model_validate_json(spec_json)
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in spec.unset_env():
        os.environ.pop(name, None)
    os.environ.update(spec.env())
    if spec.env_report:
        _write_env_report(spec.env_report)
    warnings.filterwarnings("ignore", message=".*superuser privileges.*")

    import torch  # noqa: E402 - deliberately after pinning

    torch.set_num_threads(spec.threads)
    if spec.backend.extension:
        importlib.import_module(spec.backend.extension)

    from diffq.core.settings import get_settings
    from diffq.worker import metrics

    settings = get_settings()
    if settings.log_json:
        from diffq.worker.logs import install_json_logging

        install_json_logging(spec.loglevel)
    if settings.metrics_port is not None:
        # One scrape endpoint per process: base port + device slot.
        metrics.start_server(settings.metrics_port + spec.slot)
    group = _join_group(spec) if spec.world_size > 1 else None
    if group is not None and not group.leader:
        sys.exit(_follow(spec, group))
    try:
        _consume(spec, group)
    finally:
        if group is not None:
            group.stop()  # the other ranks exit with it


def _consume(spec: ChildSpec, group) -> None:
    """Warm start, then a Celery solo-pool worker on the spec's queues until shutdown."""
    from diffq.worker.tasks import build_worker_app, runtime

    app = build_worker_app(spec, group=group)  # starts the sink's helper process
    try:
        _warm_and_serve(app, spec)
    finally:
        # On every way out (warm shutdown, failed warm start, --warmup-only) the
        # helper ends with its worker and is reaped by it, not left to PID 1.
        runtime().sink.close()


def _warm_and_serve(app, spec: ChildSpec) -> None:
    from diffq.worker import metrics

    try:
        report = warm_start(spec)
    except Exception as exc:  # a model or compile that fails now fails on retry too
        from diffq.worker.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken

        print(f"diffq worker {spec.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_GROUP_BROKEN if isinstance(exc, GroupBroken) else EXIT_FATAL)
    for shape, figures in report.get("compile", {}).get("per_shape", {}).items():
        metrics.observe_compile(shape, figures["seconds"])
    if spec.warmup or spec.warmup_only:
        print(json.dumps({"event": "warm", **report}), flush=True)
    if spec.warmup_only:
        return
    app.worker_main([
        "--quiet",
        "worker",
        "--pool=solo",
        "--concurrency=1",
        "--prefetch-multiplier=1",
        f"--queues={','.join(spec.queues)}",
        f"--hostname={spec.name}@{hostname()}",
        f"--loglevel={spec.loglevel}",
        "--without-mingle",
        "--without-gossip",
    ])


def _join_group(spec: ChildSpec):
    from diffq.worker.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken, join

    try:
        return join(spec.rank, spec.world_size, spec.backend)
    except GroupBroken as exc:
        print(f"diffq worker {spec.name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_GROUP_BROKEN)


def _follow(spec: ChildSpec, group) -> int:
    """A rank > 0: no consumer of its own; it generates what rank 0 announces."""
    import signal

    from diffq.worker.pipeline_host import PipelineHost
    from diffq.worker.tensor_parallel import follow

    # Rank 0 decides when the group stops (after its warm shutdown finishes the batch
    # in hand, which needs this rank); a SIGTERM here would break that batch.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    host = PipelineHost(backend=spec.backend, compile_mode=spec.compile, offload=spec.offload, group=group)
    try:
        return follow(group, host, spec.models, spec.dtype)
    except Exception as exc:
        print(f"diffq worker {spec.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FATAL
