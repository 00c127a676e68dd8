"""Queue depth per shape queue and the workers consuming each: the autoscaling signal.

Depth comes from the broker itself. On Redis every diffq queue is one list named
exactly like the queue (no priority sub-lists, see broker.py), so a SCAN for
`diffq.*` lists plus one pipelined LLEN reads all of them in about a millisecond,
and a queue with no key is empty. Other transports cannot list their queues
without a management API, so there the names come from the caller and from the
workers' replies, and each depth is a passive declare.

Consumers come from `inspect().active_queues()`. A solo-pool worker busy with a
batch does not answer remote control until the batch ends, so that count is a
lower bound while batches run; AMQP also reports the broker's own consumer count,
and the larger of the two is shown.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from diffq.core.broker import make_celery

PREFIX = "diffq."
# kombu's Redis priority sub-lists are '<queue>\x06\x16<priority>'.
PRIORITY_SEP = "\x06\x16"


@dataclass
class QueueInfo:
    queue: str
    depth: int
    consumers: int

    def to_json(self) -> dict:
        return asdict(self)


def is_redis(broker_url: str) -> bool:
    return broker_url.split("://", 1)[0] in ("redis", "rediss")


def redis_depths(broker_url: str, prefix: str = PREFIX) -> dict[str, int]:
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{prefix}*", count=1000, _type="list"))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.llen(key)
        depths: Counter = Counter()
        for key, n in zip(keys, pipe.execute()):
            # Fold any priority sub-list (another producer's priority >= 3) into its queue.
            depths[key.split(PRIORITY_SEP, 1)[0]] += n
        return dict(depths)
    finally:
        client.close()


def declared_depths(app, queues: list[str]) -> dict[str, tuple[int, int]]:
    """queue -> (messages, broker-side consumers) by passive declare; missing -> (0, 0)."""
    result = {}
    with app.connection_for_read() as conn:
        channel = conn.channel()
        try:
            for name in queues:
                try:
                    _, messages, consumers = channel.queue_declare(queue=name, passive=True)
                except conn.channel_errors:
                    # AMQP closes the channel on a 404 NOT_FOUND: open a new one.
                    channel = conn.channel()
                    messages, consumers = 0, 0
                result[name] = (messages, consumers)
        finally:
            channel.close()
    return result


def worker_queues(app, timeout: float) -> Counter:
    """queue -> number of workers that answered `active_queues` within `timeout`."""
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    counts: Counter = Counter()
    for queues in replies.values():
        for queue in {q["name"] for q in queues}:
            counts[queue] += 1
    return counts


def queue_report(broker_url: str, queues: list[str] | None = None, *, timeout: float = 1.0,
                 prefix: str = PREFIX, transport_options: dict | None = None) -> list[QueueInfo]:
    """Depth and consumers for every diffq queue the broker or the workers know of."""
    app = make_celery(broker_url, transport_options)
    # Fail fast on an unreachable broker instead of Celery's retry loop.
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
    consumers = worker_queues(app, timeout) if timeout > 0 else Counter()
    names = set(queues or []) | {q for q in consumers if q.startswith(prefix)}
    if is_redis(broker_url):
        depths = redis_depths(broker_url, prefix)
        broker_consumers: dict[str, int] = {}
        names |= set(depths)
    else:
        declared = declared_depths(app, sorted(names))
        depths = {q: d for q, (d, _) in declared.items()}
        broker_consumers = {q: c for q, (_, c) in declared.items()}
    return [QueueInfo(queue=q, depth=depths.get(q, 0),
                      consumers=max(consumers.get(q, 0), broker_consumers.get(q, 0)))
            for q in sorted(names)]
