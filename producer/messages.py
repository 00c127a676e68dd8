"""Batch messages as bytes: the `BatchMessage` JSON, and the Celery task message around it.

At a million prompts a pydantic model and an `as_task_v2` call per message cost
more than reading, checking and bucketing the rows. Here each message is one
orjson call over plain values that were already validated: the row by its source,
the shape and parameters by pydantic once per group. The first message of every
queue still goes through `BatchMessage`, which catches a bad run id or OUT before
anything is published, and every message is held to `MAX_MESSAGE_BYTES`. The Celery
envelope around it is the broker classes' (diffq/core/brokers/base.py `TaskMessages`).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from pydantic import BaseModel

from diffq.core.contract import MAX_MESSAGE_BYTES, SCHEMA_VERSION, BatchMessage, ShapeKey
from diffq.core.signing import canonical
from diffq.producer.bucketing import Batch


class EncodedBatch(NamedTuple):
    """A batch message ready to store in the plan and to publish."""

    queue: str
    run_id: str
    batch_id: str
    items: int
    json: bytes  # a `BatchMessage`, canonical (core/signing.py): one plan line, the task's `batch` argument

    @classmethod
    def of(cls, message: BatchMessage) -> EncodedBatch:
        return cls(message.shape.queue, message.run_id, message.batch_id, len(message.items),
                   canonical(message.model_dump(mode="json")))


def batch_id_prefix(shape: ShapeKey) -> str:
    digest = hashlib.sha1(shape.queue.encode()).hexdigest()[:6]
    return f"{shape.height}x{shape.width}-{digest}-"


def batch_id(shape: ShapeKey, index: int) -> str:
    return f"{batch_id_prefix(shape)}{index:07d}"


class BatchEncoder:
    """Encodes a run's batches; the run id and OUT are fixed for the run."""

    def __init__(self, run_id: str, out: str):
        self._head = {"schema_version": SCHEMA_VERSION, "run_id": run_id, "out": out}
        self._run_id = run_id
        # Keyed by id(): bucketing reuses one shape and one params object per group,
        # and hashing a pydantic model per batch costs more than encoding it.
        self._plain: dict[int, tuple[BaseModel, dict]] = {}
        self._queues: dict[int, tuple[str, str]] = {}
        self._checked: set[str] = set()

    def _dump(self, model: BaseModel) -> dict:
        held = self._plain.get(id(model))
        if held is None:
            held = self._plain[id(model)] = (model, model.model_dump(mode="json"))
        return held[1]

    def encode(self, batch: Batch) -> EncodedBatch:
        shape = batch.shape
        named = self._queues.get(id(shape))
        if named is None:
            self._dump(shape)  # holds the shape, so its id() is not reused
            named = self._queues[id(shape)] = (shape.queue, batch_id_prefix(shape))
        queue, id_prefix = named
        bid = f"{id_prefix}{batch.index:07d}"
        # Canonical: the form a signature covers.
        data = canonical({**self._head, "batch_id": bid, "shape": self._dump(shape),
                          "params": self._dump(batch.params), "items": batch.items})
        if len(data) > MAX_MESSAGE_BYTES:  # workers and the broker's memory count on it
            raise ValueError(f"batch {bid} would be a {len(data):,}-byte message, over the "
                             f"{MAX_MESSAGE_BYTES:,}-byte limit: use a smaller batch size or shorter prompts")
        if queue not in self._checked:
            BatchMessage.model_validate_json(data)
            self._checked.add(queue)
        return EncodedBatch(queue, self._run_id, bid, len(batch.items), data)
