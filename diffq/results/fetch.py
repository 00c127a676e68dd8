"""`diffq fetch`: download a run's images and write an imagefolder `metadata.jsonl`."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diffq.core import layout
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage


METADATA_FIELDS = ("file_name", "id", "prompt", "seed", "height", "width", "steps",
                   "guidance_scale", "model")
# Per-item fields only some rows set: written as null where absent, so every line has
# the same columns (`datasets` loads `metadata` as one struct column).
OPTIONAL_FIELDS = ("negative_prompt", "metadata")


def metadata_line(record: dict) -> dict:
    return {k: record[k] for k in METADATA_FIELDS} | {k: record.get(k) for k in OPTIONAL_FIELDS}


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
    lines = "".join(json.dumps(metadata_line(r)) + "\n" for r in records)
    _atomic_write(dest / "metadata.jsonl", lines.encode())
    return FetchResult(dest=str(dest), images=len(records), downloaded=len(todo))
