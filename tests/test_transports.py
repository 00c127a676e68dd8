"""The transport table (diffq/core/transports.py): its rows agree with kombu, and
every place that needs a broker fact reads it from there."""

from __future__ import annotations

import time
import uuid

import pytest
from kombu import Connection, Queue
from kombu.utils.imports import symbol_by_name

from diffq.core.brokers.app import make_celery
from diffq.core.brokers.redis import RedisBroker
from diffq.core.transports import TRANSPORTS, UnknownTransport, transport_for

renew_redis = RedisBroker().renew

# What kombu names each row's transport (kombu/transport/__init__.py TRANSPORT_ALIASES).
KOMBU = {"redis": "redis", "amqp": "pyamqp", "sqs": "sqs", "embedded": "filesystem", "memory": "memory"}


def test_every_scheme_has_one_row_and_unknown_schemes_are_named():
    schemes = [scheme for row in TRANSPORTS for scheme in row.schemes]
    assert len(schemes) == len(set(schemes))
    assert {row.name for row in TRANSPORTS} == set(KOMBU)
    assert transport_for("rediss://:pw@h:6380/0").name == "redis"
    assert transport_for("amqp://guest:guest@h:5672//").name == "amqp"
    assert transport_for("sqs://").name == "sqs"
    assert transport_for("filesystem://localhost/").name == "embedded"
    with pytest.raises(UnknownTransport, match="'kafka://'"):
        transport_for("kafka://h:9092")


@pytest.mark.parametrize("row", TRANSPORTS, ids=lambda row: row.name)
def test_event_loop_column_matches_kombu(row):
    """Celery runs a consumer hub exactly when kombu's transport implements
    `asynchronous` (kombu/transport/redis.py, pyamqp.py, SQS/__init__.py: True;
    filesystem.py, memory.py: False, the base `virtual.Transport` default)."""
    from kombu.transport import TRANSPORT_ALIASES

    transport = symbol_by_name(row.broker.kombu_transport or TRANSPORT_ALIASES[KOMBU[row.name]])
    assert transport.implements.asynchronous is row.event_loop


def test_only_transports_without_redelivery_lose_a_task_in_flight():
    # The embedded runner reconciles from the run folder exactly where the table says
    # the broker will not hand a dead worker's batch back (tests/test_embedded_run.py;
    # the others: tests/test_reliability.py, tests/test_brokers.py).
    lossy = {row.name for row in TRANSPORTS if row.loses_inflight_on_kill}
    assert lossy == {"embedded", "memory"}
    assert all(row.broker.renew is None for row in TRANSPORTS if row.loses_inflight_on_kill)


def test_every_broker_has_a_publisher():
    assert all(callable(row.broker.publisher) for row in TRANSPORTS)


def test_embedded_row_swaps_in_diffqs_filesystem_transport(tmp_path):
    from diffq.core.brokers.embedded import EmbeddedTransport, embedded_broker

    url, options = embedded_broker(tmp_path)
    app = make_celery(url, options)
    with app.connection_for_write() as connection:
        assert isinstance(connection.transport, EmbeddedTransport)
    assert app.conf.broker_transport_options == options


def test_monitoring_is_off_where_no_monitor_can_attach(tmp_path, monkeypatch):
    """Task events and remote control cost the worker's main thread a publish per
    event and a pidbox poll per cycle between two device calls: only brokers a
    monitor can reach get them; DIFFQ_TASK_EVENTS decides events either way."""
    from diffq.core.brokers.embedded import embedded_broker

    monkeypatch.delenv("DIFFQ_TASK_EVENTS", raising=False)
    embedded = make_celery(*embedded_broker(tmp_path)).conf
    assert (embedded.worker_send_task_events, embedded.worker_enable_remote_control) == (False, False)
    for url in ("redis://127.0.0.1:1/0", "amqp://guest@127.0.0.1:1//", "sqs://"):
        conf = make_celery(url).conf
        assert (conf.worker_send_task_events, conf.worker_enable_remote_control) == (True, True), url
    monkeypatch.setenv("DIFFQ_TASK_EVENTS", "false")
    assert make_celery("redis://127.0.0.1:1/0").conf.worker_send_task_events is False
    monkeypatch.setenv("DIFFQ_TASK_EVENTS", "true")
    assert make_celery(*embedded_broker(tmp_path)).conf.worker_send_task_events is True


def test_redis_options_come_from_the_row(monkeypatch):
    monkeypatch.delenv("DIFFQ_VISIBILITY_TIMEOUT", raising=False)
    options = make_celery("redis://127.0.0.1:1/0").conf.broker_transport_options
    assert options["priority_steps"] == [0] and options["unacked_restore_throttle"] == 1
    assert make_celery("redis://127.0.0.1:1/0", {"priority_steps": [0, 5]}).conf \
        .broker_transport_options["priority_steps"] == [0, 5]


