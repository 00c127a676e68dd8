"""Workers without --queues find their queues on the broker (worker/delivery/routing.py
Discovery, the transport table's `list_queues`): Redis by SCAN, SQS (moto's server)
by ListQueues, RabbitMQ only through its management API (a private node with the
plugin, tests/servers.py), refused clearly otherwise."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
from kombu import Connection, Exchange, Queue
from kombu.transport.SQS import Channel as SQSChannel
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.app.queues import queue_report
from diffq.core.contract import ShapeKey, is_shape_queue, queue_from_entity_name, queue_name
from diffq.core.brokers.base import DEAD_LETTERS, CannotList
from diffq.core.transports import transport_for
from diffq.producer.submit import submit
from diffq.worker.delivery.routing import Discovery, startup_queues
from diffq.worker.process.supervisor import Supervisor, plan_children
from tests.helpers import wait_until
from tests.servers import free_port

runner = CliRunner()


def prompts(path, sizes, n, tag="p"):
    rows = [{"id": f"{tag}-{h}x{w}-{i}", "prompt": f"{tag} {i}", "height": h, "width": w}
            for h, w in sizes for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_shape_queue_names_parse_back_from_kombus_sqs_spelling():
    """kombu/transport/SQS/__init__.py `entity_name`: '.' -> '-', other punctuation -> '_'."""
    for model in ("/models/tiny", "black-forest-labs/FLUX.2-klein-4B", "a/b.c_d"):
        queue = queue_name(ShapeKey(model=model, height=1024, width=768, batch_size=2,
                                    max_sequence_length=512, cfg=True, dtype="bfloat16"))
        spelled = SQSChannel.entity_name(None, queue)
        assert "." not in spelled and queue_from_entity_name(spelled) == queue
        assert is_shape_queue(queue) and is_shape_queue(queue, [model]) and not is_shape_queue(queue, ["/other"])
    assert queue_from_entity_name("diffq-dead") is None and not is_shape_queue(DEAD_LETTERS)


@pytest.mark.parametrize("url", ["filesystem://localhost/", "memory://"])
def test_brokers_that_cannot_list_are_refused_before_anything_starts(url):
    with pytest.raises(CannotList, match="--queues"):
        startup_queues(url, [])
    result = runner.invoke(app, ["worker", "--broker", url])
    assert result.exit_code == 2 and "--queues" in result.output


def test_redis_lists_only_shape_queues_of_the_workers_models(make_redis_server, tmp_path):
    server = make_redis_server()
    mine, other = str(tmp_path / "mine"), str(tmp_path / "other")
    ours = submit(prompts(tmp_path / "a.jsonl", [(64, 64), (32, 64)], 2), str(tmp_path / "a"), model=mine,
                  broker_url=server.url, batch_size=2)
    theirs = submit(prompts(tmp_path / "b.jsonl", [(64, 64)], 2), str(tmp_path / "b"), model=other,
                    broker_url=server.url, batch_size=2)
    import redis

    redis.Redis.from_url(server.url).lpush(DEAD_LETTERS, b"{}")  # never served, whatever is in it
    assert startup_queues(server.url, [mine]) == sorted(ours.queues)
    assert startup_queues(server.url, []) == sorted({**ours.queues, **theirs.queues})
    plan = runner.invoke(app, ["worker", "--broker", server.url, "--models", f"{mine},/x", "--plan"])
    assert plan.exit_code == 0, plan.output
    [child] = json.loads(plan.stdout)
    assert child["discover"] is True and child["serve_models"] == [mine, "/x"] and child["queues"] == "discovered"


@pytest.mark.slow
def test_worker_without_queues_serves_runs_submitted_later(make_redis_server, tiny_model, tmp_path):
    """The worker starts on an empty broker; each run's shapes are found and done."""
    server = make_redis_server()
    supervisor = Supervisor(plan_children(device="cpu", devices=[0], broker_url=server.url, queues=[],
                                          discover=True, serve_models=[tiny_model], models=[tiny_model],
                                          loglevel="ERROR"))
    supervisor.start()
    try:
        first = submit(prompts(tmp_path / "a.jsonl", [(32, 32), (32, 48)], 3, "a"), str(tmp_path / "a"),
                       model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
        st = wait_until(first.out, supervisor, lambda s: s.done + s.failed >= first.total, timeout=240)
        assert (st.done, st.failed) == (6, 0)
        # A later run, new shapes: served by the same process, no restart.
        later = submit(prompts(tmp_path / "b.jsonl", [(48, 32), (32, 32)], 2, "b"), str(tmp_path / "b"),
                       model=tiny_model, broker_url=server.url, batch_size=2, steps=1)
        st = wait_until(later.out, supervisor, lambda s: s.done + s.failed >= later.total, timeout=240)
        assert (st.done, st.failed) == (4, 0) and supervisor.deaths == 0
    finally:
        supervisor.stop(timeout=60)
    assert all(info.depth == 0 for info in queue_report(server.url, timeout=0))


def test_sqs_lists_queues_by_prefix(s3_server, tmp_path):
    """ListQueues against moto's SQS server; names come back in diffq's spelling."""
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    broker_url = f"sqs://testing:testing@127.0.0.1:{s3_server.port}"
    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-"}
    model = str(tmp_path / "m")
    result = submit(prompts(tmp_path / "a.jsonl", [(64, 64), (32, 64)], 2), str(tmp_path / "a"), model=model,
                    broker_url=broker_url, transport_options=options, batch_size=2)
    assert startup_queues(broker_url, [model], transport_options=options) == sorted(result.queues)
    report = {q.queue: q.depth for q in queue_report(broker_url, timeout=0, transport_options=options)}
    assert {q: report[q] for q in result.queues} == result.queues and report[DEAD_LETTERS] == 0


def test_rabbitmq_without_management_api_is_refused_clearly(rabbitmq_vhost):
    """AMQP has no queue listing: without --rabbitmq-api the worker refuses and says
    what to pass; with an API URL that does not answer it says that, naming the URL."""
    amqp_url = rabbitmq_vhost
    assert transport_for(amqp_url).list_needs_api
    result = runner.invoke(app, ["worker", "--broker", amqp_url])
    assert result.exit_code == 2 and "--rabbitmq-api" in result.output and "--queues" in result.output
    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = runner.invoke(app, ["worker", "--broker", amqp_url, "--rabbitmq-api", silent])
    assert result.exit_code == 2 and silent in result.output and "did not answer" in result.output
    # Named queues still work on AMQP: the report shows them (and the dead letters).
    report = {q.queue for q in queue_report(amqp_url, ["diffq.x-000000.64x64.b1.l64.nocfg.fp32"], timeout=0)}
    assert report == {"diffq.x-000000.64x64.b1.l64.nocfg.fp32", DEAD_LETTERS}


def test_rabbitmq_lists_shape_queues_through_its_management_api(rabbitmq_server, rabbitmq_vhost, tmp_path):
    """The API lists the broker URL's vhost only: what submit published there, the
    served models' shape queues, without the dead letters or others' queues."""
    amqp_url, api = rabbitmq_vhost, rabbitmq_server.api_url
    mine, other = str(tmp_path / "mine"), str(tmp_path / "other")
    ours = submit(prompts(tmp_path / "a.jsonl", [(64, 64), (32, 64)], 2), str(tmp_path / "a"), model=mine,
                  broker_url=amqp_url, batch_size=2)
    theirs = submit(prompts(tmp_path / "b.jsonl", [(64, 64)], 2), str(tmp_path / "b"), model=other,
                    broker_url=amqp_url, batch_size=2)
    with Connection(amqp_url) as connection:
        Queue("not-diffq", Exchange("not-diffq"), routing_key="not-diffq")(connection.channel()).declare()
    elsewhere = rabbitmq_server.make_vhost()  # another vhost's shape queues are not this broker URL's
    submit(prompts(tmp_path / "c.jsonl", [(48, 48)], 2), str(tmp_path / "c"), model=mine, broker_url=elsewhere,
           batch_size=2)
    assert startup_queues(amqp_url, [mine], api) == sorted(ours.queues)
    assert startup_queues(amqp_url, [], api) == sorted({**ours.queues, **theirs.queues})
    report = {q.queue: q.depth for q in queue_report(amqp_url, timeout=0, rabbitmq_api=api)}
    assert report == {**ours.queues, **theirs.queues, DEAD_LETTERS: 0}
    listed = runner.invoke(app, ["queues", "--broker", amqp_url, "--rabbitmq-api", api, "--timeout", "0", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {row["queue"] for row in json.loads(listed.stdout)} == {*ours.queues, *theirs.queues, DEAD_LETTERS}


def test_rabbitmq_lists_the_default_vhost_too(rabbitmq_server, tmp_path):
    """The broker URL's vhost '/' goes into the API path quoted (%2F)."""
    model = str(tmp_path / f"m{uuid.uuid4().hex[:8]}")  # the node's '/' is shared: this test's queues only
    result = submit(prompts(tmp_path / "a.jsonl", [(64, 64)], 2), str(tmp_path / "a"), model=model,
                    broker_url=rabbitmq_server.amqp_url, batch_size=2)
    try:
        assert startup_queues(rabbitmq_server.amqp_url, [model], rabbitmq_server.api_url) == sorted(result.queues)
    finally:
        for queue in result.queues:
            rabbitmq_server.api("DELETE", f"queues/%2F/{queue}")


def test_discovery_keeps_found_queues_and_skips_failed_listings():
    """An emptied Redis queue has no key to list: what was found stays served, and a
    listing that fails keeps the known queues."""
    from diffq.worker.delivery.routing import Router
    from tests.helpers import patched

    calls = iter([["diffq.m-000000.64x64.b1.l64.nocfg.fp32"], RuntimeError("broker hiccup"), []])

    def list_queues(connection, prefix, api):
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    transport = transport_for("redis://x")
    fake = dataclasses.replace(transport, broker=patched(transport.broker, list_queues=list_queues))
    router = Router([], set, fake, discovery=Discovery(fake))
    for _ in range(3):
        router._next_discovery = 0.0
        router.discover(connection=None)
        assert router.served == ["diffq.m-000000.64x64.b1.l64.nocfg.fp32"]


@pytest.mark.slow
def test_worker_without_queues_on_sqs(s3_server, tiny_model, tmp_path):
    """The same on moto's SQS: a run submitted after the worker started is found by
    ListQueues and done."""
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    broker_url = f"sqs://testing:testing@127.0.0.1:{s3_server.port}"
    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-",
               "wait_time_seconds": 1, "polling_interval": 0.2}
    supervisor = Supervisor(plan_children(device="cpu", devices=[0], broker_url=broker_url, queues=[],
                                          transport_options=options, discover=True, serve_models=[tiny_model],
                                          models=[tiny_model], loglevel="ERROR"))
    supervisor.start()
    try:
        result = submit(prompts(tmp_path / "a.jsonl", [(32, 32), (32, 48)], 2), str(tmp_path / "a"),
                        model=tiny_model, broker_url=broker_url, transport_options=options, batch_size=2, steps=1)
        st = wait_until(result.out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=240)
        assert (st.done, st.failed) == (4, 0) and supervisor.deaths == 0
    finally:
        supervisor.stop(timeout=60)


@pytest.mark.slow
def test_worker_without_queues_on_rabbitmq(rabbitmq_server, rabbitmq_vhost, tiny_model, tmp_path):
    """The same on AMQP through the management API: a run submitted after the worker
    started is found and done."""
    supervisor = Supervisor(plan_children(device="cpu", devices=[0], broker_url=rabbitmq_vhost, queues=[],
                                          discover=True, serve_models=[tiny_model], models=[tiny_model],
                                          rabbitmq_api=rabbitmq_server.api_url, loglevel="ERROR"))
    supervisor.start()
    try:
        result = submit(prompts(tmp_path / "a.jsonl", [(32, 32), (32, 48)], 2), str(tmp_path / "a"),
                        model=tiny_model, broker_url=rabbitmq_vhost, batch_size=2, steps=1)
        st = wait_until(result.out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=240)
        assert (st.done, st.failed) == (4, 0) and supervisor.deaths == 0
    finally:
        supervisor.stop(timeout=60)
    report = queue_report(rabbitmq_vhost, timeout=0, rabbitmq_api=rabbitmq_server.api_url)
    assert {info.queue for info in report} >= set(result.queues) and all(info.depth == 0 for info in report)
