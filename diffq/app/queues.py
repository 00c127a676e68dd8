"""Queue depth per shape queue and the workers consuming each: the autoscaling signal.

Depth comes from the broker itself, as the transport table says
(diffq/core/transports.py): a broker that can list its queues (Redis: one SCAN
for `diffq.*` lists plus one pipelined LLEN, and a queue with no key is empty)
reports every diffq queue; on the others the names come from the caller and from
the workers' replies, and each depth is a passive declare.

The dead letters (`diffq.dead`: messages a worker refused, worker/delivery/dead_letters.py)
are always reported, the same way on every broker: their count and, where the
broker keeps them, a few letters' queue, reason and time (the broker object's
`peek_dead_letters`, diffq/core/brokers/: Redis's newest, RabbitMQ's oldest with the queue its
`x-death` names, a sample on SQS). SQS and, given its management API URL,
RabbitMQ list their queues too (the broker object's `list_queues`).

Consumers come from `inspect().active_queues()` (a worker's consumer loop answers
while its task threads generate); a passive declare also reports the broker's own
consumer count (AMQP), and the larger of the two is shown.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import DEAD_LETTERS, PEEKED_LETTERS, PREFIX, declared_depths
from diffq.core.brokers.redis import PRIORITY_SEP
from diffq.core.transports import transport_for
from diffq.worker.api import peeked

__all__ = ["DEAD_LETTERS", "PEEKED_LETTERS", "PREFIX", "PRIORITY_SEP", "QueueInfo", "dead_letter_lines",
           "queue_report", "with_runs", "worker_queues"]


@dataclass
class QueueInfo:
    queue: str
    depth: int
    consumers: int
    # Batches of windowed runs still in OUT for the feeder (producer/feed.py): the
    # broker's depth is only the window, this is the rest of the backlog.
    unpublished: int = 0
    # Each windowed run with batches of this queue, as the feeds folders list them: its
    # out and run id and its counts here (core/feeds.py `RunFeedCounts`: in the broker,
    # in OUT, the live feeder, waiting for one); the table's per-run lines sum them.
    runs: list[dict] = field(default_factory=list, compare=False)
    # The dead letters' row only: some of them, {queue, reason, at}, and which ones.
    letters: list[dict] | None = field(default=None, compare=False)
    letters_order: str | None = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k not in ("letters", "letters_order")}


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
                 rabbitmq_api: str | None = None, letters: int = 0,
                 unpublished: dict[str, int] | None = None) -> list[QueueInfo]:
    """Depth and consumers for every diffq queue the broker or the workers know of;
    with `letters`, up to that many dead letters on the dead letters' row; with
    `unpublished` (queue -> batches still in OUT), those queues too, and their count."""
    unpublished = unpublished or {}
    transport = transport_for(broker_url)
    app = make_celery(broker_url, transport_options)
    consumers: Counter = Counter()
    broker_consumers: dict[str, int] = {}
    with app.connection_for_write() as conn:
        # Fail fast on an unreachable broker instead of Celery's retry loop.
        conn.ensure_connection(max_retries=1)
        if timeout > 0:
            consumers = worker_queues(app, timeout)
        names = (set(queues or []) | {q for q in consumers if q.startswith(prefix)} | {DEAD_LETTERS}
                 | {q for q, n in unpublished.items() if n})
        broker = transport.broker
        if broker.list_depths is None and broker.list_queues is not None \
                and (rabbitmq_api or not transport.list_needs_api):
            names |= set(broker.list_queues(conn, prefix, rabbitmq_api))
        if broker.list_depths is not None:
            depths = broker.list_depths(conn, prefix)
            names |= set(depths)
        else:
            declared = declared_depths(conn, sorted(names))
            depths = {q: d for q, (d, _) in declared.items()}
            broker_consumers = {q: c for q, (_, c) in declared.items()}
        dead = broker.peek_dead_letters(conn, letters, peeked=peeked) if broker.peek_dead_letters and letters else None
    report = [QueueInfo(queue=q, depth=depths.get(q, 0),
                        consumers=max(consumers.get(q, 0), broker_consumers.get(q, 0)),
                        unpublished=unpublished.get(q, 0))
              for q in sorted(names)]
    if dead is not None:
        for info in report:
            if info.queue == DEAD_LETTERS:
                info.depth, info.letters, info.letters_order = dead.count, dead.letters, dead.order
    return report


def with_runs(report: list[QueueInfo], runs: list) -> None:
    """Each run's counts (`producer.feed.waiting_runs`: (entry, RunFeedCounts)) on the rows
    of the queues it has batches of."""
    for info in report:
        info.runs = [{"out": entry.out, "run_id": entry.run_id, **counts.on(info.queue).to_json()}
                     for entry, counts in runs if info.queue in counts.per_queue]


def dead_letter_lines(report: list[QueueInfo]) -> list[str]:
    """The dead letters `queue_report` peeked at, one line each (time UTC, queue, reason)."""
    lines = []
    for info in report:
        if info.letters:
            lines.append(f"dead letters, {info.letters_order}:")
            for letter in info.letters:
                at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(letter["at"])) if letter["at"] else "-"
                lines.append(f"  {at}  {letter['queue'] or '?'}  {letter['reason']}")
    return lines
