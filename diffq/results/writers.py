"""The output formats of `export` (and `fetch`'s imagefolder): one writer class each.

As in img2dataset, every format is a `Writer` with the same two calls: `write(position,
record, image)` for each image in position order (the position in the single export,
which names WebDataset samples and decides the part a file holds), then `close()`,
which hands the last file to the destination and returns the keys written. `WRITERS`
is the table of formats; the CLI's `--format` choices are its keys. Adding a format
is a class here and its row in `WRITERS`.

A writer is told which parts of the output are its own (`shard`, see export.py) and
says which records it needs (`parts`); `reads_images` says whether it is handed each
image's bytes or copies the image from the run folder itself (imagefolder: images go
from store to store without passing through this process's memory whole).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from diffq.core.records import ImageRecord, jsonl
from diffq.core.storage import Storage, open_storage


# Here, not in export.py, so the writers need nothing from export (no import cycle).
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


#: on_image(bytes of the image now in DEST, whether this writer copied it there).
OnImage = Callable[[int, bool], None]


class Destination:
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


class Writer:
    """One output format. Every writer takes the same arguments: the destination, the
    run folder's storage, `part_size` (images per file), this exporter's `shard`,
    `chunk` (images per round trip: a Parquet row group, a batch of copies),
    `max_workers` (parallel copies) and `on_image`, called once an image is in DEST."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # for --format's help, after the name
    reads_images: ClassVar[bool] = True  # write() is handed the image's bytes (else None)

    def __init__(self, dest: Destination, *, source: Storage, part_size: int, shard: Shard, chunk: int,
                 max_workers: int, on_image: OnImage):
        self.dest, self.source, self.part_size, self.shard = dest, source, part_size, shard
        self.chunk, self.max_workers, self.on_image = chunk, max_workers, on_image
        self.files: list[str] = []

    @property
    def parts(self) -> Callable[[int], bool] | None:
        """The parts whose records this writer needs (None: all of them)."""
        return None if self.shard.whole else self.shard.owns

    def write(self, position: int, record: ImageRecord, image: bytes | None) -> None:
        raise NotImplementedError

    def close(self) -> list[str]:
        return self.files

    def abort(self) -> None:
        """Release what an unfinished write holds; nothing more reaches DEST."""

    def write_all(self, samples: Iterable[tuple[int, ImageRecord, bytes | None]]) -> list[str]:
        """Write every (position, record, image) and close; abort on an error."""
        try:
            for position, record, image in samples:
                self.write(position, record, image)
        except BaseException:
            self.abort()
            raise
        return self.close()


class _PartFiles(Writer):
    """A file per part (`part_size` positions), handed to DEST as soon as it is full:
    subclasses open, add to and finish one file at a time."""

    pattern: ClassVar[str]  # the part's key, from its number

    def __init__(self, dest: Destination, **kwargs):
        super().__init__(dest, **kwargs)
        self._part: int | None = None

    def write(self, position: int, record: ImageRecord, image: bytes | None) -> None:
        part = position // self.part_size
        if part != self._part:
            self._end()
            self._part, self._key = part, self.pattern.format(part)
            self._path = self.dest.temp_path(self._key)
            self._open(self._path)
        self._add(position, record, image)

    def _end(self) -> None:
        if self._part is not None:
            self._finish()
            self.dest.finish(self._path, self._key)
            self.files.append(self._key)
            self._part = None

    def close(self) -> list[str]:
        self._end()
        return self.files

    def abort(self) -> None:
        if self._part is not None:
            self._part = None
            self._finish()  # into the temporary folder, which the destination removes

    def _open(self, path: Path) -> None:
        raise NotImplementedError

    def _add(self, position: int, record: ImageRecord, image: bytes) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


def _extension(record: ImageRecord) -> str:
    return record.file_name.rsplit(".", 1)[-1]


