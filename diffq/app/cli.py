"""The `diffq` command line: thin Typer wrappers over the Python API."""

from __future__ import annotations

import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from diffq.app.choices import CompileMode, Device, Dtype, Family, TpuGeneration
from diffq.app.commands import cancel, data, fleet, plan, qualify
from diffq.app.options import (Broker, Compile, CompileCache, DeviceDtypeOpt, DeviceOpt, Generation, Model, Offload,
                               Out, Prompts, RunId, Routing, SeedBase, check_compile, devices_of, err, fail,
                               generation_options, out, resolve_dtype)
from diffq.core.settings import get_settings
from diffq.worker.spec import DRAIN_TIMEOUT_S

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Shape-bucketed diffusers image generation over Celery queues.")


@app.command("tiny-pipeline")
def tiny_pipeline(
    directory: Annotated[Path, typer.Argument(help="Folder to write the pipeline into")],
    family: Annotated[Family, typer.Option("--family", help="Pipeline family")] = Family("flux2-klein"),
    seed: Annotated[int, typer.Option("--seed", help="Weight seed")] = 0,
) -> None:
    """Write a tiny random-weight pipeline that loads and runs offline (tests, demo, benchmarks)."""
    from diffq.app.tiny import build_tiny_pipeline

    path = build_tiny_pipeline(directory, family=family.value, seed=seed)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    out.print(f"{path} ({family.value}, {size / 1e6:.2f} MB)")


@app.command()
@generation_options(dtype_from_device=True)
def run(
    prompts: Prompts,
    out_: Out,
    model: Model,
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Worker processes (cpu)")] = 1,
    device: DeviceOpt = Device("cpu"),
    cores: Annotated[Optional[str], typer.Option("--cores", help="NeuronCores, e.g. 0-7, or auto (those the Neuron device plugin allocated)")] = None,
    chips: Annotated[Optional[str], typer.Option("--chips", help="TPU chips, e.g. 0-3")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs, e.g. 0,1")] = None,
    compile: Compile = CompileMode("none"),
    compile_cache: CompileCache = None,
    offload: Offload = None,
    warmup: Annotated[Optional[str], typer.Option("--warmup", help="Compile before consuming: 'auto' (every shape of the run) or HxW[,HxW…]")] = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="Torch threads per worker")] = 1,
    run_id: RunId = None,
    seed_base: SeedBase = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
    generation: Generation = None,
) -> None:
    """Run everything locally (embedded broker, no servers) and wait; exit 0 only if every item was produced."""
    from diffq.producer.sources import InputError
    from diffq.producer.submit import RunExists
    from diffq.app.runner import RunFailed, run as run_embedded
    from diffq.worker.models import ModelUnavailable

    try:
        result = run_embedded(
            prompts, out_, model=model, devices=devices_of(device, workers, cores, chips, gpus),
            device=device.value, compile=compile.value, compile_cache=compile_cache, offload=offload,
            warmup=[w for w in (warmup or "").split(",") if w], threads=threads, progress=progress, console=err, run_id=run_id, seed_base=seed_base,
            **generation.kwargs(dtype=resolve_dtype(device, generation.dtype)),
        )
    except (InputError, RunExists, ModelUnavailable, RunFailed, ValueError) as exc:
        fail(str(exc))
    out.print(f"{result.out}")
    out.print(f"{result.done}/{result.total} images, {result.failed} failed, "
              f"{result.seconds:.1f}s, {result.images_per_s:.1f} images/s"
              + (f", {result.reenqueued} re-enqueued" if result.reenqueued else ""))
    if not result.ok:
        raise typer.Exit(1)


@app.command()
@generation_options()
def submit(
    prompts: Prompts,
    out_: Out,
    model: Model,
    broker: Broker = None,
    run_id: RunId = None,
    seed_base: SeedBase = None,
    generation: Generation = None,
) -> None:
    """Validate the whole file, write the run manifest to OUT, publish batches to per-shape queues."""
    from diffq.producer.sources import InputError
    from diffq.producer.submit import RunExists, submit as submit_run

    broker = broker or get_settings().broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    try:
        result = submit_run(prompts, out_, model=model, broker_url=broker, run_id=run_id, seed_base=seed_base,
                            **generation.kwargs())
    except (InputError, RunExists, ValueError) as exc:
        fail(str(exc))
    out.print(result.out)
    out.print(f"run {result.run_id}: {result.summary()}")


