"""`fleet manifests --monitoring`: each alert rule under `promtool test rules`, the rule
groups under `promtool check rules`, the PodMonitor and PrometheusRule against the
Prometheus Operator's own CRD schemas, and every metric and label the rules and the
dashboard name scraped from a real worker and a real backlog service."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from diffq.app import monitoring
from diffq.app.cli import app
from diffq.worker.device.backends import get_backend
from diffq.testing.servers import free_port, missing

ROOT = Path(__file__).resolve().parent.parent
CRDS = Path(__file__).parent / "data" / "prometheus-operator-crd"
NS = "diffq"
RENDER = ["fleet", "manifests", "--model", "/models/m", "--shapes", "1024x1024,768x1344",
          "--out-prefix", "s3://bucket/runs"]


def promtool() -> str:
    """Debian's promtool, as scripts/test-services.sh provides it (on PATH or unpacked
    under .tools/)."""
    found = shutil.which("promtool") or next((str(p) for p in [ROOT / ".tools/prometheus/usr/bin/promtool"]
                                              if p.exists()), None)
    if found is None:
        missing("promtool not found (scripts/test-services.sh unpacks Debian's prometheus package into .tools/)")
    return found


def rendered(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, RENDER + list(args))
    assert result.exit_code == 0, result.output
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kind(docs: list[dict], name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == name]
    return doc


# --- the rendering ---------------------------------------------------------------

@pytest.mark.parametrize("device", ["neuron", "cuda", "tpu"])
def test_without_monitoring_the_rendering_is_unchanged_and_with_it_only_ports_and_objects_are_added(device):
    plain = CliRunner().invoke(app, RENDER + ["--device", device])
    again = CliRunner().invoke(app, RENDER + ["--device", device])
    assert plain.exit_code == 0 and plain.stdout == again.stdout
    assert "PodMonitor" not in plain.stdout and "metrics-0" not in plain.stdout
    before = [d for d in yaml.safe_load_all(plain.stdout) if d]
    after = rendered("--device", device, "--monitoring")
    for doc in before:  # every object is still there, the same but for the workers' ports
        [same] = [copy.deepcopy(d) for d in after if (d["kind"], d["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])]
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] != "diffq-backlog":
            ports = same["spec"]["template"]["spec"]["containers"][0].pop("ports")
            doc["spec"]["template"]["spec"]["containers"][0].pop("ports")
            assert [p["containerPort"] for p in ports] == list(range(9400, 9400 + len(ports)))
            profile = get_backend(device).k8s
            assert len(ports) == profile.devices_per_pod  # one per worker process
        assert same == doc
    monitor = kind(after, "PodMonitor")
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    worker = next(d for d in after if d["kind"] == "Deployment" and d["metadata"]["name"] != "diffq-backlog")
    named = {p["name"] for p in worker["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert named <= ports and "http" in ports
    backlog = next(d for d in after if d["kind"] == "Deployment" and d["metadata"]["name"] == "diffq-backlog")
    assert backlog["spec"]["template"]["spec"]["containers"][0]["name"] == "backlog"  # the rules' `container`
    assert {"PrometheusRule", "ConfigMap"} <= {d["kind"] for d in after}


def test_alert_thresholds_are_options_and_bad_ones_are_named():
    rule = kind(rendered("--monitoring", "--alert", "stall_minutes=45", "--alert", "stall_for_minutes=0",
                         "--alert", "failure_window_minutes=1.5"), "PrometheusRule")
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert "> 2700" in rules["DiffqRunStalled"]["expr"] and rules["DiffqRunStalled"]["for"] == "0s"
    assert "[90s]" in rules["DiffqItemsFailing"]["expr"] and "[15" not in rules["DiffqItemsFailing"]["expr"]
    for bad in ("stall=3", "stall_minutes=soon", "stall_minutes"):
        result = CliRunner().invoke(app, RENDER + ["--monitoring", "--alert", bad])
        assert result.exit_code == 2 and "--alert" in result.output
    # Each refused by its kind, which the message names with its range (celery-mixin's
    # thresholds are percents: 5 is what a port of it types).
    for bad, said in (("failure_ratio=5", "a ratio in [0, 1]"), ("busy_ratio=2", "a ratio in [0, 1]"),
                      ("degenerate_ratio=-0.1", "a ratio in [0, 1]"), ("stall_minutes=0", "minutes in (0, 10080]"),
                      ("storage_window_minutes=20000", "minutes in (0, 10080]"),
                      ("idle_minutes=-1", "minutes to wait in [0, 1440]"), ("ttfi_p90_seconds=0", "seconds in (0,"),
                      ("restarts=2.5", "a whole number"), ("restarts=0", "count")):
        result = CliRunner().invoke(app, RENDER + ["--monitoring", "--alert", bad])
        assert result.exit_code == 2 and said in result.output, (bad, result.output)
    result = CliRunner().invoke(app, RENDER + ["--alert", "stall_minutes=45"])
    assert result.exit_code == 2 and "--monitoring" in result.output


def test_every_wait_and_window_is_an_option():
    """Every alert's `for` is a Thresholds field (a wait), and every range but the
    per-hour ones is a window option: nothing fixed in the text of a rule."""
    names = {f.name for f in dataclasses.fields(monitoring.Thresholds)}
    for alert in monitoring.ALERTS:
        wait = re.fullmatch(r"\{(\w+)_s\}s", alert.for_)
        assert wait and wait[1] + "_minutes" in names, alert.name
        assert set(re.findall(r"\[(\w+)\]", alert.expr)) <= {"1h"}, alert.name


def test_runbooks_are_the_projects_own_and_name_the_alerts_run():
    """No address in the rules by default; with --runbook-url each alert its own anchor
    on that page; a run's alert names its real OUT, the others the fleet's queues command."""
    rules = kind(rendered("--monitoring"), "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert not re.search(r"https?://", yaml.safe_dump(rules))
    base = "https://docs.example.org/diffq/fleet.html"
    rules = kind(rendered("--monitoring", "--runbook-url", base), "PrometheusRule")["spec"]["groups"][0]["rules"]
    urls = [r["annotations"]["runbook_url"] for r in rules]
    assert all(u.startswith(base + "#") for u in urls) and len(set(urls)) == len(rules)
    docs = (ROOT / "docs" / "fleet.md").read_text()
    for rule in rules:  # each anchor is a heading of the runbook page
        assert f"#### {rule['alert']}\n" in docs, rule["alert"]
    by_name = {r["alert"]: r for r in rules}
    assert "`diffq status {{ $labels.out }}`" in by_name["DiffqRunStalled"]["annotations"]["runbook"]
    assert "`diffq queues --out-prefix s3://bucket/runs`" in by_name["DiffqItemsFailing"]["annotations"]["runbook"]
    assert not any(re.search(r"\bOUT\b", r["annotations"]["runbook"]) for r in rules)
    for bad in ("ftp://x/runbook", "https://x/runbook#here", "runbook.md"):
        result = CliRunner().invoke(app, RENDER + ["--monitoring", "--runbook-url", bad])
        assert result.exit_code == 2 and "--runbook-url" in result.output


def test_every_alert_names_its_severity_and_the_diffq_command_that_shows_more():
    rules = monitoring.rule_groups(NS, monitoring.Thresholds())[0]["rules"]
    assert [r["alert"] for r in rules] == [a.name for a in monitoring.ALERTS]
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert re.search(r"`(diffq|kubectl) [a-z-]", rule["annotations"]["runbook"]), rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert "{" not in rule["annotations"]["description"].replace("{{ $labels.", "")


# --- the Prometheus Operator's CRDs -------------------------------------------------

def crd_schema(name: str) -> dict:
    crd = yaml.safe_load((CRDS / f"monitoring.coreos.com_{name}.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("name,kind_name", [("podmonitors", "PodMonitor"), ("prometheusrules", "PrometheusRule")])
def test_the_monitors_validate_against_the_operators_crds(name, kind_name):
    # OpenAPI v3 schemas are JSON Schema draft 4 in all that is checked here; the schema
    # itself is not checked as one (its Go-syntax patterns, `^(?i)…`, are not Python's).
    validator = jsonschema.Draft4Validator(crd_schema(name))
    for device in ("neuron", "cuda"):
        doc = kind(rendered("--device", device, "--monitoring"), kind_name)
        validator.validate(doc)
    broken = json.loads(json.dumps(doc))
    if kind_name == "PodMonitor":
        broken["spec"]["podMetricsEndpoints"][0]["interval"] = "half a minute"
    else:
        broken["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    with pytest.raises(jsonschema.ValidationError):  # the schema does check what it is given
        validator.validate(broken)


# --- promtool ------------------------------------------------------------------------

def test_promtool_checks_the_rendered_rules(tmp_path):
    rule = kind(rendered("--monitoring"), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(monitoring.ALERTS)} rules found" in result.stdout


def _series(name: str, values: str, **labels) -> dict:
    labels = {"namespace": NS, **labels}
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


# Per alert: test cases of (input series, [(eval time, [labels of each alert expected])]):
# an empty list is an alert that must stay quiet then.
W = {"pod": "w-0", "pool": "p"}
UP_WORKER = {"pod": "w-0", "container": "worker"}
UP_BACKLOG = {"pod": "diffq-backlog-x", "container": "backlog"}
CASES: dict[str, list[tuple[list[dict], list[tuple[str, list[dict]]]]]] = {
    "DiffqRunStalled": [
        ([_series("diffq_run_items", "5x60", run="r", out="s3://b/r", state="pending"),
          _series("diffq_run_last_progress_timestamp_seconds", "0x60", run="r", out="s3://b/r"),
          _series("diffq_run_items", "0x60", run="d", out="s3://b/d", state="pending"),
          _series("diffq_run_last_progress_timestamp_seconds", "0x60", run="d", out="s3://b/d"),
          _series("up", "0x60", **UP_WORKER)],  # a worker frozen hard: its target stays, up 0
         [("20m", []), ("40m", [{"run": "r", "out": "s3://b/r"}])]),
        ([_series("diffq_run_items", "5x60", run="r", out="s3://b/r", state="pending"),  # no workers: not stalled
          _series("diffq_run_last_progress_timestamp_seconds", "0x60", run="r", out="s3://b/r")],
         [("40m", [])]),
        # The backlog service dies at 45m with the run firing: its series go stale and
        # the alert holds; back at 70m with the run moved (progress at 4200 s): resolved.
        ([_series("diffq_run_items", "5x45 stale _x24 0x20", run="r", out="s3://b/r", state="pending"),
          _series("diffq_run_last_progress_timestamp_seconds", "0x45 stale _x24 4200x20", run="r", out="s3://b/r"),
          _series("up", "1x45 0x24 1x20", **UP_BACKLOG),
          _series("up", "1x90", **UP_WORKER)],
         [("40m", [{"run": "r", "out": "s3://b/r"}]), ("60m", [{"run": "r", "out": "s3://b/r"}]),
          ("75m", [])]),
    ],
    "DiffqDeadLettersGrowing": [
        ([_series("diffq_dead_letters_queued", "0x20 1x40"), _series("up", "1x60", **UP_BACKLOG)],
         [("10m", []), ("25m", [{}]), ("50m", [])]),
    ],
    "DiffqItemsFailing": [
        ([_series("diffq_images_total", "0+10x60", queue="q1", **W),
          _series("diffq_failures_total", "0+1x60", queue="q1", **W),
          _series("diffq_images_total", "0+10x60", queue="q2", **W),
          _series("diffq_failures_total", "0+0.2x60", queue="q2", **W)],
         [("5m", []), ("40m", [{"queue": "q1"}])]),
        # Every item of a queue fails: no images series at all (the bad model or device case).
        ([_series("diffq_failures_total", "0+1x60", queue="q3", **W)], [("40m", [{"queue": "q3"}])]),
    ],
    # One set of twenty fails every item: 0.05 of the queue (ItemsFailing quiet), 1 of its own.
    "DiffqAdapterSetFailing": [
        ([*[_series("diffq_adapter_set_images_total", "0+10x60", adapter_set=f"s{i:02d}", **W) for i in range(19)],
          *[_series("diffq_adapter_set_failures_total", "0x60", adapter_set=f"s{i:02d}", **W) for i in range(19)],
          _series("diffq_adapter_set_images_total", "0x60", adapter_set="s19", **W),
          _series("diffq_adapter_set_failures_total", "0+10x60", adapter_set="s19", **W)],
         [("5m", []), ("40m", [{"adapter_set": "s19"}])]),
    ],
    "DiffqWorkerRestarting": [
        ([_series("kube_pod_container_status_restarts_total", "0 0 1 2 3 3x30", pod="a", container="worker"),
          _series("diffq_worker_restarts", "0x5 1 2 3x30", pod="b"),
          _series("diffq_worker_restarts", "0x5 1x30", pod="c")],
         [("1m", []), ("15m", [{"pod": "a"}, {"pod": "b"}])]),
    ],
    "DiffqBatchesReturned": [
        ([_series("diffq_redeliveries_total", "0+1x90", queue="q", **W)], [("5m", []), ("60m", [{}])]),
        ([_series("diffq_redeliveries_total", "0+0.2x90", queue="q", **W),
          _series("diffq_lease_lapses_total", "0x90", **W)], [("60m", [])]),
        ([_series("diffq_lease_lapses_total", "0x10 1x80", **W)], [("5m", []), ("30m", [{}])]),
    ],
    "DiffqDevicesIdleWithBacklog": [
        ([_series("diffq_queue_batches", "5x60", queue="q", where="broker"),
          _series("diffq_images_total", "0x60", queue="q", **W),
          _series("diffq_device_busy_ratio", "0.05x60", **W)], [("20m", []), ("45m", [{"pool": "p"}])]),
        ([_series("diffq_queue_batches", "5x60", queue="q", where="out")],  # no worker at all
         [("45m", [{"pool": monitoring.NO_WORKER}])]),
        ([_series("diffq_queue_batches", "5x60", queue="q", where="broker"),
          _series("diffq_images_total", "0+10x60", queue="q", **W),
          _series("diffq_device_busy_ratio", "0.9x60", **W)], [("45m", [])]),
        ([_series("diffq_queue_batches", "0x60", queue="q", where="broker")], [("45m", [])]),
        # One pool stuck among busy ones: its own alert, whatever the namespace's mean.
        ([_series("diffq_queue_batches", "5x60", queue="q", where="broker"),
          _series("diffq_queue_batches", "5x60", queue="q2", where="broker"),
          _series("diffq_images_total", "0x60", queue="q", pod="s-0", pool="stuck"),
          _series("diffq_device_busy_ratio", "0x60", pod="s-0", pool="stuck"),
          *[_series("diffq_images_total", "0+10x60", queue="q2", pod=f"b-{i}", pool="busy") for i in range(4)],
          *[_series("diffq_device_busy_ratio", "0.95x60", pod=f"b-{i}", pool="busy") for i in range(4)]],
         [("45m", [{"pool": "stuck"}])]),
    ],
    "DiffqTimeToFirstImageSlow": [
        ([_series("diffq_time_to_first_image_seconds_bucket", "0x90", le="600", **W),
          _series("diffq_time_to_first_image_seconds_bucket", "0+1x90", le="1800", **W),
          _series("diffq_time_to_first_image_seconds_bucket", "0+1x90", le="+Inf", **W)], [("60m", [{}])]),
        ([_series("diffq_time_to_first_image_seconds_bucket", "0+1x90", le="600", **W),
          _series("diffq_time_to_first_image_seconds_bucket", "0+1x90", le="1800", **W),
          _series("diffq_time_to_first_image_seconds_bucket", "0+1x90", le="+Inf", **W)], [("60m", [])]),
    ],
    "DiffqRecompiles": [
        ([_series("diffq_recompiles_total", "0x10 1x40", shape="s", **W)],
         [("5m", []), ("15m", [{"shape": "s"}]), ("45m", [])]),
    ],
    "DiffqGraphFallbacks": [
        ([_series("diffq_graph_fallbacks_total", "0x10 4x40", shape="s", **W)],
         [("5m", []), ("15m", [{"shape": "s"}]), ("45m", [])]),
    ],
    "DiffqStorageFailing": [
        # As a worker exports them: every stage from 0; storage down from 5m to 35m, the
        # sink's tries counted as they fail (it has given up on no batch yet).
        ([_series("diffq_upload_failures_total", "0x5 1+1x30 31x30", stage="try", **W),
          _series("diffq_upload_failures_total", "0x65", stage="store", **W),
          _series("diffq_upload_failures_total", "0x65", stage="lookup", **W)],
         [("5m", []), ("12m", []), ("20m", [{}]), ("35m", [{}]), ("45m", [])]),
        ([_series("diffq_upload_failures_total", "0x60", stage=stage, **W) for stage in ("try", "store", "lookup")],
         [("20m", [])]),
    ],
    "DiffqDegenerateImages": [
        ([_series("diffq_images_total", "0+100x60", queue="q1", **W),
          _series("diffq_degenerate_images_total", "0+2x60", queue="q1", kind="flat", **W),
          _series("diffq_images_total", "0+100x60", queue="q2", **W),
          _series("diffq_degenerate_images_total", "0+0.5x60", queue="q2", kind="flat", **W)],
         [("5m", []), ("45m", [{"queue": "q1"}])]),
    ],
    "DiffqFeederNotRunning": [
        ([_series("diffq_run_batches_waiting", "3x60", run="r", out="o", queue="q"),
          _series("diffq_feeder_last_pass_timestamp_seconds", "0+60x10 600x50")],
         [("10m", []), ("20m", [{}])]),
        ([_series("diffq_run_batches_waiting", "3x60", run="r", out="o", queue="q")], [("1m", [{}])]),
        ([_series("diffq_run_batches_waiting", "0x60", run="r", out="o", queue="q")], [("20m", [])]),
    ],
    "DiffqBacklogServiceDown": [
        ([_series("up", "1x10 0x20 1x10", **UP_BACKLOG)],
         [("5m", []), ("11m", []), ("13m", [{"namespace": None}]), ("25m", [{"namespace": None}]),
          ("35m", [])]),  # absent(… == 1) keeps no label
    ],
}


def _expected(rule: dict, labels: dict) -> dict:
    """The alert's labels (its own, the expression's) and its annotations filled in."""
    full = {k: v for k, v in {"namespace": NS, **labels}.items() if v is not None}

    def fill(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: full[m.group(1)], text)

    return {"exp_labels": {**full, **rule["labels"]},
            "exp_annotations": {k: fill(v) for k, v in rule["annotations"].items()}}


def test_every_alert_fires_when_it_should_and_stays_quiet_when_it_should_not(tmp_path):
    """`promtool test rules` on synthetic series: each alert's cases (CASES) against the
    rendered rules, every alert covered, each both firing and quiet."""
    rule = kind(rendered("--monitoring"), "PrometheusRule")
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(CASES) == set(rules), "every alert has its cases"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    tests = []
    for alert, cases in CASES.items():
        fired = quiet = False
        for series, checks in cases:
            tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [
                {"eval_time": at, "alertname": alert, "exp_alerts": [_expected(rules[alert], x) for x in expected]}
                for at, expected in checks]})
            fired |= any(expected for _, expected in checks)
            quiet |= any(not expected for _, expected in checks)
        assert fired and quiet, alert
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}))
    result = subprocess.run([promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules_can_fail(tmp_path):
    """The harness above fails a wrong expectation (a quiet alert expected to fire)."""
    rule = kind(rendered("--monitoring"), "PrometheusRule")
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    series = [_series("diffq_upload_failures_total", "0x60", stage="store", **W)]
    tests = [{"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "20m", "alertname": "DiffqStorageFailing",
         "exp_alerts": [_expected(rules["DiffqStorageFailing"], {})]}]}]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}))
    result = subprocess.run([promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode != 0


# --- the dashboard -------------------------------------------------------------------

def test_the_dashboard_file_is_the_rendered_one():
    """infra/k8s/monitoring/ holds the dashboard as rendered for the default namespace:
    regenerate it with `python -m diffq.app.monitoring` after a change."""
    path = ROOT / "infra" / "k8s" / "monitoring" / monitoring.DASHBOARD_FILE
    assert path.read_text() == monitoring.dashboard_json(NS)
    board = json.loads(path.read_text())
    assert board["uid"] == monitoring.DASHBOARD_UID and len(board["panels"]) >= 9
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "pool", "queue", "run"]
    panels = {p["id"]: p for p in board["panels"]}
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    for label in ("pool", "queue", "run"):  # each variable narrows some panel
        assert any(f'{label}=~"${label}"' in e for e in exprs), label
    latency = next(p for p in board["panels"] if p["title"] == monitoring.P_LATENCY)
    assert [t["expr"].split(",")[0] for t in latency["targets"]] == [
        f"histogram_quantile(0.{q}" for q in (50, 95, 99)]
    assert "diffq_batch_seconds_bucket" in latency["targets"][0]["expr"]
    # Every alert's dashboard_url opens its own panel, which shows one of its metrics.
    for rule, alert in zip(monitoring.rule_groups(NS, monitoring.Thresholds())[0]["rules"], monitoring.ALERTS):
        url = rule["annotations"]["dashboard_url"]
        assert url.startswith(f"/d/{monitoring.DASHBOARD_UID}?viewPanel="), url
        panel = panels[int(url.rsplit("=", 1)[1])]
        assert panel["title"] == alert.panel
        shown = set(re.findall(r"(diffq_\w+?|up)(?:_bucket)?\{", " ".join(t["expr"] for t in panel["targets"])))
        named = set(re.findall(r"(diffq_\w+?|up)(?:_bucket)?\{", rule["expr"]))
        assert shown & named, (alert.name, shown, named)
    config_map = kind(rendered("--monitoring", "--price-per-device-hour", "1.5"), "ConfigMap")
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    priced = json.loads(config_map["data"][monitoring.DASHBOARD_FILE])
    assert any("1.5 * count" in t["expr"] for p in priced["panels"] for t in p["targets"])


# --- every name and label, against real processes -------------------------------------

FUNCTIONS = {"sum", "max", "min", "avg", "count", "group", "rate", "increase", "delta", "histogram_quantile", "time",
             "absent", "by", "on", "and", "or", "unless", "without", "ignoring", "group_left", "group_right"}


def used(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """metric -> label names its selectors match on; the label names of by/on clauses."""
    selectors: dict[str, set[str]] = {}
    for name, inner in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        selectors.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", inner))
    # `without (…)` names labels to drop (Prometheus' own on ALERTS), not ones to find.
    stripped = re.sub(r"\[[^]]*\]", "", re.sub(r"\{[^}]*\}", "{}", re.sub(r'"[^"]*"', '""', expr)))
    stripped = re.sub(r"\bwithout\s*\([^)]*\)", "", stripped)
    bare = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?!\s*[({])", stripped))
    grouped = {label.strip() for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
               for label in clause.split(",")}
    stray = bare - FUNCTIONS - grouped
    assert not stray, f"a metric without a selector in {expr}: {stray}"  # every metric names its namespace
    return selectors, grouped


def test_every_expression_names_a_metric_and_labels_from_the_list_or_the_scrape():
    """Offline half: every selector names the namespace; names and labels of the rules
    and panels, all gathered (the scrape test below checks them against real processes)."""
    exprs = [r["expr"] for r in monitoring.rule_groups(NS, monitoring.Thresholds())[0]["rules"]] \
        + monitoring.dashboard_queries(NS)
    for expr in exprs:
        selectors, _ = used(expr)
        assert selectors and all("namespace" in labels for labels in selectors.values()), expr


def scrape(url: str) -> dict[str, set[str]]:
    """Sample name -> label names, from a real /metrics."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":  # listed even before its first labelled sample
            names.setdefault(f"{family.name}_total", set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def wait_for(predicate, timeout: float = 240.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_rules_and_panels_name_only_what_a_real_worker_and_backlog_service_export(
        make_redis_server, tmp_path, tiny_model, monkeypatch):
    """A windowed run on a real worker (its metrics port) and a real `diffq fleet backlog`
    (its /metrics): each metric and label the rules and the dashboard name is in one of
    the scrapes, or in STANDARD_METRICS / the PodMonitor's target labels. Series a tiny
    run does not produce (a recompile, a dead letter, a restart) are made to happen."""
    import redis

    from diffq.producer.submit import submit
    from diffq.worker.observe import metrics
    from tests.helpers import start_workers

    broker = make_redis_server().url
    out, feeds = str(tmp_path / "run"), str(tmp_path / "feeds")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": f"item {i}", "height": 64, "width": 64})
                               + "\n" for i in range(12)))
    result = submit(prompts, out, model=tiny_model, broker_url=broker, batch_size=2, steps=1, window=2,
                    feeds=feeds)
    [queue] = result.queues
    redis.Redis.from_url(broker).lpush(queue, b"not a kombu envelope")  # a dead letter, malformed
    backlog_port, metrics_port = free_port(), free_port()
    service = subprocess.Popen([sys.executable, "-m", "diffq", "fleet", "backlog", "--broker", broker,
                                "--feeds", feeds, "--host", "127.0.0.1", "--port", str(backlog_port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    monkeypatch.setenv("DIFFQ_METRICS_PORT", str(metrics_port))
    workers = start_workers(broker, [queue], tiny_model, n=1)
    try:
        backlog_url = f"http://127.0.0.1:{backlog_port}/metrics"
        worker_url = f"http://127.0.0.1:{metrics_port}/metrics"

        def run_done():
            try:
                names = scrape(backlog_url)
            except OSError:
                return None
            return names if "diffq_feeder_last_publish_timestamp_seconds" in names else None

        wait_for(run_done, what="the feeder's first publish")

        def worker_done():
            try:
                names = scrape(worker_url)
            except OSError:
                return None
            return names if "diffq_time_to_first_image_seconds_bucket" in names \
                and "diffq_dead_letters_total" in names else None

        worker_names = wait_for(worker_done, what="the worker's first image and its dead letter")
        backlog_names = scrape(backlog_url)
    finally:
        workers.stop(timeout=60)
        service.terminate()
        service.wait(timeout=30)
    assert {"diffq_run_items", "diffq_queue_batches", "diffq_dead_letters_queued",
            "diffq_run_last_progress_timestamp_seconds", "diffq_run_batches_waiting"} <= set(backlog_names)
    exported = {**worker_names}
    for name, labels in backlog_names.items():
        exported.setdefault(name, set()).update(labels)
    # Series with labels appear once observed: those a tiny run does not make are checked
    # by their declared label names (the same process's registry, by the exported family).
    declared = {
        "diffq_compiles_total": metrics.COMPILES, "diffq_recompiles_total": metrics.RECOMPILES,
        "diffq_graph_fallbacks_total": metrics.GRAPH_FALLBACKS,
        "diffq_failures_total": metrics.FAILURES, "diffq_degenerate_images_total": metrics.DEGENERATE,
        "diffq_upload_failures_total": metrics.UPLOAD_FAILURES, "diffq_redeliveries_total": metrics.REDELIVERIES,
        "diffq_lease_lapses_total": metrics.LEASE_LAPSES,
        "diffq_adapter_set_images_total": metrics.SET_IMAGES,
        "diffq_adapter_set_failures_total": metrics.SET_FAILURES}
    for name, metric in declared.items():
        assert name in worker_names, f"the worker does not export {name}"
        assert worker_names[name] <= set(metric._labelnames)
        exported[name] |= set(metric._labelnames)
    target = set(monitoring.TARGET_LABELS)
    exprs = [r["expr"] for r in monitoring.rule_groups(NS, monitoring.Thresholds())[0]["rules"]] \
        + monitoring.dashboard_queries(NS)
    for expr in exprs:
        selectors, grouped = used(expr)
        for name, labels in selectors.items():
            if name in monitoring.STANDARD_METRICS:
                continue
            assert name in exported, f"{name} (in {expr}) is exported by no diffq process"
            assert labels <= exported[name] | target | {"le"}, (name, labels - exported[name] - target)
        available = set().union(*(exported.get(n, set()) for n in selectors)) | target | {"le"}
        assert grouped <= available, (expr, grouped - available)


# --- the run metrics and the worker's side, in process ------------------------------------

def samples(registry) -> dict[tuple[str, tuple], float]:
    from prometheus_client.exposition import generate_latest

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def test_run_metrics_count_as_status_does_and_see_progress_move(make_redis_server, tmp_path):
    """A windowed run: items pending, batches in the broker and in OUT per queue; a
    credit moves done and the last-progress time, which is OUT's (the manifest's
    creation before any progress; the segment's time after), so a new service (a
    restart) reports the same age; the broker away leaves the run series; a run no
    longer listed, not finished, is still reported."""
    from diffq.app.queues import queue_report
    from diffq.app.run_metrics import RunMetrics, registry
    from diffq.core.progress import ProgressLog
    from diffq.core.runfolder import read_manifest
    from diffq.core.storage import open_storage
    from diffq.producer.feed import registered, waiting
    from diffq.producer.messages import batch_id
    from diffq.producer.submit import submit

    broker = make_redis_server().url
    out, feeds = str(tmp_path / "run"), str(tmp_path / "feeds")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": "x", "height": 64, "width": 64}) + "\n"
                               for i in range(12)))
    result = submit(prompts, out, model="/models/m", broker_url=broker, batch_size=2, window=2, feeds=feeds)
    [queue] = result.queues
    listed = [out]
    broker_up = [True]
    now = [1000.0]

    def queues():
        if not broker_up[0]:
            raise ConnectionError("broker away")
        return queue_report(broker, timeout=0, unpublished=waiting(feeds))

    assert [e.out for e in registered(open_storage(feeds))] == [out]
    reg = registry(RunMetrics(lambda: listed, queues=queues, clock=lambda: now[0]))
    first = samples(reg)
    run_id = result.run_id
    key = lambda state: ("diffq_run_items", (("out", out), ("run", run_id), ("state", state)))  # noqa: E731
    assert (first[key("pending")], first[key("done")], first[key("failed")]) == (12, 0, 0)
    assert first[("diffq_run_batches_waiting", (("out", out), ("queue", queue), ("run", run_id)))] == 4
    assert first[("diffq_queue_batches", (("queue", queue), ("where", "broker")))] == 2
    assert first[("diffq_queue_batches", (("queue", queue), ("where", "out")))] == 4
    assert first[("diffq_dead_letters_queued", ())] == 0
    moved = ("diffq_run_last_progress_timestamp_seconds", (("out", out), ("run", run_id)))
    manifest = read_manifest(open_storage(out))
    assert first[moved] == manifest.created_at  # never moved: its creation

    now[0] = 1060.0
    assert samples(reg)[moved] == manifest.created_at  # nothing moved
    log = ProgressLog(open_storage(out), writer="w")
    log.add(batch_id(manifest.shapes[0].shape, 0), queue, ["i0", "i1"])
    before = time.time()
    log.flush()
    now[0] = 1120.0
    broker_up[0] = False
    second = samples(reg)
    assert (second[key("done")], second[key("pending")]) == (2, 10)
    assert before - 0.01 <= second[moved] <= time.time()  # the segment's own time, in OUT
    assert not any(name == "diffq_queue_batches" for name, _ in second)  # the broker's part left out
    restarted = registry(RunMetrics(lambda: listed, queues=queues, clock=lambda: now[0] + 3600))
    assert samples(restarted)[moved] == second[moved]  # a new service: the same age

    listed.clear()  # no longer listed, not finished: still reported
    assert samples(reg)[key("pending")] == 10


def test_each_worker_process_serves_on_its_place_in_the_pod_and_says_its_restarts(monkeypatch):
    """Ports are DIFFQ_METRICS_PORT + 0..n-1 whatever devices the plugin allocated (the
    pod's named ports); a restarted unit's processes carry their restart count."""
    from diffq.worker.process import supervisor as sup_module
    from diffq.worker.process.supervisor import Supervisor, plan_children

    specs = plan_children(device="cpu", devices=[4, 6, 7], broker_url="memory://", queues=["q"])
    assert [(s.slot, s.position, s.restarts) for s in specs] == [(4, 0, 0), (6, 1, 0), (7, 2, 0)]
    started = []

    class Dead:
        exitcode = 1
        pid = 0

        def is_alive(self):
            return False

    supervisor = Supervisor(specs[:1])

    def start(child):
        started.append(child.spec.restarts)
        child.process = Dead()

    monkeypatch.setattr(supervisor, "_start", start)
    supervisor.start()
    supervisor.poll()  # the death seen: a restart after the backoff
    supervisor.units[0].next_start = sup_module.time.monotonic() - 1
    supervisor.poll()
    supervisor.units[0].next_start = 0.0
    supervisor.poll()
    supervisor.units[0].next_start = sup_module.time.monotonic() - 1
    supervisor.poll()
    assert started == [0, 1, 2]
