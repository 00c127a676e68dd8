"""The `diffq` command line: thin Typer wrappers over the Python API."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from diffq.app.choices import GENERATION_HELP, CompileMode, DeviceGeneration, Dtype, Family
from diffq.app.commands import cancel, data, fleet, plan, qualify
from diffq.app.options import (DEFAULT_LORA_MODE, DEFAULT_ON_DEGENERATE, AllowFallback, LoraModeOpt, Broker, Compile, CompileCache, Devices,
                               DtypeOpt, Feeds, Generation, LocalWorkers, Model, Offload, OnDegenerate, Out, Prompts,
                               RunId, Routing, SeedBase, Threads, Warmup, Window, check_compile, device_options, err,
                               fail, generation_options, local_worker_options, out)
from diffq.core.contract import without_layout
from diffq.core.profile import lora_mode_and_profile
from diffq.core.settings import get_settings
from diffq.producer.feed import AUTO, DEFAULT_WINDOW, POLL_S, parse_window
from diffq.worker.api import DRAIN_TIMEOUT_S

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Shape-bucketed diffusers image generation over Celery queues.")


def _version(value: bool) -> None:
    if value:
        from diffq import __version__

        out.print(f"diffq {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit")] = False,
) -> None:
    """Shape-bucketed diffusers image generation over Celery queues."""


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


@app.command("tiny-lora")
def tiny_lora(
    pipeline_dir: Annotated[Path, typer.Argument(help="A tiny pipeline's folder (diffq tiny-pipeline)")],
    out_file: Annotated[Path, typer.Argument(help="The adapter file to write (.safetensors)")],
    rank: Annotated[int, typer.Option("--rank", min=1, max=1024, help="LoRA rank")],
    seed: Annotated[int, typer.Option("--seed", help="Weight seed")] = 0,
    targets: Annotated[Optional[str], typer.Option(
        "--targets", help="Comma-separated module names the adapter targets (default: the attention "
                          "projections to_q,to_k,to_v,to_out.0)")] = None,
) -> None:
    """Write a random LoRA adapter for a tiny pipeline's transformer, in diffusers' LoRA format (tests, demo)."""
    from diffq.app.tiny import TINY_LORA_TARGETS, build_tiny_lora

    names = tuple(filter(None, (t.strip() for t in targets.split(",")))) if targets else TINY_LORA_TARGETS
    try:
        path = build_tiny_lora(pipeline_dir, out_file, rank=rank, seed=seed, targets=names)
    except (OSError, ValueError) as exc:
        fail(str(exc))
    out.print(f"{path} (rank {rank}, {path.stat().st_size / 1e3:.1f} kB)")


@app.command()
@generation_options()
@local_worker_options()
def run(
    prompts: Prompts,
    out_: Out,
    model: Model,
    run_id: RunId = None,
    seed_base: SeedBase = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
    rates: plan.KeepRates = None,
    local: LocalWorkers = None,
    generation: Generation = None,
) -> None:
    """Run everything locally (embedded broker, no servers) and wait; exit 0 only if every item was produced.

    Again with the same file and options on the same OUT, it finishes an interrupted run (other options: refused)."""
    from diffq.producer.sources import InputError
    from diffq.producer.submit import RunExists
    from diffq.app.runner import RunFailed, run as run_embedded
    from diffq.worker.api import ModelUnavailable

    try:
        workers = local.kwargs()
        if rates:  # planned for this run's devices, kept in OUT before it starts
            from diffq.app.fleet_plan import plan_for_run

            fleet = plan_for_run(prompts, out_, model=model, rates=rates, devices=len(workers["devices"]),
                                 options=generation)
            err.print(fleet.summary(), highlight=False, markup=False)
        result = run_embedded(prompts, out_, model=model, progress=progress, console=err, run_id=run_id,
                              seed_base=seed_base, **workers, options=generation)
    except (InputError, RunExists, ModelUnavailable, RunFailed, ValueError) as exc:
        fail(str(exc))
    out.print(f"{result.out}")
    out.print(result.summary())
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
    rates: plan.KeepRates = None,
    window: Window = AUTO,
    feeds: Feeds = None,
    generation: Generation = None,
) -> None:
    """Validate the whole file, write the run manifest and plan to OUT, publish its batches:
    where a feeder will feed the run (a fleet's, live above OUT; or --feeds, DIFFQ_FEEDS) a
    window per shape queue, the feeder publishing the rest as it drains; without one, every batch."""
    from diffq.producer.sources import InputError
    from diffq.producer.submit import RunExists, submit as submit_run

    broker = broker or get_settings().broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    try:
        window_batches = parse_window(window)
        if rates:  # the fleet is not known here: the report plans for the devices the run used
            from diffq.app.fleet_plan import plan_for_run

            fleet = plan_for_run(prompts, out_, model=model, rates=rates, options=generation)
            err.print(fleet.summary(), highlight=False, markup=False)
        result = submit_run(prompts, out_, model=model, broker_url=broker, run_id=run_id, seed_base=seed_base,
                            window=window_batches, feeds=feeds, options=generation)
    except (InputError, RunExists, ValueError) as exc:
        fail(str(exc))
    out.print(result.out)
    out.print(f"run {result.run_id}: {result.summary()}")
    _say_feeder(result.unpublished, result.out, result.feeds)
    if result.why:
        err.print(result.why, highlight=False, markup=False, soft_wrap=True)  # one line


def _say_feeder(unpublished: int, out_dir: str, feeds: str | None) -> None:
    """Where the batches still in OUT will come from: the fleet's feeder or `diffq feed`."""
    if not unpublished:
        return
    if feeds:
        err.print(f"the feeder of {feeds} publishes the other {unpublished} batches as the window drains",
                  highlight=False, markup=False)
    else:
        err.print(f"no feeds folder (--feeds or DIFFQ_FEEDS): run `diffq feed {out_dir}` to publish the other "
                  f"{unpublished} batches as the window drains", highlight=False, markup=False)


@app.command()
def feed(
    out_dirs: Annotated[list[str], typer.Argument(metavar="OUT...", help="Run folders to feed")],
    broker: Broker = None,
    poll: Annotated[float, typer.Option("--poll", min=0.05, help="Seconds between two looks at the runs' progress")] = POLL_S,
) -> None:
    """Publish what runs submitted with a window still hold in OUT, as their windows drain;
    returns once every batch is published (or the run is cancelled). While it feeds, each
    run folder holds its heartbeat: `status` and `queues` do not show the run waiting."""
    import signal
    import threading

    from diffq.producer.feed import Feeder
    from diffq.producer.publish import CeleryPublisher

    broker = broker or get_settings().broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    publisher = CeleryPublisher(broker)
    feeder = Feeder(publisher, outs=tuple(out_dirs))
    stop = threading.Event()
    # SIGTERM stops it as Ctrl-C does: its heartbeats go with it, and `status` says at once
    # that the runs' batches in OUT wait for a feeder.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    done = False
    try:
        done = feeder.serve(stop, poll, until_done=True)
    except KeyboardInterrupt:
        pass
    finally:
        publisher.close()
    if done:
        out.print(f"{len(out_dirs)} runs: nothing left to feed (every batch published, or the run cancelled)")
    else:
        err.print("stopped: what the runs still hold in OUT waits for a feeder (`diffq feed` again, or "
                  "`diffq resume OUT`)", highlight=False, markup=False)


@app.command()
@device_options(", one process each", workers_help="Processes (cpu)")
def worker(
    broker: Broker = None,
    queues: Annotated[Optional[str], typer.Option("--queues", "-Q", help="Comma-separated shape queues")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Serve the queues of this run folder's manifest")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Load this model before consuming (fail fast)")] = None,
    serve_models: Annotated[Optional[str], typer.Option("--models", help="Without --queues: serve only these models' queues, M1,M2 (default: --model's, else every model's)")] = None,
    rabbitmq_api: Annotated[Optional[str], typer.Option("--rabbitmq-api", help="RabbitMQ management API URL (http://USER:PASS@HOST:15672): how a worker without --queues lists an AMQP broker's queues")] = None,
    dtype: DtypeOpt = Dtype("auto"),
    compile: Compile = CompileMode("none"),
    compile_cache: CompileCache = None,
    compile_cache_local: Annotated[Optional[str], typer.Option("--compile-cache-local", help="Where a URL compile cache is mirrored on this host (default under /tmp)")] = None,
    warmup: Warmup = None,
    warmup_only: Annotated[bool, typer.Option("--warmup-only", help="Compile the warmup shapes, push the compile cache, print a JSON report per process, exit")] = False,
    offload: Offload = None,
    threads: Threads = 1,
    routing: Annotated[Routing, typer.Option("--routing", help="compile-aware: drain compiled shapes before taking a new one; round-robin: Celery's default")] = Routing.compile_aware,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree: groups of N devices, each group one consumer (models larger than one device)")] = 1,
    master_port: Annotated[int, typer.Option("--master-port", help="Rendezvous port of the first --tp group (group g uses this + g)")] = 29500,
    device_generation: Annotated[Optional[DeviceGeneration], typer.Option("--generation", "--tpu-generation", help=GENERATION_HELP)] = None,
    allow_fallback: AllowFallback = False,
    on_degenerate: OnDegenerate = DEFAULT_ON_DEGENERATE,
    lora_mode: LoraModeOpt = DEFAULT_LORA_MODE,
    plan: Annotated[bool, typer.Option("--plan", help="Print each child's pinning and queues as JSON (no --queues needed); start nothing")] = False,
    out_prefix: Annotated[Optional[list[str]], typer.Option("--out-prefix", help="Run folders this worker may write to: the prefix `diffq submit --out` folders live under (s3://BUCKET/runs, gs://BUCKET/runs or an absolute path; repeat or comma-separate). Default: DIFFQ_ALLOWED_OUT_PREFIXES; on a network broker, with neither and no --run, refused unless --any-out")] = None,
    any_out: Annotated[bool, typer.Option("--any-out", help="No run-folder scope: write into whatever run folder a batch names")] = False,
    loglevel: Annotated[str, typer.Option("--loglevel", help="Celery log level")] = "INFO",
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0, help="On SIGTERM, seconds the batch in hand may take before it is handed back (exit 0 either way)")] = DRAIN_TIMEOUT_S,
    devices: Devices = None,
) -> None:
    """Start one pinned worker process per device, consuming shape queues until SIGTERM.

    With --tp N, N devices form one tensor-parallel group: rank 0 consumes and the
    group generates each batch together (e.g. --device neuron --cores 0-7 --tp 4:
    two groups of four NeuronCores).
    """
    from diffq.worker.api import Supervisor, plan_children

    settings = get_settings()
    broker = broker or settings.broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    prefixes = _worker_prefixes(out_prefix, any_out, settings.allowed_out_prefixes)
    names, models, discovery, runs = _served_queues(broker, queues, run, model, serve_models,
                                              rabbitmq_api or settings.rabbitmq_api,
                                              devices.backend.served_dtypes, discover=not plan,
                                              layouts=tp == 1)  # a --tp group takes no adapters
    check_compile(models, compile.value)
    try:
        mode, lora_profile = lora_mode_and_profile(lora_mode)
        if tp > 1 and (settings.allowed_adapters or (lora_queues := [q for q in names if without_layout(q) != q])):
            from diffq.worker.api import lora_modes

            said = (f"queue {lora_queues[0]} carries a LoRA layout" if not settings.allowed_adapters else
                    "DIFFQ_ALLOWED_ADAPTERS is set: unset it for a --tp worker")
            raise ValueError(f"{lora_modes.TP_REFUSAL.format(tp=tp)} ({said})")
        specs = plan_children(device=devices.device.value, devices=devices.slots(),
                              broker_url=broker, queues=names, threads=threads, compile=compile.value,
                              compile_cache=compile_cache or settings.compile_cache,
                              compile_cache_local=compile_cache_local, offload=offload,
                              warmup=[w for w in (warmup or ("auto" if warmup_only else "")).split(",") if w],
                              warmup_only=warmup_only, routing=routing.value,
                              models=models, dtype=dtype.value, tp=tp, master_port=master_port,
                              generation=device_generation.value if device_generation else None,
                              allowed_out_prefixes=prefixes, loglevel=loglevel,
                              drain_timeout_s=drain_timeout, allow_fallback=allow_fallback,
                              on_degenerate=on_degenerate.value, lora_mode=mode, lora_profile=lora_profile, runs=runs,
                              **discovery)
        if not plan:
            _refuse_unscoped(broker, runs, prefixes, any_out)
        _say_what_is_admitted(broker, specs)
    except ValueError as exc:
        fail(str(exc))
    if plan:
        out.print_json(json.dumps(_child_plans(specs, tp)))
        return
    raise typer.Exit(Supervisor(specs).serve_forever())



