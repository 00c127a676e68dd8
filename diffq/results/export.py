"""Export a run folder as a dataset: imagefolder, WebDataset tar shards or Parquet.

Everything streams: records are read a window of record files at a time and images
a chunk at a time, and each shard is written to a temporary file and handed to the
destination storage as soon as it is full. Memory is bounded by the chunk and one
Parquet row group, not by the run size. The destination is any storage URL (local,
s3://, gs://), so an export can go straight to a bucket.

Output order is deterministic (record files sorted by key, items in record order),
so exporting the same run twice gives the same shards.

`shard=Shard(i, n)` (`--shard i/n`) writes the i-th of n disjoint parts of that same
output, so n exporters on n machines split a run and the union of their files is a
single export's, byte for byte: file k (`shard-k.tar`, `part-k.parquet`; for
imagefolder, the images of positions k·shard_size … (k+1)·shard_size − 1) belongs
to exporter k mod n, and exporter 0 also writes imagefolder's `metadata.jsonl`. A
record's position in the single export is known only once every record before it is
counted, so each exporter reads every record file but parses only its own (a record
file's lines are its images). Export a finished run: exporters that see different
records disagree on positions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import groupby, islice
from pathlib import Path

import orjson

from diffq.core import layout
from diffq.core.progress import root_batch
from diffq.core.records import ImageRecord, parse_record
from diffq.core.runfolder import ItemSet, first_records, read_manifest, record_keys
from diffq.core.storage import Storage, open_storage
from diffq.results.writers import DEFAULT_FORMAT, FORMATS, WHOLE, WRITERS, Destination, Shard

DEFAULT_SHARD_SIZE = 1000
#: Images fetched per round trip; with the Parquet row group this bounds memory.
CHUNK = 128
#: Record files read per round trip.
RECORD_WINDOW = 64

Progress = Callable[[int, int], None]


@dataclass
class ExportResult:
    dest: str
    format: str
    images: int
    bytes: int
    files: list[str] = field(default_factory=list)
    run_images: int = 0  # images in the whole export: every shard of one export must agree




def record_groups(storage: Storage) -> Iterator[list[str]]:
    """Every record key, sorted, grouped by root batch: a root's keys sort together (all
    start with `records/<root>.`, and no root id holds a '.'), and only they can share
    an item (a derived batch carries some of its root's items)."""
    for _, keys in groupby(record_keys(storage), key=lambda key: root_batch(layout.batch_of_record(key))):
        yield list(keys)


def _unique(bodies: list[bytes]) -> list[ImageRecord]:
    """A root's records, each item once (runfolder.first_records)."""
    if len(bodies) == 1:  # one batch's record: its items are distinct (BatchMessage checks)
        return parse_record(bodies[0])
    return [record for records in first_records(map(parse_record, bodies)) for record in records]


def _count_unique(bodies: list[bytes]) -> int:
    """len(_unique(bodies)) without parsing records: lines, or ids where batches overlap."""
    if len(bodies) == 1:
        return sum(1 for line in bodies[0].splitlines() if line.strip())
    return len(ItemSet(orjson.loads(line)["id"] for body in bodies for line in body.splitlines() if line.strip()))


class Positioned:
    """(position, record) of every image of the run, in a stable order, reading `window`
    record files at a time; with `parts`, only those whose part (position // part_size)
    it accepts (the others are counted, not parsed). Once iterated, `run_images` is the
    number of images in the whole run."""

    def __init__(self, storage: Storage, part_size: int = 1, parts: Callable[[int], bool] | None = None,
                 window: int = RECORD_WINDOW):
        self.storage, self.part_size, self.parts, self.window = storage, part_size, parts, window
        self.run_images = 0

    def __iter__(self) -> Iterator[tuple[int, ImageRecord]]:
        position, parts, size = 0, self.parts, self.part_size
        for groups in _chunks(record_groups(self.storage), max(1, self.window // 2)):
            bodies = dict(self.storage.get_many(key for group in groups for key in group))
            for group in groups:
                mine = [bodies.pop(key) for key in group]
                if parts is not None:
                    n = _count_unique(mine)
                    if not any(parts(part) for part in range(position // size, (position + n - 1) // size + 1)):
                        position += n
                        continue
                records = _unique(mine)
                for offset, record in enumerate(records):
                    if parts is None or parts((position + offset) // size):
                        yield position + offset, record
                position += len(records)
        self.run_images = position


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def _with_images(storage: Storage, records: Iterable[tuple[int, ImageRecord]], chunk: int
                 ) -> Iterator[tuple[int, ImageRecord, bytes]]:
    for batch in _chunks(records, chunk):
        data = dict(storage.get_many(r.file_name for _, r in batch))
        for position, record in batch:
            yield position, record, data.pop(record.file_name)


def export(out: str, dest: str | Path, *, format: str = DEFAULT_FORMAT, shard_size: int = DEFAULT_SHARD_SIZE,
           chunk: int = CHUNK, max_workers: int = 16, on_progress: Progress | None = None,
           shard: Shard = WHOLE) -> ExportResult:
    """Write the finished images of run folder `out` to `dest` as a dataset.

    `format`: a writers.WRITERS key (imagefolder, as `fetch` writes it; WebDataset tar
    shards; Parquet), each writer's docstring says what it writes. `shard_size` is
    images per tar / Parquet file; `on_progress(done, total)` is called after each
    image, total being the run's item count. `shard`: only this exporter's part of
    the files (module docstring).
    """
    writer_class = WRITERS.get(format)
    if writer_class is None:
        raise ValueError(f"unknown export format {format!r}: expected one of {', '.join(FORMATS)}")
    if shard_size < 1 or chunk < 1:
        raise ValueError("shard_size and chunk must be positive")
    storage = open_storage(out)
    total = read_manifest(storage).total
    counts = {"images": 0, "bytes": 0}

    def tick(size: int, copied: bool) -> None:
        counts["images"] += 1
        counts["bytes"] += size
        if on_progress:
            on_progress(counts["images"], total)

    target = Destination(os.fspath(dest))
    try:
        writer = writer_class(target, source=storage, part_size=shard_size, shard=shard, chunk=chunk,
                              max_workers=max_workers, on_image=tick)
        records = Positioned(storage, shard_size, writer.parts)
        files = writer.write_all(_with_images(storage, records, chunk) if writer.reads_images
                                 else ((position, record, None) for position, record in records))
    finally:
        target.close()
    return ExportResult(dest=target.url, format=format, images=counts["images"], bytes=counts["bytes"],
                        files=files, run_images=records.run_images)
