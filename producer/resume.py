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

import getpass
import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from diffq.core import layout
from diffq.core.contract import BatchMessage
from diffq.core.progress import reconcile
from diffq.core.runfolder import read_cancel, read_failures, read_manifest, recorded_batches
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


def cancel(out: str) -> bool:
    """Mark the run cancelled: workers drop its batches as they receive them, without
    generating them; nothing stored is touched. Returns False if it already was."""
    storage = open_storage(out)
    read_manifest(storage)
    marker = json.dumps({"cancelled_at": time.time(), "by": f"{getpass.getuser()}@{socket.gethostname()}"})
    return storage.put_bytes(layout.CANCEL, marker.encode(), content_type="application/json", if_absent=True)


def uncancel(storage: Storage) -> bool:
    """Remove the run's cancel marker, then wait out the workers' cached look at it,
    so none drops what is published next. Returns whether the run was cancelled."""
    if read_cancel(storage) is None:
        return False
    storage.delete(layout.CANCEL)
    time.sleep(layout.CANCEL_CHECK_S)
    return True


def resume(out: str, broker_url: str, transport_options: dict | None = None) -> Requeued:
    """Re-enqueue exactly the items that are neither done nor failed (a cancelled run
    is un-cancelled first)."""
    storage = open_storage(out)
    settled = scan(storage).settled
    uncancel(storage)
    return _publish(storage, missing_batches(storage, settled), broker_url, transport_options)


class RunCancelled(RuntimeError):
    pass


def retry_failed(out: str, broker_url: str, transport_options: dict | None = None) -> Requeued:
    """Re-enqueue the items that failed (and are not done since)."""
    storage = open_storage(out)
    recorded = scan(storage)
    if read_cancel(storage) is not None:
        # Workers would drop what this publishes; resume un-cancels and redoes it all.
        raise RunCancelled(f"{storage.url} is cancelled: `diffq resume` re-enqueues everything missing")
    failed = recorded.failed - recorded.done
    return _publish(storage, select_batches(storage, failed.__contains__, "f"), broker_url, transport_options)
