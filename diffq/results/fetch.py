"""`diffq fetch`: download a run's images and write an imagefolder `metadata.jsonl`.

Its lines are the run's image records (records.ImageRecord), one per image, in the
order `export` writes them: both write through writers.ImageFolderWriter.
`shard=Shard(i, n)` (`--shard i/n`) fetches the i-th of n disjoint parts of the
images, as export splits them, and only shard 0 writes metadata.jsonl: the union of n
machines' DEST folders is a single fetch's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffq.core import layout
from diffq.core.records import ImageRecord
from diffq.core.runfolder import read_manifest
from diffq.core.storage import open_storage
from diffq.results.export import DEFAULT_SHARD_SIZE, WHOLE, Positioned, Shard
from diffq.results.writers import Destination, ImageFolderWriter


def _fetched_ids(metadata: Path) -> set[str]:
    if not metadata.exists():
        return set()
    with open(metadata) as lines:
        return {json.loads(line)["id"] for line in lines if line.strip()}


@dataclass
class FetchResult:
    dest: str
    images: int  # images this fetch holds in DEST (its shard's)
    downloaded: int
    run_images: int = 0  # images in the whole run: every shard of one fetch must agree


def fetch(out: str, dest: str | Path, *, max_workers: int = 16, only_new: bool = False,
          on_progress: Callable[[int, int], None] | None = None, shard: Shard = WHOLE,
          shard_size: int = DEFAULT_SHARD_SIZE) -> FetchResult:
    """Download every finished image and write DEST/metadata.jsonl (HF imagefolder).

    Resumable: an image already in DEST with the stored size is not fetched again.
    only_new: trust DEST/metadata.jsonl and fetch only items it does not list yet,
    without listing sizes or checking files (the cheap way to follow a running run).
    on_progress(downloaded, to_download) is called after each download. shard: only
    the images of positions k·shard_size … (k+1)·shard_size − 1 with k mod n = i, and
    metadata.jsonl only from shard 0.
    """
    if only_new and not shard.whole:
        raise ValueError("--only-new reads DEST/metadata.jsonl, which only shard 0 writes: not with --shard")
    storage = open_storage(out)
    read_manifest(storage)
    dest = Path(dest)
    (dest / layout.IMAGES_PREFIX).mkdir(parents=True, exist_ok=True)
    if only_new:
        known = _fetched_ids(dest / "metadata.jsonl")

        def needed(record: ImageRecord) -> bool:
            return record.id not in known
    else:
        sizes = dict(storage.list_with_sizes(layout.IMAGES_PREFIX))

        def needed(record: ImageRecord) -> bool:
            target = dest / record.file_name
            return not (target.exists() and target.stat().st_size == sizes.get(record.file_name))

    def downloaded(size: int, copied: bool) -> None:
        if copied and on_progress:
            on_progress(folder.copied, folder.queued)

    target = Destination(str(dest))
    try:
        # Every record is read before the first download, so progress knows how many are left.
        folder = ImageFolderWriter(target, source=storage, part_size=shard_size, shard=shard, chunk=None,
                                   max_workers=max_workers, on_image=downloaded, needed=needed)
        records = Positioned(storage, shard_size, folder.parts)
        folder.write_all((position, record, None) for position, record in records)
    finally:
        target.close()
    return FetchResult(dest=str(dest), images=folder.images, downloaded=folder.copied, run_images=records.run_images)