def _served_queues(broker: str, queues: str | None, run: str | None, model: str | None, serve_models: str | None,
                   rabbitmq_api: str | None, dtypes, *, discover: bool,
                   layouts: bool = True) -> tuple[list[str], list[str], dict, list]:
    """The queues a worker consumes, the models it loads and the runs it serves:
    --queues, plus a run folder's shapes with --run (then only that run's batches are
    taken); with neither, the broker's queues of the served models (discovery goes on
    while it runs). `discover=False` (--plan) lists nothing."""
    names = [q for q in (queues or "").split(",") if q]
    models = [model] if model else []
    runs = []
    if run:
        from diffq.core.runfolder import read_manifest
        from diffq.core.storage import open_storage
        from diffq.worker.api import RunScope

        storage = open_storage(run)
        manifest = read_manifest(storage)
        names += [s.queue for s in manifest.shapes if s.queue not in names]
        models = models or manifest.models or [manifest.defaults.model]
        runs = [RunScope.of(storage.url, manifest.run_id)]
    if names:
        return names, models, _variants(broker, names, rabbitmq_api) if not run else {}, runs
    from diffq.worker.api import startup_queues

    serve = [m for m in (serve_models or "").split(",") if m] or models
    if discover:
        try:
            names = startup_queues(broker, serve, rabbitmq_api, dtypes=dtypes, layouts=layouts)
        except ValueError as exc:
            fail(str(exc))
    return names, models, {"discover": True, "serve_models": serve, "rabbitmq_api": rabbitmq_api}, runs


