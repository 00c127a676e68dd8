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
import shlex
import urllib.parse
from dataclasses import dataclass, field, fields, replace

from diffq.app.backlog import PORT as BACKLOG_PORT

# What the rules and panels may name beside diffq's own metrics: Prometheus' own `up`
# and `ALERTS`, and kube-state-metrics' container restarts (kube-prometheus-stack ships it).
STANDARD_METRICS = ("up", "ALERTS", "kube_pod_container_status_restarts_total")
# Labels the PodMonitor's targets add to every series (the operator's, and `pool`).
TARGET_LABELS = ("namespace", "pod", "container", "endpoint", "job", "instance", "pool")
# kube-prometheus-stack's defaults: its Prometheus selects monitors and rules by the
# Helm release label; its Grafana sidecar loads ConfigMaps labelled grafana_dashboard.
RELEASE = "kube-prometheus-stack"
DASHBOARD_LABEL = ("grafana_dashboard", "1")
DASHBOARD_UID = "diffq-fleet"
DASHBOARD_FILE = "diffq-dashboard.json"
# An alert's dashboard_url: the panel alone, on Grafana's own path (relative: Grafana's
# address is the cluster's; Alertmanager templates prefix it).
DASHBOARD_PATH = f"/d/{DASHBOARD_UID}"
WORKER_PORT = "metrics-{}"
SCRAPE_INTERVAL = "30s"


@dataclass(frozen=True)
class Kind:
    """What a threshold is: its unit and the values that mean something for it."""

    name: str
    low: float
    high: float
    low_open: bool = False  # the low bound itself refused (a zero-length window)
    whole: bool = False

    def check(self, value: float) -> str | None:
        """Why `value` is not one of this kind, or None."""
        low = "(" if self.low_open else "["
        bad = (value != value or value < self.low or value > self.high or (self.low_open and value == self.low)
               or (self.whole and value != int(value)))
        return (f"a {self.name}{', a whole number' if self.whole else ''} in {low}{_number(self.low)}, "
                f"{_number(self.high)}]") if bad else None


# A share of items or time (celery-mixin's thresholds are percents: 5 here is a typo for 0.05).
RATIO = Kind("ratio", 0, 1)
# An age or a window: more than nothing, at most a week (a window is a range vector's length).
MINUTES = Kind("minutes", 0, 7 * 24 * 60, low_open=True)
# How long a condition holds before its alert fires (a rule's `for`): 0 fires at once.
WAIT = Kind("minutes to wait", 0, 24 * 60)
SECONDS = Kind("seconds", 0, 24 * 3600, low_open=True)
COUNT = Kind("count", 1, 1_000_000, whole=True)


