"""Results read from the run folder alone: status and fetch. No broker involved.

Status counts from the workers' progress summary (producer/progress.py); runs
from before it, and resume (which needs every item id), read the records.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diffq import layout
from diffq.contract import FailureRecord, RunManifest
from diffq.producer.progress import ProgressSummary
from diffq.storage import NotFound, Storage, open_storage


class NotARun(RuntimeError):
    pass


def read_manifest(storage: Storage) -> RunManifest:
    try:
        return RunManifest.model_validate_json(storage.get_bytes(layout.MANIFEST))
    except NotFound:
        raise NotARun(f"{storage.url} holds no diffq run (no {layout.MANIFEST})") from None


def _parse_records(body: bytes) -> Iterator[dict]:
    for line in body.decode().splitlines():
        if line:
            yield json.loads(line)


def iter_records(storage: Storage) -> Iterator[dict]:
    """Every image record, each item once (first record wins if a race wrote two)."""
    seen: set[str] = set()
    keys = [key for key in storage.list(layout.RECORDS_PREFIX) if key.endswith(".jsonl")]
    for _, body in storage.get_many(keys):
        for record in _parse_records(body):
            if record["id"] not in seen:
                seen.add(record["id"])
                yield record


class ProgressTracker:
    """Progress from every record and failure file, reading each one once.

    Record files never change after they are written (if_absent), so a watcher
    only needs to read the keys it has not seen.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._read: set[str] = set()
        self.done_ids: set[str] = set()
        self.failed_ids: set[str] = set()
        self.done_per_queue: dict[str, int] = {}
        self.generate_s: list[float] = []
        self.batches: dict[str, tuple[str, list[str]]] = {}  # recorded batch -> (queue, item ids)

    def refresh(self) -> None:
        new = [key for prefix in (layout.RECORDS_PREFIX, layout.FAILURES_PREFIX)
               for key in self.storage.list(prefix) if key not in self._read]
        for key, body in self.storage.get_many(new):
            self._read.add(key)
            if key.startswith(layout.FAILURES_PREFIX):
                self.failed_ids.update(FailureRecord.model_validate_json(body).item_ids)
                continue
            records = list(_parse_records(body))
            if records:
                self.generate_s.append(records[0].get("generate_s", 0.0))
                batch_id = key[len(layout.RECORDS_PREFIX):-len(".jsonl")]
                self.batches[batch_id] = (records[0].get("queue", ""), [record["id"] for record in records])
            for record in records:
                if record["id"] in self.done_ids:
                    continue
                self.done_ids.add(record["id"])
                queue = record.get("queue", "")
                self.done_per_queue[queue] = self.done_per_queue.get(queue, 0) + 1

    @property
    def done(self) -> int:
        return len(self.done_ids)

    @property
    def failed(self) -> int:
        return len(self.failed_ids - self.done_ids)


class RunProgress:
    """What status and watch count from: the progress summary once the run has
    one; until then (nothing credited yet, or a run from before the summary)
    every record, read incrementally."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.summary = ProgressSummary(storage)
        self.source: ProgressSummary | ProgressTracker | None = None
        self._scan: ProgressTracker | None = None

    def refresh(self) -> None:
        if self.summary.refresh():
            self.source = self.summary
            return
        if self._scan is None:
            self._scan = ProgressTracker(self.storage)
        self._scan.refresh()
        self.source = self._scan

    @property
    def done(self) -> int:
        return self.source.done

    @property
    def failed(self) -> int:
        return self.source.failed

    @property
    def done_per_queue(self) -> dict[str, int]:
        return self.source.done_per_queue


@dataclass
class ShapeStatus:
    total: int
    done: int = 0


@dataclass
class Status:
    out: str
    run_id: str
    total: int
    done: int
    failed: int
    shapes: dict[str, ShapeStatus] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed

    @property
    def finished(self) -> bool:
        return self.pending == 0

    def to_json(self) -> dict:
        data = asdict(self)
        data["pending"] = self.pending
        return data


def make_status(url: str, manifest: RunManifest, progress: RunProgress | ProgressTracker) -> Status:
    shapes = {s.queue: ShapeStatus(total=s.items, done=progress.done_per_queue.get(s.queue, 0))
              for s in manifest.shapes}
    return Status(out=url, run_id=manifest.run_id, total=manifest.total,
                  done=progress.done, failed=progress.failed, shapes=shapes)


def status(out: str) -> Status:
    storage = open_storage(out)
    manifest = read_manifest(storage)
    progress = RunProgress(storage)
    progress.refresh()
    return make_status(storage.url, manifest, progress)


METADATA_FIELDS = ("file_name", "id", "prompt", "seed", "height", "width", "steps",
                   "guidance_scale", "model")


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _fetched_ids(metadata: Path) -> set[str]:
    if not metadata.exists():
        return set()
    with open(metadata) as lines:
        return {json.loads(line)["id"] for line in lines if line.strip()}


@dataclass
class FetchResult:
    dest: str
    images: int
    downloaded: int


def fetch(out: str, dest: str | Path, *, max_workers: int = 16, only_new: bool = False,
          on_progress: Callable[[int, int], None] | None = None) -> FetchResult:
    """Download every finished image and write DEST/metadata.jsonl (HF imagefolder).

    Resumable: an image already in DEST with the stored size is not fetched again.
    only_new: trust DEST/metadata.jsonl and fetch only items it does not list yet,
    without listing sizes or checking files (the cheap way to follow a running run).
    on_progress(downloaded, to_download) is called after each download.
    """
    storage = open_storage(out)
    read_manifest(storage)
    dest = Path(dest)
    (dest / layout.IMAGES_PREFIX).mkdir(parents=True, exist_ok=True)
    records = list(iter_records(storage))
    if only_new:
        known = _fetched_ids(dest / "metadata.jsonl")
        todo = [record for record in records if record["id"] not in known]
    else:
        sizes = dict(storage.list_with_sizes(layout.IMAGES_PREFIX))

        def needed(record: dict) -> bool:
            target = dest / record["file_name"]
            return not (target.exists() and target.stat().st_size == sizes.get(record["file_name"]))

        todo = [record for record in records if needed(record)]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        for done, _ in enumerate(pool.map(lambda r: storage.download_file(r["file_name"], dest / r["file_name"]),
                                          todo), start=1):
            if on_progress:
                on_progress(done, len(todo))
    lines = "".join(json.dumps({k: r[k] for k in METADATA_FIELDS}) + "\n" for r in records)
    _atomic_write(dest / "metadata.jsonl", lines.encode())
    return FetchResult(dest=str(dest), images=len(records), downloaded=len(todo))
