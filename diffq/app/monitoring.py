"""What `fleet manifests --monitoring` renders beside the fleet, for the Prometheus
Operator (kube-prometheus-stack): a PodMonitor for the workers and the backlog
service, a PrometheusRule of alerts, and a Grafana dashboard in a ConfigMap its
sidecar loads.

The alerts are a table (`ALERTS`): each says what it watches in PromQL, how loud it
is (`severity`, the monitoring-mixins convention) and the `diffq` command that shows
more (its `runbook` annotation). Their thresholds are `Thresholds`, one field each,
set with `--alert NAME=VALUE`. Every metric a rule or a panel names is one diffq
exports (worker/observe/metrics.py per worker process, diffq/app/run_metrics.py on
the backlog service) or one of `STANDARD_METRICS`; tests/test_monitoring.py scrapes
real processes to hold that true.

Each worker process serves its own /metrics on DIFFQ_METRICS_PORT + its place in the
pod (worker/process/child.py): a pod of n processes gets n named ports, and the
PodMonitor scrapes each by name. The dashboard is built with grafana-foundation-sdk
(pinned to its Grafana 11.6 build), not written as JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields

from diffq.app.backlog import PORT as BACKLOG_PORT

# What the rules and panels may name beside diffq's own metrics: Prometheus' own
# `up` and kube-state-metrics' container restarts (kube-prometheus-stack ships both).
STANDARD_METRICS = ("up", "kube_pod_container_status_restarts_total")
# Labels the PodMonitor's targets add to every series (the operator's, and `pool`).
TARGET_LABELS = ("namespace", "pod", "container", "endpoint", "job", "instance", "pool")
# kube-prometheus-stack's defaults: its Prometheus selects monitors and rules by the
# Helm release label; its Grafana sidecar loads ConfigMaps labelled grafana_dashboard.
RELEASE = "kube-prometheus-stack"
DASHBOARD_LABEL = ("grafana_dashboard", "1")
DASHBOARD_UID = "diffq-fleet"
DASHBOARD_FILE = "diffq-dashboard.json"
RUNBOOK = "https://github.com/diffq/diffq/blob/main/docs/fleet.md#monitoring"
WORKER_PORT = "metrics-{}"
SCRAPE_INTERVAL = "30s"


@dataclass(frozen=True)
class Thresholds:
    """Each alert's threshold (`--alert NAME=VALUE`); docs/fleet.md says why each default."""

    # No item done or failed for this long while items are pending and workers run: a
    # first Neuron compile of a large model takes up to ~20 min, so 30 leaves room.
    stall_minutes: float = 30
    # Items failing after every retry, over items finished, per queue over 15 min.
    failure_ratio: float = 0.05
    # Container (kube-state-metrics) or worker-process (supervisor) restarts in 30 min.
    restarts: float = 3
    # Batches the broker gave back (lost holders) per hour: one lost 8-process pod
    # returns up to 16 (one held plus one run ahead each); more is more than one host.
    returned_per_hour: float = 20
    # Devices below this busy ratio (or none at all) while batches wait, for idle_minutes:
    # a cold pod's model fetch and first compile keep its device idle up to ~20 min.
    busy_ratio: float = 0.2
    idle_minutes: float = 30
    # A worker life's start to its first image, p90 over an hour: past a first compile.
    ttfi_p90_seconds: float = 1200
    # Degenerate images (NaN, flat) over images generated, per queue over 30 min.
    degenerate_ratio: float = 0.01
    # Stores failing for this long (the sinks retry without end; storage is down or full).
    storage_minutes: float = 10
    # The feeder's last pass older than this while windowed runs wait in OUT (it passes
    # every few seconds).
    feeder_minutes: float = 5