def _knob(default: float, kind: Kind):
    return field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class Thresholds:
    """Each alert's threshold, window and wait (`--alert NAME=VALUE`), each typed by
    its kind; docs/fleet.md says why each default. A `*_for_minutes` is its alert's
    `for`; a `*_window_minutes` the range its rate or increase looks back over."""

    # No item done or failed for this long while items are pending and workers run: a
    # first Neuron compile of a large model takes up to ~20 min, so 30 leaves room.
    stall_minutes: float = _knob(30, MINUTES)
    stall_for_minutes: float = _knob(5, WAIT)
    # Dead letters that grew over this window.
    dead_letter_window_minutes: float = _knob(15, MINUTES)
    dead_letter_for_minutes: float = _knob(0, WAIT)
    # Items failing after every retry, over items finished, per queue over the window.
    failure_ratio: float = _knob(0.05, RATIO)
    failure_window_minutes: float = _knob(15, MINUTES)
    failure_for_minutes: float = _knob(10, WAIT)
    # Container (kube-state-metrics) or worker-process (supervisor) restarts in the window.
    restarts: float = _knob(3, COUNT)
    restart_window_minutes: float = _knob(30, MINUTES)
    restart_for_minutes: float = _knob(0, WAIT)
    # Batches the broker gave back (lost holders) per hour: one lost 8-process pod
    # returns up to 16 (one held plus one run ahead each); more is more than one host.
    returned_per_hour: float = _knob(20, COUNT)
    returned_for_minutes: float = _knob(0, WAIT)
    # A pool's devices below this busy ratio (or no worker at all) while batches wait, for
    # idle_minutes: a cold pod's model fetch and first compile keep its device idle up to ~20 min.
    busy_ratio: float = _knob(0.2, RATIO)
    idle_minutes: float = _knob(30, WAIT)
    # A worker life's start to its first image, p90 over an hour: past a first compile.
    ttfi_p90_seconds: float = _knob(1200, SECONDS)
    ttfi_for_minutes: float = _knob(0, WAIT)
    # A shape compiled again, or run uncompiled, within the window.
    recompile_window_minutes: float = _knob(15, MINUTES)
    recompile_for_minutes: float = _knob(0, WAIT)
    fallback_window_minutes: float = _knob(15, MINUTES)
    fallback_for_minutes: float = _knob(0, WAIT)
    # Stores failing (any within the window) for storage_minutes: storage is down,
    # full or denied. The sinks retry a failed store for minutes before giving up, and
    # count each failed try as it happens (stage `try`), so the alert holds while the
    # fault lasts and resolves a window after it ends.
    storage_window_minutes: float = _knob(5, MINUTES)
    storage_minutes: float = _knob(10, WAIT)
    # Degenerate images (NaN, flat) over images generated, per queue over the window.
    degenerate_ratio: float = _knob(0.01, RATIO)
    degenerate_window_minutes: float = _knob(30, MINUTES)
    degenerate_for_minutes: float = _knob(15, WAIT)
    # The feeder's last pass older than this while windowed runs wait in OUT (it passes
    # every few seconds).
    feeder_minutes: float = _knob(5, MINUTES)
    feeder_for_minutes: float = _knob(0, WAIT)
    # The backlog service unscraped this long: every run alert is blind meanwhile, so
    # sooner than the rest (a rollout's new pod is ready in seconds).
    backlog_down_minutes: float = _knob(2, WAIT)

    def values(self) -> dict[str, str]:
        """What a rule's text may name: each field, and each duration's `<stem>_s` in seconds."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = _number(value)
            if f.name.endswith("_minutes"):
                seconds = round(value * 60)
                values[f"{f.name.removesuffix('_minutes')}_s"] = _number(max(seconds, 1) if value else 0)
        return values


def parse_thresholds(values: list[str] | tuple[str, ...]) -> Thresholds:
    """`--alert NAME=VALUE` values -> Thresholds; a bad one names the valid names, or
    its kind and range."""
    known = {f.name: f.metadata["kind"] for f in fields(Thresholds)}
    given: dict[str, float] = {}
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in known:
            raise ValueError(f"--alert {item!r}: expected NAME=VALUE with NAME one of {', '.join(known)}")
        try:
            given[name] = float(value)
        except ValueError:
            raise ValueError(f"--alert {item!r}: {value!r} is not a number") from None
        why = known[name].check(given[name])
        if why:
            raise ValueError(f"--alert {item!r}: {name} is {why}")
    return Thresholds(**given)


def check_runbook_url(base: str | None) -> str | None:
    """`--runbook-url BASE`: an http(s) page without a fragment (each alert adds its own)."""
    if base is None:
        return None
    url = urllib.parse.urlsplit(base)
    if url.scheme not in ("http", "https") or not url.netloc or url.fragment:
        raise ValueError(f"--runbook-url {base!r}: an http(s) address of the runbook page, without a #fragment "
                         "(each alert adds its own anchor)")
    return base


# DevicesIdleWithBacklog's `pool` where no worker runs in the namespace at all.
NO_WORKER = "none running"
# A rule's runbook command where it has no run: the queues and the runs behind them.
QUEUES_COMMAND = "diffq queues{scope}"
# An alert computed from the backlog service's series is held while that service is
# down: its inputs go stale with it, and a run alert must not resolve because its
# source died (BacklogServiceDown says so). The alert's own ALERTS series, less the
# labels Prometheus adds (rules/alerting.go: alertname, alertstate, and the rule's
# labels), is its last state; it holds until the service is scraped again.
HELD = """max without (alertname, alertstate, severity) (ALERTS{{ns}, alertname="{alert}", alertstate="firing"})
          unless on (namespace) (up{{ns}, container="backlog"} == 1)"""


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    for_: str  # how long the condition holds before it fires: a Thresholds wait, in seconds
    expr: str  # with {ns} (the namespace matcher) and the thresholds' values to fill in
    summary: str
    description: str
    command: str  # the diffq command that shows more ({queues}: `diffq queues` of the fleet's runs)
    panel: str  # the dashboard panel that shows it (its title)
    source: str = "workers"  # "backlog": computed from the backlog service's series (held while it is down)

    @property
    def anchor(self) -> str:
        """Its section in the runbook page (docs/fleet.md: a heading per alert)."""
        return self.name.lower()

    def rule(self, namespace: str, thresholds: Thresholds, runbook_url: str | None = None,
             queues: str = "diffq queues", dashboard_url: str | None = None) -> dict:
        values = thresholds.values() | {"ns": f'namespace="{namespace}"', "alert": self.name, "queues": queues,
                                        "namespace": namespace, "no_worker": NO_WORKER}
        expr = self.expr if self.source != "backlog" else f"({self.expr})\n or ({HELD})"
        annotations = {"summary": _fill(self.summary, values),
                       "description": _fill(self.description, values),
                       "runbook": f"Run `{_fill(self.command, values)}` to see more."}
        if runbook_url:
            annotations["runbook_url"] = f"{runbook_url}#{self.anchor}"
        if dashboard_url:
            annotations["dashboard_url"] = f"{dashboard_url}?viewPanel={panel_id(self.panel)}"
        return {"alert": self.name,
                "expr": " ".join(_fill(expr, values).split()),
                "for": _fill(self.for_, values),
                "labels": {"severity": self.severity},
                "annotations": annotations}


def _fill(text: str, values: dict[str, str]) -> str:
    """`{name}` -> its value; anything else, Prometheus' `{{ $labels.x }}` and PromQL's
    `{label="v"}`, stays as written."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def _number(value: float) -> str:
    return f"{value:g}"


