"""Shapes from queue names: which graphs a worker's queues will need.

The queue name is the shape key (`diffq.core.contract.queue_name`) with the model as a
slug, so it parses back to a `ShapeKey` given the models the worker loads. Used to
warm up exactly the graphs the served queues need, and to route by compiled shape.
"""

from __future__ import annotations

import random
import re

from celery import bootsteps

from diffq.core.contract import ShapeKey, model_slug

_QUEUE_RE = re.compile(
    r"diffq\.(?P<slug>[a-z0-9-]+)\.(?P<height>\d+)x(?P<width>\d+)\.b(?P<batch>\d+)"
    r"\.l(?P<seq>\d+)\.(?P<cfg>cfg|nocfg)\.(?P<dtype>fp32|bf16|fp16)"
)
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def shape_from_queue(queue: str, models: list[str]) -> ShapeKey | None:
    """The shape a queue carries, or None if it is not a shape queue of these models."""
    match = _QUEUE_RE.fullmatch(queue)
    if not match:
        return None
    model = next((m for m in models if model_slug(m) == match["slug"]), None)
    if model is None:
        return None
    return ShapeKey(model=model, height=int(match["height"]), width=int(match["width"]),
                    batch_size=int(match["batch"]), max_sequence_length=int(match["seq"]),
                    cfg=match["cfg"] == "cfg", dtype=_DTYPES[match["dtype"]])


# -- Compile-aware routing ---------------------------------------------------------
#
# A worker serving several shape queues keeps consuming the shapes it has already
# compiled while they have a backlog, and takes on one new shape at a time only
# when they are empty (chosen at random, weighted by backlog, so idle workers of a
# fleet spread over new shapes instead of all compiling the same ones). Celery's
# own consumer API switches queues: `add_task_queue` / `cancel_task_queue`.


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


class CompileAwareRouting(bootsteps.StartStopStep):
    """Consumer bootstep; re-chooses queues every second and after each batch.

    Needs the consumer's event loop (Redis, AMQP); with the embedded filesystem
    broker, which has none, the worker keeps Celery's round-robin over its queues.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)
    interval = 1.0

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.consumer = None
        self.rng = random.Random()

    def start(self, consumer):
        global _active_step
        if consumer.hub is None or len(_state["served"]) < 2:
            return
        self.consumer = consumer
        _active_step = self
        consumer.hub.call_repeatedly(self.interval, self.update)

    def stop(self, consumer):
        global _active_step
        _active_step = None
        self.consumer = None

    def _depths(self) -> dict[str, int]:
        depths = {}
        channel = self.consumer.connection.channel()
        try:
            for queue in _state["served"]:
                try:
                    depths[queue] = channel.queue_declare(queue=queue, passive=True).message_count
                except Exception:  # a queue nobody published to yet (Redis: no key)
                    depths[queue] = 0
        finally:
            channel.close()
        return depths

    def update(self) -> None:
        consumer = self.consumer
        if consumer is None or consumer.task_consumer is None:
            return
        served = _state["served"]
        want = choose_queues(served, _state["compiled"](), self._depths(), self.rng)
        current = {queue for queue in served if consumer.task_consumer.consuming_from(queue)}
        for queue in sorted(want - current):
            consumer.add_task_queue(queue)
        for queue in sorted(current - want):
            consumer.cancel_task_queue(queue)


_state: dict = {"served": [], "compiled": set}
_active_step: CompileAwareRouting | None = None


def configure(served: list[str], compiled) -> None:
    """What the routing step serves, and a callable giving the compiled queues."""
    _state["served"] = list(served)
    _state["compiled"] = compiled


def after_batch() -> None:
    """Re-choose right after a batch (main thread), before the next fetch."""
    if _active_step is not None:
        _active_step.update()