@app.command()
def worker(
    broker: Broker = None,
    device: DeviceOpt = Device("cpu"),
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, help="Processes (cpu)")] = 1,
    cores: Annotated[Optional[str], typer.Option("--cores", help="NeuronCores, one process each: 0-7, or auto (those the Neuron device plugin allocated)")] = None,
    chips: Annotated[Optional[str], typer.Option("--chips", help="TPU chips, one process each: 0-3")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs, one process each: 0,1")] = None,
    queues: Annotated[Optional[str], typer.Option("--queues", "-Q", help="Comma-separated shape queues")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Serve the queues of this run folder's manifest")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Load this model before consuming (fail fast)")] = None,
    serve_models: Annotated[Optional[str], typer.Option("--models", help="Without --queues: serve only these models' queues, M1,M2 (default: --model's, else every model's)")] = None,
    rabbitmq_api: Annotated[Optional[str], typer.Option("--rabbitmq-api", help="RabbitMQ management API URL (http://USER:PASS@HOST:15672): how a worker without --queues lists an AMQP broker's queues")] = None,
    dtype: DeviceDtypeOpt = None,
    compile: Compile = CompileMode("none"),
    compile_cache: CompileCache = None,
    compile_cache_local: Annotated[Optional[str], typer.Option("--compile-cache-local", help="Where a URL compile cache is mirrored on this host (default under /tmp)")] = None,
    warmup: Annotated[Optional[str], typer.Option("--warmup", help="Compile before consuming: 'auto' (every served shape) or HxW[,HxW…]")] = None,
    warmup_only: Annotated[bool, typer.Option("--warmup-only", help="Compile the warmup shapes, push the compile cache, print a JSON report per process, exit")] = False,
    offload: Offload = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="Torch threads per process")] = 1,
    routing: Annotated[Routing, typer.Option("--routing", help="compile-aware: drain compiled shapes before taking a new one; round-robin: Celery's default")] = Routing.compile_aware,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree: groups of N devices, each group one consumer (models larger than one device)")] = 1,
    master_port: Annotated[int, typer.Option("--master-port", help="Rendezvous port of the first --tp group (group g uses this + g)")] = 29500,
    tpu_generation: Annotated[Optional[TpuGeneration], typer.Option("--tpu-generation", help="TPU generation where none is attached (--plan, manifests); default: read from PCI ids")] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Print each child's pinning and queues as JSON (no --queues needed); start nothing")] = False,
    loglevel: Annotated[str, typer.Option("--loglevel", help="Celery log level")] = "INFO",
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0, help="On SIGTERM, seconds the batch in hand may take before it is handed back (exit 0 either way)")] = DRAIN_TIMEOUT_S,
) -> None:
    """Start one pinned worker process per device, consuming shape queues until SIGTERM.

    With --tp N, N devices form one tensor-parallel group: rank 0 consumes and the
    group generates each batch together (e.g. --device neuron --cores 0-7 --tp 4:
    two groups of four NeuronCores).
    """
    from diffq.worker.supervisor import Supervisor, plan_children

    settings = get_settings()
    broker = broker or settings.broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    names = [q for q in (queues or "").split(",") if q]
    models = [model] if model else []
    if run:
        from diffq.core.runfolder import read_manifest
        from diffq.core.storage import open_storage

        manifest = read_manifest(open_storage(run))
        names += [s.queue for s in manifest.shapes if s.queue not in names]
        models = models or manifest.models or [manifest.defaults["model"]]
    discovery = {}
    if not names:
        from diffq.worker.routing import startup_queues

        serve = [m for m in (serve_models or "").split(",") if m] or models
        if not plan:  # a plan needs no queues and starts nothing
            try:
                names = startup_queues(broker, serve, rabbitmq_api)
            except ValueError as exc:
                fail(str(exc))
        discovery = {"discover": True, "serve_models": serve, "rabbitmq_api": rabbitmq_api}
    check_compile(models, compile.value)
    try:
        specs = plan_children(device=device.value, devices=devices_of(device, workers, cores, chips, gpus),
                              broker_url=broker, queues=names, threads=threads, compile=compile.value,
                              compile_cache=compile_cache or settings.compile_cache,
                              compile_cache_local=compile_cache_local, offload=offload,
                              warmup=[w for w in (warmup or ("auto" if warmup_only else "")).split(",") if w],
                              warmup_only=warmup_only, routing=routing.value,
                              models=models, dtype=resolve_dtype(device, dtype), tp=tp, master_port=master_port,
                              generation=tpu_generation.value if tpu_generation else None,
                              allowed_out_prefixes=settings.allowed_out_prefixes, loglevel=loglevel,
                              drain_timeout_s=drain_timeout, **discovery)
    except ValueError as exc:
        fail(str(exc))
    if plan:
        def child_plan(spec) -> dict:
            # Without --queues the worker would consume the queues it discovers.
            return {**spec.plan(), "queues": spec.queues or "discovered"}

        if tp == 1:
            out.print_json(json.dumps([child_plan(spec) for spec in specs]))
        else:
            from diffq.worker.tensor_parallel import sharding_plan

            groups = [specs[i:i + tp] for i in range(0, len(specs), tp)]
            out.print_json(json.dumps([{
                "group": ranks[0].group,
                "world_size": tp,
                "devices": ranks[0].group_slots,
                "master": f"{ranks[0].master_addr}:{ranks[0].master_port}",
                "sharding": dataclasses.asdict(sharding_plan(ranks[0].backend, tp)),
                "ranks": [child_plan(spec) for spec in ranks],
            } for ranks in groups]))
        return
    raise typer.Exit(Supervisor(specs).serve_forever())


