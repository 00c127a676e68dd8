"""Compile-aware routing: which of its queues a worker consumes from now.

A worker serving several shape queues keeps consuming the shapes it has already
compiled while they have a backlog, and takes on one new shape at a time only
when they are empty (chosen at random, weighted by backlog, so idle workers of a
fleet spread over new shapes instead of all compiling the same ones). Celery's
own consumer API switches queues: `add_task_queue` / `cancel_task_queue`.
Queue names parse back to shapes with `diffq.core.contract.shape_from_queue`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from diffq.core.transports import Transport

def choose_queues(served: list[str], compiled: set[str], depths: dict[str, int], rng: random.Random) -> set[str]:
    """The queues to consume from now."""
    backlog = {queue for queue in served if depths.get(queue, 0) > 0}
    hot = backlog & compiled
    if hot:
        return hot
    fresh = sorted(backlog - compiled)
    if fresh:
        pick = rng.choices(fresh, weights=[depths[queue] for queue in fresh])[0]
        return {pick} | (compiled & set(served))
    # Nothing queued anywhere: listen everywhere, so new work starts at once.
    return set(served)


class Router:
    """Re-chooses the consumer's queues: on a 1 s timer and right after each batch.

    Needs the consumer's event loop (the transport table's `event_loop`); without one
    (the embedded filesystem broker) the worker keeps Celery's round-robin.
    """

    interval = 1.0

    def __init__(self, served: list[str], compiled: Callable[[], set[str]], transport: Transport,
                 rng: random.Random | None = None):
        self.served = list(served)
        self.compiled = compiled  # the queues whose shapes this process has compiled
        self.transport = transport
        self.rng = rng or random.Random()
        self.consumer = None

    @property
    def applies(self) -> bool:
        """Only a choice among several queues, and only with an event loop to run it."""
        return len(self.served) >= 2 and self.transport.event_loop

    def attach(self, consumer) -> None:
        self.consumer = consumer

    def detach(self) -> None:
        self.consumer = None

    def update(self) -> None:
        consumer = self.consumer
        if consumer is None or consumer.task_consumer is None:
            return
        depths = self.transport.queue_depths(consumer.connection, self.served)
        want = choose_queues(self.served, self.compiled(), depths, self.rng)
        current = {queue for queue in self.served if consumer.task_consumer.consuming_from(queue)}
        for queue in sorted(want - current):
            consumer.add_task_queue(queue)
        for queue in sorted(current - want):
            consumer.cancel_task_queue(queue)
