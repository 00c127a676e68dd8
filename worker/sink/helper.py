"""The sink in a helper process, so the generating process keeps the GIL to itself.

Why: on the tiny model the pipeline's steps are Python-bound, and every Python line
the sink threads run (PIL glue, JSON, storage clients) competes with them for the
GIL. Measured in one process (docs/BENCHMARKS.md): a pipeline call takes ~10 %
longer while the threaded sink stores the previous batch, and as long as with no
sink at all when the same work runs in a helper process.

How: the worker sends each batch's message over a socket pair to a helper
(`python -m diffq.worker.sink.helper`, no torch) that runs the same `Sink`
(encode/upload threads, images if absent, then the record, then the credit, with
its retries). The pixels of a batch of arrays cross in a shared-memory slot (an
anonymous memfd mapped by both processes, its descriptor passed over the socket
once per helper): the worker's send thread copies the arrays in (numpy's copy
releases the GIL), the helper's encoding threads build each image straight from
the slot just before encoding it (`Pixels`), and the slot is free again once the
batch is stored, has failed, or the helper is gone (`Slots`). Reading each batch
off the socket cost the helper's core a large share of what JPEG's encoder does
(docs/BENCHMARKS.md); PIL images, and systems without memfd, still go through the
socket. In the worker only two threads touch the socket, and they spend their
time blocked in send/recv or copying without the GIL. Every batch still gets a
future that resolves once it is stored, so deferred acks (batches.py) work
unchanged.

Failure: if the helper dies, the batches it held fail (their acks turn into
requeues, nothing is lost) and the next batch starts a new helper. When the worker
goes away, its end of the socket closes and the helper stores what it was handed
before exiting (those batches were never acked; their redelivered copies find the
records). The helper ignores SIGINT/SIGTERM: the worker decides when it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import mmap
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future, wait
from multiprocessing.connection import Connection

import numpy as np

from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.storage import Storage, open_storage
from diffq.worker.observe import heap, metrics
from diffq.worker.sink.store import SINK_NICENESS, BatchOutcome, Handed, Pixels, Sink, place_on_sink_cpus

log = logging.getLogger(__name__)

_CLOSE = {"op": "close"}


class SinkLost(RuntimeError):
    """The helper process ended before storing the batch (it will be delivered again)."""


class SinkError(RuntimeError):
    """Storing failed in the helper (after its retries); carries the helper's error."""


