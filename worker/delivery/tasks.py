"""A batch's life on the worker, receipt to outcome, top to bottom (`generate_batch`).

    receipt      the batch line acks what the sink finished meanwhile; a message that
                 is not a diffq batch goes to the dead letters
    on_received  hooks (worker/delivery/hooks.py): a cancelled run's batch is dropped unseen
    redelivered  a copy whose record is stored is credited again, not generated again
    generate     before_generate hooks (fault injection), the pipeline host's call,
                 after_generate hooks (metrics); raised: on_error hooks (retry, split,
                 failure record); a broken tensor-parallel group hands the batch back
    store        degenerate images set aside (worker/delivery/failures.py); the batch line
                 hands the rest to the sink, whose credit the ack will wait for
    outcome      one report to the batch line (`finish`): when the task returns, it
                 carries out `decide(outcome)` (worker/delivery/outcomes.py, the one table)

Storage trouble anywhere on the way (`StorageTrouble`) ends the life with a retry
that uses up none of the batch's attempts. The Celery glue around this is
worker/delivery/celery_adapter.py; the process state it runs in, worker/delivery/runtime.py.
"""

from __future__ import annotations

import json
import logging

from diffq.core import layout
from diffq.core.brokers.app import stop_consuming
from diffq.core.contract import BatchMessage
from diffq.core.records import BatchMeasures
from diffq.worker.observe import startup
from diffq.worker.delivery.admission import schema_reason
from diffq.worker.delivery.dead_letters import dead_letters_of
from diffq.worker.delivery.outcomes import Outcome, Refused
from diffq.worker.delivery.door import Delivered
from diffq.worker.delivery.failures import StorageTrouble, set_aside_degenerate, storage_trouble, write_failure
from diffq.worker.delivery.hooks import PERMANENT_ERRORS, Batch, BatchHook, End, default_hooks, split
from diffq.worker.delivery.runtime import OutNotAllowed, Runtime, preload
from diffq.worker.device.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken
from diffq.worker.observe import metrics

# Where they lived before the life was split into hooks (callers and tests import them here).
__all__ = ["generate_batch", "Runtime", "OutNotAllowed", "preload", "PERMANENT_ERRORS", "split",
           "write_failure", "set_aside_degenerate"]

log = logging.getLogger("diffq.worker")


def generate_batch(task, payload: dict) -> dict | None:
    with task.runtime.line.batch_task():
        return _generate_batch(task, payload)


def _generate_batch(task, payload: dict) -> dict | None:
    rt: Runtime = task.runtime
    rt.line.received()
    try:
        message = BatchMessage.from_json_payload(payload)
        storage = rt.storage_for(message.out)
    except ValueError as exc:  # pydantic's ValidationError included: no retry can fix it
        return dead_letter(task, payload, exc, Refused.NOT_A_BATCH)
    except OutNotAllowed as exc:
        return dead_letter(task, payload, exc, Refused.OUT_NOT_ALLOWED)
    batch = Batch(task, message, storage)
    try:
        end = live(batch, hooks_of(rt))
    except StorageTrouble as trouble:
        metrics.observe_upload_failure("lookup")
        end = batch.retry(trouble.error, counted=False)
    return finish(batch, end)