def parse_thresholds(values: list[str] | tuple[str, ...]) -> Thresholds:
    """`--alert NAME=VALUE` values -> Thresholds; a bad one names the valid names."""
    names = [f.name for f in fields(Thresholds)]
    given: dict[str, float] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in names:
            raise ValueError(f"--alert {item!r}: expected NAME=VALUE with NAME one of {', '.join(names)}")
        try:
            given[name] = float(value)
        except ValueError:
            raise ValueError(f"--alert {item!r}: {value!r} is not a number") from None
        if given[name] < 0:
            raise ValueError(f"--alert {item!r}: a threshold is not negative")
    return Thresholds(**given)


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    for_: str  # how long the condition holds before it fires ("0m": at once)
    expr: str  # with {ns} (the namespace matcher) and the thresholds' fields to fill in
    summary: str
    description: str
    command: str  # the diffq command that shows more

    def rule(self, namespace: str, thresholds: Thresholds) -> dict:
        values = {f.name: _number(getattr(thresholds, f.name)) for f in fields(Thresholds)}
        values |= {f"{name}_s": _number(round(getattr(thresholds, f"{name}_minutes") * 60))
                   for name in ("stall", "feeder", "idle", "storage")}
        values["ns"] = f'namespace="{namespace}"'
        return {"alert": self.name,
                "expr": " ".join(_fill(self.expr, values).split()),
                "for": _fill(self.for_, values),
                "labels": {"severity": self.severity},
                "annotations": {"summary": _fill(self.summary, values),
                                "description": _fill(self.description, values),
                                "runbook": f"Run `{self.command}` to see more.",
                                "runbook_url": RUNBOOK}}


