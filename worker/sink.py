"""The sink: encode a batch's images in threads, store them, then its record.

Runs beside generation: the task hands over a batch and goes on to the next one.
Batches are stored in order by one writer thread; within a batch, encoding and
uploads run on a small pool (PIL's encoders and the storage clients release the
GIL). Images are written only if absent, so a redelivered batch never overwrites
what is stored; then the record, so a record always means its images exist; then
the batch is credited in this process's progress segment (diffq/progress.py),
which is what status reads. All of it happens before the ack, so a worker that
dies in between leaves the batch to be delivered again, and the copy that finds
the record stored credits it (`credit`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from diffq import layout
from diffq.contract import BatchMessage
from diffq.progress import ProgressLog
from diffq.storage import Storage

log = logging.getLogger(__name__)

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
_CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# Progress logs kept per process (one per run folder); an evicted one is replaced
# by a fresh log under a new writer name, which readers treat the same.
MAX_LOGS = 64
# Relative to the generating thread (0): a lower priority, never starved on a busy core.
SINK_NICENESS = 10


def _yield_to_generation() -> None:
    """Lower this thread's scheduling priority (Linux: niceness is per thread).

    Encoding overlaps the next batch's generation; where cores are scarce the
    encoder should take what generation leaves, not preempt the device loop.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SINK_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def encode(image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    options = {"compress_level": 1} if fmt == "png" else {"quality": 90}
    image.save(buffer, format=_PIL_FORMATS[fmt], **options)
    return buffer.getvalue()


@dataclass
class BatchOutcome:
    batch_id: str
    written: int  # images newly stored (0 for a fully redelivered batch)
    bytes: int
    store_s: float


class Sink:
    def __init__(self, threads: int = 4, retry_for_s: float = 600.0):
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffq-sink",
                                          initializer=_yield_to_generation)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="diffq-io",
                                        initializer=_yield_to_generation)
        self.retry_for_s = retry_for_s
        self._logs: OrderedDict[str, ProgressLog] = OrderedDict()  # writer thread only

    def start(self) -> None:
        """Nothing to start: the threads are created on first use (SinkProcess starts a helper)."""

    def submit(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict) -> Future:
        return self._writer.submit(self._store_and_credit, storage, message, images, record_extra)

    def credit(self, storage: Storage, message: BatchMessage) -> Future:
        """Credit a batch whose record is already stored (a redelivered copy)."""
        return self._writer.submit(self._with_retry, message.batch_id, lambda: self._credit(storage, message))

    def _store_and_credit(self, storage: Storage, message: BatchMessage, images: list,
                          record_extra: dict) -> BatchOutcome:
        outcome = self._with_retry(message.batch_id, lambda: self._store(storage, message, images, record_extra))
        # Credited even when the record was there already: the copy that stored it
        # may have died before crediting it.
        self._with_retry(message.batch_id, lambda: self._credit(storage, message))
        return outcome

    def _credit(self, storage: Storage, message: BatchMessage) -> None:
        log = self._logs.get(storage.url)
        if log is None:
            log = self._logs[storage.url] = ProgressLog(storage)
            if len(self._logs) > MAX_LOGS:
                self._logs.popitem(last=False)
        self._logs.move_to_end(storage.url)
        log.add(message.batch_id, message.shape.queue, [item.id for item in message.items])
        log.flush()

    def _with_retry(self, batch_id: str, write: Callable):
        """Outlast a storage outage instead of regenerating the batch.

        The clients retry each request themselves; this outer loop covers outages
        longer than their budget (botocore's standard mode gives up quickly once many
        threads retry at once). Writes are idempotent (if_absent), so a retry after a
        partial attempt is safe. Past `retry_for_s` the error reaches the ack, which
        hands the batch back to the broker.
        """
        deadline = time.monotonic() + self.retry_for_s
        attempt = 0
        while True:
            try:
                return write()
            except Exception as exc:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise
                delay = min(15.0, 0.5 * 2**attempt)
                log.warning("storing batch %s failed (%r); retry %d in %.1fs", batch_id, exc, attempt, delay)
                time.sleep(delay)

    def _store(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict) -> BatchOutcome:
        started = time.perf_counter()
        fmt = message.params.format
        keys = [layout.image_key(item.id, fmt) for item in message.items]

        def put(index: int) -> tuple[bool, int]:
            data = encode(images[index], fmt)
            return storage.put_bytes(keys[index], data, content_type=_CONTENT_TYPES[fmt], if_absent=True), len(data)

        results = list(self._pool.map(put, range(len(images))))
        finished_at = time.time()
        images_s = round(time.perf_counter() - started, 4)
        lines = []
        for item, key in zip(message.items, keys):
            lines.append(json.dumps({
                "file_name": key,
                "id": item.id,
                "prompt": item.prompt,
                "seed": item.seed,
                "height": message.shape.height,
                "width": message.shape.width,
                "steps": message.params.num_inference_steps,
                "guidance_scale": message.params.guidance_scale,
                "model": message.shape.model,
                "run_id": message.run_id,
                "batch_id": message.batch_id,
                "queue": message.shape.queue,
                "finished_at": finished_at,
                # Encoding + storing this batch's images (overlapped with the next batch).
                "store_s": images_s,
                **record_extra,
            }))
        # One record per batch id: a redelivered batch finds it and writes nothing.
        storage.put_bytes(layout.record_key(message.batch_id), ("\n".join(lines) + "\n").encode(),
                          content_type="application/jsonl", if_absent=True)
        return BatchOutcome(
            batch_id=message.batch_id,
            written=sum(1 for ok, _ in results if ok),
            bytes=sum(size for _, size in results),
            store_s=time.perf_counter() - started,
        )

    def flush(self) -> None:
        """Wait for everything handed over so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