# The dashboard's panels an alert points at (`Alert.panel`, `dashboard_url`).
P_IMAGES = "Images per second by pool and shape"
P_BACKLOG = "Backlog: batches queued and waiting in OUT"
P_PENDING = "Items pending per run"
P_ETA = "ETA of the pending items"
P_LATENCY = "Batch latency (p50, p95, p99)"
P_TTFI = "Time to first image"
P_PHASES = "Worker start phases (p90)"
P_BUSY = "Device busy ratio by pool"
P_FAILURES = "Failed items and dead letters"
P_STORAGE = "Stores failing"
P_DEGENERATE = "Degenerate images"
P_RETURNED = "Returned batches and lease lapses"
P_COMPILES = "Compiles, recompiles and graph fallbacks per hour"
P_RESTARTS = "Restarts"
P_SERVICE = "Backlog service and feeder"
P_COST = "Cost per 1,000 images"
P_SETS = "Images and failures per adapter set"

ALERTS: tuple[Alert, ...] = (
    Alert("DiffqRunStalled", "critical", "{stall_for_s}s",
          # `up` rather than a worker's own series: a worker frozen hard serves no
          # /metrics, but its target stays (up 0) while its pod does.
          """max by (namespace, run, out) (diffq_run_items{{ns}, state="pending"}) > 0
             and on (namespace, run, out) (time() - diffq_run_last_progress_timestamp_seconds{{ns}}) > {stall_s}
             and on (namespace) (count by (namespace) (up{{ns}, container="worker"}) > 0)""",
          "Run {{ $labels.run }} has made no progress for {stall_minutes} minutes",
          "Items of {{ $labels.out }} are pending and workers run, but none was done or failed for "
          "{stall_minutes} minutes: its batches may be on queues no worker serves, or the workers stuck.",
          "diffq status {{ $labels.out }}", P_PENDING, source="backlog"),
    Alert("DiffqDeadLettersGrowing", "warning", "{dead_letter_for_s}s",
          # By namespace: the same alert across the backlog service's pods (a restart renames it).
          """sum by (namespace) (delta(diffq_dead_letters_queued{{ns}}[{dead_letter_window_s}s])) > 0""",
          "Dead letters are growing",
          "Workers refused messages in the last {dead_letter_window_minutes} minutes (more dead letters in "
          "diffq.dead): unsigned, for another run or model, or not diffq batches.",
          "{queues}", P_FAILURES, source="backlog"),
    # The denominator falls back to the failures alone where a queue has no images
    # series: a queue whose every item fails is a ratio of 1, not an empty result.
    Alert("DiffqItemsFailing", "warning", "{failure_for_s}s",
          """sum by (namespace, queue) (rate(diffq_failures_total{{ns}}[{failure_window_s}s]))
             / (sum by (namespace, queue) (rate(diffq_failures_total{{ns}}[{failure_window_s}s]))
                + (sum by (namespace, queue) (rate(diffq_images_total{{ns}}[{failure_window_s}s]))
                   or 0 * sum by (namespace, queue) (rate(diffq_failures_total{{ns}}[{failure_window_s}s]))))
             > {failure_ratio}""",
          "Items of {{ $labels.queue }} fail after every retry",
          "More than {failure_ratio} of the items finished on {{ $labels.queue }} failed after every retry "
          "(failure records in each run's OUT/failures).",
          "{queues}", P_FAILURES),
    # One LoRA set of twenty failing every item is 0.05 of its queue's: under
    # ItemsFailing's ratio. Each set's own ratio, the same threshold; the label is the
    # set's short digest (capped per worker, an idle set let go after worker/observe/metrics.py
    # SET_LABEL_IDLE_S, which tests/test_metrics.py holds past this window + for).
    Alert("DiffqAdapterSetFailing", "warning", "{failure_for_s}s",
          """sum by (namespace, adapter_set) (rate(diffq_adapter_set_failures_total{{ns}}[{failure_window_s}s]))
             / (sum by (namespace, adapter_set) (rate(diffq_adapter_set_failures_total{{ns}}[{failure_window_s}s]))
                + sum by (namespace, adapter_set) (rate(diffq_adapter_set_images_total{{ns}}[{failure_window_s}s])))
             > {failure_ratio}""",
          "Items of LoRA adapter set {{ $labels.adapter_set }} fail after every retry",
          "More than {failure_ratio} of the items finished with adapter set {{ $labels.adapter_set }} failed "
          "after every retry (`diffq status OUT --by-adapter` names the set's adapters).",
          "{queues}", P_SETS),
    Alert("DiffqWorkerRestarting", "warning", "{restart_for_s}s",
          """max by (namespace, pod) (increase(kube_pod_container_status_restarts_total{{ns},
                 container=~"worker|backlog"}[{restart_window_s}s])) >= {restarts}
             or max by (namespace, pod) (delta(diffq_worker_restarts{{ns}}[{restart_window_s}s])) >= {restarts}""",
          "{{ $labels.pod }} is restarting",
          "The pod's container or one of its worker processes restarted {restarts} times or more in "
          "{restart_window_minutes} minutes (crash-looping: an out-of-memory, a device fault, a bad model).",
          "kubectl logs --previous {{ $labels.pod }}", P_RESTARTS),
    Alert("DiffqBatchesReturned", "warning", "{returned_for_s}s",
          """sum by (namespace) (increase(diffq_redeliveries_total{{ns}}[1h])) > {returned_per_hour}
             or sum by (namespace) (increase(diffq_lease_lapses_total{{ns}}[1h])) > 0""",
          "Batches are coming back from lost holders",
          "More than {returned_per_hour} batches an hour came back from holders that lost them (lost hosts, "
          "lapsed leases), or a worker held one past DIFFQ_MAX_HOLD_S: their work is done twice.",
          "{queues}", P_RETURNED),
    # Per pool: a queue with batches counts for each pool whose workers serve it (their
    # diffq_images_total children, exported from discovery on); no worker at all in
    # the namespace is the other branch, its `pool` NO_WORKER.
    Alert("DiffqDevicesIdleWithBacklog", "critical", "{idle_s}s",
          """max by (namespace, pool) ((sum by (namespace, queue) (diffq_queue_batches{{ns}}) > 0)
               * on (namespace, queue) group_right () group by (namespace, queue, pool) (diffq_images_total{{ns}}))
             unless on (namespace, pool) (avg by (namespace, pool) (diffq_device_busy_ratio{{ns}}) >= {busy_ratio})
             or label_replace(sum by (namespace) (diffq_queue_batches{{ns}}) > 0
                              unless on (namespace) count by (namespace) (diffq_device_busy_ratio{{ns}}),
                              "pool", "{no_worker}", "", "")""",
          "Batches wait but the devices of {{ $labels.pool }} are idle",
          "Batches are queued or waiting in OUT for pool {{ $labels.pool }}, yet its devices are busy less than "
          "{busy_ratio} of the time (or no worker runs at all) for {idle_minutes} minutes: the autoscaler or "
          "the scheduler is stuck, or the pool's workers are.",
          "{queues}", P_BUSY, source="backlog"),
    Alert("DiffqTimeToFirstImageSlow", "warning", "{ttfi_for_s}s",
          """histogram_quantile(0.9, sum by (namespace, le)
               (rate(diffq_time_to_first_image_seconds_bucket{{ns}}[1h]))) > {ttfi_p90_seconds}""",
          "New workers take long to their first image",
          "The p90 of a worker life's start to its first stored image is over {ttfi_p90_seconds} s: a cold "
          "compile cache or slow model fetches (the start phases panel says which).",
          "{queues}", P_TTFI),
    Alert("DiffqRecompiles", "warning", "{recompile_for_s}s",
          """sum by (namespace, shape) (increase(diffq_recompiles_total{{ns}}[{recompile_window_s}s])) > 0""",
          "Shape {{ $labels.shape }} compiled again",
          "A worker compiled a graph for a shape it already served in the last {recompile_window_minutes} "
          "minutes: in steady state every compile is minutes of a device lost (on Neuron and TPU).",
          "{queues}", P_COMPILES),
    Alert("DiffqGraphFallbacks", "warning", "{fallback_for_s}s",
          """sum by (namespace, shape) (increase(diffq_graph_fallbacks_total{{ns}}[{fallback_window_s}s])) > 0""",
          "Shape {{ $labels.shape }} runs uncompiled",
          "Compiled-graph calls failed on the device and re-ran op by op (--allow-fallback): the slow path.",
          "{queues}", P_COMPILES),
    Alert("DiffqStorageFailing", "critical", "{storage_s}s",
          """sum by (namespace) (increase(diffq_upload_failures_total{{ns}}[{storage_window_s}s])) > 0""",
          "Storing images fails",
          "Workers' stores into run folders have kept failing for {storage_minutes} minutes (storage down, "
          "full or denied): the batches wait on the workers.",
          "{queues}", P_STORAGE),
    Alert("DiffqDegenerateImages", "warning", "{degenerate_for_s}s",
          """sum by (namespace, queue) (rate(diffq_degenerate_images_total{{ns}}[{degenerate_window_s}s]))
             / (sum by (namespace, queue) (rate(diffq_images_total{{ns}}[{degenerate_window_s}s]))
                or sum by (namespace, queue) (rate(diffq_degenerate_images_total{{ns}}[{degenerate_window_s}s])))
             > {degenerate_ratio}""",
          "Degenerate images on {{ $labels.queue }}",
          "More than {degenerate_ratio} of the images of {{ $labels.queue }} are degenerate (NaN or one flat "
          "colour): a dtype the model does not hold, or a broken device.",
          "{queues}", P_DEGENERATE),
    Alert("DiffqFeederNotRunning", "critical", "{feeder_for_s}s",
          """sum by (namespace) (diffq_run_batches_waiting{{ns}}) > 0
             unless on (namespace) (time() - max by (namespace)
                                     (diffq_feeder_last_pass_timestamp_seconds{{ns}}) < {feeder_s})""",
          "Windowed runs wait for a feeder that does not run",
          "Batches of windowed runs wait in OUT but the feeder has not passed for {feeder_minutes} minutes: "
          "nothing publishes them.",
          "{queues}", P_SERVICE, source="backlog"),
    Alert("DiffqBacklogServiceDown", "critical", "{backlog_down_s}s",
          """absent(up{{ns}, container="backlog"} == 1)""",
          "The backlog service is down: run alerts are blind",
          "Prometheus has not scraped diffq-backlog for {backlog_down_minutes} minutes. KEDA's backlog triggers "
          "have no value (pools do not scale on it), the feeder publishes nothing, and every alert computed "
          "from its series (run stalled, devices idle with backlog, feeder, dead letters) holds what it said "
          "when the service went and cannot start firing until it is back.",
          "kubectl -n {namespace} describe deploy/diffq-backlog", P_SERVICE),
)


