"""The hooks on a batch's life: each cross-cutting concern one small object.

The life itself (worker/delivery/tasks.py, `live`) is receipt → hooks → generate → store;
at each step it calls every hook in order:

    on_received(batch)              a diffq batch arrived, nothing looked up or generated yet
    before_generate(batch)          just before the pipeline call; raising here is generation failing
    after_generate(batch, generated) the pipeline returned
    on_error(batch, exc)            generation raised

Each may end the batch by returning an `End` (an `Outcome`, the task's result, and
what follows once it is reported); the life stops there and reports the outcome,
and `decide` (worker/delivery/outcomes.py) says what the broker sees, as for every other
ending. None lets the life go on. The hooks (the order of `default_hooks`):

    Cancel    `diffq cancel` marked the run: drop the batch unseen (cancelled)
    Faults    DIFFQ_FAULT_* injection (worker/device/faults.py), inert unless set
    Metrics   batches, compiles, recompiles, graph fallbacks (worker/observe/metrics.py)
    Retries   generation raised: retry with backoff, then split, then a failure record
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from diffq.core import layout
from diffq.core.adapters import set_digest
from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.signing import HEADER as SIGNATURE
from diffq.core.storage import Storage
from diffq.worker.device import faults
from diffq.worker.observe import metrics
from diffq.worker.delivery.outcomes import Outcome
from diffq.worker.delivery.door import Delivered
from diffq.worker.delivery.failures import storage_trouble, write_failure
from diffq.worker.device.models import ModelUnavailable
from diffq.worker.device.pipeline_host import (AdapterOrderError, AdapterUnsupported, CompileUnsupported,
                                               FamilyUnsupported, LoraChangeUnseen, SpeedupUnsupported)
from diffq.worker.delivery.runtime import OutNotAllowed, Runtime

log = logging.getLogger("diffq.worker")

# Errors no retry can fix: fail the batch's items at once.
PERMANENT_ERRORS = (ModelUnavailable, CompileUnsupported, OutNotAllowed, FamilyUnsupported, SpeedupUnsupported,
                    AdapterUnsupported, AdapterOrderError)

# A retried batch waits base * 2**attempt seconds, capped: a device never idles long
# on a batch whose store or model is recovering.
MAX_BACKOFF_S = 30.0


def backoff_s(retries: int) -> float:
    return min(MAX_BACKOFF_S, get_settings().retry_backoff_s * 2**retries)


@dataclass(frozen=True)
class End:
    """How a batch's life ended: what it reports, and what the task returns."""

    outcome: Outcome
    result: dict | None = None
    future: Future | None = None  # what a held ack waits for (generated, already stored)
    # Runs once the outcome is reported and raises out of the task: Celery's retry.
    then: Callable[[], BaseException] | None = None


@dataclass
class Batch:
    """One delivery's batch on its way through its life: what the hooks see."""

    task: object  # the bound Celery task (a stub in tests): request, app, runtime
    message: BatchMessage
    storage: Storage
    notes: dict = field(default_factory=dict)  # a hook's own per-batch state, by hook

    @property
    def runtime(self) -> Runtime:
        return self.task.runtime

    @functools.cached_property
    def delivery(self) -> Delivered:
        """The task's side of its delivery (worker/delivery/door.py): one per batch, asked
        at every step."""
        return Delivered(self.task)

    @property
    def attempts(self) -> int:
        return self.delivery.retries + 1

    @property
    def redelivered(self) -> bool:
        """Delivered before (the broker says so) or retried: it may already be stored."""
        return self.delivery.redelivered

    def end(self, outcome: Outcome, future: Future | None = None, **result) -> End:
        return End(outcome, {"batch_id": self.message.batch_id, **result}, future)

    def retry(self, exc: Exception, *, counted: bool = True) -> End:
        """Celery's retry after a backoff; storage trouble is not the batch's fault and
        uses up none of its attempts (`counted=False`)."""
        delivery = self.delivery
        limit = {} if counted else {"max_retries": None}
        # Back to the batch's own queue (not the envelope's routing key, which the
        # sender wrote), signed afresh with this worker's current key.
        queue = self.message.shape.queue
        batch = self.message.model_dump(mode="json")
        again = {"kwargs": {"batch": batch}, "queue": queue, **signed(self.runtime, queue, batch)}
        return End(Outcome.RETRY, then=lambda: delivery.retry(exc, backoff_s(delivery.retries), **limit, **again))


class BatchHook:
    """One concern on a batch's life; every method may end the batch (see the module)."""

    def on_received(self, batch: Batch) -> End | None:
        return None

    def before_generate(self, batch: Batch) -> End | None:
        return None

    def after_generate(self, batch: Batch, generated) -> End | None:
        return None

    def on_error(self, batch: Batch, exc: Exception) -> End | None:
        return None


