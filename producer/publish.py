"""Publishing batch messages to their shape queues, pipelined.

Each broker's object names its fast path (`publisher`, diffq/core/brokers/): on
Redis the Celery messages pushed straight onto the queue lists in a redis-py
pipeline, one round trip per `batch_size` messages, in the envelope kombu's Redis
transport stores (brokers/redis.py `RedisLists`, faster than kombu's own
`Producer.batch`: ../shared/CELERY.md); every other broker (AMQP, SQS, the embedded
filesystem one) through kombu's `Producer.batch` (brokers/base.py `KombuBatch`),
which pipelines where the transport can and publishes at once where it cannot.
Either way each queue is declared once through kombu, as `send_task` would, and on
close the broker's dead letters for the queues published to (the broker's
`declare_dead_letters`: RabbitMQ's policy given DIFFQ_RABBITMQ_API, SQS's redrive
policy; the worker declares them too).
"""

from __future__ import annotations

import logging

from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import TaskMessages, new_task_id
from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.signing import Keys, keys_from_settings
from diffq.core.transports import transport_for
from diffq.producer.messages import EncodedBatch

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
        self._broker = transport_for(broker_url).broker
        self._sink = self._broker.publisher(self._producer, batch_size)

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
            self._broker.declare_dead_letters(self._connection, sorted(self._declared), get_settings().rabbitmq_api)
        except Exception as exc:  # the workers declare them at start as well
            log.warning("could not declare the broker's dead letters: %s", exc)
