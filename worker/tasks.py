"""The batch task's body and the per-process runtime it runs in.

A batch message is validated on receipt, generated on the process's pipeline host,
and handed to the process's batch line (batches.py: back-pressure, sink, held ack,
routing). Failures retry with backoff (Celery's retry), then the batch is halved
until a poison item fails alone with a failure record, and the run goes on.
The runtime is an object the task carries (`task.runtime`), set up by
worker/celery_adapter.py, which owns every other piece of Celery glue.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from celery import Task
from pydantic import ValidationError

from diffq.core import layout
from diffq.core.broker import TASK_NAME
from diffq.core.contract import BatchMessage
from diffq.core.records import DEGENERATE_CHECKS, BatchMeasures, FailureRecord
from diffq.core.settings import get_settings
from diffq.core.storage import Storage, open_storage
from diffq.core.transports import transport_for
from diffq.worker import faults, metrics
from diffq.worker.batches import BatchLine
from diffq.worker.lease import LeaseKeeper
from diffq.worker.dead_letters import DeadLetters
from diffq.worker.delivery import Outcome
from diffq.worker.models import ModelUnavailable
from diffq.worker.pipeline_host import CompileUnsupported, FamilyUnsupported, PipelineHost
from diffq.worker.routing import Discovery, Router
from diffq.worker.sink import Sink
from diffq.worker.sink_process import SinkProcess, make_sink
from diffq.worker.spec import ChildSpec, hostname
from diffq.worker.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken

log = logging.getLogger("diffq.worker")


class OutNotAllowed(PermissionError):
    pass


# Errors no retry can fix: fail the batch's items at once.
PERMANENT_ERRORS = (ModelUnavailable, CompileUnsupported, OutNotAllowed, FamilyUnsupported)


def ended(task: Task, outcome: Outcome, result: dict | None = None) -> dict | None:
    """Report how this delivery's batch ended: the batch line decides what the broker
    sees (worker/delivery.py)."""
    task.runtime.line.report(task.request.id, outcome)
    return result


def hand_back(task: Task, message: BatchMessage, reason: str, exit_code: int) -> dict:
    """Give the batch back to its queue at once (not a failed attempt) and stop the
    process with `exit_code`."""
    from celery.worker import state as worker_state

    log.warning("%s; batch %s goes back to the queue", reason, message.batch_id)
    worker_state.should_stop = exit_code
    return ended(task, Outcome.HAND_BACK, {"batch_id": message.batch_id, "handed_back": reason})


@dataclass
class Runtime:
    """A worker process's state: its spec, pipelines, sink, run folders, batch line."""

    spec: ChildSpec
    host: PipelineHost
    sink: Sink | SinkProcess = field(default_factory=make_sink)
    storages: dict[str, Storage] = field(default_factory=dict)
    line: BatchLine | None = None  # built on the sink when not given
    lease: LeaseKeeper | None = None  # while consuming (worker/celery_adapter.py)
    # run folder -> (when looked at, cancelled then): `diffq cancel`'s marker
    cancel_seen: dict[str, tuple[float, bool]] = field(default_factory=dict)
    # Set once the consumer has stopped fetching and handed back what it held.
    consuming_stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.line is None:
            self.line = BatchLine(self.sink)

    @classmethod
    def start(cls, spec: ChildSpec, group=None) -> Runtime:
        """The runtime of a worker process; its sink helper starts importing now, while
        the model loads."""
        rt = cls(spec=spec, host=PipelineHost(backend=spec.backend, compile_mode=spec.compile,
                                              offload=spec.offload, group=group,
                                              checks=frozenset(spec.degenerate_policy)))
        transport = transport_for(spec.broker_url)
        discovery = Discovery(transport, spec.serve_models, spec.rabbitmq_api,
                              dtypes=spec.backend.served_dtypes) if spec.discover else None
        if spec.routing == "compile-aware" or discovery is not None:
            rt.line.router = Router(spec.queues, rt.compiled_queues, transport, discovery=discovery,
                                    compile_aware=spec.routing == "compile-aware")
        return rt

    def compiled_queues(self) -> set[str]:
        return {shape.queue for shape in self.host.shapes_seen}

    @property
    def worker(self) -> str:
        return f"{self.spec.name}@{hostname()}"

    def storage_for(self, out: str) -> Storage:
        if out not in self.storages:
            # Check the normalised URL (resolved path, no '..'), on a path boundary:
            # '/data/runs-evil' is not under '/data/runs'.
            storage = open_storage(out)
            allowed = [prefix.rstrip("/") for prefix in self.spec.allowed_out_prefixes]
            if allowed and not any(storage.url == p or storage.url.startswith(p + "/") for p in allowed):
                raise OutNotAllowed(f"run folder {storage.url} is outside this worker's allowed prefixes")
            self.storages[out] = storage
        return self.storages[out]


