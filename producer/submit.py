"""Submit: validate the whole file, write the manifest and plan, publish batches.

Two streaming passes over the input. The first validates every row (nothing is
written or enqueued if any row is bad) and counts shapes; the second buckets and
publishes. Each plan part is stored before its batches are published, so the run
folder always knows every batch the broker might hold.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from diffq import __version__, layout
from diffq.broker import TASK_NAME, make_celery
from diffq.contract import BatchMessage, RunManifest, ShapeKey, ShapeSummary
from diffq.storage import Storage, open_storage
from diffq.producer.bucketing import Batch, RunOptions, bucket, shape_for
from diffq.producer.sources import Defaults, IdChecker, InputError, read_prompts

PLAN_PART_BATCHES = 2000


class RunExists(RuntimeError):
    pass


@dataclass
class SubmitResult:
    out: str
    run_id: str
    total: int
    batches: int
    queues: dict[str, int] = field(default_factory=dict)  # queue -> batches

    @property
    def shapes(self) -> int:
        return len(self.queues)

    def summary(self) -> str:
        return f"{self.total} items, {self.shapes} shapes, {self.batches} batches"


def batch_id(shape: ShapeKey, index: int) -> str:
    digest = hashlib.sha1(shape.queue.encode()).hexdigest()[:6]
    return f"{shape.height}x{shape.width}-{digest}-{index:07d}"


def to_message(batch: Batch, run_id: str, out: str) -> BatchMessage:
    return BatchMessage(
        run_id=run_id,
        out=out,
        batch_id=batch_id(batch.shape, batch.index),
        shape=batch.shape,
        params=batch.params,
        items=batch.items,
    )


class CeleryPublisher:
    """Publishes batch messages to their shape queues in pipelined batches.

    Celery builds each message (`as_task_v2`, the same format `send_task` sends) and
    kombu's `Producer.batch` flushes them in groups, one round trip per group on
    Redis instead of one per message (~950 msg/s for `apply_async` in a loop vs
    ~8,800 msg/s, ../shared/CELERY.md). Transports without batching publish at once.
    """

    def __init__(self, broker_url: str, transport_options: dict | None = None, batch_size: int = 1000):
        self.app = make_celery(broker_url, transport_options)
        self._connection = self.app.connection_for_write()
        self._producer = self._connection.Producer(serializer="json")
        self._batch = self._producer.batch(max_size=batch_size)
        self._batch.__enter__()
        self._declared: set[str] = set()

    def publish(self, message: BatchMessage) -> None:
        name = message.shape.queue
        queue = self.app.amqp.queues[name]  # created on first use, routed by its own name
        headers, properties, body, _ = self.app.amqp.as_task_v2(
            uuid.uuid4().hex, TASK_NAME, args=(), kwargs={"batch": message.model_dump(mode="json")},
            # Keep stored messages lean: Redis holds ~3 KB per message otherwise.
            argsrepr="", kwargsrepr=f"{message.run_id}/{message.batch_id}",
        )
        declare = None if name in self._declared else [queue]
        self._declared.add(name)
        # The default exchange routes by queue name (AMQP and kombu's virtual
        # transports alike) and spares Redis a routing-table lookup per message.
        self._producer.publish(body, exchange="", routing_key=name, headers=headers,
                               serializer="json", declare=declare, retry=True, **properties)

    def close(self) -> None:
        try:
            self._batch.__exit__(None, None, None)  # flushes what is still buffered
        finally:
            self._connection.release()


@dataclass
class Plan:
    """What the validation pass learned: enough to write the manifest up front."""

    total: int
    batches: int
    shapes: list[ShapeSummary]


def validate(path: str | Path, options: RunOptions, defaults: Defaults) -> Plan:
    ids = IdChecker(path)
    # Plain tuple keys per row; shape keys are built once per shape at the end.
    per_group: Counter = Counter()
    total = 0
    for prompt in read_prompts(path, defaults):
        ids.check(prompt)
        per_group[(prompt.height, prompt.width, prompt.guidance_scale > 1.0,
                   prompt.num_inference_steps, prompt.guidance_scale)] += 1
        total += 1
    if total == 0:
        raise InputError(path, None, None, "no prompts in file")
    items: Counter = Counter()
    batches: Counter = Counter()
    shapes: dict[str, ShapeKey] = {}
    for (height, width, cfg, _, _), count in per_group.items():
        shape = shape_for(options, height, width, cfg)
        shapes[shape.queue] = shape
        items[shape.queue] += count
        batches[shape.queue] += math.ceil(count / options.batch_size)
    summaries = [ShapeSummary(shape=shapes[q], queue=q, items=items[q], batches=batches[q]) for q in sorted(shapes)]
    return Plan(total=total, batches=sum(batches.values()), shapes=summaries)


def make_options(*, model: str, batch_size: int = 4, steps: int = 4, guidance_scale: float = 1.0,
                 max_sequence_length: int = 64, height: int = 128, width: int = 128,
                 format: str = "png", dtype: str = "float32",
                 size_multiple: int = 16) -> tuple[RunOptions, Defaults]:
    """The run-wide options (shape and output) and the per-row defaults."""
    return (
        RunOptions(model=model, batch_size=batch_size, max_sequence_length=max_sequence_length,
                   dtype=dtype, format=format),
        Defaults(height=height, width=width, num_inference_steps=steps,
                 guidance_scale=guidance_scale, size_multiple=size_multiple),
    )


def write_plan_part(storage: Storage, part: int, messages: list[BatchMessage]) -> None:
    body = "".join(message.to_json() + "\n" for message in messages).encode()
    storage.put_bytes(layout.plan_key(part), body, content_type="application/jsonl")


def read_plan(storage: Storage) -> Iterator[BatchMessage]:
    for key in sorted(storage.list(layout.PLAN_PREFIX)):
        for line in storage.get_bytes(key).decode().splitlines():
            if line:
                yield BatchMessage.model_validate_json(line)


def submit(
    prompts: str | Path,
    out: str,
    *,
    model: str,
    broker_url: str | None = None,
    transport_options: dict | None = None,
    publisher=None,
    batch_size: int = 4,
    steps: int = 4,
    guidance_scale: float = 1.0,
    max_sequence_length: int = 64,
    height: int = 128,
    width: int = 128,
    format: str = "png",
    dtype: str = "float32",
    run_id: str | None = None,
    seed_base: str | None = None,
    size_multiple: int = 16,
    on_published: Callable[[int], None] | None = None,
    plan: Plan | None = None,
) -> SubmitResult:
    """Validate `prompts`, write the run folder's manifest and plan, publish batches.

    Raises `InputError` (nothing written, nothing enqueued) on any bad row and
    `RunExists` if OUT already holds a run: nothing produced is ever overwritten.
    """
    options, defaults = make_options(model=model, batch_size=batch_size, steps=steps,
                                     guidance_scale=guidance_scale,
                                     max_sequence_length=max_sequence_length, height=height,
                                     width=width, format=format, dtype=dtype,
                                     size_multiple=size_multiple)
    plan = plan or validate(prompts, options, defaults)

    storage = open_storage(out)
    run_id = run_id or uuid.uuid4().hex[:12]
    manifest = RunManifest(
        run_id=run_id,
        created_at=time.time(),
        source=Path(prompts).name,
        out=storage.url,
        total=plan.total,
        batches=plan.batches,
        plan_parts=math.ceil(plan.batches / PLAN_PART_BATCHES),
        shapes=plan.shapes,
        defaults={"model": model, "batch_size": batch_size, "steps": steps,
                  "guidance_scale": guidance_scale, "max_sequence_length": max_sequence_length,
                  "height": height, "width": width, "format": format, "dtype": dtype,
                  "seed_base": seed_base or run_id},
        diffq_version=__version__,
    )
    body = json.dumps(manifest.model_dump(mode="json"), indent=2).encode()
    if not storage.put_bytes(layout.MANIFEST, body, content_type="application/json", if_absent=True):
        raise RunExists(f"{storage.url} already holds a run; use a new OUT, or `diffq resume {storage.url}`")

    own_publisher = publisher is None
    if own_publisher:
        if not broker_url:
            raise ValueError("submit needs a broker URL (--broker or DIFFQ_BROKER_URL)")
        publisher = CeleryPublisher(broker_url, transport_options)
    result = SubmitResult(out=storage.url, run_id=run_id, total=plan.total, batches=0)
    pending: list[BatchMessage] = []
    part = 0

    def flush() -> None:
        nonlocal part, pending
        write_plan_part(storage, part, pending)
        for message in pending:
            publisher.publish(message)
            result.batches += 1
            result.queues[message.shape.queue] = result.queues.get(message.shape.queue, 0) + 1
            if on_published:
                on_published(len(message.items))
        part += 1
        pending = []

    try:
        for batch in bucket(read_prompts(prompts, defaults), options, manifest.defaults["seed_base"]):
            pending.append(to_message(batch, run_id, storage.url))
            if len(pending) == PLAN_PART_BATCHES:
                flush()
        if pending:
            flush()
    finally:
        if own_publisher:
            publisher.close()
    return result
