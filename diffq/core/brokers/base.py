"""What every broker class shares, and the broker base class (`Broker`).

Everything diffq does with kombu and Celery beyond their public API lives in this
package, one class per broker (redis.py, rabbitmq.py, sqs.py, embedded.py); the
transport table (diffq/core/transports.py) holds the facts about each broker as data
and points at its object (the Celery app both sides build, which reads the table, is
app.py: nothing here imports the table back). Here: the task envelope the producer splices batches into
(`TaskMessages`, Celery's own `as_task_v2` taken once as a template), kombu's
`Producer.batch` publisher, depths by passive declare, the arrival stamp of kombu's
virtual transports, the held deliveries of kombu's virtual QoS, and the dead letters'
queue and report. A worker's delivery ends are decided by worker/delivery/outcomes.py;
a broker object carries out the ones that reach past kombu's public API (through
ports the worker hands it: `closed`, `peeked`), and answers what an ack or reject
met (`answer`: done, or `ConnectionLost`), for the worker's door to decide the end.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError

from diffq.core.contract import QUEUE_PREFIX as PREFIX
from diffq.core.signing import HEADER as SIGNATURE, Keys

if TYPE_CHECKING:
    from celery import Celery

TASK_NAME = "diffq.generate_batch"
# Where a worker puts messages it cannot take (not JSON, pickle, wrong schema, too
# big): one queue on every broker, shown by `diffq queues`, never consumed by workers.
DEAD_LETTERS = f"{PREFIX}dead"
DEAD_QUEUE = Queue(DEAD_LETTERS, Exchange(DEAD_LETTERS), routing_key=DEAD_LETTERS)
PEEKED_LETTERS = 10  # letters `diffq queues` shows

# What a broker that does not answer raises through kombu (or its socket, before kombu wraps it).
UNREACHABLE = (OperationalError, OSError)


class CannotList(ValueError):
    """This broker cannot list its queues (as configured): name them with --queues."""


# -- what a consumer channel reports of a delivery -------------------------------------------


@dataclass(frozen=True)
class ConnectionLost:
    """An ack, reject or close the broker can no longer be told about: the delivery's
    connection is gone. `settle` forgets it here; the broker still holds it as unacked
    and gives it back once its lease lapses. The worker decides the end (its door)."""

    tag: str
    settle: Callable[[], None]


@dataclass(frozen=True)
class StillHeld:
    """A delivery its consumer channel still holds as it closes: `restore` puts it
    back on its queue (what kombu's own close would do). The worker decides the end."""

    tag: str
    restore: Callable[[], None]


# -- the envelope: Celery's task message around a batch ---------------------------------------


def new_task_id() -> str:
    """`uuid.uuid4().hex` at a fraction of the cost (UUID's constructor dominates)."""
    value = int.from_bytes(os.urandom(16), "big")
    value = value & ~(0xF000 << 64) | (0x4000 << 64)  # version 4
    value = value & ~(0xC000 << 48) | (0x8000 << 48)  # RFC 4122 variant
    return f"{value:032x}"


def dashed(hex_id: str) -> str:
    """The canonical 8-4-4-4-12 form, as `str(uuid.uuid4())` writes it."""
    return f"{hex_id[:8]}-{hex_id[8:12]}-{hex_id[12:16]}-{hex_id[16:20]}-{hex_id[20:]}"


_ID = "00000000000000000000000000000000"
_SLOT = "__diffq_batch__"


class TaskMessages:
    """Celery protocol 2 messages for the batch task, from one `as_task_v2` template.

    What varies per message: the task id (in `id`, `root_id` and `correlation_id`),
    `kwargsrepr` and the `batch` argument. Everything else is what Celery builds.
    """

    def __init__(self, app: Celery, keys: Keys | None = None):
        self._keys = keys  # with keys, every message is signed (core/signing.py)
        headers, properties, body, _ = app.amqp.as_task_v2(
            _ID, TASK_NAME, args=(), kwargs={"batch": _SLOT},
            # Keep stored messages lean: by default Celery adds a repr of the arguments
            # (up to kwargsrepr_maxsize, 1024 chars; celery/app/amqp.py) to every message.
            argsrepr="", kwargsrepr=_SLOT,
        )
        self._headers = dict(headers)
        self._header_ids = [key for key, value in headers.items() if value == _ID]
        self._properties = dict(properties)
        self._property_ids = [key for key, value in properties.items() if value == _ID]
        self._body_head, self._body_tail = orjson.dumps(body).split(orjson.dumps(_SLOT))

    def body(self, encoded) -> bytes:
        """The JSON task body `[args, kwargs, embed]`, with the batch (an `EncodedBatch`,
        producer/messages.py) as `kwargs["batch"]`."""
        return self._body_head + encoded.json + self._body_tail

    def headers(self, encoded, task_id: str) -> dict:
        headers = self._headers.copy()
        for key in self._header_ids:
            headers[key] = task_id
        headers["kwargsrepr"] = f"{encoded.run_id}/{encoded.batch_id}"
        if self._keys is not None:
            headers[SIGNATURE] = self._keys.sign(encoded.queue, encoded.run_id, encoded.json)
        return headers

    def properties(self, task_id: str) -> dict:
        properties = self._properties.copy()
        for key in self._property_ids:
            properties[key] = task_id
        return properties


# -- publishing --------------------------------------------------------------------------------


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


# -- depths ------------------------------------------------------------------------------------


def declared_depths(connection, queues: list[str]) -> dict[str, tuple[int, int]]:
    """queue -> (messages, broker-side consumers) by passive declare; missing -> (0, 0)."""
    result = {}
    channel = connection.channel()
    try:
        for name in queues:
            try:
                _, messages, consumers = channel.queue_declare(queue=name, passive=True)
            except Exception:
                # A queue nobody published to yet (Redis: no key; AMQP: 404, which
                # also closes the channel, so open a new one).
                close_quietly(channel)
                channel = connection.channel()
                messages, consumers = 0, 0
            result[name] = (messages, consumers)
    finally:
        close_quietly(channel)
    return result



def close_quietly(channel) -> None:
    try:
        channel.close()
    except Exception:
        pass


def passive_queue_depths(connection, queues: list[str]) -> dict[str, int]:
    return {queue: messages for queue, (messages, _) in declared_depths(connection, queues).items()}


# -- arrivals ----------------------------------------------------------------------------------


# Where a worker finds the queue a delivery was taken from, as the transport saw it.
# On Redis, SQS and the filesystem the envelope's delivery_info is the publisher's
# to write, so its routing key is only what the sender claims.
ARRIVAL = "diffq_arrival"


class StampingCallbacks(dict):
    """kombu's virtual transports hand each fetched message to the callback of the
    queue they took it from (kombu/transport/virtual/base.py `Transport._deliver`:
    `self._callbacks[queue](message)`; kombu/transport/SQS/__init__.py
    `_on_messages_ready`: `self.connection._callbacks.get(qname)`); each callback set
    here first writes that queue into the message's delivery_info."""

    def __init__(self, callbacks: dict):
        super().__init__()
        for queue, callback in callbacks.items():
            self[queue] = callback

    def __setitem__(self, queue, callback):
        def stamped(raw, _queue=queue, _callback=callback):
            properties = raw.get("properties") if isinstance(raw, dict) else None
            if isinstance(properties, dict):
                info = properties.get("delivery_info")
                if not isinstance(info, dict):
                    info = properties["delivery_info"] = {}
                info[ARRIVAL] = _queue
            return _callback(raw)

        super().__setitem__(queue, stamped)


def stamp_virtual_arrivals(consumer) -> None:
    """Make every delivery to this kombu Consumer's connection carry its queue (once)."""
    transport = consumer.channel.connection
    callbacks = getattr(transport, "_callbacks", None)
    if isinstance(callbacks, dict) and not isinstance(callbacks, StampingCallbacks):
        transport._callbacks = StampingCallbacks(callbacks)


def virtual_arrival(message, consumer) -> str | None:
    return (message.delivery_info or {}).get(ARRIVAL)



# -- what a consumer holds ---------------------------------------------------------------------


def held_deliveries(consumer) -> list:
    """The deliveries a Celery consumer holds unacked, or [] without one.

    kombu's virtual QoS (kombu/transport/virtual/base.py, class QoS, kombu 5.7) keeps
    every delivery in `_delivered`; `ack()` and `reject()` only add the tag to
    `_dirty`, and `_flush()` drops dirty tags from `_delivered` on the next
    `append()`. So an acked batch stays in `_delivered` until the next delivery:
    renewing it is wasted and handing it back could re-queue a finished batch.
    """
    try:
        qos = consumer.task_consumer.channel.qos
        delivered, acked = qos._delivered, qos._dirty
    except AttributeError:
        return []
    for _ in range(3):
        try:
            # `_delivered` first: an ack landing between the two copies is then seen.
            held = list(delivered.items())
            done = set(acked)
        except RuntimeError:  # changed while copied: take it again
            continue
        return [message for tag, message in held if tag not in done]
    return []


# -- dead letters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetterReport:
    """The dead letters on a broker: how many, and some of them (queue, reason, at)."""

    count: int
    letters: list[dict]
    order: str  # which ones `letters` are, in words



def letter_fields(payload, queue: str | None, reason: str) -> dict:
    """A worker's JSON letter (worker/delivery/dead_letters.py `letter`) as it is, else what the
    broker says about a message it moved itself."""
    if isinstance(payload, dict) and payload.get("v") == 1 and "reason" in payload:
        return {"queue": payload.get("queue"), "reason": payload.get("reason"), "at": payload.get("at")}
    return {"queue": queue, "reason": reason, "at": None}


def envelope_payload(envelope: dict):
    """The body of a kombu virtual-transport envelope, parsed (None if not JSON)."""
    body = envelope.get("body")
    try:
        if (envelope.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return json.loads(body)
    except (ValueError, TypeError):
        return None


def envelope_queue(envelope: dict) -> str | None:
    return ((envelope.get("properties") or {}).get("delivery_info") or {}).get("routing_key")




class Broker:
    """One broker kind as diffq drives it beyond kombu's public API; the transport
    table's row (diffq/core/transports.py) points at its object. What a broker does
    not do is None here (the callers check): no lease to renew, no hand-back, no
    listing, no consumer-channel fixes, no dead-letter peek."""

    # The producer's fast path: a class (producer, batch_size) with put / flush / close.
    publisher = KombuBatch
    # A kombu Transport class replacing the scheme's own ("module:Class").
    kombu_transport: str | None = None
    # renew(channel, messages) -> renewed, every lease period; None where the broker
    # needs nothing (AMQP: the connection is the lease; embedded: the runner reconciles).
    renew = None
    # hand_back(channel, messages) -> handed: held deliveries back now (drain past its
    # timeout, parent gone); None where closing the connection does it or nothing can.
    hand_back = None
    # list_depths(connection, prefix) -> {queue: depth}: every queue in one call;
    # None: names come from the caller and the workers, each depth a passive declare.
    list_depths = None
    # shared_depths(connection, prefix, max_age) -> {queue: depth}: one listing the
    # whole fleet shares; None: each worker reads queue_depths itself.
    shared_depths = None
    # list_queues(connection, prefix, api) -> names, for workers without --queues.
    list_queues = None
    # guard_deliveries(channel, on_bad): check raw deliveries the transport would choke on.
    guard_deliveries = None
    # consumer_channel(channel, closed): what the worker's consumer channel needs
    # beyond kombu's own; `closed(StillHeld | ConnectionLost)` for each delivery held at its close.
    consumer_channel = None
    # answer(message) -> Future | None: what this delivery's next ack or reject meets where
    # it runs (None once the broker was told, a `ConnectionLost` when it could not be);
    # None: the broker's acks answer nothing beyond kombu's (they raise on a lost connection).
    answer = None
    # peek_dead_letters(connection, limit, peeked) -> DeadLetterReport; None: only the depth.
    peek_dead_letters = None
    # stamp_arrivals(consumer): what the consumer needs installed for `arrival` to know.
    stamp_arrivals = staticmethod(stamp_virtual_arrivals)

    def kombu_transport_for(self, broker_url: str) -> str | None:
        """The kombu Transport class ("module:Class") Celery is handed for this URL."""
        return self.kombu_transport

    def options(self, settings) -> dict:
        """kombu transport options this broker needs (settings -> dict)."""
        return {"visibility_timeout": settings.visibility_timeout}

    def consumer_arguments(self, settings) -> dict:
        """Arguments of the worker's basic.consume."""
        return {}

    def queue_depths(self, connection, queues: list[str]) -> dict[str, int]:
        """The depth of each of `queues` (0 for one with no messages yet)."""
        return passive_queue_depths(connection, queues)

    def arrival(self, message, consumer) -> str | None:
        """The queue a delivery arrived on, as the transport saw it."""
        return virtual_arrival(message, consumer)

    def held(self, consumer) -> list:
        """The deliveries a Celery consumer holds unacked."""
        return held_deliveries(consumer)

    def declare_dead_letters(self, connection, queues: list[str], api: str | None = None) -> bool:
        """True where the broker now dead-letters a delivery rejected without requeue
        itself; False: the worker writes a letter to DEAD_LETTERS and acks. Idempotent;
        run by `diffq submit` and worker start."""
        return False
