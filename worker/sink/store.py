"""The sink: encode a batch's images in threads, store them, then its record.

Runs beside generation: the task hands over a batch and goes on to the next one.
Batches are stored in order by one writer thread; within a batch, encoding and
uploads run on a small pool (the storage clients release the GIL, and so do PIL's
WebP encoder and, in part, its PNG one; its JPEG encoder holds it, so there the
threads overlap file I/O and bookkeeping, not encoding). Images are written only
if absent, so a redelivered batch never overwrites what is stored; then the
record, so a record always means its images exist; then the batch is credited in
this process's progress segment (diffq/progress.py), which is what status reads.
All of it happens before the ack, so a worker that dies in between leaves the
batch to be delivered again, and the copy that finds the record stored credits it
(`credit`). Where the store limits rewrites of one object (GCS: about one a
second), credits that arrive within that interval are written together; the
worker's back-pressure waits only for images + record (`Handed.stored`), the ack
for the write holding the credit (`Handed.credited`).
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
from dataclasses import dataclass, field
from functools import partial

from pydantic import ValidationError

from diffq import __version__
from diffq.core import layout
from diffq.core.contract import BatchMessage
from diffq.core.adapters import set_digest
from diffq.core.progress import ProgressLog, TroubleNote
from diffq.core.records import BatchMeasures, ImageRecord, jsonl
from diffq.core.settings import get_settings
from diffq.core.storage import Storage
from diffq.worker.device.backends import parse_devices
from diffq.worker.observe import metrics

log = logging.getLogger(__name__)

# Progress logs kept per process (one per run folder); an evicted one is replaced
# by a fresh log under a new writer name, which readers treat the same.
MAX_LOGS = 64
# Relative to the generating thread (0): a lower priority, never starved on a busy core.
SINK_NICENESS = 10


def _yield_to_generation() -> None:
    """Lower this thread's scheduling priority (Linux: niceness is per thread), and
    keep it on the sink's CPUs where `DIFFQ_SINK_CPUS` names them.

    Encoding overlaps the next batch's generation; where cores are scarce the
    encoder should take what generation leaves, not preempt the device loop.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SINK_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass
    place_on_sink_cpus()


def place_on_sink_cpus() -> None:
    """Run the calling thread (and what it starts later) on `DIFFQ_SINK_CPUS`."""
    cpus = get_settings().sink_cpus
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, parse_devices(cpus))  # 0: the calling thread (Linux)
    except (AttributeError, OSError, ValueError) as exc:
        log.warning("DIFFQ_SINK_CPUS=%s not applied: %s", cpus, exc)


@dataclass(frozen=True)
class Pixels:
    """A generated image's 8-bit pixels in a buffer (the sink helper's shared-memory
    slot), made a PIL image by the thread that encodes it, just before encoding: the
    encoder then reads pixels that were unpacked a moment ago (still in the CPU's
    cache), and a batch's images are not all held unpacked at once."""

    mode: str
    size: tuple[int, int]  # width, height
    data: memoryview

    def image(self):
        from PIL import Image

        # Not initialised (Image.new's default fills it with zeros), then unpacked.
        image = Image.new(self.mode, self.size, None)
        image.frombytes(self.data)
        return image