def live(batch: Batch, hooks: list[BatchHook]) -> End:
    """The batch from receipt to stored, calling the hooks at each step: how it ended."""
    rt, message, storage = batch.runtime, batch.message, batch.storage
    if reason := (rt.run_problem(storage, message.run_id) or rt.model_problem(storage, message.shape.model)
                  or rt.adapter_problem(storage, message.shape, message.params.adapters)):
        return refused(batch, reason)
    for hook in hooks:
        if end := hook.on_received(batch):
            return end
    # Only a redelivered or retried batch can already be stored; first deliveries
    # skip the lookup so it does not sit between two batches on the device. (A
    # duplicate that slips through only costs compute: every write is if_absent.)
    if batch.redelivered:
        with storage_trouble():
            if storage.exists(layout.record_key(message.batch_id)):
                # The copy that stored the record may have died before crediting it.
                return batch.end(Outcome.ALREADY_STORED, rt.line.credit_again(storage, message), skipped=True)
    try:
        for hook in hooks:
            if end := hook.before_generate(batch):
                return end
        generated = rt.host.generate(message.shape, message.params, message.items)
        rt.line.paced(generated.generate_s)  # short calls: the next batch comes in now
    except GroupBroken as exc:
        # A rank of this worker's tensor-parallel group died: the supervisor restarts
        # the group, and the batch goes back meanwhile.
        return hand_back(batch, str(exc), EXIT_GROUP_BROKEN)
    except Exception as exc:
        for hook in hooks:
            if end := hook.on_error(batch, exc):
                return end
        raise
    for hook in hooks:
        if end := hook.after_generate(batch, generated):
            return end
    stored, images, flagged = set_aside_degenerate(batch.task, storage, message, generated, batch.attempts)
    if stored is None:  # every item failed a check: their failure record is stored
        return batch.end(Outcome.FAILED, failed=len(message.items))
    credited = rt.line.store(storage, stored, images, BatchMeasures(
        device=f"{rt.spec.device}:{rt.spec.slot}",
        dtype=rt.host.backend.dtype_for(message.shape.dtype),  # what ran, where the queue says auto
        worker=rt.worker,
        generate_s=round(generated.generate_s, 4),
        # Wall-clock span of the pipeline call: the device idle gap between two
        # batches of one worker is the next start minus this end.
        generate_started_at=round(generated.started_at, 4),
        generate_ended_at=round(generated.ended_at, 4),
        graph_fallbacks=generated.graph_fallbacks,
        graphs_compiled=generated.graphs,
        degenerate=flagged or {},
        **generated.record_extra,
    ))
    if clock := startup.clock():
        clock.first_batch(storage, credited, rt.worker, f"{rt.spec.device}:{rt.spec.slot}", rt.host.fetches)
    log.info(json.dumps({"event": "batch", "run": message.run_id, "batch": message.batch_id,
                         "queue": message.shape.queue, "items": len(message.items),
                         "generate_s": round(generated.generate_s, 3)}))
    return batch.end(Outcome.GENERATED, credited, items=len(stored.items))


def finish(batch: Batch, end: End) -> dict | None:
    """Report how the batch ended, the one report of its life: when the task returns,
    the batch line carries out `decide(end.outcome)`. Then Celery's retry, if any."""
    batch.runtime.line.report(batch.delivery.id, end.outcome, end.future)
    if end.then is not None:
        raise end.then()
    return end.result


def hooks_of(rt: Runtime) -> list[BatchHook]:
    if rt.hooks is None:
        rt.hooks = default_hooks()
    return rt.hooks


def hand_back(batch: Batch, reason: str, exit_code: int) -> End:
    """Give the batch back to its queue at once (not a failed attempt) and stop the
    process with `exit_code`."""
    log.warning("%s; batch %s goes back to the queue", reason, batch.message.batch_id)
    stop_consuming(exit_code)
    return batch.end(Outcome.HAND_BACK, handed_back=reason)


def dead_letter(task, batch, exc: Exception, why: Refused = Refused.NOT_A_BATCH) -> dict:
    """A message that is not a diffq batch, or one this worker may not take: to the
    dead letters, never retried."""
    reason = schema_reason(exc)
    delivery = Delivered(task)
    queue = delivery.routing_key or "?"
    # Rejected for the broker to route where it dead-letters (RabbitMQ's policy), else a letter and an ack.
    outcome = dead_letters_of(delivery.app, task.runtime.worker).refuse(
        queue, reason, {"batch": batch}, "application/json", {"task": task.name, "id": delivery.id}, why=why)
    return ended(task, outcome, {"dead_letter": reason})


def refused(batch: Batch, reason: str) -> End:
    """A batch this worker may not take (not its run's): to the dead letters with the
    reason, never generated or retried."""
    task, message, delivery = batch.task, batch.message, batch.delivery
    outcome = dead_letters_of(delivery.app, batch.runtime.worker).refuse(
        message.shape.queue, f"refused: batch {message.batch_id}: {reason}", {"batch": message.model_dump(mode="json")},
        "application/json", {"task": task.name, "id": delivery.id}, why=Refused.NOT_ITS_RUN)
    return batch.end(outcome, dead_letter=reason)


def ended(task, outcome: Outcome, result: dict | None = None) -> dict | None:
    """Report how a delivery that never became a `Batch` ended (see `finish`)."""
    task.runtime.line.report(Delivered(task).id, outcome)
    return result