def _variants(broker: str, names: list[str], rabbitmq_api: str | None) -> dict:
    """--queues Q (a per-shape pool's): Q's LoRA runs too, `Q.r16-…` (the same shape with a
    layout), found by the worker's discovery where the broker can list its queues."""
    from diffq.core.transports import transport_for

    transport = transport_for(broker)
    if transport.broker.list_queues is None or (transport.list_needs_api and not rabbitmq_api):
        return {}
    return {"discover": True, "rabbitmq_api": rabbitmq_api, "variants_of": list(names)}


def _worker_prefixes(out_prefix: list[str] | None, any_out: bool, setting) -> list[str]:
    """`--out-prefix`, else DIFFQ_ALLOWED_OUT_PREFIXES; none with `--any-out` (named, it wins)."""
    from diffq.app.fleet import parse_out_prefixes

    if any_out and out_prefix:
        fail("--any-out and --out-prefix contradict each other: pass one")
    if any_out:
        return []
    try:
        return list(parse_out_prefixes(out_prefix or list(setting)))
    except ValueError as exc:
        fail(str(exc))


def _refuse_unscoped(broker: str, runs: list, prefixes: list[str], any_out: bool) -> None:
    """On a broker others can publish to, a worker serves one run (--run) or run folders
    under a prefix, or is told `--any-out` by name, as `diffq fleet manifests` is."""
    from diffq.core.transports import transport_for

    if runs or prefixes or any_out or transport_for(broker).keda is None:  # keda: a fleet's broker
        return
    fail("this worker would write wherever a batch's run folder says, for anyone who can publish to the "
         "broker: pass --out-prefix s3://BUCKET/runs (where your `diffq submit --out` folders live; or "
         "DIFFQ_ALLOWED_OUT_PREFIXES), --run OUT (one run), or --any-out to write anywhere")


