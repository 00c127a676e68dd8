"""Dead letters the broker's own way (diffq/core/brokers/: `declare_dead_letters`, `peek_dead_letters`), against
real servers: a private RabbitMQ node with its management API (tests/servers.py,
a fresh vhost per test), where diffq sets its policy, and moto's SQS server. A
message refused on a shape queue ends in the broker's dead-letter place, is not
delivered again, and `queue_report` (`diffq queues`) shows it the same way as on Redis."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import redis
from kombu import Connection, Exchange, Queue

from diffq.app.queues import queue_report
from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import DEAD_LETTERS, DEAD_QUEUE
from diffq.core.brokers.rabbitmq import DEAD_LETTER_POLICY, rabbitmq_dead_letter_policy
from diffq.core.brokers.sqs import SQS_MAX_RECEIVES, sqs_entity_name
from diffq.core.transports import TRANSPORTS, transport_for

SHAPE_QUEUE = "diffq.m-000000.64x64.b1.l64.nocfg.fp32"


def test_brokers_with_fleets_keep_their_dead_letters_where_diffq_can_show_them():
    for row in TRANSPORTS:
        if row.keda is not None:
            assert row.broker.peek_dead_letters is not None, row.name
    assert transport_for("redis://h").broker.declare_dead_letters(None, [SHAPE_QUEUE]) is False  # nothing to declare


def test_the_rabbitmq_policy_covers_every_diffq_queue_but_the_dead_one():
    policy = rabbitmq_dead_letter_policy()
    pattern = re.compile(policy["pattern"])
    assert pattern.search(SHAPE_QUEUE) and pattern.search("diffq.default") and pattern.search("diffq.deadline")
    assert not pattern.search(DEAD_LETTERS) and not pattern.search("celery") and not pattern.search("x.diffq.a")
    assert policy["definition"] == {"dead-letter-exchange": DEAD_LETTERS, "dead-letter-routing-key": DEAD_LETTERS}
    assert policy["apply-to"] == "queues"


def assert_policy_set(rabbitmq_server, amqp_url: str) -> None:
    """The broker holds diffq's policy on the URL's vhost, as diffq sent it."""
    vhost = amqp_url.rsplit("/", 1)[1]
    policy = rabbitmq_server.api("GET", f"policies/{vhost}/{DEAD_LETTER_POLICY}")
    assert {key: policy[key] for key in rabbitmq_dead_letter_policy()} == rabbitmq_dead_letter_policy()


def test_rabbitmq_dead_letters_a_reject_on_an_old_queue_and_diffq_queues_shows_it(rabbitmq_server, rabbitmq_vhost):
    amqp_url = rabbitmq_vhost
    # No credentials in the API URL: the broker URL's are used.
    api = f"http://127.0.0.1:{rabbitmq_server.api_port}"
    with Connection(amqp_url) as connection:
        # A shape queue declared the way diffq always has (no arguments), before the policy.
        old = Queue(SHAPE_QUEUE, Exchange(SHAPE_QUEUE), routing_key=SHAPE_QUEUE)
        old(connection.channel()).declare()
        assert transport_for(amqp_url).broker.declare_dead_letters(connection, [SHAPE_QUEUE], api) is True
        assert_policy_set(rabbitmq_server, amqp_url)
        # Declared again as before: no PRECONDITION_FAILED, the policy needs no arguments.
        old(connection.channel()).declare()
        connection.Producer().publish(b"\x80 not a task", exchange="", routing_key=SHAPE_QUEUE,
                                      content_type="application/octet-stream", content_encoding="binary")
        message = None
        deadline = time.monotonic() + 30
        while message is None:  # basic.get can miss a message still being routed
            assert time.monotonic() < deadline
            message = old(connection.channel()).get(no_ack=False)
        message.reject(requeue=False)
        for _ in range(100):
            if _depth(connection, DEAD_LETTERS) == 1:
                break
            time.sleep(0.05)
        assert _depth(connection, SHAPE_QUEUE) == 0, "the refused message is back on its queue"
    [info] = [i for i in queue_report(amqp_url, [SHAPE_QUEUE], timeout=0, letters=10) if i.queue == DEAD_LETTERS]
    assert info.depth == 1 and info.letters_order == "oldest first"
    [letter] = info.letters
    assert letter["queue"] == SHAPE_QUEUE and letter["reason"].startswith("rejected") and letter["at"] > 0
    # Peeking left it in place.
    assert [i.depth for i in queue_report(amqp_url, [], timeout=0) if i.queue == DEAD_LETTERS] == [1]
    assert json.loads(json.dumps(info.to_json()))["letters"][0]["queue"] == SHAPE_QUEUE


def test_rabbitmq_without_the_api_declares_the_dead_queue_and_says_workers_write_letters(rabbitmq_vhost):
    with Connection(rabbitmq_vhost) as connection:
        assert transport_for(rabbitmq_vhost).broker.declare_dead_letters(connection, [SHAPE_QUEUE], None) is False
        _depth(connection, DEAD_LETTERS)  # declared (a passive declare of a missing queue raises)


def _depth(connection, queue: str) -> int:
    channel = connection.channel()
    try:
        return channel.queue_declare(queue=queue, passive=True)[1]
    finally:
        channel.close()


@pytest.fixture
def sqs(s3_server):
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    import boto3

    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-",
               "wait_time_seconds": 1, "polling_interval": 0.2}
    client = boto3.client("sqs", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{s3_server.port}")
    return f"sqs://testing:testing@127.0.0.1:{s3_server.port}", options, client


def test_sqs_redrive_policy_moves_a_batch_received_too_often_and_a_refusal_at_once(sqs):
    broker_url, options, client = sqs
    prefix = options["queue_name_prefix"]
    app = make_celery(broker_url, options)
    with app.connection_for_write() as connection:
        connection.Producer().publish({"hello": 1}, exchange="", routing_key=SHAPE_QUEUE, serializer="json",
                                      declare=[app.amqp.queues[SHAPE_QUEUE]])
        way = transport_for(broker_url).broker
        assert way.declare_dead_letters(connection, [SHAPE_QUEUE]) is False
        assert way.declare_dead_letters(connection, [SHAPE_QUEUE]) is False  # again: the same policy, nothing changes
    url = client.get_queue_url(QueueName=prefix + sqs_entity_name(SHAPE_QUEUE))["QueueUrl"]
    dead_url = client.get_queue_url(QueueName=prefix + sqs_entity_name(DEAD_LETTERS))["QueueUrl"]
    dead_arn = client.get_queue_attributes(QueueUrl=dead_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = json.loads(client.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
                        ["Attributes"]["RedrivePolicy"])
    assert policy["deadLetterTargetArn"] == dead_arn and int(policy["maxReceiveCount"]) == SQS_MAX_RECEIVES
    # An operator's own redrive policy (to another queue) is left as it is.
    theirs = client.create_queue(QueueName=prefix + "theirs-dlq")["QueueUrl"]
    their_arn = client.get_queue_attributes(QueueUrl=theirs, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    other = "diffq.other-000000.64x64.b1.l64.nocfg.fp32"
    other_url = client.create_queue(QueueName=prefix + sqs_entity_name(other), Attributes={"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": their_arn, "maxReceiveCount": "3"})})["QueueUrl"]
    with app.connection_for_write() as connection:
        way.declare_dead_letters(connection, [other])
    kept = json.loads(client.get_queue_attributes(QueueUrl=other_url, AttributeNames=["RedrivePolicy"])
                      ["Attributes"]["RedrivePolicy"])
    assert kept["deadLetterTargetArn"] == their_arn and int(kept["maxReceiveCount"]) == 3
    # A host lost mid-batch: received and never deleted, again and again.
    for _ in range(SQS_MAX_RECEIVES):
        assert client.receive_message(QueueUrl=url, VisibilityTimeout=0, WaitTimeSeconds=1).get("Messages")
    assert not client.receive_message(QueueUrl=url, VisibilityTimeout=0, WaitTimeSeconds=1).get("Messages")
    # A message a worker refuses: its letter, written at once.
    from diffq.worker.delivery.dead_letters import DeadLetters

    DeadLetters(app, "w@h").send(SHAPE_QUEUE, "not JSON", b"\xff")
    [info] = [i for i in queue_report(broker_url, [SHAPE_QUEUE], timeout=0, transport_options=options, letters=10)
              if i.queue == DEAD_LETTERS]
    assert info.depth == 2 and len(info.letters) == 2
    reasons = sorted((letter["queue"], letter["reason"].split(" (")[0]) for letter in info.letters)
    assert reasons == [(SHAPE_QUEUE, "moved by the redrive policy"), (SHAPE_QUEUE, "not JSON")]


def test_redis_shows_its_newest_letters_first(make_redis_server):
    from diffq.worker.delivery.dead_letters import DeadLetters

    server = make_redis_server()
    dead = DeadLetters(make_celery(server.url), "w@h")
    dead.send(SHAPE_QUEUE, "first", b"a")
    dead.send(SHAPE_QUEUE, "second", b"b")
    redis.Redis.from_url(server.url).lpush(DEAD_LETTERS, b"not an envelope")
    [info] = [i for i in queue_report(server.url, timeout=0, letters=2) if i.queue == DEAD_LETTERS]
    assert info.depth == 3 and info.letters_order == "newest first"
    assert [letter["reason"] for letter in info.letters] == ["not a kombu message", "second"]
    assert info.letters[1]["queue"] == SHAPE_QUEUE and info.letters[1]["at"] > 0
    assert "letters" not in [i for i in queue_report(server.url, timeout=0) if i.queue == DEAD_LETTERS][0].to_json()


def _not_diffq_messages(connection, queue: str) -> None:
    """Three kinds a worker refuses on receipt or in the task: not JSON, another
    task, a diffq call whose batch fails the schema."""
    from tests.test_dead_letters import task_body

    producer = connection.Producer()
    producer.publish(b"\x80 not json", exchange="", routing_key=queue, content_type="application/json",
                     content_encoding="utf-8")
    for task, body in (("someone.else", task_body({})), ("diffq.generate_batch", task_body({"foo": 1}))):
        task_id = uuid.uuid4().hex
        producer.publish(body, exchange="", routing_key=queue, content_type="application/json",
                         content_encoding="utf-8",
                         headers={"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None,
                                  "retries": 0, "eta": None, "expires": None, "group": None, "shadow": None,
                                  "timelimit": [None, None], "argsrepr": "", "kwargsrepr": "",
                                  "ignore_result": False})


def _worker_refuses_then_runs(broker_url: str, tiny_model, tmp_path, count_dead, transport_options=None,
                              **spec_fields) -> str:
    """A submitted run with three bad messages behind it on its queue, one real worker:
    the run completes, the bad ones reach the dead letters, the worker lives."""
    from diffq.producer.submit import submit
    from tests.helpers import start_workers, wait_until
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"ok-{i}", "prompt": f"fine {i}"}) + "\n" for i in range(4)))
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=broker_url, transport_options=transport_options,
                    batch_size=2, steps=1, height=32, width=32)
    [queue] = result.queues
    with make_celery(broker_url, transport_options).connection_for_write() as connection:
        _not_diffq_messages(connection, queue)
    if transport_options:
        spec_fields["transport_options"] = transport_options
    supervisor = start_workers(broker_url, [queue], tiny_model, n=1, **spec_fields)
    try:
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=240)
        deadline = time.monotonic() + 60
        while count_dead() < 3:
            assert time.monotonic() < deadline, f"{count_dead()} dead letters"
            supervisor.poll()
            time.sleep(0.2)
        assert supervisor.deaths == 0, "a bad message ended the worker"
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (result.total, 0)
    return queue


@pytest.mark.slow
def test_a_rabbitmq_worker_rejects_to_the_dead_letter_exchange(rabbitmq_server, rabbitmq_vhost, tiny_model,
                                                               tmp_path):
    amqp_url = rabbitmq_vhost

    def count_dead() -> int:
        with Connection(amqp_url) as connection:
            return _depth(connection, DEAD_LETTERS)

    queue = _worker_refuses_then_runs(amqp_url, tiny_model, tmp_path, count_dead,
                                      rabbitmq_api=rabbitmq_server.api_url)
    assert_policy_set(rabbitmq_server, amqp_url)
    with Connection(amqp_url) as connection:
        assert _depth(connection, queue) == 0
        channel = connection.channel()
        dead = DEAD_QUEUE(channel)
        messages = [dead.get(no_ack=False) for _ in range(4)]
        channel.close()  # unacked: requeued
    assert messages[3] is None and all(m is not None for m in messages[:3])
    # Refused on receipt (not JSON, another task): rejected by the worker and routed by
    # RabbitMQ, once each, the broker's way; the schema failure is refused in the task
    # body (dead_letters_of(...).refuse) and routed the same way.
    deaths = [m.headers["x-death"] for m in messages[:3] if (m.headers or {}).get("x-death")]
    assert len(deaths) == 3 and all(len(d) == 1 and d[0]["queue"] == queue and d[0]["reason"] == "rejected"
                                    and d[0]["count"] == 1 for d in deaths), deaths
    [info] = [i for i in queue_report(amqp_url, [queue], timeout=0, letters=10) if i.queue == DEAD_LETTERS]
    assert info.depth == 3 and {letter["queue"] for letter in info.letters} == {queue}


@pytest.mark.slow
def test_an_sqs_worker_moves_what_it_refuses_to_the_redrive_target(sqs, tiny_model, tmp_path):
    broker_url, options, client = sqs
    dead_name = options["queue_name_prefix"] + sqs_entity_name(DEAD_LETTERS)

    def count_dead() -> int:
        try:
            url = client.get_queue_url(QueueName=dead_name)["QueueUrl"]
        except client.exceptions.QueueDoesNotExist:
            return 0
        return int(client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
                   ["Attributes"]["ApproximateNumberOfMessages"])

    queue = _worker_refuses_then_runs(broker_url, tiny_model, tmp_path, count_dead, transport_options=options)
    url = client.get_queue_url(QueueName=options["queue_name_prefix"] + sqs_entity_name(queue))["QueueUrl"]
    left = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    # Deleted, not left for SQS to deliver again; and submit set the redrive policy.
    assert (left["ApproximateNumberOfMessages"], left["ApproximateNumberOfMessagesNotVisible"]) == ("0", "0")
    assert json.loads(left["RedrivePolicy"])["maxReceiveCount"] in (SQS_MAX_RECEIVES, str(SQS_MAX_RECEIVES))
    [info] = [i for i in queue_report(broker_url, [queue], timeout=0, transport_options=options, letters=10)
              if i.queue == DEAD_LETTERS]
    assert info.depth == 3 and {letter["queue"] for letter in info.letters} == {queue}
    assert all("moved by the redrive policy" not in letter["reason"] for letter in info.letters)


class StubMessage:
    delivery_info = {"routing_key": SHAPE_QUEUE}
    body, content_type, headers = b"\x80", "application/json", {}

    def __init__(self):
        self.calls: list[str] = []

    def ack(self):
        self.calls.append("ack")

    def reject(self, requeue=False):
        self.calls.append("requeue" if requeue else "reject")


def test_a_refusal_is_rejected_where_the_broker_routes_it_and_written_and_acked_elsewhere():
    from diffq.worker.delivery.dead_letters import DeadLetters
    from diffq.worker.delivery.outcomes import Action, Outcome, decide

    app = make_celery("memory://")
    routed, written = StubMessage(), StubMessage()
    DeadLetters(app, "w@h", by_broker=True).reject(routed, "not JSON")
    DeadLetters(app, "w@h").reject(written, "not JSON")
    assert routed.calls == ["reject"] and written.calls == ["ack"]
    with app.connection_for_read() as connection:
        letter = DEAD_QUEUE(connection.default_channel).get(no_ack=True)
        assert letter.payload["queue"] == SHAPE_QUEUE and letter.payload["reason"] == "not JSON"
        assert DEAD_QUEUE(connection.default_channel).get(no_ack=True) is None  # the routed one wrote none
    # The task body's refusals end the same two ways.
    assert DeadLetters(app, "w@h", by_broker=True).refuse(SHAPE_QUEUE, "schema", {}) is Outcome.REFUSED
    assert decide(Outcome.REFUSED) is Action.REJECT and decide(Outcome.DEAD_LETTER) is Action.ACK


def test_a_worker_whose_policy_cannot_be_set_writes_letters(rabbitmq_vhost, caplog):
    from diffq.worker.delivery.dead_letters import declare_dead_letters

    with caplog.at_level("WARNING", logger="diffq.worker"):
        assert declare_dead_letters(make_celery(rabbitmq_vhost), [SHAPE_QUEUE], "http://127.0.0.1:1") is False
    assert "written as letters" in caplog.text
