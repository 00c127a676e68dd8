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

import io
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby, islice
from pathlib import Path

import orjson

from diffq.core import layout
from diffq.core.progress import root_batch
from diffq.core.records import ImageRecord, jsonl, parse_record
from diffq.core.runfolder import read_manifest, record_keys
from diffq.core.storage import Storage, open_storage

FORMATS = ("imagefolder", "webdataset", "parquet")
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


@dataclass(frozen=True)
class Shard:
    """This exporter's part of an export split n ways: file k goes to shard k mod n."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: expected I/N with 0 ≤ I < N")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'I/N', e.g. '3/8' (from a Kubernetes Job: "$(JOB_COMPLETION_INDEX)/8")."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if match is None:
            raise ValueError(f"shard {text!r}: expected I/N with 0 ≤ I < N, e.g. 0/4")
        return cls(int(match[1]), int(match[2]))

    def owns(self, part: int) -> bool:
        return part % self.count == self.index

    @property
    def whole(self) -> bool:
        return self.count == 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE = Shard()


def record_groups(storage: Storage) -> Iterator[list[str]]:
    """Every record key, sorted, grouped by root batch: a root's keys sort together (all
    start with `records/<root>.`, and no root id holds a '.'), and only they can share
    an item (a derived batch carries some of its root's items)."""
    for _, keys in groupby(record_keys(storage), key=lambda key: root_batch(layout.batch_of_record(key))):
        yield list(keys)


def _unique(bodies: list[bytes]) -> list[ImageRecord]:
    """A root's records, each item once (the first record of it wins)."""
    if len(bodies) == 1:  # one batch's record: its items are distinct (BatchMessage checks)
        return parse_record(bodies[0])
    seen: set[str] = set()
    return [record for body in bodies for record in parse_record(body)
            if record.id not in seen and not seen.add(record.id)]


def _count_unique(bodies: list[bytes]) -> int:
    """len(_unique(bodies)) without parsing records: lines, or ids where batches overlap."""
    if len(bodies) == 1:
        return sum(1 for line in bodies[0].splitlines() if line.strip())
    return len({orjson.loads(line)["id"] for body in bodies for line in body.splitlines() if line.strip()})


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


def _parts(samples: Iterable[tuple[int, ImageRecord, bytes]], size: int
           ) -> Iterator[tuple[int, Iterator[tuple[int, ImageRecord, bytes]]]]:
    """(part, its samples lazily) by position // size: a part never sits in memory whole.
    Consume each before the next."""
    return groupby(samples, key=lambda sample: sample[0] // size)


def _with_images(storage: Storage, records: Iterable[tuple[int, ImageRecord]], chunk: int
                 ) -> Iterator[tuple[int, ImageRecord, bytes]]:
    for batch in _chunks(records, chunk):
        data = dict(storage.get_many(r.file_name for _, r in batch))
        for position, record in batch:
            yield position, record, data.pop(record.file_name)


class _Destination:
    """Finished files go to the destination storage: renamed into place locally, uploaded otherwise."""

    def __init__(self, url: str):
        self.storage = open_storage(url)
        self.url = self.storage.url
        root = self.storage.local_path("x")
        self.local = root.parent if root is not None else None
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        # Temporary files sit next to their target when local, so the rename is atomic.
        self._tmp = tempfile.TemporaryDirectory(prefix=".diffq-export-", dir=self.local)

    def temp_path(self, name: str) -> Path:
        return Path(self._tmp.name) / name

    def finish(self, path: Path, key: str) -> None:
        if self.local is not None:
            target = self.local / key
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        else:
            self.storage.upload_file(path, key)
            path.unlink()

    def close(self) -> None:
        self._tmp.cleanup()


def _extension(record: ImageRecord) -> str:
    return record.file_name.rsplit(".", 1)[-1]


def _write_webdataset(samples: Iterator[tuple[int, ImageRecord, bytes]], dest: _Destination, shard_size: int,
                      tick: Callable[[int], None]) -> list[str]:
    files = []
    for shard, group in _parts(samples, shard_size):
        key = f"shard-{shard:06d}.tar"
        path = dest.temp_path(key)
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for position, record, image in group:
                # WebDataset splits a member name at its first dot into key and
                # extension, and ids may hold dots: the key is the position instead.
                sample = f"{position:09d}"
                mtime = int(record.finished_at)
                for name, body in ((f"{sample}.{_extension(record)}", image),
                                   (f"{sample}.json", json.dumps(record.model_dump(), sort_keys=True).encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(body), mtime, 0o644
                    tar.addfile(info, io.BytesIO(body))
                tick(len(image))
        dest.finish(path, key)
        files.append(key)
    return files


def _parquet_schema():
    import pyarrow as pa

    types = {"string": pa.string(), "int64": pa.int64(), "int32": pa.int32(), "float64": pa.float64(),
             "bool": pa.bool_()}
    columns = ImageRecord.dtypes()
    features = {"image": {"_type": "Image"}} | {
        name: {"dtype": dtype, "_type": "Value"} for name, dtype in columns.items()}
    fields = [pa.field("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))]
    fields += [pa.field(name, types[dtype]) for name, dtype in columns.items()]
    # `datasets` reads its features from this key, which turns the struct into an Image.
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})


def _cell(record: ImageRecord, name: str):
    value = getattr(record, name)
    if value is not None and name in _JSON_TEXT:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    return value


_JSON_TEXT = ImageRecord.json_text_fields()


def _write_parquet(samples: Iterator[tuple[int, ImageRecord, bytes]], dest: _Destination, shard_size: int,
                   tick: Callable[[int], None], row_group: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    files = []
    for shard, group in _parts(samples, shard_size):
        key = f"part-{shard:06d}.parquet"
        path = dest.temp_path(key)
        with pq.ParquetWriter(path, schema) as writer:
            for rows in _chunks(group, row_group):
                columns = {"image": [{"bytes": image, "path": r.file_name.rsplit("/", 1)[-1]}
                                     for _, r, image in rows]}
                columns |= {name: [_cell(r, name) for _, r, _ in rows] for name in ImageRecord.fields()}
                writer.write_table(pa.Table.from_pydict(columns, schema=schema))
                for _, _, image in rows:
                    tick(len(image))
        dest.finish(path, key)
        files.append(key)
    return files


def _write_imagefolder(storage: Storage, records: Iterator[tuple[int, ImageRecord]], dest: _Destination,
                       chunk: int, tick: Callable[[int], None], max_workers: int, copies: Callable[[int], bool],
                       metadata: bool) -> list[str]:
    """Images of the positions `copies` accepts; with `metadata`, metadata.jsonl of every record read."""
    lines_path = dest.temp_path("metadata.jsonl")

    def copy(record: ImageRecord) -> int:
        key = record.file_name
        if dest.local is not None:
            target = dest.local / key
            # Images are written atomically and never overwritten: present means complete.
            if target.exists():
                return target.stat().st_size
            storage.download_file(key, target)
            return target.stat().st_size
        body = storage.get_bytes(key)
        dest.storage.put_bytes(key, body)
        return len(body)

    with open(lines_path, "wb") as lines, ThreadPoolExecutor(max_workers, thread_name_prefix="diffq-export") as pool:
        for batch in _chunks(records, chunk):
            mine = [record for position, record in batch if copies(position)]
            for size in pool.map(copy, mine):
                tick(size)
            if metadata:
                lines.write(jsonl(record for _, record in batch))
    if not metadata:
        return []
    dest.finish(lines_path, "metadata.jsonl")
    return ["metadata.jsonl"]


def export(out: str, dest: str | Path, *, format: str = "imagefolder", shard_size: int = DEFAULT_SHARD_SIZE,
           chunk: int = CHUNK, max_workers: int = 16, on_progress: Progress | None = None,
           shard: Shard = WHOLE) -> ExportResult:
    """Write the finished images of run folder `out` to `dest` as a dataset.

    imagefolder: DEST/images/… and DEST/metadata.jsonl, as `fetch` writes (existing
    local images are not fetched again). webdataset: DEST/shard-NNNNNN.tar, each sample
    an image and a .json of its record. parquet: DEST/part-NNNNNN.parquet with an
    `image` column ({bytes, path}, decoded as images by `datasets`) and one column per
    record field. `shard_size` is images per tar / Parquet file; `on_progress(done,
    total)` is called after each image, total being the run's item count. `shard`:
    only this exporter's part of the files (module docstring).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: expected one of {', '.join(FORMATS)}")
    if shard_size < 1 or chunk < 1:
        raise ValueError("shard_size and chunk must be positive")
    storage = open_storage(out)
    total = read_manifest(storage).total
    counts = {"images": 0, "bytes": 0}

    def tick(size: int) -> None:
        counts["images"] += 1
        counts["bytes"] += size
        if on_progress:
            on_progress(counts["images"], total)

    def owned(position: int) -> bool:
        return shard.owns(position // shard_size)

    target = _Destination(os.fspath(dest))
    try:
        if format == "imagefolder":
            metadata = shard.index == 0  # one writer of the one metadata file
            records = Positioned(storage, shard_size, None if metadata or shard.whole else shard.owns)
            files = _write_imagefolder(storage, iter(records), target, chunk, tick, max_workers, owned, metadata)
        else:
            records = Positioned(storage, shard_size, None if shard.whole else shard.owns)
            samples = _with_images(storage, records, chunk)
            if format == "webdataset":
                files = _write_webdataset(samples, target, shard_size, tick)
            else:
                files = _write_parquet(samples, target, shard_size, tick, row_group=chunk)
    finally:
        target.close()
    return ExportResult(dest=target.url, format=format, images=counts["images"], bytes=counts["bytes"],
                        files=files, run_images=records.run_images)