def as_image(image):
    """A PIL image of a generated one (an H×W×3 uint8 array, `Pixels`, or already PIL)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, Pixels):
        return image.image()
    return Image.fromarray(image)


def fit_image(image, fit: str, height: int | None, width: int | None):
    """The image to store for an item that asked for height x width (size buckets).

    "resize" stretches the bucket's image to the requested size; "crop" scales it to
    cover the requested size and cuts the centre (PIL's ImageOps.fit); "none" keeps it.
    """
    if fit == "none" or height is None or image.size == (width, height):
        return image
    from PIL import Image, ImageOps

    if fit == "resize":
        return image.resize((width, height), Image.Resampling.LANCZOS)
    return ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS)


# EXIF tags: the Exif sub-IFD pointer and its UserComment (undefined bytes, whose
# first 8 name the character code).
_EXIF_IFD, _USER_COMMENT = 0x8769, 0x9286


def provenance(message: BatchMessage, item, size: tuple[int, int], model_revision: str | None = None,
               lora_mode: str | None = None) -> dict[str, str]:
    """What made this image, as text: written into the file itself (off with
    --no-embed-metadata), so it travels with the image wherever it is copied."""
    fields = {
        "prompt": item.prompt,
        "negative_prompt": item.negative_prompt,
        "seed": str(item.seed),
        "steps": str(message.params.num_inference_steps),
        "guidance_scale": f"{message.params.guidance_scale:g}",
        "size": f"{size[0]}x{size[1]}",  # width x height, as stored
        "model": message.shape.model,
        "model_revision": model_revision,  # an object-storage model's (core/model_store.py)
        "speedup": message.params.speedup,
        # The LoRA adapters, each path, scale and pinned revision (JSON: a list).
        "adapters": json.dumps([adapter.model_dump(mode="json") for adapter in message.params.adapters])
        if message.params.adapters else None,
        "lora_mode": lora_mode,  # how the worker put them in (worker/device/lora_modes.py)
        "diffq_version": __version__,
    }
    return {key: value for key, value in fields.items() if value is not None}


def _png_text(text: dict[str, str]) -> dict:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_itxt(key, value)  # iTXt: UTF-8, unlike tEXt's Latin-1
    return {"pnginfo": info}


def _exif(text: dict[str, str]) -> dict:
    # JSON with \u escapes is pure ASCII, so the "ASCII" character code holds any
    # prompt losslessly.
    from PIL import Image

    exif = Image.Exif()
    exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = b"ASCII\0\0\0" + json.dumps(text, sort_keys=True).encode()
    return {"exif": exif}


# The format table's `provenance` carriers (diffq/core/layout.py): PIL save options
# that write the text into the file.
PROVENANCE_WRITERS = {"png-text": _png_text, "exif": _exif}


def encode(image, fmt: str, text: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    row = layout.IMAGE_FORMATS[fmt]
    options = dict(row.options)
    if text:
        options.update(PROVENANCE_WRITERS[row.provenance](text))
    image.save(buffer, format=row.pil, **options)
    return buffer.getvalue()


@dataclass
class BatchOutcome:
    batch_id: str
    written: int  # images newly stored (0 for a fully redelivered batch)
    bytes: int
    store_s: float


@dataclass
class Handed:
    """A batch handed to the sink. `stored`: its images and record are stored (what
    the worker's back-pressure waits for; result: BatchOutcome). `credited`: its
    progress credit is stored too (what the ack waits for)."""

    stored: Future
    credited: Future


@dataclass
class _Credits:
    """One run folder's progress log and the credits waiting for its next write."""

    log: ProgressLog
    waiting: list = field(default_factory=list)  # futures resolved by the next write
    next_write: float = 0.0  # monotonic time the segment may be rewritten
    timer: threading.Timer | None = None


# A run folder's progress segment is rewritten at most this often: credits of batches
# stored meanwhile (a fast device's stream) wait and go in one write, and their acks
# with them; a store with a rewrite limit of its own (GCS) keeps the longer one.
CREDITS_EVERY_S = 0.05


# BatchMeasures' field of per-item flags (item id -> check) for ImageRecord.degenerate.
DEGENERATE_KEY = "degenerate"


# Freed pixel blocks PIL keeps for the next images (its default, 0, hands each
# image's memory back to the OS, and every batch's new images fault it in again:
# docs/BENCHMARKS.md). PILLOW_BLOCKS_MAX, where set, decides instead.
PIXEL_BLOCKS_KEPT = 16


def _extra(record_extra, name: str):
    """A field of the worker's measures (BatchMeasures, or its dict across the sink process)."""
    return record_extra.get(name) if isinstance(record_extra, dict) else getattr(record_extra, name, None)


def keep_pixel_blocks() -> None:
    from PIL import Image

    if "PILLOW_BLOCKS_MAX" not in os.environ:
        Image.core.set_blocks_max(max(Image.core.get_blocks_max(), PIXEL_BLOCKS_KEPT))


class Sink:
    def __init__(self, threads: int = 4, retry_for_s: float = 600.0,
                 failed_try: Callable[[], None] = partial(metrics.observe_upload_failure, "try")):
        """`failed_try` is told of each failed try (the worker's metrics; a helper
        process passes it on to its worker)."""
        keep_pixel_blocks()
        self._failed_try = failed_try
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffq-sink",
                                          initializer=_yield_to_generation)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="diffq-io",
                                        initializer=_yield_to_generation)
        self.retry_for_s = retry_for_s
        self._credits: OrderedDict[str, _Credits] = OrderedDict()  # writer thread only
        # Why storing fails, per run folder, told to status / watch / the runner (writer thread only).
        self._notes: OrderedDict[str, TroubleNote] = OrderedDict()
        self._notes_dir = get_settings().trouble_dir or None

    def submit(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict) -> Handed:
        handed = Handed(stored=Future(), credited=Future())
        self._writer.submit(self._store_and_credit, storage, message, images, record_extra, handed)
        return handed

    def credit(self, storage: Storage, message: BatchMessage) -> Future:
        """Credit a batch whose record is already stored (a redelivered copy)."""
        credited: Future = Future()
        self._writer.submit(self._credit, storage, message, credited)
        return credited

    def _store_and_credit(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict,
                          handed: Handed) -> None:
        try:
            outcome = self._with_retry(message.batch_id, lambda: self._store(storage, message, images, record_extra),
                                       storage)
        except Exception as exc:
            handed.stored.set_exception(exc)
            handed.credited.set_exception(exc)
            return
        handed.stored.set_result(outcome)
        # Credited even when the record was there already: the copy that stored it
        # may have died before crediting it.
        self._credit(storage, message, handed.credited, _extra(record_extra, "lora_mode"))

    def _credit(self, storage: Storage, message: BatchMessage, credited: Future, lora_mode: str | None = None) -> None:
        """Add the credit; write the segment now, or when the store allows the next
        rewrite of it (GCS: once a second), for every credit waiting by then."""
        credits = self._credits.get(storage.url)
        if credits is None:
            credits = self._credits[storage.url] = _Credits(ProgressLog(storage))
            if len(self._credits) > MAX_LOGS:
                self._write_credits(self._credits.popitem(last=False)[1])
        self._credits.move_to_end(storage.url)
        credits.log.add(message.batch_id, message.shape.queue, [item.id for item in message.items],
                        set_digest(message.params.adapters), lora_mode)
        credits.waiting.append(credited)
        delay = credits.next_write - time.monotonic()
        if delay <= 0:
            self._write_credits(credits)
        elif credits.timer is None:
            credits.timer = threading.Timer(delay, self._writer.submit, args=(self._write_credits, credits))
            credits.timer.daemon = True
            credits.timer.start()

    def _write_credits(self, credits: _Credits) -> None:
        if credits.timer is not None:
            credits.timer.cancel()
            credits.timer = None
        waiting, credits.waiting = credits.waiting, []
        if not waiting:
            return
        try:
            self._with_retry("progress", credits.log.flush, credits.log.storage)
        except Exception as exc:  # the acks turn into requeues; redelivered copies credit again
            for future in waiting:
                future.set_exception(exc)
        else:
            for future in waiting:
                future.set_result(None)
        credits.next_write = time.monotonic() + max(credits.log.storage.min_rewrite_interval_s, CREDITS_EVERY_S)

    def _note(self, storage: Storage) -> TroubleNote:
        note = self._notes.get(storage.url)
        if note is None:
            note = self._notes[storage.url] = TroubleNote(storage, local=self._notes_dir)
            if len(self._notes) > MAX_LOGS:  # the oldest one, unless it is in trouble now
                oldest = next(iter(self._notes))
                if self._notes[oldest].trouble is None:
                    del self._notes[oldest]
        self._notes.move_to_end(storage.url)
        return note

    def trouble(self, storage: Storage):
        """Storing into this run folder failing now: a `progress.Trouble`, or None."""
        note = self._notes.get(storage.url)
        return note.trouble if note is not None else None

    def _with_retry(self, batch_id: str, write: Callable, storage: Storage | None = None):
        """Outlast a storage outage instead of regenerating the batch.

        The clients retry each request themselves; this outer loop covers outages
        longer than their budget (botocore's standard mode gives up quickly once many
        threads retry at once). Writes are idempotent (if_absent), so a retry after a
        partial attempt is safe. Past `retry_for_s` the error reaches the ack, which
        hands the batch back to the broker. Meanwhile the run folder's trouble note
        says why (diffq/core/progress.py), for status, watch and the runner.
        """
        deadline = time.monotonic() + self.retry_for_s
        note = self._note(storage) if storage is not None else None
        attempt = 0
        while True:
            try:
                result = write()
            except ValidationError:  # a record that breaks its schema will not heal
                raise
            except Exception as exc:
                attempt += 1
                self._failed_try()
                if note is not None:
                    note.failed(exc)
                if time.monotonic() >= deadline:
                    raise
                delay = min(15.0, 0.5 * 2**attempt)
                log.warning("storing batch %s failed (%r); retry %d in %.1fs", batch_id, exc, attempt, delay)
                time.sleep(delay)
            else:
                if note is not None:
                    note.stored()
                return result

    def _store(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict) -> BatchOutcome:
        started = time.perf_counter()
        fmt = message.params.format
        keys = [layout.image_key(item.id, fmt) for item in message.items]

        fit = message.params.fit
        embed = message.params.embed_metadata
        revision, lora_mode = (_extra(record_extra, name) for name in ("model_revision", "lora_mode"))

        def put(index: int) -> tuple[bool, int]:
            item = message.items[index]
            image = fit_image(as_image(images[index]), fit, item.requested_height, item.requested_width)
            data = encode(image, fmt, provenance(message, item, image.size, revision, lora_mode) if embed else None)
            return storage.put_bytes(keys[index], data, content_type=layout.IMAGE_FORMATS[fmt].content_type,
                                     if_absent=True), len(data)

        results = list(self._pool.map(put, range(len(images))))
        finished_at = time.time()
        store_s = round(time.perf_counter() - started, 4)
        # Validated here, in the writer: a bad measure fails this batch's futures, not the caller.
        measures = BatchMeasures.model_validate(record_extra) if isinstance(record_extra, dict) else record_extra
        records = [ImageRecord.of(message, item, key, measures, store_s=store_s, finished_at=finished_at)
                   for item, key in zip(message.items, keys)]
        # One record per batch id: a redelivered batch finds it and writes nothing.
        storage.put_bytes(layout.record_key(message.batch_id), jsonl(records),
                          content_type="application/jsonl", if_absent=True)
        return BatchOutcome(
            batch_id=message.batch_id,
            written=sum(1 for ok, _ in results if ok),
            bytes=sum(size for _, size in results),
            store_s=time.perf_counter() - started,
        )

    def flush(self) -> None:
        """Wait for everything handed over so far, credits written at once."""
        self._writer.submit(self._write_all).result()

    def _write_all(self) -> None:
        for credits in self._credits.values():
            self._write_credits(credits)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
