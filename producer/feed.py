"""The feeder: a window of each run's batches in the broker, the rest in OUT.

`submit` writes the whole plan to OUT and publishes, per shape queue, only the first
`window` batches of the run; the feeder publishes the next ones as the run's earlier
batches settle (every item done or failed: the progress summary and the failure
records, core/progress.py), so the broker holds at most `window` batches of a run per
queue, whatever the run's size. The window is per run and queue: shape queues are
shared by runs, and a big run holds no more of a queue than a small one may.

What is published is marked in OUT after the broker took it (`feed/<source>/state.json`:
a count per queue of the source's first batches, publish then mark), so a feeder killed
anywhere loses nothing: the next one republishes at most what was published but not
yet marked. A batch published twice is generated once: a worker that meets a batch
already stored credits it again and acks (worker/delivery/tasks.py). A second feeder beside the
first publishes the same batches again at worst, on the same guard; a count it marks
is never more than it published itself, so nothing is skipped. No broker offers
publish-and-mark atomically; this order needs none.

The feeder publishes each queue's batches in the source's order: a run with LoRA
adapters has them grouped by adapter set there (submit.py `grouped_by_set`).

The source is the plan (`plan`) or what `resume` / `retry-failed` re-planned (written
under `feed/<source>/`); `feed.json` names the current one and is written only by
those, so a feeder's late mark cannot undo a resume. A cancelled run is not fed
(`diffq cancel` stops its feeder; `resume` un-cancels and feeds again).

Which runs a fleet's feeder serves: a feeds folder, one small file per run that still
has batches to publish, written by `submit` and `resume`; the feeder runs in the
backlog service (`diffq fleet backlog`), which reports each model's and queue's
unpublished batches beside the broker's depths (app/backlog.py). A fleet's feeder
keeps a feeds folder under each run-folder prefix it was rendered with
(`feeds_under`: PREFIX/.diffq-feeds) and a heartbeat in each; `submit` looks for a
live one in the folders above its OUT (`find_feeder`) and registers the run there, so
on defaults (`fleet manifests --out-prefix P`, `submit --out P/run`) the run gets a
window with no feeds setting on either side. With none live it publishes every batch:
a window nobody feeds would stall. `--feeds` / `DIFFQ_FEEDS` name one outright.
`diffq feed OUT` feeds named runs by hand, with a heartbeat in each run folder (not
in a feeds folder: no submit registers with it), so `status` and `queues` tell it from
a run that waits for a feeder.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from diffq.core import layout
from diffq.core.progress import ProgressSummary
from diffq.core.feeds import HEARTBEAT, HEARTBEAT_S, RunFeedCounts, beat, find_feeder, read_pointer, read_state, run_feed_counts
from diffq.core.records import FeedEntry, FeedPointer, FeedQueue, FeedState
from diffq.core.runfolder import read_cancel
from diffq.core.storage import NotFound, Storage, open_storage
from diffq.producer.messages import EncodedBatch

log = logging.getLogger(__name__)

# Batches of one run each shape queue holds at once (queued or in a worker's hand).
# KEDA adds a replica per `batches_per_replica` (4) queued batches, so a window of
# 4096 lets a pool's broker trigger alone ask for 1024 pods; a thousand devices (two
# batches in hand each with run-ahead) still find hundreds queued, minutes of work,
# so none waits between two feeder passes (POLL_S). What the broker then holds per
# run and queue: docs/BENCHMARKS.md, "Broker memory".
DEFAULT_WINDOW = 4096
POLL_S = 2.0  # between two looks at a run's progress: a window drains in minutes, not seconds
_HEAD = b'{"batch_id":"'  # a canonical batch line starts so (sorted keys: core/signing.py)


# The default window: a window where a feeds folder lists the run for a fleet's feeder,
# else every batch (without a feeder, the rest of a windowed run would wait in OUT).
AUTO = "auto"


def feeds_setting() -> str | None:
    from diffq.core.settings import get_settings

    return get_settings().feeds


@dataclass
class FeedChoice:
    """Where a submit's run is fed: its window (None: every batch in the broker), the
    feeds folder that lists it (None: nobody's) and, without one, the line saying why."""

    window: int | None
    feeds: str | None
    why: str | None = None


def choose_feed(window: int | str | None, feeds: str | None, out: str) -> FeedChoice:
    """`--window` and `--feeds` as given, DIFFQ_FEEDS, else a live fleet feeder found above
    `out` (`find_feeder`); AUTO without any of them: every batch in the broker, and why."""
    feeds = feeds or feeds_setting()
    if window is None:
        return FeedChoice(None, None)
    found = feeds or find_feeder(out)
    if window != AUTO:
        return FeedChoice(window, found)
    if found:
        return FeedChoice(DEFAULT_WINDOW, found)
    return FeedChoice(None, None, (
        f"every batch published: no live feeder above {out} (a fleet rendered with `diffq fleet manifests "
        f"--out-prefix` over it keeps one there; or --feeds / DIFFQ_FEEDS)"))


def parse_window(value: str | int | None) -> int | str | None:
    """`--window`: a number of batches, `all` (None: every batch in the broker) or `auto`."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        window = int(value)
    except ValueError:
        raise ValueError(f"--window {value!r}: a number of batches per run and shape queue, or 'all'") from None
    if window < 1:
        raise ValueError(f"--window {value}: at least 1 batch per run and shape queue, or 'all'")
    return window


def source_batches(storage: Storage, source: str, queue: str, id_prefix: str) -> Iterator[tuple[EncodedBatch, list[str]]]:
    """The source's batches of one queue, in order, as published, with their item ids."""
    head = _HEAD + id_prefix.encode()
    parts = layout.feed_parts_prefix(source)
    for key in sorted(k for k in storage.list(parts) if k.endswith(".jsonl")):
        for line in storage.get_bytes(key).splitlines():
            if line.startswith(head):
                data = orjson.loads(line)
                ids = [item["id"] for item in data["items"]]
                yield EncodedBatch(queue, data["run_id"], data["batch_id"], len(ids), line), ids
            elif not line.startswith(_HEAD) and line.strip():
                raise ValueError(f"{storage.key_url(key)}: a line that is not a batch in its canonical form")


def start_feed(storage: Storage, run_id: str, source: str, queues: dict[str, tuple[str, int]], window: int,
               feeds: str | None = None) -> FeedState:
    """Make `source` the run's current one, nothing of it published yet: its state
    first, then the pointer (a feeder follows the pointer only to a state it can read).
    `queues`: queue -> (batch id prefix, batches in the source)."""
    state = FeedState(run_id=run_id, window=window, feeds=feeds,
                      queues={q: FeedQueue(prefix=prefix, total=total) for q, (prefix, total) in sorted(queues.items())})
    _put(storage, layout.feed_state_key(source), state.model_dump_json().encode())
    _put(storage, layout.FEED, FeedPointer(run_id=run_id, source=source).model_dump_json().encode())
    return state


def _put(storage: Storage, key: str, body: bytes) -> None:
    storage.put_bytes(key, body, content_type="application/json")


class RunFeed:
    """One run's feeding from its current source. `feed_once` publishes what the
    window has room for and marks it; `unpublished` is what waits in OUT."""

    def __init__(self, storage: Storage, publisher, on_published: Callable[[int], None] | None = None):
        self.storage, self.publisher, self.on_published = storage, publisher, on_published
        pointer = read_pointer(storage)
        if pointer is None:
            raise NotFound(f"{storage.url} has no {layout.FEED}: its run was submitted with every batch in the broker")
        self.source = pointer.source
        self.state = read_state(storage, self.source)
        self.published = {queue: fed.published for queue, fed in self.state.queues.items()}
        self.summary = ProgressSummary(storage)
        self._batches: dict[str, Iterator[tuple[EncodedBatch, list[str]]]] = {}
        self._outstanding: dict[str, dict[str, list[str]]] = {}  # queue -> published, not settled
        self.cancelled = False
        self.loaded = False  # one whole pass done: its counts are known

    @property
    def unpublished(self) -> dict[str, int]:
        return {queue: max(0, fed.total - self.published[queue]) for queue, fed in self.state.queues.items()}

    @property
    def finished(self) -> bool:
        """Every batch of the source published (the broker and the workers have the rest)."""
        return not any(self.unpublished.values())

    def over(self) -> bool:
        """Nothing left to feed: all published or cancelled, and still so when looked at
        again (a resume that began another source meanwhile lists the run again)."""
        if self.cancelled:
            return read_cancel(self.storage) is not None
        return self.finished and self.current()

    def current(self) -> bool:
        """Whether the run is still fed from this source (a resume may have begun another)."""
        pointer = read_pointer(self.storage)
        return pointer is not None and pointer.source == self.source

    def _queue(self, queue: str) -> Iterator[tuple[EncodedBatch, list[str]]]:
        """The queue's batches after those published; the published ones not yet
        settled are outstanding (a restarted feeder learns them in this one pass,
        against the summary just refreshed)."""
        batches = self._batches.get(queue)
        if batches is None:
            fed = self.state.queues[queue]
            batches = self._batches[queue] = source_batches(self.storage, self.source, queue, fed.prefix)
            outstanding = {}
            for _ in range(self.published[queue]):
                taken = next(batches, None)
                if taken is None:
                    break
                if not self.summary.settled(taken[0].batch_id, taken[1]):
                    outstanding[taken[0].batch_id] = taken[1]
            # Whole, or not at all: the backlog service reads it from another thread.
            self._outstanding[queue] = outstanding
        return batches

    def feed_once(self) -> int:
        """Publish up to the window per queue, then mark it; the batches published."""
        if read_cancel(self.storage) is not None:
            self.cancelled = True
            return 0
        self.summary.refresh()
        sent = 0
        for queue, fed in self.state.queues.items():
            if self.published[queue] >= fed.total and not self._outstanding.get(queue):
                continue
            batches = self._queue(queue)
            outstanding = self._outstanding[queue]
            for batch_id in [b for b, ids in outstanding.items() if self.summary.settled(b, ids)]:
                del outstanding[batch_id]
            while len(outstanding) < self.state.window and self.published[queue] < fed.total:
                taken = next(batches, None)
                if taken is None:  # the source holds fewer than its state counts
                    raise ValueError(f"{self.storage.url}: feed source {self.source!r} holds "
                                     f"{self.published[queue]} batches of {queue}, its state counts {fed.total}")
                encoded, ids = taken
                self.publisher.publish_encoded(encoded)
                outstanding[encoded.batch_id] = ids
                self.published[queue] += 1
                sent += 1
                if self.on_published:
                    self.on_published(encoded.items)
        if sent:
            self.publisher.flush()  # in the broker before it is marked
            self.mark()
        self.loaded = True
        return sent

    def mark(self) -> None:
        if not self.current():  # a resume began another source: this one is done with
            return
        state = self.state.model_copy(update={"queues": {
            queue: fed.model_copy(update={"published": self.published[queue]})
            for queue, fed in self.state.queues.items()}})
        _put(self.storage, layout.feed_state_key(self.source), state.model_dump_json().encode())


# --- the feeds folder: which runs a fleet's feeder serves --------------------------
def feed_key(out: str) -> str:
    return hashlib.sha1(out.encode()).hexdigest()[:20] + ".json"


def register(feeds: str, out: str, run_id: str) -> None:
    """List the run in the feeds folder (again: a resume of a run already listed)."""
    _put(open_storage(feeds), feed_key(out), FeedEntry(out=out, run_id=run_id).model_dump_json().encode())


def registered(feeds: Storage) -> list[FeedEntry]:
    entries = []
    for key in sorted(feeds.list()):
        if key.endswith(".json"):
            try:
                entries.append(FeedEntry.model_validate_json(feeds.get_bytes(key)))
            except (NotFound, ValidationError) as exc:
                log.warning("feeds folder %s: %s skipped: %s", feeds.url, key, exc)
    return entries


def waiting_runs(folders: list[str]) -> list[tuple[FeedEntry, RunFeedCounts]]:
    """Each run the feeds folders list: its batches in the broker (about) and in OUT, and
    whether a live feeder serves it (read, nothing fed)."""
    from diffq.core.runfolder import read_manifest

    found = []
    for folder in folders:
        for entry in registered(open_storage(folder)):
            storage = open_storage(entry.out)
            try:
                manifest = read_manifest(storage)
                summary = ProgressSummary(storage).refresh()
                left = {s.queue: (max(0, s.items - summary.done_per_queue.get(s.queue, 0)), s.shape.batch_size)
                        for s in manifest.shapes}
                counts = run_feed_counts(storage, left)
            except Exception as exc:  # one run unreadable: the others still shown
                log.warning("feeds folder %s: %s: %s", folder, entry.out, exc)
                continue
            if counts is not None:
                found.append((entry, counts))
    return found


def waiting(feeds: str) -> dict[str, int]:
    """queue -> batches the feeds folder's runs still hold in OUT (read, nothing fed)."""
    unpublished: dict[str, int] = {}
    for entry in registered(open_storage(feeds)):
        storage = open_storage(entry.out)
        try:
            pointer = read_pointer(storage)
            if pointer is None or read_cancel(storage) is not None:
                continue
            for queue, fed in read_state(storage, pointer.source).queues.items():
                unpublished[queue] = unpublished.get(queue, 0) + fed.unpublished
        except (NotFound, ValidationError) as exc:
            log.warning("feeds folder: %s: %s", entry.out, exc)
    return unpublished


class Feeder:
    """Feeds every run of its feeds folders (and `outs`, named) through one publisher:
    a pass publishes what each run's window has room for. A run leaves its folder once
    its source is all published; a cancelled one once seen cancelled (resume lists it
    again). `unpublished()` is queue -> batches waiting in OUT over every run fed.
    While it serves, each feeds folder holds its heartbeat (`beat`), and each named run
    one of its own (layout.FEEDER: `diffq feed OUT` serves that run alone), taken away
    when it stops or the run is done."""

    def __init__(self, publisher, feeds: str | list[str] | tuple[str, ...] | None = None,
                 outs: tuple[str, ...] = ()):
        self.publisher = publisher
        folders = [feeds] if isinstance(feeds, str) else list(feeds or ())
        self.feeds = [open_storage(folder) for folder in dict.fromkeys(folders)]
        self.outs = list(outs)
        # The runs named (`diffq feed OUT`): each its own heartbeat while fed (layout.FEEDER).
        self._own = {out: open_storage(out) for out in self.outs}
        self._beat_lock = threading.Lock()  # a run dropped is beaten no more
        self._runs: dict[str, RunFeed] = {}
        self._listed: dict[str, Storage] = {}  # out -> the feeds folder listing it
        self._unpublished: dict[str, int] = {}
        # Wall-clock times of the last finished pass and the last batch published
        # (the backlog service's metrics: diffq/app/run_metrics.py).
        self.last_pass: float | None = None
        self.last_publish: float | None = None
        self._beaten = float("-inf")

    def runs(self) -> list[str]:
        listed = {}
        for folder in self.feeds:
            for entry in registered(folder):
                listed.setdefault(entry.out, folder)
        self._listed = listed
        return list(dict.fromkeys(self.outs + list(listed)))

    def beat(self, clock=time.monotonic) -> None:
        """The heartbeat in every feeds folder and named run, at most every HEARTBEAT_S."""
        if clock() - self._beaten < HEARTBEAT_S:
            return
        with self._beat_lock:
            for folder in self.feeds:
                self._beat(folder, HEARTBEAT)
            for out in self.outs:
                if out in self._runs:  # a run it feeds: a mistyped OUT gets no folder made
                    self._beat(self._own[out], layout.FEEDER)
        self._beaten = clock()

    @staticmethod
    def _beat(storage: Storage, key: str) -> None:
        try:
            beat(storage, key=key)
        except Exception as exc:  # that folder away: the others still say so
            log.warning("feeder heartbeat in %s: %s: %s", storage.url, type(exc).__name__, exc)

    def _beating(self, stop) -> None:
        while not stop.is_set():
            self.beat()
            stop.wait(HEARTBEAT_S)

    def _unbeat(self, out: str) -> None:
        """A named run's heartbeat gone with its feeding: `status` says at once it waits."""
        try:
            self._own[out].delete(layout.FEEDER)
        except Exception as exc:  # it ages past LIVE_S instead
            log.warning("feeder heartbeat in %s not removed: %s: %s", out, type(exc).__name__, exc)

    def pass_once(self) -> int:
        sent = 0
        unpublished: dict[str, int] = {}
        for out in self.runs():
            try:
                run = self._runs.get(out)
                if run is None or not run.current():
                    run = self._runs[out] = RunFeed(open_storage(out), self.publisher)
                    if out in self._own:  # its heartbeat now, before a first pass that may be long
                        with self._beat_lock:
                            self._beat(self._own[out], layout.FEEDER)
                sent += run.feed_once()
            except NotFound as exc:  # no feed (every batch went to the broker) or no run: nothing to feed
                log.warning("not feeding %s: %s", out, exc)
                self._drop(out)
                continue
            except Exception as exc:  # one run's trouble does not stop the others
                log.warning("feeding %s: %s: %s", out, type(exc).__name__, exc)
                continue
            if run.over():
                self._drop(out)
            if not run.cancelled:
                for queue, n in run.unpublished.items():
                    if n:
                        unpublished[queue] = unpublished.get(queue, 0) + n
        self._unpublished = unpublished
        self.last_pass = time.time()
        if sent:
            self.last_publish = self.last_pass
        return sent

    def _drop(self, out: str) -> None:
        self._runs.pop(out, None)
        if out in self.outs:
            with self._beat_lock:
                self.outs.remove(out)
                self._unbeat(out)
        folder = self._listed.pop(out, None)
        if folder is not None:
            folder.delete(feed_key(out))

    def unpublished(self) -> dict[str, int]:
        return dict(self._unpublished)

    def runs_fed(self) -> list[dict]:
        """Per run fed, once a whole pass has counted it: its batches in the broker (published,
        not settled) and in OUT."""
        return [{"out": out, "run_id": run.state.run_id,
                 "in_broker": sum(len(batches) for batches in run._outstanding.values()),
                 "in_out": sum(run.unpublished.values())}
                for out, run in list(self._runs.items()) if run.loaded and not run.cancelled]

    def serve(self, stop, poll_s: float = POLL_S, until_done: bool = False) -> bool:
        """Passes every `poll_s` until `stop` (a threading.Event) is set or, `until_done`,
        until no run is left to feed (True then). The named runs' heartbeats go with it."""
        # The heartbeat on its own thread: a long pass (a restarted feeder learning a big
        # run's outstanding batches, a slow store) must not let it age past LIVE_S.
        beating = threading.Event()
        heart = threading.Thread(target=self._beating, args=(beating,), name="diffq-feeder-heartbeat", daemon=True)
        heart.start()
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    self.pass_once()
                except Exception as exc:  # the feeds folder away: try again next pass
                    log.warning("feeder pass: %s: %s", type(exc).__name__, exc)
                if until_done and not self.runs():
                    return True
                stop.wait(max(0.0, poll_s - (time.monotonic() - started)))
            return False
        finally:
            beating.set()
            heart.join()
            with self._beat_lock:
                for out in self.outs:
                    self._unbeat(out)
