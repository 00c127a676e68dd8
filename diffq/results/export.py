"""Export a run folder as a dataset: imagefolder, WebDataset tar shards or Parquet.

Everything streams: records are read a window of record files at a time and images
a chunk at a time, and each shard is written to a temporary file and handed to the
destination storage as soon as it is full. Memory is bounded by the chunk and one
Parquet row group, not by the run size. The destination is any storage URL (local,
s3://, gs://), so an export can go straight to a bucket.

Output order is deterministic (record files sorted by key, items in record order),
so exporting the same run twice gives the same shards.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path

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


def iter_records_ordered(storage: Storage, window: int = RECORD_WINDOW) -> Iterator[ImageRecord]:
    """Every image record once, in a stable order, reading `window` record files at a time.

    Duplicates (a race that recorded one item twice) are dropped by an 8-byte digest
    of the id, the only per-item state kept.
    """
    keys = record_keys(storage)
    seen: set[bytes] = set()
    for start in range(0, len(keys), window):
        chunk = keys[start:start + window]
        bodies = dict(storage.get_many(chunk))
        for key in chunk:
            for record in parse_record(bodies.pop(key)):  # parsed one batch at a time
                digest = hashlib.blake2b(record.id.encode(), digest_size=8).digest()
                if digest not in seen:
                    seen.add(digest)
                    yield record


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def _shards(items: Iterable, size: int) -> Iterator[Iterator]:
    """Lazy groups of `size`: a shard never sits in memory whole. Consume each before the next."""
    iterator = iter(items)
    for first in iterator:
        yield chain([first], islice(iterator, size - 1))


def _with_images(storage: Storage, records: Iterable[ImageRecord], chunk: int
                 ) -> Iterator[tuple[ImageRecord, bytes]]:
    for batch in _chunks(records, chunk):
        data = dict(storage.get_many(r.file_name for r in batch))
        for record in batch:
            yield record, data.pop(record.file_name)


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


def _write_webdataset(samples: Iterator[tuple[ImageRecord, bytes]], dest: _Destination, shard_size: int,
                      tick: Callable[[int], None]) -> list[str]:
    files = []
    for shard, group in enumerate(_shards(samples, shard_size)):
        key = f"shard-{shard:06d}.tar"
        path = dest.temp_path(key)
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for n, (record, image) in enumerate(group):
                # WebDataset splits a member name at its first dot into key and
                # extension, and ids may hold dots: the key is the position instead.
                sample = f"{shard * shard_size + n:09d}"
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


def _write_parquet(samples: Iterator[tuple[ImageRecord, bytes]], dest: _Destination, shard_size: int,
                   tick: Callable[[int], None], row_group: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    files = []
    for shard, group in enumerate(_shards(samples, shard_size)):
        key = f"part-{shard:06d}.parquet"
        path = dest.temp_path(key)
        with pq.ParquetWriter(path, schema) as writer:
            for rows in _chunks(group, row_group):
                columns = {"image": [{"bytes": image, "path": r.file_name.rsplit("/", 1)[-1]}
                                     for r, image in rows]}
                columns |= {name: [_cell(r, name) for r, _ in rows] for name in ImageRecord.fields()}
                writer.write_table(pa.Table.from_pydict(columns, schema=schema))
                for _, image in rows:
                    tick(len(image))
        dest.finish(path, key)
        files.append(key)
    return files


def _write_imagefolder(storage: Storage, records: Iterator[ImageRecord], dest: _Destination, chunk: int,
                       tick: Callable[[int], None], max_workers: int) -> list[str]:
    metadata = dest.temp_path("metadata.jsonl")

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

    with open(metadata, "wb") as lines, ThreadPoolExecutor(max_workers, thread_name_prefix="diffq-export") as pool:
        for batch in _chunks(records, chunk):
            for record, size in zip(batch, pool.map(copy, batch)):
                lines.write(jsonl([record]))
                tick(size)
    dest.finish(metadata, "metadata.jsonl")
    return ["metadata.jsonl"]


def export(out: str, dest: str | Path, *, format: str = "imagefolder", shard_size: int = DEFAULT_SHARD_SIZE,
           chunk: int = CHUNK, max_workers: int = 16, on_progress: Progress | None = None) -> ExportResult:
    """Write the finished images of run folder `out` to `dest` as a dataset.

    imagefolder: DEST/images/… and DEST/metadata.jsonl, as `fetch` writes (existing
    local images are not fetched again). webdataset: DEST/shard-NNNNNN.tar, each sample
    an image and a .json of its record. parquet: DEST/part-NNNNNN.parquet with an
    `image` column ({bytes, path}, decoded as images by `datasets`) and one column per
    record field. `shard_size` is images per tar / Parquet file; `on_progress(done,
    total)` is called after each image, total being the run's item count.
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

    target = _Destination(os.fspath(dest))
    try:
        records = iter_records_ordered(storage)
        if format == "imagefolder":
            files = _write_imagefolder(storage, records, target, chunk, tick, max_workers)
        else:
            samples = _with_images(storage, records, chunk)
            if format == "webdataset":
                files = _write_webdataset(samples, target, shard_size, tick)
            else:
                files = _write_parquet(samples, target, shard_size, tick, row_group=chunk)
    finally:
        target.close()
    return ExportResult(dest=target.url, format=format, images=counts["images"], bytes=counts["bytes"],
                        files=files)
