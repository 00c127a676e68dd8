"""Which deliveries the lease keeper sees as held (worker/delivery/lease.py), on a real kombu
virtual channel (the in-memory transport): the unit beside tests/test_leases.py's
end-to-end runs."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from kombu import Connection, Consumer, Producer, Queue

from diffq.core.brokers.base import held_deliveries
from diffq.worker.delivery.lease import LeaseKeeper


def two_deliveries(connection):
    """Two messages delivered to a consumer on a fresh queue, neither acked yet."""
    queue = Queue(f"lease-{uuid.uuid4().hex}")
    channel = connection.channel()
    Producer(channel).publish({"n": 1}, routing_key=queue.name, declare=[queue], serializer="json")
    Producer(channel).publish({"n": 2}, routing_key=queue.name, declare=[queue], serializer="json")
    received = []
    consumer = Consumer(channel, [queue], callbacks=[lambda body, message: received.append(message)],
                        accept=["json"])
    consumer.consume()
    while len(received) < 2:
        connection.drain_events(timeout=5)
    # What held_deliveries reads from a Celery worker's consumer.
    return SimpleNamespace(task_consumer=consumer), received


def test_an_acked_delivery_not_yet_flushed_is_not_held():
    with Connection("memory://") as connection:
        consumer, (first, second) = two_deliveries(connection)
        assert held_deliveries(consumer) == [first, second]
        first.ack()
        # kombu's QoS.ack only marks the tag dirty (kombu/transport/virtual/base.py):
        # the acked delivery is still in `_delivered` until the next append() flushes it.
        qos = consumer.task_consumer.channel.qos
        assert first.delivery_tag in qos._delivered and first.delivery_tag in qos._dirty
        assert held_deliveries(consumer) == [second]
        second.reject()  # rejected (not requeued) is just as finished
        assert held_deliveries(consumer) == []


def test_the_keeper_renews_and_hands_back_only_unacked_deliveries():
    seen = {"renew": [], "hand_back": []}

    def record(name):
        def call(channel, messages):
            seen[name].append([m.payload for m in messages])
            return len(messages)
        return call

    broker = SimpleNamespace(renew=record("renew"), hand_back=record("hand_back"))  # the broker object's two
    with Connection("memory://") as connection:
        consumer, (first, _) = two_deliveries(connection)
        first.ack()
        keeper = LeaseKeeper(broker, connection.clone, lambda: held_deliveries(consumer),
                             period=60, max_hold_s=600)
        try:
            assert keeper.renew_once() == 1 and keeper.hand_back() == 1
        finally:
            keeper.stop()
    assert seen == {"renew": [[{"n": 2}]], "hand_back": [[{"n": 2}]]}
