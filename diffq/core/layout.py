"""The run folder: which key holds what. Storage is the source of truth; each
file's schema is in records.py.

    manifest.json                 the run: total, shapes, defaults (written before publishing)
    plan/part-000000.jsonl        every batch message as submitted (resume reads these)
    images/<safe id>.<ext>        one image per item, written only if absent
    records/<batch id>.jsonl      one ImageRecord per image of a finished batch (metadata.jsonl lines)
    progress/<writer>-<n>.json    batches credited done by one worker process (or by
                                  resume's reconciliation): what status reads, see
                                  progress.py. Written after the record, before the ack
    failures/<batch id>.json      items that failed after every retry
    fleet-plan.json               `submit`/`run --rates`: the plan's device time (report
                                  shows planned vs actual)
    cancel.json                   `diffq cancel`: workers drop the run's batches they
                                  receive (checked before each batch, cached for
                                  CANCEL_CHECK_S); `diffq resume` removes it
    feed.json                     the source the run is fed from now (a window of it
                                  in the broker, the rest in OUT): "plan" or a resume's
    feed/<source>/state.json      what the feeder has published of that source, per
                                  shape queue
    feed/<source>/part-*.jsonl    batches `resume` / `retry-failed` re-planned, fed
                                  from there like the plan
    feed/feeder.heartbeat         `diffq feed OUT`'s heartbeat while it feeds this run
                                  (this run's alone: no submit registers with it)

Batch ids: a plan batch's id has no '.'; work derived from a batch appends a
'.'-suffix (`<id>.s0`/`.s1` halves of a failing batch, `<id>.r<hash>` resumed,
`<id>.f<hash>` retried failures), and carries a subset of that batch's items.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

MANIFEST = "manifest.json"
PLAN_PREFIX = "plan/"
IMAGES_PREFIX = "images/"
RECORDS_PREFIX = "records/"
FAILURES_PREFIX = "failures/"
PROGRESS_PREFIX = "progress/"
STARTS_PREFIX = "starts/"  # a WorkerStart per worker life that stored a batch of the run
CANCEL = "cancel.json"
FLEET_PLAN = "fleet-plan.json"
FEED = "feed.json"
FEED_PREFIX = "feed/"
FEEDER = "feed/feeder.heartbeat"  # not `.json`, beside no source's state (core/feeds.py)
# How long a worker trusts its last look at CANCEL; resume waits this long after
# removing it before publishing, so no worker drops the resumed batches.
CANCEL_CHECK_S = 2.0


@dataclass(frozen=True)
class ImageFormat:
    extension: str
    pil: str  # PIL's format name
    content_type: str
    # PIL save options: the fastest PNG level, as encoding must keep up with the
    # next batch's generation; quality 90 for the lossy formats.
    options: dict = field(default_factory=dict)
    # Where the file carries its provenance text (worker/sink/store.py `PROVENANCE_WRITERS`):
    # PNG's own text chunks (iTXt), else EXIF's UserComment, which JPEG and WebP hold.
    provenance: str = "exif"


PROVENANCE_CARRIERS = ("png-text", "exif")

IMAGE_FORMATS = {
    "png": ImageFormat("png", "PNG", "image/png", {"compress_level": 1}, provenance="png-text"),
    "jpeg": ImageFormat("jpg", "JPEG", "image/jpeg", {"quality": 90}, provenance="exif"),
    "webp": ImageFormat("webp", "WEBP", "image/webp", {"quality": 90}, provenance="exif"),
}

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
MAX_NAME = 100


def safe_name(item_id: str) -> str:
    """A file name derived from an item id that can never escape the run folder.

    Ids that are already safe keep their name (so `<id>.png` is what users expect);
    anything else is cleaned and suffixed with a hash of the original, which keeps
    distinct ids distinct ("a/b" and "a_b" do not collide).
    """
    cleaned = _UNSAFE.sub("_", item_id)[:MAX_NAME].strip(".")
    if cleaned == item_id and cleaned:
        return cleaned
    digest = hashlib.sha256(item_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{cleaned or 'item'}-{digest}"


def image_key(item_id: str, fmt: str) -> str:
    return f"{IMAGES_PREFIX}{safe_name(item_id)}.{IMAGE_FORMATS[fmt].extension}"


def start_key(worker: str, pid: int, began_at: float) -> str:
    return f"{STARTS_PREFIX}{safe_name(f'{worker}-{pid}-{int(began_at)}')}.json"


def record_key(batch_id: str) -> str:
    return f"{RECORDS_PREFIX}{batch_id}.jsonl"


def batch_of_record(key: str) -> str:
    """The batch id of a record key (`record_key`'s inverse)."""
    return key[len(RECORDS_PREFIX):-len(".jsonl")]


def failure_key(batch_id: str) -> str:
    return f"{FAILURES_PREFIX}{batch_id}.json"


def progress_key(writer: str, segment: int) -> str:
    return f"{PROGRESS_PREFIX}{writer}-{segment:06d}.json"


def plan_key(part: int, prefix: str = PLAN_PREFIX) -> str:
    return f"{prefix}part-{part:06d}.jsonl"


PLAN_SOURCE = "plan"  # the feed source that is the plan itself


def feed_parts_prefix(source: str) -> str:
    """Where a feed source's batches are: the plan's parts, or a resume's own."""
    return PLAN_PREFIX if source == PLAN_SOURCE else f"{FEED_PREFIX}{source}/"


def feed_state_key(source: str) -> str:
    return f"{FEED_PREFIX}{source}/state.json"