def run_cancelled(rt: Runtime, storage: Storage, out: str) -> bool:
    """Whether `diffq cancel` marked the run, looked at once per CANCEL_CHECK_S per run."""
    now = time.monotonic()
    seen = rt.cancel_seen.get(out)
    if seen is None or now - seen[0] >= layout.CANCEL_CHECK_S:
        seen = rt.cancel_seen[out] = (now, storage.exists(layout.CANCEL))
    return seen[1]


def dead_letter(task: Task, batch, exc: ValueError) -> dict:
    """A message that is not a diffq batch: to the dead letters, acked, never retried."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "message"
        reason = f"not a diffq batch: {exc.error_count()} schema errors, first {where}: {first['msg']}"
    else:
        reason = str(exc)
    queue = (task.request.delivery_info or {}).get("routing_key") or "?"
    DeadLetters(task.app, task.runtime.worker).send(queue, reason, {"batch": batch}, "application/json",
                                                    {"task": task.name, "id": task.request.id})
    return ended(task, Outcome.DEAD_LETTER, {"dead_letter": reason})


def write_failure(storage: Storage, message: BatchMessage, error: str, attempts: int, worker: str,
                  degenerate: dict[str, str] | None = None) -> None:
    record = FailureRecord(run_id=message.run_id, batch_id=message.batch_id,
                           item_ids=[item.id for item in message.items], error=error[:2000], attempts=attempts,
                           worker=worker, failed_at=time.time(), degenerate=degenerate)
    storage.put_bytes(layout.failure_key(message.batch_id), record.model_dump_json().encode(),
                      content_type="application/json", if_absent=True)


def split(task: Task, message: BatchMessage, apart: set[str] | None = None) -> list[BatchMessage]:
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
    for child in children:
        task.app.send_task(TASK_NAME, kwargs={"batch": child.model_dump(mode="json")},
                           queue=message.shape.queue, routing_key=message.shape.queue)
    return children


# A retried batch waits base * 2**attempt seconds, capped: a device never idles long
# on a batch whose store or model is recovering.
MAX_BACKOFF_S = 30.0


def backoff_s(retries: int) -> float:
    return min(MAX_BACKOFF_S, get_settings().retry_backoff_s * 2**retries)


def retry_later(task: Task, exc: Exception):
    """Storage trouble is not the batch's fault: retry without using up its attempts."""
    ended(task, Outcome.RETRY)
    return task.retry(exc=exc, countdown=backoff_s(task.request.retries),
                      max_retries=None)