def _fill(text: str, values: dict[str, str]) -> str:
    """`{name}` -> its value; anything else, Prometheus' `{{ $labels.x }}` and PromQL's
    `{label="v"}`, stays as written."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def _number(value: float) -> str:
    return f"{value:g}"


ALERTS: tuple[Alert, ...] = (
    Alert("DiffqRunStalled", "critical", "5m",
          """max by (namespace, run, out) (diffq_run_items{{ns}, state="pending"}) > 0
             and on (namespace, run, out) (time() - diffq_run_last_progress_timestamp_seconds{{ns}}) > {stall_s}
             and on (namespace) (count by (namespace) (diffq_device_busy_ratio{{ns}}) > 0)""",
          "Run {{ $labels.run }} has made no progress for {stall_minutes} minutes",
          "Items of {{ $labels.out }} are pending and workers run, but none was done or failed for "
          "{stall_minutes} minutes: its batches may be on queues no worker serves, or the workers stuck.",
          "diffq status {{ $labels.out }}"),
    Alert("DiffqDeadLettersGrowing", "warning", "0m",
          """delta(diffq_dead_letters_queued{{ns}}[15m]) > 0""",
          "Dead letters are growing",
          "Workers refused messages in the last 15 minutes (more dead letters in diffq.dead): unsigned, "
          "for another run or model, or not diffq batches.",
          "diffq queues"),
    Alert("DiffqItemsFailing", "warning", "10m",
          """sum by (namespace, queue) (rate(diffq_failures_total{{ns}}[15m]))
             / (sum by (namespace, queue) (rate(diffq_images_total{{ns}}[15m]))
                + sum by (namespace, queue) (rate(diffq_failures_total{{ns}}[15m]))) > {failure_ratio}""",
          "Items of {{ $labels.queue }} fail after every retry",
          "More than {failure_ratio} of the items finished on {{ $labels.queue }} failed after every retry "
          "(failure records in OUT/failures).",
          "diffq report OUT"),
    Alert("DiffqWorkerRestarting", "warning", "0m",
          """max by (namespace, pod) (increase(kube_pod_container_status_restarts_total{{ns},
                 container=~"worker|backlog"}[30m])) >= {restarts}
             or max by (namespace, pod) (delta(diffq_worker_restarts{{ns}}[30m])) >= {restarts}""",
          "{{ $labels.pod }} is restarting",
          "The pod's container or one of its worker processes restarted {restarts} times or more in 30 minutes "
          "(crash-looping: an out-of-memory, a device fault, a bad model).",
          "diffq report OUT"),
    Alert("DiffqBatchesReturned", "warning", "0m",
          """sum by (namespace) (increase(diffq_redeliveries_total{{ns}}[1h])) > {returned_per_hour}
             or sum by (namespace) (increase(diffq_lease_lapses_total{{ns}}[1h])) > 0""",
          "Batches are coming back from lost holders",
          "More than {returned_per_hour} batches an hour came back from holders that lost them (lost hosts, "
          "lapsed leases), or a worker held one past DIFFQ_MAX_HOLD_S: their work is done twice.",
          "diffq queues"),
    Alert("DiffqDevicesIdleWithBacklog", "critical", "{idle_s}s",
          """sum by (namespace) (diffq_queue_batches{{ns}}) > 0
             unless on (namespace) (avg by (namespace) (diffq_device_busy_ratio{{ns}}) >= {busy_ratio})""",
          "Batches wait but the devices are idle",
          "Batches are queued or waiting in OUT, yet the workers' devices are busy less than {busy_ratio} of the "
          "time (or no worker runs) for {idle_minutes} minutes: the autoscaler or the scheduler is stuck.",
          "diffq queues"),
    Alert("DiffqTimeToFirstImageSlow", "warning", "0m",
          """histogram_quantile(0.9, sum by (namespace, le)
               (rate(diffq_time_to_first_image_seconds_bucket{{ns}}[1h]))) > {ttfi_p90_seconds}""",
          "New workers take long to their first image",
          "The p90 of a worker life's start to its first stored image is over {ttfi_p90_seconds} s: a cold "
          "compile cache or slow model fetches.",
          "diffq report OUT"),
    Alert("DiffqRecompiles", "warning", "0m",
          """sum by (namespace, shape) (increase(diffq_recompiles_total{{ns}}[15m])) > 0""",
          "Shape {{ $labels.shape }} compiled again",
          "A worker compiled a graph for a shape it already served: in steady state every compile is minutes "
          "of a device lost (on Neuron and TPU).",
          "diffq report OUT"),
    Alert("DiffqGraphFallbacks", "warning", "0m",
          """sum by (namespace, shape) (increase(diffq_graph_fallbacks_total{{ns}}[15m])) > 0""",
          "Shape {{ $labels.shape }} runs uncompiled",
          "Compiled-graph calls failed on the device and re-ran op by op (--allow-fallback): the slow path.",
          "diffq report OUT"),
    Alert("DiffqStorageFailing", "critical", "{storage_s}s",
          """sum by (namespace) (rate(diffq_upload_failures_total{{ns}}[5m])) > 0""",
          "Storing images fails",
          "Workers' stores into run folders have kept failing for {storage_minutes} minutes (storage down, "
          "full or denied): the batches wait on the workers.",
          "diffq status OUT"),
    Alert("DiffqDegenerateImages", "warning", "15m",
          """sum by (namespace, queue) (rate(diffq_degenerate_images_total{{ns}}[30m]))
             / sum by (namespace, queue) (rate(diffq_images_total{{ns}}[30m])) > {degenerate_ratio}""",
          "Degenerate images on {{ $labels.queue }}",
          "More than {degenerate_ratio} of the images of {{ $labels.queue }} are degenerate (NaN or one flat "
          "colour): a dtype the model does not hold, or a broken device.",
          "diffq report OUT"),
    Alert("DiffqFeederNotRunning", "critical", "0m",
          """sum by (namespace) (diffq_run_batches_waiting{{ns}}) > 0
             unless on (namespace) (time() - max by (namespace)
                                     (diffq_feeder_last_pass_timestamp_seconds{{ns}}) < {feeder_s})""",
          "Windowed runs wait for a feeder that does not run",
          "Batches of windowed runs wait in OUT but the feeder has not passed for {feeder_minutes} minutes: "
          "nothing publishes them.",
          "diffq queues --feeds FEEDS"),
    Alert("DiffqBacklogServiceDown", "critical", "5m",
          """absent(up{{ns}, container="backlog"} == 1)""",
          "The backlog service is down",
          "Prometheus cannot scrape diffq-backlog: KEDA's backlog triggers have no value, the feeder does not "
          "run, and the run metrics are gone.",
          "diffq queues"),
)


@dataclass(frozen=True)
class MonitoringOptions:
    thresholds: Thresholds = Thresholds()
    # Prometheus selects monitors and rules by this label (kube-prometheus-stack's release).
    release: str = RELEASE
    price_per_device_hour: float | None = None


def worker_processes(devices_per_pod: int) -> int:
    """Worker processes a pod runs: one per device (a TP group's ranks each serve too)."""
    return devices_per_pod


def worker_ports(n: int, base: int) -> list[dict]:
    return [{"name": WORKER_PORT.format(i), "containerPort": base + i} for i in range(n)]


def pod_monitor(namespace: str, processes: int, backlog: str, options: MonitoringOptions) -> dict:
    """One PodMonitor: every worker process's named port, and the backlog service's."""
    endpoints = [{"port": WORKER_PORT.format(i), "path": "/metrics", "interval": SCRAPE_INTERVAL,
                  "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
                                   "targetLabel": "pool"}]}
                 for i in range(processes)]
    endpoints.append({"port": "http", "path": "/metrics", "interval": SCRAPE_INTERVAL})
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": "diffq", "namespace": namespace, "labels": {"release": options.release}},
            "spec": {"selector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                                         "values": ["diffq-worker", backlog]}]},
                     "podMetricsEndpoints": endpoints}}