def _say_what_is_admitted(broker: str, specs: list) -> None:
    """On a broker others can publish to, say loudly what this worker lets through
    that a publisher chooses (worker/delivery/admission.py)."""
    from diffq.core.transports import transport_for
    from diffq.worker.api import Admission

    admission = Admission.of(specs[0], get_settings()) if specs else None
    if admission is None or transport_for(broker).keda is None:  # keda: a fleet's broker, reachable by others
        return
    for line in admission.warnings():
        err.print(f"[bold red]warning:[/] {line}", highlight=False)


def _child_plans(specs: list, tp: int) -> list[dict]:
    """`worker --plan`: each child's pinning and queues; with --tp, per group."""
    def child_plan(spec) -> dict:
        # Without --queues the worker would consume the queues it discovers.
        return {**spec.plan(), "queues": spec.queues or "discovered"}

    if tp == 1:
        return [child_plan(spec) for spec in specs]
    from diffq.worker.api import sharding_plan

    groups = [specs[i:i + tp] for i in range(0, len(specs), tp)]
    return [{
        "group": ranks[0].group,
        "world_size": tp,
        "devices": ranks[0].group_slots,
        "master": f"{ranks[0].master_addr}:{ranks[0].master_port}",
        "sharding": dataclasses.asdict(sharding_plan(ranks[0].backend, tp)),
        "ranks": [child_plan(spec) for spec in ranks],
    } for ranks in groups]

