"""The transport table: what diffq needs to know about each kind of broker, as data.

One row per broker kind, beside the backend table (worker/backends.py). Every
place that used to branch on the broker URL (the Celery app, the publisher, the
queue report, compile-aware routing, the held acks, the embedded runner, the
lease keeper) looks its answer up here instead.

Facts pinned to kombu 5.7's sources (tests/test_transports.py cites them):
- Redis keeps a delivered message in the `unacked` hash and its delivery time in
  the `unacked_index` sorted set; a live consumer's sweep (`QoS.restore_visible`,
  under the `unacked_mutex`) puts back every entry older than the visibility
  timeout (kombu/transport/redis.py). Renewing a lease = moving the score forward.
- SQS hides a received message for its visibility timeout; the holder extends it
  with `ChangeMessageVisibility` on the receipt handle (kombu/transport/SQS).
- RabbitMQ redelivers by itself when the consumer's connection goes, so nothing
  needs renewing; it closes a channel whose delivery stays unacked past
  `consumer_timeout` (see docs/RELIABILITY.md).
- The filesystem transport removes the message file on fetch: a task in flight
  when its worker is SIGKILLed is lost, so the embedded runner reconciles from the
  run folder (../shared/CELERY.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

PREFIX = "diffq."
# kombu's Redis priority sub-lists are '<queue>\x06\x16<priority>'.
PRIORITY_SEP = "\x06\x16"


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
                _close_quietly(channel)
                channel = connection.channel()
                messages, consumers = 0, 0
            result[name] = (messages, consumers)
    finally:
        _close_quietly(channel)
    return result


def _close_quietly(channel) -> None:
    try:
        channel.close()
    except Exception:
        pass


def redis_list_depths(connection, prefix: str = PREFIX) -> dict[str, int]:
    """Every diffq queue on a Redis broker: one SCAN for lists plus one pipelined LLEN.

    Each queue is one list named exactly like it (priority_steps=[0]) and an empty
    queue has no key; any priority sub-list another producer made is folded in."""
    client = connection.default_channel.client
    keys = sorted(k.decode() if isinstance(k, bytes) else k
                  for k in client.scan_iter(match=f"{prefix}*", count=1000, _type="list"))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    depths: Counter = Counter()
    for key, n in zip(keys, pipe.execute()):
        depths[key.split(PRIORITY_SEP, 1)[0]] += n
    return dict(depths)


def redis_queue_depths(connection, queues: list[str]) -> dict[str, int]:
    """The depth of each of `queues` on Redis: one pipelined LLEN (no key = empty)."""
    pipe = connection.default_channel.client.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(queue)
    return dict(zip(queues, pipe.execute()))


def passive_queue_depths(connection, queues: list[str]) -> dict[str, int]:
    return {queue: messages for queue, (messages, _) in declared_depths(connection, queues).items()}


def renew_redis(channel, messages: list) -> int:
    """Move each held delivery's `unacked_index` score to now (XX: never re-adds one
    that was acked or restored meanwhile). Returns how many entries were renewed."""
    now = time.time()
    tags = {message.delivery_tag: now for message in messages}
    if not tags:
        return 0
    # CH counts members whose score changed: the delivery time only moves forward.
    return channel.client.zadd(channel.unacked_index_key, tags, xx=True, ch=True)


def renew_sqs(channel, messages: list) -> int:
    """ChangeMessageVisibility on each held receipt handle: hidden for another timeout."""
    renewed = 0
    for message in messages:
        info = message.delivery_info
        sqs_message, queue_url = info.get("sqs_message"), info.get("sqs_queue")
        if not sqs_message or not queue_url:
            continue
        queue = channel.canonical_queue_name(info["routing_key"]) if info.get("routing_key") else None
        channel.sqs(queue=queue).change_message_visibility(
            QueueUrl=queue_url, ReceiptHandle=sqs_message["ReceiptHandle"],
            VisibilityTimeout=int(channel.visibility_timeout))
        renewed += 1
    return renewed


def _visibility_options(settings) -> dict:
    return {"visibility_timeout": settings.visibility_timeout}


def _redis_options(settings) -> dict:
    return {
        "visibility_timeout": settings.visibility_timeout,
        # Keep every message in the base list: priority sub-lists would hide depth
        # from KEDA's redis-list scaler (its listName must equal the queue name).
        "priority_steps": [0],
        # Sweep for expired leases every 10 s on every sweep (kombu scans only on
        # every 10th by default): a dead holder's batch is back within a lease + 10 s.
        "unacked_restore_interval": 10,
        "unacked_restore_throttle": 1,
    }


def _amqp_options(settings) -> dict:
    return {}


@dataclass(frozen=True)
class Transport:
    name: str
    schemes: tuple[str, ...]
    # Celery drives the consumer from an event loop (hub): timers run while idle
    # (held-ack settling, routing, Redis's restore sweep), and the consumer can
    # switch queues at run time. Without one (synloop) there are no timers.
    event_loop: bool
    # A task in flight when its worker is SIGKILLed never comes back by itself.
    loses_inflight_on_kill: bool
    # How the batch a worker holds stays its own while it works, and returns when
    # the holder dies: a renew(channel, messages) call every lease period, or None
    # where the broker needs nothing (AMQP: the connection is the lease; embedded:
    # the runner reconciles from the run folder).
    renew: Callable | None
    lease: str  # the same, in words, for `diffq queues` and the docs
    # The producer's fast path (producer/publish.py's PUBLISHERS).
    publisher: str = "kombu-batch"
    # Every queue under a prefix and its depth, in one call (connection, prefix), or None: names come from the
    # caller and the workers, and each depth is a passive declare.
    list_depths: Callable | None = None
    # The depth of each of the given queues (0 for one with no messages yet): what
    # compile-aware routing reads every second.
    queue_depths: Callable = field(default=passive_queue_depths)
    broker_options: Callable = field(default=_visibility_options)
    # A kombu Transport class replacing the scheme's own ("module:Class").
    kombu_transport: str | None = None


TRANSPORTS = (
    Transport("redis", ("redis", "rediss", "sentinel"), event_loop=True, loses_inflight_on_kill=False,
              renew=renew_redis, lease="unacked_index score renewed", publisher="redis-lists",
              list_depths=redis_list_depths, queue_depths=redis_queue_depths, broker_options=_redis_options),
    Transport("amqp", ("amqp", "amqps", "pyamqp"), event_loop=True, loses_inflight_on_kill=False,
              renew=None, lease="connection (broker redelivers when it closes)", broker_options=_amqp_options),
    Transport("sqs", ("sqs",), event_loop=True, loses_inflight_on_kill=False,
              renew=renew_sqs, lease="ChangeMessageVisibility on the receipt handle"),
    Transport("embedded", ("filesystem",), event_loop=False, loses_inflight_on_kill=True,
              renew=None, lease="none: the runner re-enqueues from the run folder",
              broker_options=lambda settings: {}, kombu_transport="diffq.core.broker:EmbeddedTransport"),
    # kombu's in-process transport: only for plans and tests that start nothing.
    Transport("memory", ("memory",), event_loop=False, loses_inflight_on_kill=True,
              renew=None, lease="none (in-process)", broker_options=lambda settings: {}),
)
_BY_SCHEME = {scheme: row for row in TRANSPORTS for scheme in row.schemes}


class UnknownTransport(ValueError):
    pass


def transport_for(broker_url: str) -> Transport:
    scheme = broker_url.split("://", 1)[0].split("+", 1)[0].lower()
    try:
        return _BY_SCHEME[scheme]
    except KeyError:
        raise UnknownTransport(f"broker URL scheme '{scheme}://' is not one diffq supports "
                               f"({', '.join(sorted(_BY_SCHEME))})") from None
