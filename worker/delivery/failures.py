"""Failure records, and storage trouble, which is no failure of the batch's.

A batch's items fail with one record (`write_failure`): a poison batch out of
retries (worker/delivery/hooks.py, `Retries`), or the items whose image failed a degenerate
check (`set_aside_degenerate`). A store or lookup that raises is `StorageTrouble`:
the batch's life ends with a retry that uses up none of its attempts (worker/delivery/tasks.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from contextlib import contextmanager

from diffq.core import layout
from diffq.core.adapters import set_digest
from diffq.core.contract import BatchMessage
from diffq.core.records import DEGENERATE_CHECKS, FailureRecord
from diffq.core.storage import Storage
from diffq.worker.observe import metrics

log = logging.getLogger("diffq.worker")


class StorageTrouble(Exception):
    """The run folder could not be read or written: retry the batch later."""

    def __init__(self, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@contextmanager
def storage_trouble():
    """Whatever the block raises is storage trouble, not the batch's fault."""
    try:
        yield
    except Exception as exc:
        raise StorageTrouble(exc) from exc


def write_failure(storage: Storage, message: BatchMessage, error: str, attempts: int, worker: str,
                  degenerate: dict[str, str] | None = None) -> None:
    record = FailureRecord(run_id=message.run_id, batch_id=message.batch_id,
                           item_ids=[item.id for item in message.items], error=error[:2000], attempts=attempts,
                           worker=worker, failed_at=time.time(), degenerate=degenerate,
                           adapter_set=set_digest(message.params.adapters))
    with storage_trouble():
        storage.put_bytes(layout.failure_key(message.batch_id), record.model_dump_json().encode(),
                          content_type="application/json", if_absent=True)
    metrics.observe_failure(message.shape.queue, len(message.items), record.adapter_set)


def set_aside_degenerate(task, storage: Storage, message: BatchMessage, generated, attempts: int):
    """--on-degenerate, applied to what the host's checks found (pipeline_host.checked_arrays).

    Items whose image fails a check are failed at once, never regenerated (their seeds
    would make the same image): one failure record names each one's check. The rest
    are stored as a batch of their own. Both parts take ids derived from their items
    (`degenerate_part`), so status, resume and retry-failed count them as any derived
    batch, and two copies of a batch that disagree only add up. When every item fails,
    the failure record is the batch's own. Returns the batch to store (None: nothing
    left), its images, and the flagged items (item id -> check) for their records."""
    found = {item.id: kind for item, kind in zip(message.items, generated.degenerate) if kind}
    if not found:
        return message, generated.images, {}
    policy = task.runtime.spec.degenerate_policy
    failing = {item_id: kind for item_id, kind in found.items() if policy.get(kind) == "fail"}
    flagged = {item_id: kind for item_id, kind in found.items() if item_id not in failing}
    stored, images = message, generated.images
    if failing:
        keep = [n for n, item in enumerate(message.items) if item.id not in failing]
        failed = degenerate_part(message, [item for item in message.items if item.id in failing]) if keep else message
        # The same text for every batch a check fails (the report groups failures by it);
        # which item failed which check is the record's `degenerate`.
        error = "DegenerateImage: " + "; ".join(DEGENERATE_CHECKS[kind] for kind in DEGENERATE_CHECKS
                                                if kind in failing.values())
        write_failure(storage, failed, error, attempts, task.runtime.worker, degenerate=failing)
        log.warning("batch %s: %d item(s) failed a degenerate-image check, recorded as %s (%s)", message.batch_id,
                    len(failing), failed.batch_id, error)
        stored = degenerate_part(message, [message.items[n] for n in keep]) if keep else None
        images = [generated.images[n] for n in keep]
    for kind, count in Counter(found.values()).items():
        metrics.observe_degenerate(message.shape.queue, kind, count)
    return stored, images, flagged


def degenerate_part(message: BatchMessage, items: list) -> BatchMessage:
    """`items` of `message` as a batch of their own, `<batch id>.d<hash of their ids>`."""
    digest = hashlib.sha1("\x00".join(item.id for item in items).encode()).hexdigest()[:8]
    return message.model_copy(update={"items": items, "batch_id": f"{message.batch_id}.d{digest}"})