def rule_groups(namespace: str, thresholds: Thresholds) -> list[dict]:
    return [{"name": "diffq", "rules": [alert.rule(namespace, thresholds) for alert in ALERTS]}]


def prometheus_rule(namespace: str, options: MonitoringOptions) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "diffq", "namespace": namespace, "labels": {"release": options.release}},
            "spec": {"groups": rule_groups(namespace, options.thresholds)}}


def dashboard_config_map(namespace: str, options: MonitoringOptions) -> dict:
    key, value = DASHBOARD_LABEL
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "diffq-dashboard", "namespace": namespace, "labels": {key: value}},
            "data": {DASHBOARD_FILE: dashboard_json(namespace, options.price_per_device_hour)}}


def render(namespace: str, processes: int, backlog: str, options: MonitoringOptions) -> list[dict]:
    """The PodMonitor, the PrometheusRule and the dashboard's ConfigMap."""
    return [pod_monitor(namespace, processes, backlog, options), prometheus_rule(namespace, options),
            dashboard_config_map(namespace, options)]


def attach(rendered: dict[str, list[dict]], fleet_options, options: MonitoringOptions) -> None:
    """Add monitoring to a rendered fleet (diffq/app/fleet.py `render`), in place: each
    worker pod's ports one per process, the backlog service wherever it is not yet
    (its /metrics carries the run-level metrics), and the `monitoring` file."""
    from diffq.app import fleet

    processes = worker_processes(fleet_options.devices_per_pod or fleet_options.profile.devices_per_pod)
    for documents in rendered.values():
        for doc in documents:
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] != fleet.BACKLOG:
                container = doc["spec"]["template"]["spec"]["containers"][0]
                container["ports"] = worker_ports(processes, fleet.METRICS_PORT)
    if not any(doc["metadata"]["name"] == fleet.BACKLOG for doc in rendered["common"]):
        rendered["common"] += fleet.backlog_service(fleet_options)
    rendered["monitoring"] = render(fleet_options.namespace, processes, fleet.BACKLOG, options)


