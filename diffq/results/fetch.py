"""`diffq fetch`: download a run's images and write an imagefolder `metadata.jsonl`.

Its lines are the run's image records (records.ImageRecord), one per image.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diffq.core import layout
from diffq.core.records import ImageRecord, jsonl
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.core.storage.base import atomic_write


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
        todo = [record for record in records if record.id not in known]
    else:
        sizes = dict(storage.list_with_sizes(layout.IMAGES_PREFIX))

        def needed(record: ImageRecord) -> bool:
            target = dest / record.file_name
            return not (target.exists() and target.stat().st_size == sizes.get(record.file_name))

        todo = [record for record in records if needed(record)]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        for done, _ in enumerate(pool.map(lambda r: storage.download_file(r.file_name, dest / r.file_name),
                                          todo), start=1):
            if on_progress:
                on_progress(done, len(todo))
    body = jsonl(records)
    atomic_write(dest / "metadata.jsonl", lambda file: file.write(body))
    return FetchResult(dest=str(dest), images=len(records), downloaded=len(todo))