def generate_batch(task: Task, batch: dict) -> dict:
    rt: Runtime = task.runtime
    rt.line.received()
    try:
        message = BatchMessage.from_json_payload(batch)
    except ValueError as exc:  # pydantic's ValidationError included: no retry can fix it
        return dead_letter(task, batch, exc)
    storage = rt.storage_for(message.out)
    try:
        cancelled = run_cancelled(rt, storage, message.out)
    except Exception as exc:
        raise retry_later(task, exc)
    if cancelled:
        # Dropped unseen: acked, nothing generated or written.
        log.info(json.dumps({"event": "cancelled", "run": message.run_id, "batch": message.batch_id,
                             "queue": message.shape.queue, "items": len(message.items)}))
        return ended(task, Outcome.CANCELLED, {"batch_id": message.batch_id, "cancelled": len(message.items)})
    # Only a redelivered or retried batch can already be stored; first deliveries
    # skip the lookup so it does not sit between two batches on the device. (A
    # duplicate that slips through only costs compute: every write is if_absent.)
    if (task.request.delivery_info or {}).get("redelivered") or task.request.retries:
        try:
            if storage.exists(layout.record_key(message.batch_id)):
                rt.line.credit_again(task.request.id, storage, message)
                return {"batch_id": message.batch_id, "skipped": True}
        except Exception as exc:
            raise retry_later(task, exc)
    attempts = task.request.retries + 1
    recompiles_before = rt.host.recompiles
    try:
        faults.check(message.items)
        started_at = time.time()
        generated = rt.host.generate(message.shape, message.params, message.items)
        ended_at = time.time()
    except GroupBroken as exc:
        # A rank of this worker's tensor-parallel group died: the supervisor restarts
        # the group, and the batch goes back meanwhile.
        return hand_back(task, message, str(exc), EXIT_GROUP_BROKEN)
    except Exception as exc:
        return handle_failure(task, storage, message, exc, attempts)
    metrics.observe_batch(message.shape.queue, len(message.items), generated.generate_s)
    if generated.compiled:  # eager backends compile too (PipelineHost.compiles)
        metrics.observe_compile(message.shape.label, generated.generate_s)
    if rt.host.recompiles > recompiles_before:
        metrics.observe_recompile(message.shape.label, rt.host.recompiles - recompiles_before)
    if generated.graph_fallbacks:  # --allow-fallback: counted, never silent
        metrics.observe_graph_fallback(message.shape.label, generated.graph_fallbacks)
    stored, images, flagged = set_aside_degenerate(task, storage, message, generated, attempts)
    if stored is None:  # every item failed a check: their failure record is stored
        return ended(task, Outcome.FAILED, {"batch_id": message.batch_id, "failed": len(message.items)})
    rt.line.store(task.request.id, storage, stored, images, BatchMeasures(
        device=f"{rt.spec.device}:{rt.spec.slot}",
        dtype=rt.host.backend.dtype_for(message.shape.dtype),  # what ran, where the queue says auto
        worker=rt.worker,
        generate_s=round(generated.generate_s, 4),
        # Wall-clock span of the pipeline call: the device idle gap between two
        # batches of one worker is the next start minus this end.
        generate_started_at=round(started_at, 4),
        generate_ended_at=round(ended_at, 4),
        graph_fallbacks=generated.graph_fallbacks,
        degenerate=flagged or {},
        **generated.record_extra,
    ))
    log.info(json.dumps({"event": "batch", "run": message.run_id, "batch": message.batch_id,
                         "queue": message.shape.queue, "items": len(message.items),
                         "generate_s": round(generated.generate_s, 3)}))
    return {"batch_id": message.batch_id, "items": len(stored.items)}


def set_aside_degenerate(task: Task, storage: Storage, message: BatchMessage, generated, attempts: int):
    """--on-degenerate, applied to what the host's checks found (pipeline_host.checked_arrays).

    Items whose image fails a check are failed at once, never regenerated (their seeds
    would make the same image): one failure record names each one's check. The rest
    are stored as a batch of their own. Both parts take ids derived from their items
    (`degenerate_part`), so status, resume and retry-failed count them as any derived
    batch, and two copies of a batch that disagree only add up. When every item fails,
    the failure record is the batch's own. Returns the batch to store (None: nothing
    left), its images, and the flagged items (item id -> check) for their records."""
    # getattr: a host that runs no checks (a test's stand-in) reports none.
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
        try:
            write_failure(storage, failed, error, attempts, task.runtime.worker, degenerate=failing)
        except Exception as exc:
            raise retry_later(task, exc)
        metrics.observe_failure(message.shape.queue, len(failing))
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


def handle_failure(task: Task, storage: Storage, message: BatchMessage, exc: Exception, attempts: int) -> dict:
    """Retry with backoff; then split the batch so a poison item fails alone; then record."""
    error = f"{type(exc).__name__}: {exc}"
    permanent = isinstance(exc, PERMANENT_ERRORS)
    settings = get_settings()
    if not permanent and task.request.retries < settings.task_max_retries:
        ended(task, Outcome.RETRY)
        raise task.retry(exc=exc, countdown=backoff_s(task.request.retries))
    refused = set(getattr(exc, "item_ids", ()))
    if refused and len(refused) < len(message.items):
        children = split(task, message, apart=refused)
        log.warning("batch %s: %d item(s) refused by the model's family (%s); split into %s", message.batch_id,
                    len(refused), error, [child.batch_id for child in children])
        return ended(task, Outcome.SPLIT, {"batch_id": message.batch_id, "split": [child.batch_id for child in children]})
    if not permanent and len(message.items) > 1:
        children = split(task, message)
        log.warning("batch %s failed %d times (%s); split into %s", message.batch_id, attempts, error,
                    [child.batch_id for child in children])
        return ended(task, Outcome.SPLIT, {"batch_id": message.batch_id, "split": [child.batch_id for child in children]})
    try:
        write_failure(storage, message, error, attempts, task.runtime.worker)
    except Exception as store_exc:
        raise retry_later(task, store_exc)
    metrics.observe_failure(message.shape.queue, len(message.items))
    return ended(task, Outcome.FAILED, {"batch_id": message.batch_id, "failed": len(message.items)})


def preload(rt: Runtime) -> None:
    for model in rt.spec.models:
        rt.host.pipeline(model, rt.spec.dtype)