# The dashboard: (title, unit, [(legend, PromQL)]) per panel, {ns} the namespace matcher.
def _panels(price: float | None) -> list[tuple[str, str, list[tuple[str, str]]]]:
    # A device is a worker process (one per device, a TP group's followers included);
    # without a price, device-hours.
    cost = ("USD per 1,000 images" if price is not None else "device-hours per 1,000 images",
            """{price} * count by (namespace) (process_start_time_seconds{{ns}, container="worker"})
               / (sum by (namespace) (rate(diffq_images_total{{ns}}[15m])) * 3600) * 1000""")
    return [
        ("Images per second by pool and shape", "short",
         [("{{pool}} {{queue}}", "sum by (pool, queue) (rate(diffq_images_total{{ns}}[5m]))")]),
        ("Backlog: batches queued and waiting in OUT", "short",
         [("{{queue}} {{where}}", "sum by (queue, where) (diffq_queue_batches{{ns}})")]),
        ("Items pending per run", "short",
         [("{{run}}", 'sum by (run) (diffq_run_items{{ns}, state="pending"})')]),
        ("ETA of the pending items", "s",
         [("{{namespace}}", """sum by (namespace) (diffq_run_items{{ns}, state="pending"})
            / sum by (namespace) (rate(diffq_images_total{{ns}}[15m]))""")]),
        ("Time to first image", "s",
         [(f"p{q}", f"histogram_quantile(0.{q}, sum by (le) "
                    "(rate(diffq_time_to_first_image_seconds_bucket{{ns}}[1h])))") for q in (50, 90)]),
        ("Device busy ratio by pool", "percentunit",
         [("{{pool}}", "avg by (pool) (diffq_device_busy_ratio{{ns}})")]),
        ("Failures and dead letters", "short",
         [("failed items/s {{queue}}", "sum by (queue) (rate(diffq_failures_total{{ns}}[5m]))"),
          ("dead letters", "sum(diffq_dead_letters_queued{{ns}})"),
          ("uploads failing/s", "sum(rate(diffq_upload_failures_total{{ns}}[5m]))")]),
        ("Compiles, recompiles and graph fallbacks per hour", "short",
         [("compiles {{shape}}", "sum by (shape) (increase(diffq_compiles_total{{ns}}[1h]))"),
          ("recompiles {{shape}}", "sum by (shape) (increase(diffq_recompiles_total{{ns}}[1h]))"),
          ("fallbacks {{shape}}", "sum by (shape) (increase(diffq_graph_fallbacks_total{{ns}}[1h]))")]),
        ("Cost per 1,000 images", "currencyUSD" if price is not None else "short", [cost]),
    ]


def _query(expr: str, namespace: str, price: float | None) -> str:
    return " ".join(_fill(expr, {"ns": f'namespace="{namespace}"', "price": _number(price or 1)}).split())


def dashboard_queries(namespace: str, price: float | None = None) -> list[str]:
    return [_query(expr, namespace, price) for _title, _unit, targets in _panels(price) for _legend, expr in targets]


def dashboard_json(namespace: str, price: float | None = None) -> str:
    """The dashboard as Grafana's JSON model, built with grafana-foundation-sdk."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard("diffq fleet").uid(DASHBOARD_UID).tags(["diffq"]).refresh("1m")
             .time("now-6h", "now")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    for title, unit, targets in _panels(price):
        panel = timeseries.Panel().title(title).unit(unit).datasource(source).height(8).span(12)
        for ref, (legend, expr) in zip("ABCDEFGH", targets):
            panel = panel.with_target(prometheus.Dataquery().expr(_query(expr, namespace, price)).ref_id(ref)
                                      .legend_format(legend).datasource(source))
        board = board.with_panel(panel)
    return json.dumps(json.loads(JSONEncoder(sort_keys=True).encode(board.build())), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # regenerates infra/k8s/monitoring/diffq-dashboard.json
    import sys
    from pathlib import Path

    target = Path(sys.argv[1] if len(sys.argv) > 1 else f"infra/k8s/monitoring/{DASHBOARD_FILE}")
    target.write_text(dashboard_json("diffq"))
    print(target)