def test_redis_renewal_moves_the_unacked_index_score_and_keeps_the_batch_held(redis_server):
    """kombu's Redis QoS (kombu/transport/redis.py): `append` records the delivery time
    in `unacked_index`; `restore_visible` puts back entries older than the visibility
    timeout. A renewed entry stays held; an unrenewed one goes back to its queue."""
    name = f"diffq.lease-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, routing_key=name)
    options = {"visibility_timeout": 1, "unacked_restore_throttle": 1}
    with Connection(redis_server, transport_options=options) as conn:
        producer = conn.Producer()
        for body in ("renewed", "abandoned"):
            producer.publish(body, routing_key=queue.name, declare=[queue])
        channel = conn.channel()
        got = [channel.basic_get(queue.name) for _ in range(2)]  # held: in `unacked`
        held = {m.payload: m for m in got}
        index = channel.unacked_index_key
        first = channel.client.zscore(index, held["renewed"].delivery_tag)
        time.sleep(1.2)  # past the visibility timeout: both would be restored now
        assert renew_redis(channel, [held["renewed"]]) == 1
        assert channel.client.zscore(index, held["renewed"].delivery_tag) > first
        channel.qos.restore_visible(num=100)
        assert channel.client.zscore(index, held["renewed"].delivery_tag) is not None
        assert channel.client.zscore(index, held["abandoned"].delivery_tag) is None
        assert channel.basic_get(queue.name, no_ack=True).payload == "abandoned"
        # An acked (or restored) delivery is never re-added by a late renewal (ZADD XX).
        assert renew_redis(channel, [held["abandoned"]]) == 0
        assert channel.client.hexists(channel.unacked_key, held["abandoned"].delivery_tag) is False
        channel.close()


def test_sqs_renewal_keeps_a_held_message_hidden_and_hand_back_shows_it_at_once(s3_server):
    """kombu's SQS channel (kombu/transport/SQS/__init__.py) keeps the receipt handle in
    `delivery_info['sqs_message']` and the queue URL in `delivery_info['sqs_queue']`; a
    renewal is ChangeMessageVisibility on them (moto's SQS, in the s3_server process)."""
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl")
    from diffq.core.brokers.sqs import SQSBroker

    renew_sqs, hand_back_sqs = SQSBroker().renew, SQSBroker().hand_back

    url = f"sqs://testing:testing@127.0.0.1:{s3_server.port}"
    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-",
               "visibility_timeout": 2, "wait_time_seconds": 0}
    name = "diffq.lease"
    with Connection(url, transport_options=options) as holder, Connection(url, transport_options=options) as other:
        holder.Producer().publish("held", routing_key=name, declare=[Queue(name, routing_key=name)])
        channel, peer = holder.channel(), other.channel()
        message = channel.basic_get(name)
        assert message.payload == "held"
        time.sleep(1.2)
        assert renew_sqs(channel, [message]) == 1  # hidden for 2 s from now
        time.sleep(1.3)  # past the first 2 s: visible again without the renewal
        assert peer.basic_get(name) is None
        assert hand_back_sqs(channel, [message]) == 1
        assert peer.basic_get(name, no_ack=True).payload == "held"


def test_several_workers_sweeping_at_once_restore_each_lapsed_lease_exactly_once(redis_server):
    """Every live worker's loop runs kombu's sweep (`restore_visible`, every
    `unacked_restore_interval`); the `unacked_mutex` lets one sweep at a time, and
    `restore_by_tag` is a WATCH transaction on the `unacked` hash, so a lapsed batch
    goes back once however many workers sweep (kombu/transport/redis.py)."""
    import threading

    name = f"diffq.sweep-{uuid.uuid4().hex[:8]}"
    options = {"visibility_timeout": 1, "unacked_restore_throttle": 1, "unacked_mutex_expire": 30}
    held = 60
    with Connection(redis_server, transport_options=options) as conn:
        producer = conn.Producer()
        for i in range(held):
            producer.publish(str(i), routing_key=name, declare=[Queue(name, routing_key=name)])
        channel = conn.channel()
        for _ in range(held):
            channel.basic_get(name)  # held by a worker that then dies
        channel.qos._delivered.clear()
        time.sleep(1.2)  # every lease lapsed

        def sweep():
            with Connection(redis_server, transport_options=options) as own:
                sweeper = own.channel()
                for _ in range(50):
                    sweeper.qos.restore_visible(num=None)

        threads = [threading.Thread(target=sweep) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bodies = [channel.basic_get(name, no_ack=True).payload for _ in range(channel.client.llen(name))]
        assert sorted(bodies, key=int) == [str(i) for i in range(held)]
        assert channel.client.hlen(channel.unacked_key) == 0
        channel.close()


def test_keda_scaler_per_scheme():
    """The KEDA rows of the table (facts from kedacore/keda at transports.KEDA_SOURCE;
    every name checked against the scaler source in tests/test_keda_scalers.py)."""
    from diffq.core.transports import keda_facts, keda_scaler

    assert {url: keda_scaler(url).type for url in ("redis://", "rediss://", "sentinel://", "amqp://", "pyamqp://",
                                                   "amqps://", "sqs://")} == {
        "redis://": "redis", "rediss://": "redis", "sentinel://": "redis-sentinel", "amqp://": "rabbitmq",
        "pyamqp://": "rabbitmq", "amqps://": "rabbitmq", "sqs://": "aws-sqs-queue"}
    assert keda_scaler("filesystem://") is None and keda_scaler("memory://") is None
    # TLS: a TLS scheme or kombu's `ssl` option; the sentinels' master: kombu's master_name.
    assert keda_facts("rediss://r", per_replica=1).tls and not keda_facts("redis://r", per_replica=1).tls
    assert keda_facts("sentinel://s", {"master_name": "m", "ssl": True}, per_replica=1).tls
    assert keda_facts("sentinel://s", {"master_name": "m"}, per_replica=1).sentinel_master == "m"
    # The AMQP host KEDA dials: amqp:// or amqps:// (amqp091-go), no credentials.
    assert keda_facts("pyamqp://u:p@h:5672//", per_replica=1).amqp_host == "amqp://h:5672/%2F"
    assert keda_facts("amqps://u:p@h/v", per_replica=1).amqp_host == "amqps://h/v"
    assert keda_facts("amqp://u:p@h", {"ssl": True}, per_replica=1).amqp_host == "amqps://h/%2F"