class _Helper:
    """One helper process and the two worker threads that talk to it."""

    def __init__(self, module: str, threads: int, retry_for_s: float, slots: Slots | None = None):
        self.slots = slots
        self._mapped: set[int] = set()  # slots whose descriptor this helper has (send thread only)
        ours, theirs = socket.socketpair()
        with theirs:
            # -P: the working directory is not put first on sys.path, so a `diffq` folder
            # (a checkout) where the worker was started cannot shadow the installed package.
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", module, str(theirs.fileno()), str(threads), str(retry_for_s)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        self._socket = ours  # for passing slot descriptors (the same socket as the Connection)
        self._conn = Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()
        self._pending: dict[int, dict[str, Future]] = {}  # job -> stage -> future
        self._jobs = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.replied = False  # a helper that never replied may be unable to start at all
        threading.Thread(target=self._send_loop, name="diffq-sink-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="diffq-sink-receive", daemon=True).start()

    def submit(self, header: dict, images: list | None, stages: tuple[str, ...]) -> dict[str, Future]:
        """Send a job; one future per stage the helper reports ("stored", "credited").
        The images' pixels are copied out by the send thread, off the generating one."""
        futures = {stage: Future() for stage in stages}
        with self._lock:
            if self.closed:
                for future in futures.values():
                    future.set_exception(SinkLost("sink helper process has ended"))
                return futures
            job = next(self._jobs)
            self._pending[job] = futures
        self._outbox.put(({**header, "job": job}, images, futures.get("stored")))
        return futures

    def pending(self) -> list[Future]:
        with self._lock:
            return [future for futures in self._pending.values() for future in futures.values()]

    def close(self) -> None:
        self._outbox.put((_CLOSE, None, None))

    def _send_loop(self) -> None:
        while True:
            header, images, stored = self._outbox.get()
            slot = self.slots.acquire(images) if images is not None and self.slots is not None else None
            if slot is not None:
                try:
                    slot.fill(images)
                finally:
                    # Free again once the batch is stored or failed (a helper that dies fails
                    # what it held): the helper reads the slot only before it replies. Not
                    # before the copy: a batch already failed gives the slot back at once.
                    stored.add_done_callback(lambda _done, slot=slot: self.slots.release(slot))
                new = slot.id not in self._mapped
                header = {**header, "slot": {"id": slot.id, "size": slot.size, "new": new, "step": images[0].nbytes,
                                             "unmap": self.slots.take_retired()}}
            try:
                self._conn.send_bytes(json.dumps(header).encode())
                if slot is not None and new:
                    socket.send_fds(self._socket, [b"s"], [slot.fd])
                    self._mapped.add(slot.id)
                elif images is not None and slot is None:
                    _send_pixels(self._conn.fileno(), images)
            except OSError:
                return  # the receive loop sees the same end and fails what is pending
            if header is _CLOSE:
                return

    def _receive_loop(self) -> None:
        try:
            while True:
                reply = json.loads(self._conn.recv_bytes())
                if reply.get("failed_try"):  # the helper's sink retrying a store: counted here, where it is served
                    metrics.observe_upload_failure("try")
                    continue
                self.replied = True
                with self._lock:
                    futures = self._pending[reply["job"]]
                    future = futures.pop(reply["stage"])
                    if not futures:
                        del self._pending[reply["job"]]
                if "error" in reply:
                    future.set_exception(SinkError(reply["error"]))
                else:
                    future.set_result(reply["outcome"])
        except (EOFError, OSError):
            pass
        with self._lock:
            self.closed = True
            lost = [future for futures in self._pending.values() for future in futures.values()]
            self._pending = {}
        code = self.process.wait()
        for future in lost:
            future.set_exception(SinkLost(f"sink helper process exited with {code} before storing the batch"))


class _Slot:
    """One shared-memory region: an anonymous memfd, mapped here and in the helper."""

    def __init__(self, slot_id: int, size: int):
        self.id, self.size = slot_id, size
        self.fd = os.memfd_create(f"diffq-sink-slot-{slot_id}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)

    def fill(self, images: list) -> None:
        """Copy a batch of same-shaped uint8 arrays in, one after the other."""
        step = images[0].nbytes
        for index, image in enumerate(images):
            target = np.frombuffer(self.map, np.uint8, count=step, offset=index * step).reshape(image.shape)
            np.copyto(target, image)  # strided sources too; releases the GIL
            del target  # no export of the map outlives the copy

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class Slots:
    """The worker's shared-memory slots for batches of pixels on their way to the helper.

    A slot is taken by the send thread for one batch and given back exactly once,
    when that batch's `stored` future resolves (stored, failed, or lost with its
    helper): the helper builds its images from the slot before it replies. Slots
    outlive helpers (a new helper is sent their descriptors on first use); `MOST`
    bounds them (back-pressure keeps at most STORES_IN_FLIGHT in flight: batches.py), and a
    batch that finds none free, or is not a batch of uint8 arrays, goes through the
    socket.
    """

    MOST = 3

    def __init__(self):
        self._lock = threading.Lock()
        self._free: list[_Slot] = []
        self._all: list[_Slot] = []
        self._ids = itertools.count()
        self._retired: list[int] = []

    def take_retired(self) -> list[int]:
        with self._lock:
            retired, self._retired = self._retired, []
        return retired

    @staticmethod
    def fits(images: list) -> bool:
        first = images[0]
        channels = first.shape[2] if isinstance(first, np.ndarray) and first.ndim == 3 else 1
        if not isinstance(first, np.ndarray) or first.ndim not in (2, 3) or channels not in ARRAY_MODES:
            return False
        return all(isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.shape == first.shape
                   for image in images)

    def acquire(self, images: list) -> _Slot | None:
        if not self.fits(images):
            return None
        size = images[0].nbytes * len(images)
        with self._lock:
            fitting = [slot for slot in self._free if slot.size >= size]
            if fitting:
                slot = min(fitting, key=lambda slot: slot.size)
                self._free.remove(slot)
                return slot
            if len(self._all) >= self.MOST:
                if not self._free:
                    return None
                self._all.remove(retired := self._free.pop(0))  # too small for this shape
                retired.close()
                self._retired.append(retired.id)  # the helper unmaps it too (`take_retired`)
            slot = _Slot(next(self._ids), size)
            self._all.append(slot)
            return slot

    def release(self, slot: _Slot) -> None:
        with self._lock:
            if slot in self._free:
                raise RuntimeError(f"shared-memory slot {slot.id} given back twice")
            if slot in self._all:
                self._free.append(slot)
            else:  # closed meanwhile (the sink closed)
                slot.close()

    def counts(self) -> tuple[int, int]:
        """(slots, free slots)."""
        with self._lock:
            return len(self._all), len(self._free)

    def close(self) -> None:
        """Unmap and close the free slots; one still taken is closed when given back."""
        with self._lock:
            for slot in self._free:
                slot.close()
            taken = [slot for slot in self._all if slot not in self._free]
            self._all, self._free = [], []
        if taken:
            log.warning("closing the sink with %d shared-memory slot(s) still taken", len(taken))


def _slots_available() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class SinkProcess:
    """`Sink`'s interface (submit / credit / flush / close), stored by a helper process."""

    HELPER_MODULE = __name__
    # Helpers in a row that died without storing anything: the helper cannot run here
    # (broken install, no fork allowed); store in threads instead of requeueing forever.
    MAX_FAILED_STARTS = 3

    def __init__(self, threads: int = 4, retry_for_s: float = 600.0, shared_memory: bool = True):
        self.threads = threads
        self.retry_for_s = retry_for_s
        # Pixels of array batches cross in shared memory where the system has memfd.
        self.slots = Slots() if shared_memory and _slots_available() else None
        self._helper: _Helper | None = None
        self._failed_starts = 0
        self._fallback = None  # a threaded Sink, once the helper proved unable to run
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the helper now (it imports in parallel with the model loading)."""
        self._current()

    def _current(self) -> _Helper | None:
        """The live helper, started if needed; None once fallen back to threads."""
        with self._lock:
            if self._fallback is not None:
                return None
            if self._helper is None or self._helper.closed:
                if self._helper is not None:
                    self._failed_starts = 0 if self._helper.replied else self._failed_starts + 1
                    if self._failed_starts >= self.MAX_FAILED_STARTS:
                        log.error("the sink helper process exited %d times without storing anything (last "
                                  "exit %s); storing in threads in this process from now on",
                                  self._failed_starts, self._helper.process.poll())
                        self._fallback = Sink(self.threads, self.retry_for_s)
                        return None
                    log.warning("sink helper exited with %s; starting a new one", self._helper.process.poll())
                self._helper = _Helper(self.HELPER_MODULE, self.threads, self.retry_for_s, self.slots)
            return self._helper

    def submit(self, storage: Storage, message: BatchMessage, images: list, record_extra: dict):
        """Returns a `Handed` (worker/sink/store.py): `stored`, then `credited`."""
        helper = self._current()
        if helper is None:
            return self._fallback.submit(storage, message, images, record_extra)
        header = {
            "op": "store", "out": storage.url, "message": message.model_dump_json(),
            # BatchMeasures' schema (a dict in tests and benchmarks: validated by the sink).
            "measures": record_extra.model_dump(mode="json") if hasattr(record_extra, "model_dump") else record_extra,
            "image": {**pixel_format(images[0]), "count": len(images)},
        }
        # The send thread writes the pixels out (a PIL image's are copied first) while
        # the next call runs, not between two device calls.
        futures = helper.submit(header, images, ("stored", "credited"))
        return Handed(stored=self._outcome(futures["stored"]), credited=futures["credited"])

    def credit(self, storage: Storage, message: BatchMessage) -> Future:
        helper = self._current()
        if helper is None:
            return self._fallback.credit(storage, message)
        return helper.submit({"op": "credit", "out": storage.url, "message": message.model_dump_json()}, None,
                             ("credited",))["credited"]

    @staticmethod
    def _outcome(reply: Future) -> Future:
        outcome: Future = Future()

        def convert(done: Future) -> None:
            if done.exception() is not None:
                outcome.set_exception(done.exception())
            else:
                outcome.set_result(BatchOutcome(**done.result()))

        reply.add_done_callback(convert)
        return outcome

    def flush(self) -> None:
        """Wait for everything handed over so far."""
        helper = self._helper
        if helper is not None:
            wait(helper.pending())
        if self._fallback is not None:
            self._fallback.flush()

    def close(self) -> None:
        self.flush()
        if self._fallback is not None:
            self._fallback.close()
        helper, self._helper = self._helper, None
        if helper is not None and not helper.closed:
            helper.close()
            helper.process.wait()
        if self.slots is not None:
            self.slots.close()


def make_sink():
    """The worker's sink: a helper process (default) or threads in the worker (`DIFFQ_SINK=thread`).

    The helper starts at once, so it imports while the worker loads its model.
    """
    settings = get_settings()
    if settings.sink == "thread":
        return Sink(threads=settings.sink_threads)
    sink = SinkProcess(threads=settings.sink_threads)
    sink.start()
    return sink


def _send_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def pixel_format(image) -> dict:
    """How the helper rebuilds an image from its raw pixels: PIL mode and (width, height)."""
    if isinstance(image, np.ndarray):
        height, width = image.shape[:2]
        return {"mode": ARRAY_MODES[image.shape[2] if image.ndim == 3 else 1], "size": [width, height]}
    return {"mode": image.mode, "size": list(image.size)}


# Channels of an H×W(×C) uint8 array -> the PIL mode of the same bytes.
ARRAY_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def _pixels(image):
    """The raw pixels: an array's own memory (written out without the GIL), or a copy
    out of a PIL image (packed under the GIL)."""
    if isinstance(image, np.ndarray):
        return memoryview(np.ascontiguousarray(image)).cast("B")
    return image.tobytes()


def _send_pixels(fd: int, images: list) -> None:
    """The images' pixels as one `Connection.send_bytes` message, written one image at
    a time (no joined copy of the whole batch)."""
    first = _pixels(images[0])
    size = len(first) * len(images)
    _send_all(fd, struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size))
    _send_all(fd, first)
    for image in images[1:]:
        _send_all(fd, _pixels(image))


def _recv_payload(conn: Connection, reuse: bytearray | None = None) -> bytearray:
    """`conn.recv_bytes()` read straight into one buffer of the right size (`reuse`
    when it has that size): the stdlib's reads it in chunks through a growing
    BytesIO, which costs the helper several times the copy itself for a batch of
    large images. Same framing as `Connection.send_bytes` (a 4-byte length, or -1
    and an 8-byte one)."""
    fd = conn.fileno()

    def read_into(view: memoryview) -> None:
        while view:
            got = os.readv(fd, [view])
            if got == 0:
                raise EOFError
            view = view[got:]

    header = bytearray(4)
    read_into(memoryview(header))
    (size,) = struct.unpack("!i", header)
    if size == -1:
        header = bytearray(8)
        read_into(memoryview(header))
        (size,) = struct.unpack("!Q", header)
    payload = reuse if reuse is not None and len(reuse) == size else bytearray(size)
    read_into(memoryview(payload))
    return payload


def serve(conn: Connection, threads: int, retry_for_s: float) -> None:
    """The helper's loop: receive batches, store them with `Sink`, reply per job."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # for the slots' descriptors
    slots: dict[int, mmap.mmap] = {}  # the worker's shared-memory slots, by id
    storages: dict[str, Storage] = {}
    reply_lock = threading.Lock()
    buffer: bytearray | None = None

    def send(body: dict) -> None:
        with reply_lock:
            try:
                conn.send_bytes(json.dumps(body).encode())
            except OSError:
                pass  # the worker is gone; its batches come back to another one

    def reply(job: int, stage: str, done: Future) -> None:
        if done.exception() is not None:
            body = {"job": job, "stage": stage, "error": f"{type(done.exception()).__name__}: {done.exception()}"}
        else:
            result = done.result()
            body = {"job": job, "stage": stage, "outcome": dataclasses.asdict(result) if result is not None else None}
        send(body)

    # Each failed try told to the worker as it happens: its /metrics is the one scraped.
    sink = Sink(threads=threads, retry_for_s=retry_for_s, failed_try=lambda: send({"failed_try": 1}))

    while True:
        try:
            header = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the worker ended: store what was handed over, then exit
        if header["op"] == "close":
            break
        payload = None
        if header["op"] == "store" and "slot" in header:
            slot = header["slot"]
            for retired in slot["unmap"]:
                if retired in slots:
                    slots.pop(retired).close()
            if slot["new"]:  # its descriptor follows the header
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                if slot["id"] in slots:
                    slots.pop(slot["id"]).close()
                slots[slot["id"]] = mmap.mmap(fds[0], slot["size"], prot=mmap.PROT_READ)
                os.close(fds[0])
            payload = slots[slot["id"]]
        elif header["op"] == "store":
            # The images are copied out of it before the next receive: reuse it.
            payload = buffer = _recv_payload(conn, buffer)
        try:
            url = header["out"]
            if url not in storages:
                storages[url] = open_storage(url)
            message = BatchMessage.model_validate_json(header["message"])
            if header["op"] == "store":
                spec = header["image"]
                size = tuple(spec["size"])
                step = header["slot"]["step"] if "slot" in header else len(payload) // spec["count"]
                with memoryview(payload) as pixels:  # slices without copies
                    views = [pixels[i * step:(i + 1) * step] for i in range(spec["count"])]
                pixels_of = [Pixels(spec["mode"], size, view) for view in views]
                if "slot" in header:
                    # The slot is the worker's until this batch is stored: each image is
                    # unpacked by the thread that encodes it. A mapping cannot close while
                    # a view of it lives: they end with the batch, before its reply.
                    images = pixels_of
                    handed = sink.submit(storages[url], message, images, header["measures"])
                    handed.stored.add_done_callback(lambda _, views=views: [view.release() for view in views])
                else:  # the socket's buffer is reused (resized) by the next receive: unpack now
                    images = [p.image() for p in pixels_of]
                    for view in views:
                        view.release()
                    handed = sink.submit(storages[url], message, images, header["measures"])
                stages = {"stored": handed.stored, "credited": handed.credited}
            else:
                stages = {"credited": sink.credit(storages[url], message)}
        except Exception as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            stages = dict.fromkeys(("stored", "credited") if header["op"] == "store" else ("credited",), failed)
        for stage, future in stages.items():
            future.add_done_callback(lambda done, job=header["job"], stage=stage: reply(job, stage, done))
    sink.close()
    for mapped in slots.values():
        mapped.close()
    sock.close()
    conn.close()


def main(argv: list[str]) -> None:
    fd, threads, retry_for_s = int(argv[0]), int(argv[1]), float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # the whole helper yields to generation, like the sink threads did (store.py)
        os.setpriority(os.PRIO_PROCESS, 0, SINK_NICENESS)
    except (AttributeError, OSError):
        pass
    place_on_sink_cpus()  # before any thread starts: they inherit it
    if get_settings().log_json:
        from diffq.worker.observe.logs import install_json_logging

        install_json_logging("INFO")
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s sink[%(process)d] %(levelname)s %(message)s")
    heap.settle()  # a full collection here was a 30 ms pause in storing, every half minute or so
    serve(Connection(fd), threads, retry_for_s)


if __name__ == "__main__":
    main(sys.argv[1:])
