"""Where a fleet's feeder is found, and what a windowed run holds where: read by
`submit` and `resume` (producer/feed.py), `status` and `queues`.

A fleet's feeder (producer/feed.py `Feeder`, in `diffq fleet backlog`) keeps a feeds
folder under each run-folder prefix it serves (`feeds_under`: PREFIX/.diffq-feeds) and
rewrites a heartbeat there every HEARTBEAT_S. A run folder finds it by looking in the
folders above it (`find_feeder`), nearest first; a heartbeat older than LIVE_S is a
dead feeder's. A run's feed state (`read_pointer`, `read_state`) says how many of its
batches were published and how many still wait in OUT.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import socket
import time
from dataclasses import dataclass

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


def beat(feeds: Storage, clock=time.time) -> None:
    """Say this feeder is alive (`find_feeder` reads it)."""
    feeds.put_bytes(HEARTBEAT, FeedHeartbeat(at=clock(), host=socket.gethostname(), pid=os.getpid(),
                                         every_s=HEARTBEAT_S).model_dump_json().encode(),
                    content_type="application/json")


def heartbeat(feeds: Storage) -> FeedHeartbeat | None:
    try:
        return FeedHeartbeat.model_validate_json(feeds.get_bytes(HEARTBEAT))
    except (NotFound, ValidationError):
        return None


def live(feeds: Storage, clock=time.time) -> bool:
    beat_ = heartbeat(feeds)
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
    feeder, and whether a live feeder is there to publish them."""

    in_broker: int
    in_out: int
    feeder: str | None  # the live feeder's feeds folder, None where none is found

    @property
    def waiting_for_feeder(self) -> bool:
        return bool(self.in_out) and self.feeder is None

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
    in_out = in_broker = 0
    for queue, fed in state.queues.items():
        items, size = pending.get(queue, (0, 1))
        in_out += fed.unpublished
        in_broker += max(0, math.ceil(items / max(1, size)) - fed.unpublished)
    feeder = None
    if in_out:
        listed = state.feeds
        feeder = (listed if listed and live(open_storage(listed)) else None) if listed else find_feeder(storage.url)
    return RunFeedCounts(in_broker=in_broker, in_out=in_out, feeder=feeder)