class Cancel(BatchHook):
    """`diffq cancel` marked the run: its batches are dropped unseen (acked, nothing
    generated or written). The marker is looked at once per CANCEL_CHECK_S per run."""

    def __init__(self):
        self.seen: dict[str, tuple[float, bool]] = {}  # run folder -> (when looked at, cancelled then)

    def on_received(self, batch: Batch) -> End | None:
        message = batch.message
        if not self.cancelled(batch.storage, message.out):
            return None
        log.info(json.dumps({"event": "cancelled", "run": message.run_id, "batch": message.batch_id,
                             "queue": message.shape.queue, "items": len(message.items)}))
        return batch.end(Outcome.CANCELLED, cancelled=len(message.items))

    def cancelled(self, storage: Storage, out: str) -> bool:
        now = time.monotonic()
        seen = self.seen.get(out)
        if seen is None or now - seen[0] >= layout.CANCEL_CHECK_S:
            with storage_trouble():
                seen = self.seen[out] = (now, storage.exists(layout.CANCEL))
        return seen[1]


class Faults(BatchHook):
    """DIFFQ_FAULT_POISON / _HOLD: a matching batch fails (or waits) as generation would."""

    def before_generate(self, batch: Batch) -> None:
        faults.check(batch.message.items)


class Metrics(BatchHook):
    """What a generated batch did on the device, as Prometheus series. Failure and
    degenerate counts are observed where their records are written (worker/delivery/failures.py)."""

    def on_received(self, batch: Batch) -> None:
        if batch.delivery.returned:  # another holder lost it (a lapsed lease: a lost host) or handed it back
            metrics.observe_redelivery(batch.message.shape.queue)

    def on_error(self, batch: Batch, exc: Exception) -> None:
        if isinstance(exc, LoraChangeUnseen):  # its batch fails permanently (Retries), and so do later adapter batches
            metrics.observe_lora_change_unseen(batch.runtime.host.lora_mode)

    def after_generate(self, batch: Batch, generated) -> None:
        shape = batch.message.shape
        metrics.observe_batch(shape.queue, len(batch.message.items), generated.generate_s,
                              set_digest(batch.message.params.adapters))
        if generated.compiled:  # eager backends compile too (PipelineHost.compiles)
            metrics.observe_compile(shape.label, generated.generate_s)
        if generated.recompiled:
            metrics.observe_recompile(shape.label, generated.recompiled)
        if generated.graph_fallbacks:  # --allow-fallback: counted, never silent
            metrics.observe_graph_fallback(shape.label, generated.graph_fallbacks)


class Retries(BatchHook):
    """Generation raised: retry with backoff (Celery's retry); out of retries, split the
    batch so a poison item fails alone (or split off the items the family refused);
    a batch of one, or a permanent error, fails with a failure record, and the run
    goes on."""

    def on_error(self, batch: Batch, exc: Exception) -> End:
        message = batch.message
        error = f"{type(exc).__name__}: {exc}"
        permanent = isinstance(exc, PERMANENT_ERRORS)
        if not permanent and batch.delivery.retries < get_settings().task_max_retries:
            return batch.retry(exc)
        refused = set(getattr(exc, "item_ids", ()))
        if refused and len(refused) < len(message.items):
            children = split(batch.task, message, apart=refused)
            log.warning("batch %s: %d item(s) refused by the model's family (%s); split into %s", message.batch_id,
                        len(refused), error, [child.batch_id for child in children])
            return batch.end(Outcome.SPLIT, split=[child.batch_id for child in children])
        if not permanent and len(message.items) > 1:
            children = split(batch.task, message)
            log.warning("batch %s failed %d times (%s); split into %s", message.batch_id, batch.attempts, error,
                        [child.batch_id for child in children])
            return batch.end(Outcome.SPLIT, split=[child.batch_id for child in children])
        write_failure(batch.storage, message, error, batch.attempts, batch.runtime.worker)
        return batch.end(Outcome.FAILED, failed=len(message.items))


def split(task, message: BatchMessage, apart: set[str] | None = None) -> list[BatchMessage]:
    """Halve a failing batch so a poison item ends up failing alone; or, given `apart`,
    split those items off (items the family refuses fail, the others go on)."""
    if apart:
        halves = [[item for item in message.items if item.id not in apart],
                  [item for item in message.items if item.id in apart]]
    else:
        middle = len(message.items) // 2
        halves = [message.items[:middle], message.items[middle:]]
    children = [message.model_copy(update={"items": items, "batch_id": f"{message.batch_id}.s{i}"})
                for i, items in enumerate(halves)]
    queue = message.shape.queue
    delivery = Delivered(task)
    for child in children:
        batch = child.model_dump(mode="json")
        delivery.publish(queue, batch, **signed(getattr(task, "runtime", None), queue, batch))
    return children


def signed(runtime: Runtime | None, queue: str, batch) -> dict:
    """The options that sign a batch a worker re-publishes, where it holds a key."""
    keys = runtime.admission.keys if runtime is not None and runtime.admission is not None else None
    if keys is None or not isinstance(batch, dict):
        return {}
    return {"headers": {SIGNATURE: keys.sign_batch(queue, batch)}}


def default_hooks() -> list[BatchHook]:
    """A worker process's hooks, in the order each step calls them."""
    return [Cancel(), Faults(), Metrics(), Retries()]