@dataclass(frozen=True)
class MonitoringOptions:
    thresholds: Thresholds = Thresholds()
    # Prometheus selects monitors and rules by this label (kube-prometheus-stack's release).
    release: str = RELEASE
    price_per_device_hour: float | None = None
    # `--runbook-url BASE`: each alert's runbook_url is BASE#<its anchor>; none without it.
    runbook_url: str | None = None
    # The runbook command of alerts without a run: `diffq queues` over the fleet's runs
    # (`attach` fills in the fleet's --out-prefix / --feeds).
    queues_command: str = "diffq queues"


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


def rule_groups(namespace: str, thresholds: Thresholds, options: MonitoringOptions | None = None) -> list[dict]:
    options = options or MonitoringOptions(thresholds=thresholds)
    return [{"name": "diffq", "rules": [
        alert.rule(namespace, thresholds, runbook_url=options.runbook_url, queues=options.queues_command,
                   dashboard_url=DASHBOARD_PATH) for alert in ALERTS]}]


def prometheus_rule(namespace: str, options: MonitoringOptions) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "diffq", "namespace": namespace, "labels": {"release": options.release}},
            "spec": {"groups": rule_groups(namespace, options.thresholds, options)}}


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
    scope = [arg for prefix in fleet_options.out_prefixes for arg in ("--out-prefix", prefix)] + (
        ["--feeds", fleet_options.feeds] if fleet_options.feeds else [])
    options = replace(options, queues_command=shlex.join(["diffq", "queues", *scope]))
    rendered["monitoring"] = render(fleet_options.namespace, processes, fleet.BACKLOG, options)


