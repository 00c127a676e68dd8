"""Every KEDA name diffq renders is one KEDA's scaler parses.

tests/data/keda/ keeps the scalers' struct definitions (their `keda:"name=…, order=…"`
field tags) and the trigger type switch, copied from kedacore/keda at the commit each
file names (transports.KEDA_SOURCE). These tests parse them and check the trigger
type, every metadata key and every TriggerAuthentication parameter `diffq fleet
manifests` renders for each broker URL scheme; and the values KEDA then dials.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diffq.app import fleet
from diffq.core import transports
from tests.test_infra import validate_manifest

KEDA = Path(__file__).parent / "data" / "keda"
OUT_PREFIX = "s3://bucket/runs"
TAG = re.compile(r'keda:"([^"]*)"')


def scaler_file(source: str) -> str:
    text = (KEDA / (Path(source).name + ".txt")).read_text()
    commit = transports.KEDA_SOURCE.split("@")[1]
    assert f"kedacore/keda {source} at commit {commit}" in text, "the excerpt names its file and KEDA_SOURCE's commit"
    return text


def parsed(source: str) -> dict[str, set[str]]:
    """{'triggerMetadata': names, 'authParams': names, ...}: each name a tagged field
    reads, by where KEDA looks for it (scalersconfig's `order`)."""
    where: dict[str, set[str]] = {}
    for tag in TAG.findall(scaler_file(source)):
        fields = dict(part.strip().split("=", 1) for part in tag.split(",") if "=" in part)
        if "name" not in fields:
            continue  # an embedded struct (`keda:"optional"`)
        for order in fields["order"].split(";"):
            where.setdefault(order.strip(), set()).update(n.strip() for n in fields["name"].split(";"))
    if source.endswith("aws_sqs_queue_scaler.go"):  # static credentials: map lookups in aws_common.go
        lookups = re.findall(r'authParams\["(\w+)"\]', scaler_file("pkg/scalers/aws/aws_common.go"))
        where.setdefault("authParams", set()).update(lookups)
    return where


def trigger_types() -> dict[str, str]:
    """Trigger type -> the constructor call scalers_builder.go makes for it."""
    text = scaler_file("pkg/scaling/scalers_builder.go")
    return dict(re.findall(r'case "([\w-]+)":\s*\n\s*return (scalers\.\w+\([^)]*\))', text))


def render(broker: str, **options) -> list[dict]:
    keys = fleet.shape_keys("org/model", [(64, 64), (128, 128)], batch_size=1)
    opts = fleet.FleetOptions(device="cpu", out_prefixes=(OUT_PREFIX,), broker=broker, **options)
    return [doc for docs in fleet.render(keys, opts).values() for doc in docs]


BROKERS = {
    "redis://:pw@redis.diffq.svc:6379/0": {},
    "rediss://:pw@redis.example:6380/0": {},
    "sentinel://s1.example:26379;sentinel://s2.example:26379": {"master_name": "mymaster"},
    "pyamqp://user:pw@rabbit.diffq.svc:5672//": {},
    "amqp://user:pw@rabbit.diffq.svc/jobs": {},
    "amqps://user:pw@rabbit.example:5671/%2F": {},
    "sqs://": {},
}


def test_excerpts_name_their_commit():
    for source in ("pkg/scalers/redis_scaler.go", "pkg/scalers/rabbitmq_scaler.go",
                   "pkg/scalers/aws_sqs_queue_scaler.go", "pkg/scalers/metrics_api_scaler.go"):
        assert parsed(source)["triggerMetadata"], source
    # The Redis facts the renderer relies on, read from the copy.
    redis = parsed("pkg/scalers/redis_scaler.go")
    assert {"enableTLS", "sentinelMaster", "listName", "databaseIndex"} <= redis["triggerMetadata"]
    assert {"address", "password"} <= redis["authParams"]
    # The same scaler, as a sentinel client for redis-sentinel.
    types = trigger_types()
    assert types["redis"] == "scalers.NewRedisScaler(ctx, false, false, config)"
    assert types["redis-sentinel"] == "scalers.NewRedisScaler(ctx, false, true, config)"


@pytest.mark.parametrize("broker", list(BROKERS))
def test_every_rendered_name_is_one_the_scaler_parses(broker):
    docs = render(broker, broker_options=BROKERS[broker])
    for doc in docs:
        validate_manifest(doc)  # Kubernetes' and KEDA's schemas (tests/data/keda.schema.json)
    types = trigger_types()
    [auth] = [d for d in docs if d["kind"] == "TriggerAuthentication"]
    scaler = transports.keda_scaler(broker)
    names = parsed(scaler.source)
    params = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
    assert params and params <= names["authParams"], params - names["authParams"]
    triggers = [t for d in docs if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    assert {t["type"] for t in triggers} == {scaler.type, "metrics-api"}
    for trigger in triggers:
        assert trigger["type"] in types, trigger["type"]
        source = "pkg/scalers/metrics_api_scaler.go" if trigger["type"] == "metrics-api" else scaler.source
        metadata = set(trigger["metadata"])
        assert metadata <= parsed(source)["triggerMetadata"], metadata - parsed(source)["triggerMetadata"]
        # KEDA reads a name from the first place its order names: none set in both.
        assert not metadata & params or trigger["type"] == "metrics-api"


def redis_triggers(broker: str, **options) -> list[dict]:
    return [t for d in render(broker, **options) if d["kind"] == "ScaledObject"
            for t in d["spec"]["triggers"] if t["type"] != "metrics-api"]


def test_redis_tls_and_sentinel():
    for trigger in redis_triggers("redis://r:6379/0"):
        assert trigger["type"] == "redis" and "enableTLS" not in trigger["metadata"]
    for trigger in redis_triggers("rediss://r:6380/0"):
        # redis_scaler.go SetEnableTLS parses it with strconv.ParseBool: "true".
        assert trigger["type"] == "redis" and trigger["metadata"]["enableTLS"] == "true"
    for trigger in redis_triggers("sentinel://s1:26379", broker_options={"master_name": "mymaster"}):
        assert trigger["type"] == "redis-sentinel" and trigger["metadata"]["sentinelMaster"] == "mymaster"
        assert "enableTLS" not in trigger["metadata"]
    for trigger in redis_triggers("sentinel://s1:26379", broker_options={"master_name": "m", "ssl": True}):
        assert trigger["metadata"]["enableTLS"] == "true"
    with pytest.raises(ValueError, match="master_name"):
        render("sentinel://s1:26379")


@pytest.mark.parametrize("broker, host", [
    ("pyamqp://alice:s3cr3t@rabbit.diffq.svc:5672//", "amqp://rabbit.diffq.svc:5672/%2F"),
    ("amqp://alice:s3cr3t@rabbit.diffq.svc", "amqp://rabbit.diffq.svc/%2F"),
    ("amqp://rabbit/jobs", "amqp://rabbit/jobs"),
    ("amqps://alice:s3cr3t@rabbit.example:5671/%2F", "amqps://rabbit.example:5671/%2F"),
])
def test_rabbitmq_host_has_the_scheme_keda_parses(broker, host):
    """amqp091-go's ParseURI takes amqp:// and amqps:// only (rabbitmq_scaler.go dials
    the `host` with it); the credentials come from the Secret, never the manifest."""
    triggers = redis_triggers(broker)
    assert triggers and {t["metadata"]["host"] for t in triggers} == {host}
    assert all(t["metadata"]["protocol"] == "amqp" for t in triggers)
    text = "".join(str(d) for d in render(broker))
    assert "s3cr3t" not in text and "alice" not in text


def test_amqp_fleet_needs_the_brokers_host():
    with pytest.raises(ValueError, match="names its host"):
        render("amqp://")


def test_fleet_manifests_takes_broker_options(tmp_path):
    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--batch-size", "1",
                                      "--device", "cpu", "--any-out", "--broker", "sentinel://s1:26379",
                                      "--broker-option", "master_name=mymaster"])
    assert result.exit_code == 0, result.output
    assert "type: redis-sentinel" in result.output and "sentinelMaster: mymaster" in result.output
    result = CliRunner().invoke(app, ["fleet", "manifests", "--model", "m", "--shapes", "64x64", "--batch-size", "1",
                                      "--device", "cpu", "--any-out", "--broker", "sentinel://s1:26379"])
    assert result.exit_code == 2 and "master_name" in result.output


def test_sentinel_workers_get_the_transport_options_keda_gets(monkeypatch):
    """kombu takes a Sentinel's master_name only from transport options: the worker pods
    read them from DIFFQ_BROKER_TRANSPORT_OPTIONS, rendered from the same --broker-option."""
    import json

    from diffq.core.brokers.app import make_celery
    from diffq.core.settings import Settings

    docs = render("sentinel://s1:26379", broker_options={"master_name": "mymaster"})
    envs = [c["env"] for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
            if any(e["name"] == "DIFFQ_BROKER_URL" for e in c["env"])]
    assert envs
    for env in envs:
        [value] = [e["value"] for e in env if e["name"] == "DIFFQ_BROKER_TRANSPORT_OPTIONS"]
        monkeypatch.setenv("DIFFQ_BROKER_TRANSPORT_OPTIONS", value)
        assert Settings().broker_transport_options == {"master_name": "mymaster"}
        assert make_celery("sentinel://s1:26379").conf.broker_transport_options["master_name"] == "mymaster"
    assert not any(e["name"] == "DIFFQ_BROKER_TRANSPORT_OPTIONS" for d in render("redis://r:6379/0")
                   if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"] for e in c["env"])