@app.command()
def status(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (with --watch: one line per refresh)")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Live progress until nothing is pending (Ctrl-C to stop)")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes with --watch")] = 2.0,
    by_adapter: Annotated[bool, typer.Option("--by-adapter", help="Also done / failed / pending per LoRA adapter set (its short digest, adapters and scales), from the progress summary; a run submitted before sets were listed falls back to its image records")] = False,
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
        st = run_status(out_dir, by_adapter=by_adapter)
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
    if st.feed:
        out.print(f"batches: {st.feed.in_broker} in the broker (about), {st.feed.in_out} in OUT for the feeder"
                  + (": waiting for a feeder (none live; `diffq resume OUT` publishes them)"
                     if st.feed.waiting_for_feeder else ""), markup=False, highlight=False, soft_wrap=True)
    if st.trouble:
        out.print(st.trouble, style="bold yellow", markup=False, highlight=False)
    if st.adapter_sets is not None:
        from diffq.results.by_adapter import set_lines

        out.print("\n".join(["", "by adapter set", *set_lines(st.adapter_sets)]), markup=False, highlight=False,
                  soft_wrap=True)
    if st.adapter_note:
        out.print(st.adapter_note, markup=False, highlight=False, soft_wrap=True)
    if st.by_adapter is not None:
        _print_by_adapter(st.by_adapter)


def _print_by_adapter(by_adapter) -> None:
    table = Table(title="by adapter set")
    for column in ("adapters (path@scale (revision))", "mode", "images", "batches", "img/s", "swap_s"):
        table.add_column(column, justify="left" if column.startswith(("adapters", "mode")) else "right")
    for group in by_adapter.rows():
        table.add_row(group.label, group.mode, str(group.images), str(group.batches), f"{group.images_per_s:.2f}",
                      f"{group.swap_s:.3f}")
    out.print(table)
    for worker, (changed, batches) in sorted(by_adapter.changes.items()):
        out.print(f"{worker}: {changed} adapter set change(s) over {batches} batch(es)", markup=False,
                  highlight=False, soft_wrap=True)
    for queue, graphs in sorted(by_adapter.graphs.items()):
        out.print(f"{queue}: {graphs.compiled} graph(s) compiled, {graphs.steady} after a worker's first batch"
                  + (" (a steady-state recompile)" if graphs.steady else ""), markup=False, highlight=False,
                  soft_wrap=True)