# The dashboard: (title, unit, [(legend, PromQL)]) per panel. Selectors: {ns} the
# namespace; {pool}, {queue}, {run} add the dashboard's variables of that label.
def _panels(price: float | None) -> list[tuple[str, str, list[tuple[str, str]]]]:
    # A device is a worker process (one per device, a TP group's followers included);
    # without a price, device-hours.
    cost = ("USD per 1,000 images" if price is not None else "device-hours per 1,000 images",
            """{price} * count by (namespace) (process_start_time_seconds{{pool}, container="worker"})
               / (sum by (namespace) (rate(diffq_images_total{{pool}}[15m])) * 3600) * 1000""")
    return [
        (P_IMAGES, "short",
         [("{{pool}} {{queue}}", "sum by (pool, queue) (rate(diffq_images_total{{pool}, {queue}}[5m]))")]),
        (P_BACKLOG, "short",
         [("{{queue}} {{where}}", "sum by (queue, where) (diffq_queue_batches{{queue}})")]),
        (P_PENDING, "short",
         [("{{run}}", 'sum by (run) (diffq_run_items{{run}, state="pending"})'),
          ("{{run}} since its last progress", "time() - max by (run) "
                                               "(diffq_run_last_progress_timestamp_seconds{{run}})")]),
        (P_ETA, "s",
         [("{{namespace}}", """sum by (namespace) (diffq_run_items{{run}, state="pending"})
            / sum by (namespace) (rate(diffq_images_total{{pool}}[15m]))""")]),
        (P_LATENCY, "s",
         [(f"p{q} {{{{queue}}}}", f"histogram_quantile(0.{q}, sum by (queue, le) "
                                 "(rate(diffq_batch_seconds_bucket{{pool}, {queue}}[5m])))") for q in (50, 95, 99)]),
        (P_TTFI, "s",
         [(f"p{q}", f"histogram_quantile(0.{q}, sum by (le) "
                    "(rate(diffq_time_to_first_image_seconds_bucket{{pool}}[1h])))") for q in (50, 90)]),
        (P_PHASES, "s",
         [("{{phase}}", "histogram_quantile(0.9, sum by (phase, le) "
                        "(rate(diffq_start_phase_seconds_bucket{{pool}}[1h])))")]),
        (P_BUSY, "percentunit",
         [("{{pool}}", "avg by (pool) (diffq_device_busy_ratio{{pool}})")]),
        (P_FAILURES, "short",
         [("failed items/s {{queue}}", "sum by (queue) (rate(diffq_failures_total{{pool}, {queue}}[5m]))"),
          ("dead letters", "sum(diffq_dead_letters_queued{{ns}})"),
          ("refused/s {{reason}}", "sum by (reason) (rate(diffq_dead_letters_total{{pool}}[5m]))")]),
        (P_STORAGE, "short",
         [("stores failing/s {{stage}}", "sum by (stage) (rate(diffq_upload_failures_total{{pool}}[5m]))")]),
        (P_DEGENERATE, "short",
         [("{{queue}} {{kind}}/s", "sum by (queue, kind) (rate(diffq_degenerate_images_total{{pool}, {queue}}[5m]))")]),
        (P_RETURNED, "short",
         [("returned {{queue}}", "sum by (queue) (increase(diffq_redeliveries_total{{pool}, {queue}}[1h]))"),
          ("lease lapses {{pool}}", "sum by (pool) (increase(diffq_lease_lapses_total{{pool}}[1h]))")]),
        (P_COMPILES, "short",
         [("compiles {{shape}}", "sum by (shape) (increase(diffq_compiles_total{{pool}}[1h]))"),
          ("recompiles {{shape}}", "sum by (shape) (increase(diffq_recompiles_total{{pool}}[1h]))"),
          ("fallbacks {{shape}}", "sum by (shape) (increase(diffq_graph_fallbacks_total{{pool}}[1h]))")]),
        (P_RESTARTS, "short",
         [("{{pod}} processes", "max by (pod) (diffq_worker_restarts{{pool}})"),
          ("{{pod}} containers", "max by (pod) (increase(kube_pod_container_status_restarts_total{{ns}}[1h]))")]),
        (P_SERVICE, "short",
         [("backlog service up", 'max(up{{ns}, container="backlog"})'),
          ("seconds since the feeder's last pass", "time() - max(diffq_feeder_last_pass_timestamp_seconds{{ns}})")]),
        (P_COST, "currencyUSD" if price is not None else "short", [cost]),
        (P_SETS, "short",
         [("images/s {{adapter_set}}", "sum by (adapter_set) (rate(diffq_adapter_set_images_total{{pool}}[5m]))"),
          ("failed items/s {{adapter_set}}",
           "sum by (adapter_set) (rate(diffq_adapter_set_failures_total{{pool}}[5m]))")]),
    ]


