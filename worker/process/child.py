"""The child bootstrap: one worker process per device, from its spec to its last ack.

`child_main` runs in a *spawned* child. It sets the pinning environment from the
backend table before anything imports torch (Neuron and TPU read it once, during
`import torch`), then serves the spec's queues (worker/delivery/celery_adapter.py). The
spec itself, torch-free, is worker/delivery/spec.py.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from diffq.core.storage.base import atomic_write
from diffq.worker.device import compile_cache
from diffq.worker.observe import heap
from diffq.worker.observe import startup
from diffq.worker.observe.lifeline import die_with_parent
from diffq.worker.delivery.spec import EXIT_FATAL, QUIET_ENV, QUIET_LOGGERS, ChildSpec


def _write_env_report(path: str) -> None:
    report = {"env": dict(os.environ), "torch_imported": "torch" in sys.modules, "pid": os.getpid()}
    atomic_write(Path(path), lambda file: file.write(json.dumps(report).encode()))


def warm_start(rt) -> dict:
    """Load models, sync the compile cache and compile the warmup shapes; before consuming.

    Runs after `import torch`, on the process's runtime. Returns a JSON-able report.
    """
    from diffq.worker.delivery.runtime import preload

    spec, host, cache = rt.spec, rt.host, rt.spec.cache
    clock = startup.clock()
    if clock:  # the process's set-up since its imports (metrics, sink helper) counts with them
        clock.phase("imports")
    started = time.perf_counter()
    with compile_cache.mirrored(cache) as sync:
        if clock:
            clock.phase("compile_cache_pull")
        _warm_in_background(spec)  # after the pull: what it builds may be there
        preload(rt)
        heap.keep()  # the pipelines stay
        loaded = time.perf_counter()
        if clock:  # the load's seconds include the weights fetch, taken out at the end
            clock.phase("load")
            clock.phase("weights_fetch", seconds=sum(f["seconds"] for f in host.fetches))
        host.warmup(spec.warmup_shapes())
        if clock:
            clock.phase("warmup")
    heap.settle()  # what the start made stays; each later shape's graphs too
    host.on_compiled.append(lambda _shape: heap.settle())
    if sync:
        host.on_compiled.append(lambda _shape: sync.push_in_background())
    return {
        "worker": spec.name,
        "load_s": round(loaded - started, 3),
        "warmup_s": round(time.perf_counter() - loaded, 3),
        "compile": host.compile_stats(),
        "cache": compile_cache.report(cache, sync),
        "fallback_ops": host.fallback_ops(),
        "heap": heap.report(),
        "fetches": host.fetches,
    }


def child_main(spec_json: str) -> None:
    heap.pause()  # until the warm start is done (a follower's: until it follows)
    spec = ChildSpec.model_validate_json(spec_json)
    clock = startup.begin(spec.name)
    # A consumer's SIGTERM hands back what it holds and exits; a follower rank holds
    # nothing and ignores SIGTERM (below), so it is killed outright.
    die_with_parent(signal.SIGTERM if spec.rank == 0 else signal.SIGKILL)
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in spec.unset_env():
        os.environ.pop(name, None)
    os.environ.update(spec.env())
    if spec.env_report:
        _write_env_report(spec.env_report)
    warnings.filterwarnings("ignore", message=".*superuser privileges.*")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)

    import torch  # noqa: E402 - deliberately after pinning

    torch.set_num_threads(spec.threads)
    if spec.backend.extension:
        importlib.import_module(spec.backend.extension)
    heap.keep()  # modules stay

    from diffq.core.settings import get_settings
    from diffq.worker.observe import metrics

    clock.phase("imports")

    settings = get_settings()
    if settings.log_json:
        from diffq.worker.observe.logs import install_json_logging

        install_json_logging(spec.loglevel)
    if settings.metrics_port is not None:
        # One scrape endpoint per process: base port + its place in the pod (the pod's named ports).
        metrics.start_server(settings.metrics_port + spec.position, settings.metrics_addr)
        metrics.observe_restarts(spec.restarts)
    group = _join_group(spec) if spec.world_size > 1 else None
    if group is not None and not group.leader:
        metrics.follower()
        _exit_without_teardown(_follow(spec, group))
    try:
        _consume(spec, group)
    finally:
        if group is not None:
            group.stop()  # the other ranks exit with it
    # Celery's warm shutdown has closed the broker connection by now (its Connection
    # step's shutdown); what a Redis channel still held, kombu restores from an exit
    # hook (a multiprocessing Finalize), which still runs. Skipped: the interpreter's
    # teardown of torch, seconds at the end of every `diffq run`.
    _exit_without_teardown()


def _warm_in_background(spec: ChildSpec) -> threading.Thread | None:
    """Start the backend's vendor set-up that a compile will ask for (the backend
    table's `warm_in_background`) in a thread, so it overlaps the model's load (its
    imports included) instead of adding to the warm-up. Nothing to start where
    nothing compiles."""
    from diffq.worker.device.backends import COMPILING_MODES

    backend = spec.backend
    if spec.compile not in COMPILING_MODES or not backend.warm_in_background:
        return None
    for module in backend.warm_imports:  # here, so the two threads never import at once
        importlib.import_module(module)
    calls = [getattr(importlib.import_module(module), name) for module, name in backend.warm_in_background]

    def run() -> None:
        for call in calls:
            try:
                call()
            except Exception as exc:  # the compile asks again, and reports it there
                print(f"diffq worker {spec.name}: background {call.__qualname__}: {exc!r}", file=sys.stderr)

    thread = threading.Thread(target=run, name="diffq-warm-background", daemon=True)
    thread.start()
    return thread


def _exit_without_teardown(code: int = 0) -> None:
    """End a child that finished cleanly without the interpreter's teardown.

    Tearing down the modules of torch, dynamo and Inductor frees their whole object
    graph one object at a time, seconds of a warm start's wall time (docs/BENCHMARKS.md,
    "Warm start") for memory the OS takes back at once. Everything an exit must do
    still runs: other threads finish, exit handlers run (logging, multiprocessing,
    Inductor's compile workers), the streams are flushed."""
    import atexit

    # The interpreter's own first exit step: the thread pools' exit hooks (they tell
    # idle workers to stop), then a join of every other non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _consume(spec: ChildSpec, group) -> None:
    """Warm start, then a Celery worker (two task threads) on the spec's queues until shutdown."""
    from diffq.worker.delivery.celery_adapter import build_app, serve
    from diffq.worker.delivery.runtime import Runtime

    rt = Runtime.start(spec, group=group)  # starts the sink's helper process
    try:
        if _warm(rt):
            serve(build_app(rt), spec)
    finally:
        # On every way out (warm shutdown, failed warm start, --warmup-only) the
        # helper ends with its worker and is reaped by it, not left to PID 1.
        rt.sink.close()


def _warm(rt) -> bool:
    """Warm start; False for a --warmup-only process, which is done after it."""
    from diffq.worker.observe import metrics

    spec = rt.spec
    try:
        report = warm_start(rt)
    except Exception as exc:  # a model or compile that fails now fails on retry too
        from diffq.worker.device.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken

        print(f"diffq worker {spec.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_GROUP_BROKEN if isinstance(exc, GroupBroken) else EXIT_FATAL)
    for shape, figures in report.get("compile", {}).get("per_shape", {}).items():
        metrics.observe_compile(shape, figures["seconds"])
    for shape, calls in report.get("compile", {}).get("graph_fallbacks", {}).items():
        metrics.observe_graph_fallback(shape, calls)
    if spec.warmup or spec.warmup_only:
        print(json.dumps({"event": "warm", **report}), flush=True)
    return not spec.warmup_only


def _join_group(spec: ChildSpec):
    from diffq.worker.device.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken, RankMisplaced, join

    try:
        return join(spec.rank, spec.world_size, spec.backend)
    except GroupBroken as exc:
        print(f"diffq worker {spec.name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_GROUP_BROKEN)
    except RankMisplaced as exc:  # the same placement on every restart
        print(f"diffq worker {spec.name}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FATAL)


def _follow(spec: ChildSpec, group) -> int:
    """A rank > 0: no consumer of its own; it generates what rank 0 announces."""
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.device.tensor_parallel import follow

    # Rank 0 decides when the group stops (after its warm shutdown finishes the batch
    # in hand, which needs this rank); a SIGTERM here would break that batch.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    heap.settle()
    host = PipelineHost(backend=spec.backend, compile_mode=spec.compile, offload=spec.offload, group=group,
                        lora_mode=spec.lora_mode)
    try:
        return follow(group, host, spec.models, spec.dtype)
    except Exception as exc:
        print(f"diffq worker {spec.name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FATAL
