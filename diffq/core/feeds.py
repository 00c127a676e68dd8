"""Where a fleet's feeder is found, and what a windowed run holds where: read by
`submit` and `resume` (producer/feed.py), `status` and `queues`.

A fleet's feeder (producer/feed.py `Feeder`, in `diffq fleet backlog`) keeps a feeds
folder under each run-folder prefix it serves (`feeds_under`: PREFIX/.diffq-feeds) and
rewrites a heartbeat there every HEARTBEAT_S. A run folder finds it by looking in the
folders above it (`find_feeder`), nearest first; a heartbeat older than LIVE_S is a
dead feeder's. A run fed by hand (`diffq feed OUT`) has a heartbeat of its own in its
run folder (layout.FEEDER), which serves that run alone: `find_feeder` never looks
there. A run's feed state (`read_pointer`, `read_state`) says how many of its batches
were published and how many still wait in OUT.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import socket
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from diffq.core import layout
from diffq.core.records import FeedHeartbeat, FeedPointer, FeedState
from diffq.core.storage import NotFound, Storage, open_storage

log = logging.getLogger(__name__)

FEEDS_DIR = ".diffq-feeds"  # under a fleet's run-folder prefix (`feeds_under`)
HEARTBEAT = "feeder.heartbeat"  # in a feeds folder; not `.json`: no run's entry
HEARTBEAT_S = 10.0  # a live feeder rewrites its heartbeat this often
# A heartbeat older than this is a dead feeder's: a restart (pod rescheduled, image
# pulled) takes longer, and a submit then publishes everything rather than wait.
LIVE_S = 60.0


def feeds_under(prefix: str) -> str:
    """The feeds folder a fleet's feeder keeps under a run-folder prefix."""
    return prefix.rstrip("/") + "/" + FEEDS_DIR


def parents(out: str) -> list[str]:
    """The folders above `out`, nearest first (`s3://b/runs/x` -> `s3://b/runs`, `s3://b`)."""
    scheme, sep, path = out.rstrip("/").partition("://")
    if not sep:
        scheme, path = "", out.rstrip("/")
    found = []
    while True:
        parent = posixpath.dirname(path)
        if parent == path or not parent:
            return found
        path = parent
        if path == "/":
            return found
        found.append(f"{scheme}{sep}{path}" if sep else path)


def beat(feeds: Storage, clock=time.time, key: str = HEARTBEAT) -> None:
    """Say this feeder is alive: in a feeds folder (`find_feeder` reads it), or with
    `key=layout.FEEDER` in the run folder a hand feeder feeds (`run_feed_counts`)."""
    feeds.put_bytes(key, FeedHeartbeat(at=clock(), host=socket.gethostname(), pid=os.getpid(),
                                       every_s=HEARTBEAT_S).model_dump_json().encode(),
                    content_type="application/json")


def heartbeat(feeds: Storage, key: str = HEARTBEAT) -> FeedHeartbeat | None:
    try:
        return FeedHeartbeat.model_validate_json(feeds.get_bytes(key))
    except (NotFound, ValidationError):
        return None


def live(feeds: Storage, clock=time.time, key: str = HEARTBEAT) -> bool:
    beat_ = heartbeat(feeds, key)
    return beat_ is not None and clock() - beat_.at < LIVE_S


def find_feeder(out: str) -> str | None:
    """The nearest feeds folder above `out` with a live feeder's heartbeat, else None."""
    for parent in parents(open_storage(out).url):
        feeds = feeds_under(parent)
        try:
            if live(open_storage(feeds)):
                return feeds
        except Exception as exc:  # a folder we may not read (a bucket's root): look further up
            log.debug("no feeder at %s: %s", feeds, exc)
    return None


def read_pointer(storage: Storage) -> FeedPointer | None:
    try:
        return FeedPointer.model_validate_json(storage.get_bytes(layout.FEED))
    except NotFound:
        return None


def read_state(storage: Storage, source: str) -> FeedState:
    return FeedState.model_validate_json(storage.get_bytes(layout.feed_state_key(source)))



@dataclass
class RunFeedCounts:
    """A windowed run's batches: published (in the broker or a worker's hand, about:
    pending items over the batch size, less those in OUT), waiting in OUT for the
    feeder, and whether a live feeder is there to publish them. The one schema of a
    run's feed counts: `status --json`'s `feed`, each run of `queues --json`."""

    in_broker: int
    in_out: int
    # Where the live feeder's heartbeat is: a fleet's feeds folder, or the run folder's
    # own (layout.FEEDER, `diffq feed OUT`); None where none is found.
    feeder: str | None
    per_queue: dict[str, tuple[int, int]] = field(default_factory=dict)  # queue -> (in_broker, in_out)

    @property
    def waiting_for_feeder(self) -> bool:
        return bool(self.in_out) and self.feeder is None

    def on(self, queue: str) -> RunFeedCounts:
        """The same run's counts of one shape queue."""
        in_broker, in_out = self.per_queue.get(queue, (0, 0))
        return RunFeedCounts(in_broker=in_broker, in_out=in_out, feeder=self.feeder,
                             per_queue={queue: (in_broker, in_out)})

    def to_json(self) -> dict:
        return {"in_broker": self.in_broker, "in_out": self.in_out, "feeder": self.feeder,
                "waiting_for_feeder": self.waiting_for_feeder}


def run_feed_counts(storage: Storage, pending: dict[str, tuple[int, int]]) -> RunFeedCounts | None:
    """`pending`: queue -> (items neither done nor failed, batch size). None for a run
    with every batch in the broker (no feed) or a cancelled one."""
    pointer = read_pointer(storage)
    if pointer is None:
        return None
    try:
        state = read_state(storage, pointer.source)
    except (NotFound, ValidationError):
        return None
    per_queue = {}
    for queue, fed in state.queues.items():
        items, size = pending.get(queue, (0, 1))
        per_queue[queue] = (max(0, math.ceil(items / max(1, size)) - fed.unpublished), fed.unpublished)
    in_out = sum(n for _, n in per_queue.values())
    return RunFeedCounts(in_broker=sum(n for n, _ in per_queue.values()), in_out=in_out,
                         feeder=run_feeder(storage, state.feeds) if in_out else None, per_queue=per_queue)


def run_feeder(storage: Storage, listed: str | None) -> str | None:
    """Where a live feeder of this run beats: its own hand feeder's (`diffq feed OUT`),
    else the feeds folder that lists it (`listed`), else the nearest above it; None."""
    if live(storage, key=layout.FEEDER):
        return storage.key_url(layout.FEEDER)
    if listed:
        return listed if live(open_storage(listed)) else None
    return find_feeder(storage.url)