# The dashboard's variables: (name, the label, the series it is read from).
VARIABLES = (("pool", "diffq_device_busy_ratio"), ("queue", "diffq_queue_batches"), ("run", "diffq_run_items"))


def panel_id(title: str) -> int:
    """A panel's id on the dashboard (its place, from 1): what an alert's dashboard_url names."""
    return [t for t, _unit, _targets in _panels(None)].index(title) + 1


def _query(expr: str, namespace: str, price: float | None) -> str:
    ns = f'namespace="{namespace}"'
    values = {"ns": ns, "price": _number(price or 1)} | {
        name: f'{ns}, {name}=~"${name}"' for name, _series in VARIABLES}
    # A second selector's variable follows the first's namespace: drop the repeat.
    return " ".join(_fill(expr, values).replace(f", {ns}", "").split())


def dashboard_queries(namespace: str, price: float | None = None) -> list[str]:
    return [_query(expr, namespace, price) for _title, _unit, targets in _panels(price) for _legend, expr in targets]


def dashboard_json(namespace: str, price: float | None = None) -> str:
    """The dashboard as Grafana's JSON model, built with grafana-foundation-sdk."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard("diffq fleet").uid(DASHBOARD_UID).tags(["diffq"]).refresh("1m")
             .time("now-6h", "now")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    for name, series in VARIABLES:
        board = board.with_variable(
            dashboard.QueryVariable(name).label(name).datasource(source)
            .query(f'label_values({series}{{namespace="{namespace}"}}, {name})')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*"))
    for title, unit, targets in _panels(price):
        panel = (timeseries.Panel().id(panel_id(title)).title(title).unit(unit).datasource(source)
                 .height(8).span(12))
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
