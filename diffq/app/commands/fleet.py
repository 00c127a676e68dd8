"""`diffq fleet manifests` and `diffq queues`: fleet operations on the command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from diffq.core.profile import lora_mode_and_profile
from diffq.core.settings import get_settings
from diffq.app.choices import CompileMode, Device, Dtype
from diffq.app.options import DEFAULT_LORA_MODE, Feeds, LoraModeOpt, generation_option
from diffq.core.options import DEFAULTS, GenerationOptions

# The generation options that name a shape's queue, as `diffq submit` was given them
# (core/options.py: their bounds and defaults).
BatchSize = generation_option("batch_size", note="Images per compiled batch (as given to submit)")
SequenceLength = generation_option("max_sequence_length", note="Text tokens per prompt (as given to submit)")
GuidanceScale = generation_option("guidance_scale", note="> 1 means CFG queues")

fleet_app = typer.Typer(no_args_is_help=True, help="Render Kubernetes manifests for a worker fleet.")


def manifests(
    model: Annotated[str, typer.Option("--model", "-m", help="Model the workers load (the producer's --model)")],
    shapes: Annotated[str, typer.Option("--shapes", help="HEIGHTxWIDTH list: 1024x1024,768x1344")],
    batch_size: BatchSize = DEFAULTS.batch_size,
    device: Annotated[Device, typer.Option("--device", help="Device kind, from the backend table")] = Device("neuron"),
    max_sequence_length: SequenceLength = DEFAULTS.max_sequence_length,
    guidance_scale: GuidanceScale = DEFAULTS.guidance_scale,
    dtype: Annotated[Dtype, typer.Option("--dtype", help="Pipeline dtype, as `diffq submit` was given it: auto (each worker runs its device's default) or a pinned dtype")] = Dtype(DEFAULTS.dtype),
    image: Annotated[Optional[str], typer.Option("--image", help="Worker image (default ghcr.io/diffq/diffq-<device>)")] = None,
    namespace: Annotated[str, typer.Option("--namespace")] = "diffq",
    devices_per_pod: Annotated[Optional[int], typer.Option("--devices-per-pod", min=1, help="Cores / chips / GPUs per pod")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree: each pod's devices form groups of N ranks (see `diffq worker --tp`)")] = 1,
    max_replicas: Annotated[int, typer.Option("--max-replicas", min=1)] = 8,
    batches_per_replica: Annotated[int, typer.Option("--batches-per-replica", min=1, help="KEDA listLength target")] = 4,
    redis_db: Annotated[int, typer.Option("--redis-db", min=0, help="Redis database index of the broker")] = 0,
    grace_seconds: Annotated[Optional[int], typer.Option("--grace-seconds", min=1, help="Longer than a batch plus a first compile")] = None,
    compile: Annotated[Optional[CompileMode], typer.Option("--compile", help="As the device offers it (default: the device's pod default)")] = None,
    storage_class: Annotated[str, typer.Option("--storage-class", help="ReadWriteMany class for the cache PVC (efs-sc on EKS, standard-rwx on GKE)")] = "efs-sc",
    broker: Annotated[Optional[str], typer.Option("--broker", help="The fleet's broker URL (or DIFFQ_BROKER_URL; default redis://): picks KEDA's scaler and the credentials pods read")] = None,
    broker_option: Annotated[Optional[list[str]], typer.Option("--broker-option", help="A kombu transport option of the broker, KEY=VALUE (repeat): master_name=NAME for sentinel:// brokers (KEDA's sentinelMaster), ssl=true for TLS without a TLS scheme")] = None,
    aws_region: Annotated[Optional[str], typer.Option("--aws-region", help="SQS brokers: the queues' region (default AWS_REGION, else us-east-1)")] = None,
    fleet_plan: Annotated[Optional[Path], typer.Option("--fleet-plan", help="`diffq plan … --rates FILE --deadline 6h --json` output: each pool's maxReplicaCount is the pods the plan needs for its queues (instead of --max-replicas)")] = None,
    out_prefix: Annotated[Optional[list[str]], typer.Option("--out-prefix", help="Run folders the workers may write to: the prefix `diffq submit --out` folders live under (s3://BUCKET/runs, gs://BUCKET/runs or an absolute path; repeat or comma-separate). Default: DIFFQ_ALLOWED_OUT_PREFIXES; with neither, refused unless --any-out")] = None,
    any_out: Annotated[bool, typer.Option("--any-out", help="Render no prefix: the workers write into whatever run folder a batch names")] = False,
    allowed_adapters: Annotated[Optional[list[str]], typer.Option("--allowed-adapters", help="LoRA adapters the workers may load: a prefix (s3://BUCKET/loras, gs://…, an absolute path, a Hub org; repeat or comma-separate), rendered as DIFFQ_ALLOWED_ADAPTERS. Default: DIFFQ_ALLOWED_ADAPTERS where set, else any adapter a batch names")] = None,
    lora_mode: LoraModeOpt = DEFAULT_LORA_MODE,
    model_cache_gib: Annotated[int, typer.Option("--model-cache-gib", min=1, help="Pools of s3:// / gs:// models: the size of each pod's node-local model cache (an emptyDir on the node's disk)")] = 200,
    out: Annotated[Optional[str], typer.Option("--out", help="Write <name>.yaml per shape here instead of stdout")] = None,
    feeds: Feeds = None,
    monitoring: Annotated[bool, typer.Option("--monitoring", help="Also render the Prometheus Operator's PodMonitor (every worker process and the backlog service), a PrometheusRule of alerts and a Grafana dashboard ConfigMap (kube-prometheus-stack)")] = False,
    alert: Annotated[Optional[list[str]], typer.Option("--alert", help="With --monitoring: an alert's threshold, window or wait (its `for`), NAME=VALUE (repeat), e.g. stall_minutes=45, failure_ratio=0.1 (a ratio in [0, 1]); docs/fleet.md lists them, their kinds and defaults")] = None,
    runbook_url: Annotated[Optional[str], typer.Option("--runbook-url", help="With --monitoring: the runbook page (your copy of docs/fleet.md, rendered): each alert's runbook_url is BASE#<its name, lower case>. Default: none")] = None,
    price_per_device_hour: Annotated[Optional[float], typer.Option("--price-per-device-hour", min=0.0, help="With --monitoring: the dashboard's cost per 1,000 images (else device-hours per 1,000 images)")] = None,
    monitoring_release: Annotated[str, typer.Option("--monitoring-release", help="With --monitoring: the `release` label kube-prometheus-stack's Prometheus selects monitors and rules by")] = "kube-prometheus-stack",
) -> None:
    """Worker Deployments + KEDA ScaledObjects from the producer's shape keys (per shape,
    or per model where workers discover their queues), the shared cache PVC, KEDA's
    broker TriggerAuthentication, and for discovery pools the backlog service. Each worker
    writes only under --out-prefix and loads only --model; batches are signed with the
    optional diffq-signing Secret's key."""
    from diffq.app import fleet

    try:
        settings = get_settings()
        # An explicit --any-out is not overridden by the setting's default.
        prefixes = out_prefix if out_prefix or any_out else settings.allowed_out_prefixes
        options = fleet.FleetOptions(device=device.value, image=image, namespace=namespace,
                                     devices_per_pod=devices_per_pod, max_replicas=max_replicas,
                                     batches_per_replica=batches_per_replica, redis_db=redis_db,
                                     grace_seconds=grace_seconds, compile=compile.value if compile else None,
                                     storage_class=storage_class, tp=tp, model_cache_gib=model_cache_gib,
                                     broker=broker or settings.broker_url or "redis://",
                                     broker_options=fleet.parse_broker_options(broker_option or []),
                                     out_prefixes=fleet.parse_out_prefixes(prefixes or []), any_out=any_out,
                                     allowed_adapters=tuple(p.strip() for value in (allowed_adapters or
                                                                                    settings.allowed_adapters)
                                                            for p in value.split(",") if p.strip()),
                                     feeds=feeds or settings.feeds,
                                     **dict(zip(("lora_mode", "lora_profile"), lora_mode_and_profile(lora_mode))),
                                     aws_region=aws_region or os.environ.get("AWS_REGION")
                                     or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        if fleet_plan is not None:
            try:
                options.planned_devices = fleet.planned_devices(json.loads(fleet_plan.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--fleet-plan {fleet_plan}: {exc}") from None
        keys = fleet.shape_keys(model, fleet.parse_shapes(shapes), GenerationOptions.of(
            batch_size=batch_size, max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
            dtype=dtype.value))
        rendered = fleet.render(keys, options)
        if monitoring:
            from diffq.app import monitoring as monitors

            monitors.attach(rendered, options, monitors.MonitoringOptions(
                thresholds=monitors.parse_thresholds(alert or []), release=monitoring_release,
                price_per_device_hour=price_per_device_hour, runbook_url=monitors.check_runbook_url(runbook_url)))
        elif alert or price_per_device_hour is not None or runbook_url is not None:
            raise ValueError("--alert, --runbook-url and --price-per-device-hour shape what --monitoring renders: "
                             "add --monitoring")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    header = fleet.header(options)
    if any_out:
        typer.echo("warning: --any-out: the workers write into whatever run folder a batch names", err=True)
    for warning in options.lora_warnings(len(keys), sorted({key.model for key in keys})):
        typer.echo(f"warning: {warning}", err=True)
    if out:
        for path in fleet.write(rendered, out, header):
            typer.echo(str(path))
    else:
        sys.stdout.write(fleet.dump([doc for docs in rendered.values() for doc in docs], header))


def queues(
    broker: Annotated[Optional[str], typer.Option("--broker", help="Broker URL (or DIFFQ_BROKER_URL)")] = None,
    names: Annotated[Optional[str], typer.Option("--queues", "-Q", help="Also report these queues (needed on AMQP without --rabbitmq-api, which cannot list queues)")] = None,
    rabbitmq_api: Annotated[Optional[str], typer.Option("--rabbitmq-api", help="RabbitMQ management API URL (http://USER:PASS@HOST:15672): lists an AMQP broker's queues")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.0, help="Seconds to wait for workers' replies (0: skip)")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    out_prefix: Annotated[Optional[list[str]], typer.Option("--out-prefix", help="Run-folder prefixes a fleet's feeder serves (as `fleet manifests --out-prefix`; default DIFFQ_ALLOWED_OUT_PREFIXES): its runs' batches in OUT are counted")] = None,
    feeds: Feeds = None,
) -> None:
    """Depth of each diffq shape queue, how many workers consume it, and (with an out-prefix
    or a feeds folder) the batches windowed runs still hold in OUT for the feeder, per queue and per run
    (--json: each queue's row lists its runs' counts)."""
    from diffq.app.queues import DEAD_LETTERS, PEEKED_LETTERS, dead_letter_lines, queue_report, with_runs
    from diffq.core.brokers.base import UNREACHABLE, CannotList

    broker = broker or get_settings().broker_url
    if not broker:
        typer.echo("error: no broker: pass --broker URL or set DIFFQ_BROKER_URL", err=True)
        raise typer.Exit(2)
    try:
        folders = _feeds_folders(out_prefix, feeds)
        unpublished, runs = None, []
        if folders:
            from diffq.producer.feed import waiting, waiting_runs

            unpublished = {}
            for folder in folders:
                for queue, n in waiting(folder).items():
                    unpublished[queue] = unpublished.get(queue, 0) + n
            runs = waiting_runs(folders)
        named = [q for q in (names or "").split(",") if q] + [q for _, counts in runs for q in counts.per_queue]
        report = queue_report(broker, list(dict.fromkeys(named)), timeout=timeout,
                              rabbitmq_api=rabbitmq_api, letters=PEEKED_LETTERS, unpublished=unpublished)
        with_runs(report, runs)
    except (CannotList, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except UNREACHABLE as exc:
        typer.echo(f"error: broker unreachable: {exc}", err=True)
        raise typer.Exit(1)
    if as_json:
        sys.stdout.write(json.dumps([info.to_json() for info in report]) + "\n")
        return
    width = max([len("queue")] + [len(info.queue) for info in report])
    in_out = f"  {'in OUT':>7}" if unpublished is not None else ""
    typer.echo(f"{'queue':<{width}}  {'depth':>7}  {'workers':>7}{in_out}")
    for info in report:
        note = "  (dead letters: messages workers refused)" if info.queue == DEAD_LETTERS else ""
        waiting_here = f"  {info.unpublished:>7}" if unpublished is not None else ""
        typer.echo(f"{info.queue:<{width}}  {info.depth:>7}  {info.consumers:>7}{waiting_here}{note}")
    for line in dead_letter_lines(report):
        typer.echo(line)
    for entry, counts in runs:
        typer.echo(f"run {entry.run_id} ({entry.out}): {counts.in_broker} batches in the broker (about), "
                   f"{counts.in_out} in OUT for the feeder" + (": waiting for a feeder" if counts.waiting_for_feeder
                                                              else ""))


def _feeds_folders(out_prefix: list[str] | None, feeds: str | None) -> list[str]:
    """The feeds folders under the out-prefixes (else DIFFQ_ALLOWED_OUT_PREFIXES) and the feeds folder."""
    from diffq.app.fleet import parse_out_prefixes
    from diffq.core.feeds import feeds_under

    settings = get_settings()
    prefixes = parse_out_prefixes(out_prefix or list(settings.allowed_out_prefixes))
    folders = [feeds_under(prefix) for prefix in prefixes]
    return folders + ([feeds or settings.feeds] if feeds or settings.feeds else [])


def backlog(
    broker: Annotated[Optional[str], typer.Option("--broker", help="Broker URL (or DIFFQ_BROKER_URL)")] = None,
    rabbitmq_api: Annotated[Optional[str], typer.Option("--rabbitmq-api", help="RabbitMQ management API URL (or DIFFQ_RABBITMQ_API): how an AMQP broker's queues are listed")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on")] = "0.0.0.0",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: a free one)")] = 9500,
    out_prefix: Annotated[Optional[list[str]], typer.Option("--out-prefix", help="Run-folder prefixes whose runs this service feeds (repeat or comma-separate; default DIFFQ_ALLOWED_OUT_PREFIXES): it keeps a feeds folder and a heartbeat under each (PREFIX/.diffq-feeds), where `diffq submit --out PREFIX/...` finds it")] = None,
    feeds: Feeds = None,
) -> None:
    """Serve each model's backlog over all its shape queues (GET /backlog?model=M, ?queue=Q) for
    KEDA's metrics-api scaler: queued batches plus those windowed runs still hold in OUT, which
    this service publishes as their windows drain (the fleet's feeder, given --out-prefix or --feeds)."""
    import threading

    from diffq.app.backlog import Backlog, model_backlogs, serve
    from diffq.producer.feed import Feeder
    from diffq.producer.publish import CeleryPublisher

    settings = get_settings()
    broker = broker or settings.broker_url
    if not broker:
        typer.echo("error: no broker: pass --broker URL or set DIFFQ_BROKER_URL", err=True)
        raise typer.Exit(2)
    api = rabbitmq_api or settings.rabbitmq_api
    try:
        folders = _feeds_folders(out_prefix, feeds)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    stop = threading.Event()
    feeder = None
    if folders:
        feeder = Feeder(CeleryPublisher(broker), folders)
        threading.Thread(target=feeder.serve, args=(stop,), name="diffq-feeder", daemon=True).start()
    from diffq.app.queues import queue_report
    from diffq.app.run_metrics import RunMetrics, registry

    run_metrics = RunMetrics(feeder.runs if feeder else list, feeder=feeder, queues=lambda: queue_report(
        broker, timeout=0, rabbitmq_api=api, unpublished=feeder.unpublished() if feeder else None))
    server = serve(Backlog(lambda: model_backlogs(broker, api, feeder.unpublished() if feeder else None),
                           runs=feeder.runs_fed if feeder else None),
                   host, port, metrics=registry(run_metrics))
    typer.echo(f"backlog on http://{host}:{server.server_address[1]}/backlog"
               + (f", feeding the runs listed in {', '.join(folders)}" if folders else ""), err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()


def register(app: typer.Typer) -> None:
    fleet_app.command("manifests")(manifests)
    fleet_app.command("backlog")(backlog)
    app.add_typer(fleet_app, name="fleet")
    app.command("queues")(queues)
