"""Re-enqueue what the run folder says is left: `resume` and `retry-failed`.

The plan (every batch as submitted) minus the records is the work left; the broker
is never asked. Batch ids of re-enqueued work derive from the items they carry, so
running the same resume twice publishes the same batch ids, and the second copy of
a batch finds the first one's record and does nothing.

Both read every record (`scan`), so they also reconcile the progress summary with
them (a batch recorded but never credited, its message lost, would otherwise stay
pending in `status` forever); so does the embedded runner, through `scan`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from diffq.core.contract import BatchMessage
from diffq.core.progress import reconcile
from diffq.core.runfolder import read_failures, read_manifest, recorded_batches
from diffq.core.storage import Storage, open_storage
from diffq.producer.submit import CeleryPublisher, read_plan


def _derived_id(batch_id: str, tag: str, item_ids: list[str]) -> str:
    digest = hashlib.sha1("\x00".join(item_ids).encode()).hexdigest()[:8]
    return f"{batch_id}.{tag}{digest}"


def select_batches(storage: Storage, wanted: Callable[[str], bool], tag: str) -> Iterator[BatchMessage]:
    """Plan batches reduced to the items `wanted` accepts, under derived batch ids."""
    for message in read_plan(storage):
        items = [item for item in message.items if wanted(item.id)]
        if items:
            batch_id = _derived_id(message.batch_id, tag, [item.id for item in items])
            yield message.model_copy(update={"items": items, "batch_id": batch_id})


def missing_batches(storage: Storage, skip_ids: set[str]) -> Iterator[BatchMessage]:
    return select_batches(storage, lambda item_id: item_id not in skip_ids, "r")


@dataclass
class Requeued:
    out: str
    items: int
    batches: int


def _publish(storage: Storage, messages: Iterator[BatchMessage], broker_url: str,
             transport_options: dict | None) -> Requeued:
    publisher = CeleryPublisher(broker_url, transport_options)
    items = batches = 0
    try:
        for message in messages:
            publisher.publish(message)
            items += len(message.items)
            batches += 1
    finally:
        publisher.close()
    return Requeued(out=storage.url, items=items, batches=batches)


@dataclass
class Recorded:
    """Item ids the run folder's records say are done, and those its failure records name."""

    done: set[str]
    failed: set[str]

    @property
    def settled(self) -> set[str]:
        return self.done | self.failed


def scan(storage: Storage) -> Recorded:
    """Read every record and failure; credit recorded batches the progress summary lacks."""
    read_manifest(storage)
    recorded = recorded_batches(storage)
    reconcile(storage, recorded)
    return Recorded(done={item for _, ids in recorded.values() for item in ids},
                    failed={item for failure in read_failures(storage) for item in failure.item_ids})


def resume(out: str, broker_url: str, transport_options: dict | None = None) -> Requeued:
    """Re-enqueue exactly the items that are neither done nor failed."""
    storage = open_storage(out)
    return _publish(storage, missing_batches(storage, scan(storage).settled), broker_url, transport_options)


def retry_failed(out: str, broker_url: str, transport_options: dict | None = None) -> Requeued:
    """Re-enqueue the items that failed (and are not done since)."""
    storage = open_storage(out)
    recorded = scan(storage)
    failed = recorded.failed - recorded.done
    return _publish(storage, select_batches(storage, failed.__contains__, "f"), broker_url, transport_options)