@app.command()
def status(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (with --watch: one line per refresh)")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Live progress until nothing is pending (Ctrl-C to stop)")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes with --watch")] = 2.0,
) -> None:
    """Progress of a run, read from its run folder alone (no broker needed)."""
    from diffq.core.runfolder import NotARun
    from diffq.results.status import status as run_status

    if watch:
        from diffq.results.watch import watch as watch_run

        try:
            watch_run(out_dir, interval=interval, console=out, as_json=as_json)
        except NotARun as exc:
            fail(str(exc))
        return
    try:
        st = run_status(out_dir)
    except NotARun as exc:
        fail(str(exc))
    if as_json:
        sys.stdout.write(json.dumps(st.to_json()) + "\n")
        return
    table = Table(title=f"run {st.run_id}  ·  {st.out}")
    for column in ("queue", "done", "total"):
        table.add_column(column, justify="right" if column != "queue" else "left")
    for queue, shape in st.shapes.items():
        table.add_row(queue, str(shape.done), str(shape.total))
    out.print(table)
    out.print(f"{st.done}/{st.total} done, {st.failed} failed, "
              + (f"{st.cancelled} cancelled, " if st.cancelled else "") + f"{st.pending} pending")


@app.command()
def fetch(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    dest: Annotated[Path, typer.Argument(help="Local folder (HF imagefolder layout)")],
    only_new: Annotated[bool, typer.Option("--only-new", help="Fetch only items not yet in DEST/metadata.jsonl (no size checks)")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Download finished images and write DEST/metadata.jsonl (loadable as an HF imagefolder).

    Resumable: a second call fetches only what is missing.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from diffq.core.runfolder import NotARun
    from diffq.results.fetch import fetch as fetch_run

    bar = Progress(TextColumn("[bold]fetch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err, disable=not progress, transient=True)
    task = bar.add_task("fetch", total=None)
    try:
        with bar:
            result = fetch_run(out_dir, dest, only_new=only_new,
                               on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    except NotARun as exc:
        fail(str(exc))
    out.print(f"{result.images} images in {result.dest} ({result.downloaded} downloaded)")



def _requeue(kind: str, out_dir: str, broker: str | None) -> None:
    from diffq.producer import resume as requeue
    from diffq.core.runfolder import NotARun

    broker = broker or get_settings().broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    try:
        result = getattr(requeue, kind)(out_dir, broker)
    except (NotARun, requeue.RunCancelled) as exc:
        fail(str(exc))
    out.print(f"{result.out}: re-enqueued {result.items} items in {result.batches} batches")


@app.command()
def resume(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    broker: Broker = None,
) -> None:
    """Re-enqueue exactly the items that are neither done nor failed (read from OUT, not the broker)."""
    _requeue("resume", out_dir, broker)


@app.command("retry-failed")
def retry_failed(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    broker: Broker = None,
) -> None:
    """Re-enqueue the items that failed after every retry."""
    _requeue("retry_failed", out_dir, broker)


# The other command groups, each adding its commands to `app`.
for group in (fleet, data, plan, qualify, cancel):
    group.register(app)

if __name__ == "__main__":
    app()
