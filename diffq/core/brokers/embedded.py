"""The embedded broker: kombu's filesystem transport, tuned (`EmbeddedBroker`), and
kombu's in-process memory transport (`MemoryBroker`, for plans and tests that start nothing).

The filesystem transport removes the message file on fetch: a task in flight when
its worker is SIGKILLed is lost (../shared/CELERY.md), so the fetch is the delivery's
end on this broker, and the embedded runner republishes from the run folder a batch
a dead worker held (`lost with its worker` in worker/delivery/outcomes.py, carried out
by diffq/app/runner.py).
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from queue import Empty

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from diffq.core.brokers.base import Broker


def embedded_broker(folder: str | Path) -> tuple[str, dict]:
    """kombu's filesystem transport: the embedded default, no server needed.

    Exactly-once across several worker processes (../shared/CELERY.md), polling
    every 0.1 s instead of the default 1 s.
    """
    folder = Path(folder)
    queue_dir = folder / "queue"
    control_dir = folder / "control"
    for path in (queue_dir, control_dir):
        path.mkdir(parents=True, exist_ok=True)
    return "filesystem://localhost/", {
        "data_folder_in": str(queue_dir),
        "data_folder_out": str(queue_dir),
        "control_folder": str(control_dir),
        "polling_interval": 0.1,
    }


# This process's publish count, for the message file names (`EmbeddedChannel._put`):
# shared by its channels and threads.
_published = itertools.count()


class EmbeddedChannel(filesystem.Channel):
    """kombu's filesystem channel, but messages come in publish order and only whole,
    and the queue folder is listed once per pass, not once per message.

    kombu names a message file `<ms>_<uuid4>.<queue>.msg` and takes the folder in
    sorted name order (kombu/transport/filesystem.py in kombu 5.7.0: `_put`, lines
    262-279; `_get`, lines 281-318), so the messages a publisher wrote within one
    millisecond came in uuid order, that is shuffled (a LoRA run whose batches were
    grouped by adapter hot-swapped up to twice as often). `_put` here names it `<ms>_<n>-<uuid4 hex>.<queue>.msg`: the same
    millisecond on the same clock, so names still sort by time against other
    publishers' and kombu's own; then this process's publish count, fixed width, so
    one publisher's messages sort in the order it wrote them; the uuid keeps names
    unique across processes (a forked child counts on from its parent's count).
    `_get` sorts the milliseconds as numbers (`_publish_order`): kombu's unpadded
    ones sort as text, so when the clock (time since boot) gains a digit, at 2.8 h,
    28 h, 11.6 days, the newer messages came before every older one still queued.

    kombu's `_get` lists and sorts the whole folder for every message it takes, on
    the worker's main thread between two device calls: its cost grows with the
    messages still queued (a run publishes all of its batches at once). Here the
    sorted names of a queue are kept and taken oldest first; the folder is listed
    again only when they run out. Taking a message is still the atomic rename that
    makes delivery exactly-once across processes: a name another worker took
    meanwhile fails to move and is skipped. Messages published after a listing
    (retries, halves, hand-backs) are newer than every name in it, so they come next.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._listed: dict[str, collections.deque] = {}

    def _put(self, queue, payload, **kwargs):
        # The name: kombu's millisecond (the same clock, read through kombu's module),
        # then the count. Written under another name and renamed into place: kombu
        # writes the file under its own name, where a consumer may take it and read it
        # half written (its lock is one no reader takes).
        name = f"{int(round(filesystem.monotonic() * 1000))}_{next(_published):016x}-{uuid.uuid4().hex}.{queue}.msg"
        path = os.path.join(self.data_folder_out, name)
        try:
            with open(path + ".part", "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.rename(path + ".part", path)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {path!r} to directory") from exc

    def _get(self, queue):
        names = self._listed.get(queue)
        if not names:
            suffix = f"{queue}.msg"
            names = self._listed[queue] = collections.deque(sorted(
                (name for name in os.listdir(self.data_folder_in) if name.partition(".")[2] == suffix),
                key=_publish_order))
        processed = self.processed_folder if self.store_processed else tempfile.gettempdir()
        while names:
            name = names.popleft()
            path = os.path.join(processed, name)
            try:
                os.rename(os.path.join(self.data_folder_in, name), path)
            except FileNotFoundError:
                continue  # taken by another worker since the listing
            except OSError:  # another file system: what kombu's shutil.move does
                try:
                    shutil.move(os.path.join(self.data_folder_in, name), processed)
                except OSError:
                    continue
            try:
                with open(path, "rb") as f:
                    payload = f.read()
                if not self.store_processed:
                    os.remove(path)
            except OSError as exc:
                raise ChannelError(f"Cannot read file {path!r} from queue.") from exc
            return loads(bytes_to_str(payload))
        raise Empty()


def _publish_order(name: str) -> tuple[int, str]:
    """`<ms>_…` names by the millisecond as a number, then as text: the digits' count
    first, as the milliseconds are unpadded."""
    return len(name.partition("_")[0]), name


class EmbeddedTransport(filesystem.Transport):
    """kombu's filesystem transport, but a warm shutdown takes effect between polls.

    Celery drives a transport without an event loop from `synloop`, which blocks in
    `drain_events(timeout=2.0)` and, on seeing the shutdown flag, runs one more such
    cycle: every warm shutdown of an idle worker waited seconds before the process
    even began to exit (docs/BENCHMARKS.md). Here
    the wait is cut into polling intervals and ends as soon as the flag is set.
    """

    Channel = EmbeddedChannel

    def drain_events(self, connection, timeout=None):
        if timeout is None:
            return super().drain_events(connection, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return super().drain_events(connection, timeout=0)  # one look at the queues
            except socket.timeout:
                left = deadline - time.monotonic()
                if left <= 0 or _worker_stopping():
                    raise
            # Between looks: the polling interval, or less when the worker acked or
            # widened its window (`wake_consumer`); then back to Celery's loop, which
            # applies a new window before it drains again. The ring is taken here, not
            # cleared on entry: one rung after Celery's loop applied the window and
            # before this drain began would be lost, and the new window wait out a
            # whole polling interval.
            if _doorbell.wait(min(self.polling_interval or left, left)):
                _doorbell.clear()
                raise socket.timeout()


# Rung by a worker's task threads (worker/delivery/batches.py) when it may take another
# message: its embedded consumer, otherwise between two polls, looks at once.
_doorbell = threading.Event()


def wake_consumer() -> None:
    _doorbell.set()


def _worker_stopping() -> bool:
    from celery.worker import state

    # Exit code 0 means "stop" too, so compare by identity (0 == False).
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


class EmbeddedBroker(Broker):
    """No lease (the runner re-enqueues from the run folder), no listing: the folder's
    queues are the runner's own."""

    kombu_transport = "diffq.core.brokers.embedded:EmbeddedTransport"

    def options(self, settings) -> dict:
        return {}


class MemoryBroker(Broker):
    """kombu's in-process transport: nothing beyond kombu's API."""

    def options(self, settings) -> dict:
        return {}