class WebDatasetWriter(_PartFiles):
    """DEST/shard-NNNNNN.tar, each sample an image and a .json of its record."""

    name, summary, pattern = "webdataset", "tar shards", "shard-{:06d}.tar"

    def _open(self, path: Path) -> None:
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)

    def _add(self, position: int, record: ImageRecord, image: bytes) -> None:
        # WebDataset splits a member name at its first dot into key and extension, and
        # ids may hold dots: the key is the position instead.
        sample = f"{position:09d}"
        mtime = int(record.finished_at)
        for name, body in ((f"{sample}.{_extension(record)}", image),
                           (f"{sample}.json", json.dumps(record.model_dump(), sort_keys=True).encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(body), mtime, 0o644
            self._tar.addfile(info, io.BytesIO(body))
        self.on_image(len(image), False)

    def _finish(self) -> None:
        self._tar.close()


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


_JSON_TEXT = ImageRecord.json_text_fields()


def _cell(record: ImageRecord, name: str):
    value = getattr(record, name)
    if value is not None and name in _JSON_TEXT:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    return value


class ParquetWriter(_PartFiles):
    """DEST/part-NNNNNN.parquet: an `image` column ({bytes, path}, decoded as images by
    `datasets`) and one column per record field, a row group per `chunk` images."""

    name, pattern = "parquet", "part-{:06d}.parquet"

    def _open(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self._schema = _parquet_schema()
        self._writer = pq.ParquetWriter(path, self._schema)
        self._rows: list[tuple[ImageRecord, bytes]] = []

    def _add(self, position: int, record: ImageRecord, image: bytes) -> None:
        self._rows.append((record, image))
        if len(self._rows) >= self.chunk:
            self._write_rows()

    def _write_rows(self) -> None:
        import pyarrow as pa

        rows, self._rows = self._rows, []
        if not rows:
            return
        columns = {"image": [{"bytes": image, "path": r.file_name.rsplit("/", 1)[-1]} for r, image in rows]}
        columns |= {name: [_cell(r, name) for r, _ in rows] for name in ImageRecord.fields()}
        self._writer.write_table(pa.Table.from_pydict(columns, schema=self._schema))
        for _, image in rows:
            self.on_image(len(image), False)

    def _finish(self) -> None:
        self._write_rows()
        self._writer.close()


class ImageFolderWriter(Writer):
    """Hugging Face imagefolder: DEST/images/… under the run folder's keys, and
    DEST/metadata.jsonl, a line per record it is given, in order. `export --format
    imagefolder` and `fetch` both write through it.

    Images of this shard's parts are copied from the run folder, `chunk` at a time in
    parallel; one DEST already holds is not (`needed`: by default, a local image is
    complete once present, images being written atomically and never overwritten).
    Shard 0 alone writes metadata.jsonl, of every record, into place at `close`."""

    name = "imagefolder"
    reads_images = False

    def __init__(self, dest: Destination, *, needed: Callable[[ImageRecord], bool] | None = None,
                 chunk: int | None = None, **kwargs):
        super().__init__(dest, chunk=chunk, **kwargs)  # chunk None: every copy at close
        self.metadata = self.shard.index == 0
        self.needed = needed or self._absent
        self.images = 0  # of this shard's parts, in DEST
        self.queued = self.copied = 0
        self._pending: list[ImageRecord] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lines = open(dest.temp_path("metadata.jsonl"), "wb") if self.metadata else None

    @property
    def parts(self) -> Callable[[int], bool] | None:
        return None if self.metadata or self.shard.whole else self.shard.owns

    def _absent(self, record: ImageRecord) -> bool:
        return self.dest.local is None or not (self.dest.local / record.file_name).exists()

    def write(self, position: int, record: ImageRecord, image: bytes | None = None) -> None:
        if self._lines is not None:
            self._lines.write(jsonl([record]))
        if not self.shard.owns(position // self.part_size):
            return
        self.images += 1
        if self.needed(record):
            self.queued += 1
            self._pending.append(record)
            if self.chunk is not None and len(self._pending) >= self.chunk:
                self._copy_pending()
        else:
            target = self.dest.local / record.file_name if self.dest.local is not None else None
            self.on_image(target.stat().st_size if target is not None and target.exists() else 0, False)

    def _copy(self, record: ImageRecord) -> int:
        key = record.file_name
        if self.dest.local is not None:
            target = self.dest.local / key
            self.source.download_file(key, target)
            return target.stat().st_size
        body = self.source.get_bytes(key)
        self.dest.storage.put_bytes(key, body)
        return len(body)

    def _copy_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="diffq-export")
        for size in self._pool.map(self._copy, pending):
            self.copied += 1
            self.on_image(size, True)

    def close(self) -> list[str]:
        self._copy_pending()
        self._release()
        if self.metadata:  # once every image is in
            self.dest.finish(self.dest.temp_path("metadata.jsonl"), "metadata.jsonl")
            self.files.append("metadata.jsonl")
        return self.files

    def abort(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._lines is not None:
            self._lines.close()
            self._lines = None


WRITERS: dict[str, type[Writer]] = {w.name: w for w in (ImageFolderWriter, WebDatasetWriter, ParquetWriter)}
FORMATS = tuple(WRITERS)
DEFAULT_FORMAT = ImageFolderWriter.name


def formats_help() -> str:
    return " | ".join(f"{w.name} ({w.summary})" if w.summary else w.name for w in WRITERS.values())
