"""Queue depth per shape queue and the workers consuming each: the autoscaling signal.

Depth comes from the broker itself, as the transport table says
(diffq/core/transports.py): a broker that can list its queues (Redis: one SCAN
for `diffq.*` lists plus one pipelined LLEN, and a queue with no key is empty)
reports every diffq queue; on the others the names come from the caller and from
the workers' replies, and each depth is a passive declare.

The dead letters (`diffq.dead`: messages a worker refused, worker/dead_letters.py)
are always reported. SQS and, given its management API URL, RabbitMQ list their
queues too (the transport table's `list_queues`).

Consumers come from `inspect().active_queues()`. A solo-pool worker busy with a
batch does not answer remote control until the batch ends, so that count is a
lower bound while batches run; a passive declare also reports the broker's own
consumer count (AMQP), and the larger of the two is shown.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from diffq.core.broker import make_celery
from diffq.core.transports import DEAD_LETTERS, PREFIX, PRIORITY_SEP, declared_depths, transport_for

__all__ = ["DEAD_LETTERS", "PREFIX", "PRIORITY_SEP", "QueueInfo", "queue_report", "worker_queues"]


@dataclass
class QueueInfo:
    queue: str
    depth: int
    consumers: int

    def to_json(self) -> dict:
        return asdict(self)


def worker_queues(app, timeout: float) -> Counter:
    """queue -> number of workers that answered `active_queues` within `timeout`."""
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    counts: Counter = Counter()
    for queues in replies.values():
        for queue in {q["name"] for q in queues}:
            counts[queue] += 1
    return counts


def queue_report(broker_url: str, queues: list[str] | None = None, *, timeout: float = 1.0,
                 prefix: str = PREFIX, transport_options: dict | None = None,
                 rabbitmq_api: str | None = None) -> list[QueueInfo]:
    """Depth and consumers for every diffq queue the broker or the workers know of."""
    transport = transport_for(broker_url)
    app = make_celery(broker_url, transport_options)
    consumers: Counter = Counter()
    broker_consumers: dict[str, int] = {}
    with app.connection_for_write() as conn:
        # Fail fast on an unreachable broker instead of Celery's retry loop.
        conn.ensure_connection(max_retries=1)
        if timeout > 0:
            consumers = worker_queues(app, timeout)
        names = set(queues or []) | {q for q in consumers if q.startswith(prefix)} | {DEAD_LETTERS}
        if transport.list_depths is None and transport.list_queues is not None \
                and (rabbitmq_api or not transport.list_needs_api):
            names |= set(transport.list_queues(conn, prefix, rabbitmq_api))
        if transport.list_depths is not None:
            depths = transport.list_depths(conn, prefix)
            names |= set(depths)
        else:
            declared = declared_depths(conn, sorted(names))
            depths = {q: d for q, (d, _) in declared.items()}
            broker_consumers = {q: c for q, (_, c) in declared.items()}
    return [QueueInfo(queue=q, depth=depths.get(q, 0),
                      consumers=max(consumers.get(q, 0), broker_consumers.get(q, 0)))
            for q in sorted(names)]