@app.command()
def fetch(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    dest: Annotated[Path, typer.Argument(help="Local folder (HF imagefolder layout)")],
    only_new: Annotated[bool, typer.Option("--only-new", help="Fetch only items not yet in DEST/metadata.jsonl (no size checks)")] = False,
    shard: data.ShardOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Download finished images and write DEST/metadata.jsonl (loadable as an HF imagefolder).

    Resumable: a second call fetches only what is missing.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from diffq.core.runfolder import NotARun
    from diffq.results.fetch import fetch as fetch_run

    part = data.parse_shard(shard)
    bar = Progress(TextColumn("[bold]fetch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err, disable=not progress, transient=True)
    task = bar.add_task("fetch", total=None)
    try:
        with bar:
            result = fetch_run(out_dir, dest, only_new=only_new, shard=part,
                               on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    except (NotARun, ValueError) as exc:
        fail(str(exc))
    out.print(f"{result.images} images in {result.dest} ({result.downloaded} downloaded)"
              f"{data.shard_note(part, result.run_images)}")



def _requeue(kind: str, out_dir: str, broker: str | None, window: str = AUTO,
             feeds: str | None = None) -> None:
    from diffq.producer import resume as requeue
    from diffq.core.runfolder import NotARun

    broker = broker or get_settings().broker_url
    if not broker:
        fail("no broker: pass --broker URL or set DIFFQ_BROKER_URL")
    try:
        result = getattr(requeue, kind)(out_dir, broker, window=parse_window(window), feeds=feeds)
    except (NotARun, requeue.RunCancelled, requeue.PlanIncomplete, ValueError) as exc:
        fail(str(exc))
    out.print(f"{result.out}: re-enqueued {result.items} items in {result.batches} batches")
    _say_feeder(result.unpublished, result.out, result.feeds)


@app.command()
@local_worker_options()
def resume(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    broker: Broker = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar (without a broker)")] = True,
    window: Window = AUTO,
    feeds: Feeds = None,
    local: LocalWorkers = None,
) -> None:
    """Finish a run from what OUT holds (never the broker): the items neither done nor failed.

    With --broker (or DIFFQ_BROKER_URL) they are re-enqueued for a fleet; without one they are
    produced here as `diffq run` does (embedded broker, local workers), and it waits."""
    from diffq.app.runner import RunFailed, resume as resume_embedded
    from diffq.core.runfolder import NotARun
    from diffq.producer.resume import PlanIncomplete
    from diffq.worker.api import ModelUnavailable

    if broker or get_settings().broker_url:
        if given := local.given():
            fail(f"{', '.join(given)}: options of local workers, which a resume with a broker does not start "
                 "(the fleet's workers serve what it re-enqueues)")
        _requeue("resume", out_dir, broker, window, feeds)
        return
    if given := [name for name, set_ in (("--window", window != AUTO), ("--feeds", feeds)) if set_]:
        fail(f"{', '.join(given)}: options of a resume with a broker (a fleet's feeder); without one the local "
             "workers are fed here, as `diffq run` feeds its own")
    try:
        result = resume_embedded(out_dir, progress=progress, console=err, **local.kwargs())
    except (NotARun, PlanIncomplete, ModelUnavailable, RunFailed, ValueError) as exc:
        fail(str(exc))
    out.print(result.out)
    out.print(result.summary())
    if not result.ok:
        raise typer.Exit(1)


@app.command("retry-failed")
def retry_failed(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    broker: Broker = None,
    window: Window = AUTO,
    feeds: Feeds = None,
) -> None:
    """Re-enqueue the items that failed after every retry (a window at once, as submit)."""
    _requeue("retry_failed", out_dir, broker, window, feeds)


# The other command groups, each adding its commands to `app`.
for group in (fleet, data, plan, qualify, cancel):
    group.register(app)

if __name__ == "__main__":
    app()
