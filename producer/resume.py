"""Re-enqueue what the run folder says is missing: items neither done nor failed.

The plan (every batch as submitted) minus the records is the work left. Used by the
embedded runner after a worker died with a batch in hand, and by `diffq resume`.
"""

from __future__ import annotations

from collections.abc import Iterator

from diffq.contract import BatchMessage
from diffq.producer.submit import read_plan
from diffq.storage import Storage


def missing_batches(storage: Storage, skip_ids: set[str], attempt: int) -> Iterator[BatchMessage]:
    """Plan batches reduced to their unfinished items, under fresh batch ids.

    A fresh id per attempt (`<batch>.r<n>`) keeps each attempt's record separate;
    items already stored are filtered out, so nothing is recorded twice.
    """
    for message in read_plan(storage):
        items = [item for item in message.items if item.id not in skip_ids]
        if items:
            yield message.model_copy(update={"items": items, "batch_id": f"{message.batch_id}.r{attempt}"})
