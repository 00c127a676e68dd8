"""Publishing batch messages to their shape queues, pipelined.

The transport table (diffq/core/transports.py) names each broker's fast path.
Redis ("redis-lists"): the Celery messages pushed straight onto the queue lists in
a redis-py pipeline, one round trip per `batch_size` messages; the envelope is the
one kombu's Redis transport stores (`Channel._put`, pinned byte for byte by
tests/test_publish.py), built with orjson rather than through kombu's per-message
publish path (faster than kombu's own `Producer.batch`: ../shared/CELERY.md).
Every other broker ("kombu-batch": AMQP, SQS, the embedded filesystem one)
publishes through kombu's `Producer.batch`, which pipelines where the transport
can and publishes at once where it cannot. Either way each queue is declared once
through kombu, as `send_task` would, and on close the broker's dead letters for
the queues published to (the transport table's `dead_letters.declare`: RabbitMQ's
policy given DIFFQ_RABBITMQ_API, SQS's redrive policy; the worker declares them too).
"""

from __future__ import annotations

import base64
import contextlib
import logging

import orjson
from kombu.transport import redis as kombu_redis

from diffq.core.broker import make_celery
from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.signing import Keys, keys_from_settings
from diffq.core.transports import transport_for
from diffq.producer.messages import EncodedBatch, TaskMessages, dashed, new_task_id

log = logging.getLogger(__name__)


class CeleryPublisher:
    """Publishes batch messages, in groups of `batch_size`; `close` sends the rest."""

    def __init__(self, broker_url: str, transport_options: dict | None = None, batch_size: int = 1000,
                 keys: Keys | None = None):
        self.app = make_celery(broker_url, transport_options)
        # Signed where a key is set (DIFFQ_SIGNING_KEY): workers with a key refuse the rest.
        self._messages = TaskMessages(self.app, keys if keys is not None else keys_from_settings())
        self._connection = self.app.connection_for_write()
        self._producer = self._connection.Producer(serializer="json")
        self._declared: set[str] = set()
        self._transport = transport_for(broker_url)
        self._sink = PUBLISHERS[self._transport.publisher](self._producer, batch_size)

    def publish(self, message: BatchMessage) -> None:
        self.publish_encoded(EncodedBatch.of(message))

    def publish_encoded(self, encoded: EncodedBatch) -> None:
        if encoded.queue not in self._declared:
            # Created on first use, and routed by its own name (default exchange).
            self._producer.maybe_declare(self.app.amqp.queues[encoded.queue], retry=True)
            self._declared.add(encoded.queue)
        task_id = new_task_id()
        self._sink.put(encoded.queue, self._messages.body(encoded),
                       self._messages.headers(encoded, task_id), self._messages.properties(task_id))

    def flush(self) -> None:
        """Sends what is buffered: the feeder marks batches published only after this."""
        self._sink.flush()

    def close(self) -> None:
        try:
            self._sink.close()  # sends what is still buffered
            if self._declared:
                self._declare_dead_letters()
        finally:
            self._connection.release()

    def _declare_dead_letters(self) -> None:
        # After the messages: SQS applies a redrive policy on receipt, RabbitMQ's
        # policy applies to a queue whenever it is set.
        try:
            self._transport.dead_letters.declare(self._connection, sorted(self._declared),
                                                 get_settings().rabbitmq_api)
        except Exception as exc:  # the workers declare them at start as well
            log.warning("could not declare the broker's dead letters: %s", exc)


class RedisLists:
    """LPUSH of kombu Redis transport envelopes in a non-transactional pipeline.

    One LPUSH per list per flush, with every message buffered for it: the same
    order on the list as one LPUSH each, without redis-py's cost per command.
    kombu's `_put` would also PEXPIRE a queue declared with `x-expires`; diffq's
    shape queues are declared without it.
    """

    def __init__(self, producer, batch_size: int):
        channel: kombu_redis.Channel = producer.channel
        self._channel = channel
        self._batch_size = batch_size
        self._stack = contextlib.ExitStack()
        # kombu's own client: its pool, TLS, password and global key prefix.
        client = self._stack.enter_context(channel.conn_or_acquire())
        self._pipeline = self._stack.enter_context(client.pipeline(transaction=False))
        self._buffered = 0
        self._pending: dict[str, list[bytes]] = {}  # list name -> envelopes, oldest first
        self._lists: dict[str, str] = {}

    def _list(self, queue: str) -> str:
        # Priority 0 lands in the base list with diffq's priority_steps=[0]; asking
        # the channel keeps it right under any other steps a deployment sets.
        name = self._lists.get(queue)
        if name is None:
            name = self._lists[queue] = self._channel._q_for_pri(queue, 0)
        return name

    def put(self, queue: str, body: bytes, headers: dict, properties: dict) -> None:
        # The envelope kombu's virtual Channel stores: prepare_message, then
        # _inplace_augment_message (base64 body, delivery tag, delivery info).
        properties.update(
            delivery_mode=2,  # persistent, as the default exchange publishes
            delivery_info={"exchange": "", "routing_key": queue},
            priority=0,
            body_encoding="base64",
            delivery_tag=dashed(new_task_id()),
        )
        envelope = orjson.dumps({"body": base64.b64encode(body).decode("ascii"),
                                 "content-encoding": "utf-8", "content-type": "application/json",
                                 "headers": headers, "properties": properties})
        name = self._list(queue)
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = []
        pending.append(envelope)
        self._buffered += 1
        if self._buffered >= self._batch_size:
            self.flush()

    def flush(self) -> None:
        if self._buffered:
            for name, envelopes in self._pending.items():
                self._pipeline.lpush(name, *envelopes)
            self._pending.clear()
            self._buffered = 0
            self._pipeline.execute()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._stack.close()


class KombuBatch:
    """kombu's `Producer.batch`: pipelined where the transport supports it."""

    def __init__(self, producer, batch_size: int):
        self._producer = producer
        self._batch = producer.batch(max_size=batch_size)
        self._batch.__enter__()

    def put(self, queue: str, body: bytes, headers: dict, properties: dict) -> None:
        # The default exchange routes by queue name (AMQP and kombu's virtual
        # transports alike) and spares a routing-table lookup per message.
        self._producer.publish(body, exchange="", routing_key=queue, headers=headers,
                               content_type="application/json", content_encoding="utf-8",
                               retry=True, **properties)

    def flush(self) -> None:
        self._batch.flush()

    def close(self) -> None:
        self._batch.__exit__(None, None, None)


# The transport table's `publisher` names one of these.
PUBLISHERS = {"redis-lists": RedisLists, "kombu-batch": KombuBatch}
