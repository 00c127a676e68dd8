"""Prompt sources: stream JSONL / CSV / TXT / Parquet rows with their line numbers.

Nothing here holds a whole file: each reader yields one row at a time, so a file of
millions of prompts costs the memory of one row (one Parquet record batch).
Every problem becomes an `InputError` naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import os
import tempfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from diffq.core.adapters import AdapterError, AdapterLayout, RunAdapters
from diffq.core.contract import (MAX_METADATA_BYTES, MAX_PROMPT_CHARS, AdapterRef, GuidanceScale, ImageSide,
                                 InferenceSteps, ItemId, ModelName, Seed, bounds, metadata_size)
from diffq.core.families import Family, FamilyError, cfg_bit, family_of
from diffq.core.options import DEFAULTS
from diffq.core.validation import first_error
from diffq.producer.sizes import SizeBuckets

FORMATS = ("jsonl", "csv", "txt", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
             ".txt": "txt", ".parquet": "parquet", ".pq": "parquet"}


class InputError(ValueError):
    """A bad row: says where (file, line, field) and what, never a traceback."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


@dataclass(frozen=True)
class Defaults:
    # Defaults from the generation options, declared once (core/options.py).
    height: int = DEFAULTS.height
    width: int = DEFAULTS.width
    num_inference_steps: int = DEFAULTS.steps
    guidance_scale: float = DEFAULTS.guidance_scale
    size_multiple: int = 16  # where the family is unknown; a known family has its own
    # With buckets, a row's size is what was asked for and the bucket is what is
    # generated: only the buckets must be multiples of `size_multiple`.
    size_buckets: SizeBuckets | None = None
    model: str | None = None  # rows without a `model` field use this one
    # The run's adapters: rows without a `lora` field take its default (`--lora`).
    adapters: RowAdapters | None = None


class PromptRow(BaseModel):
    """One input row. Unknown columns are errors: a typo like 'heigth' must not be ignored."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    # The bounds are the queue contract's (core/contract.py), declared there once.
    id: ItemId | None = None
    height: ImageSide | None = None
    width: ImageSide | None = None
    seed: Seed | None = None
    num_inference_steps: InferenceSteps | None = None
    guidance_scale: GuidanceScale | None = None
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    metadata: dict | None = None
    model: ModelName | None = None
    # LoRA adapters: "PATH", "PATH@0.8", {"path", "scale"} or a list; checked by RowAdapters.
    lora: Any = None

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt is blank")
        if "\x00" in value:
            raise ValueError("prompt contains a NUL character")
        return value

    @field_validator("negative_prompt")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("negative_prompt contains a NUL character")
        return value

    @field_validator("id")
    @classmethod
    def _printable_id(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError("id contains control characters")
        return value


class Prompt(NamedTuple):
    """A validated row with every default applied: what bucketing consumes.

    A named tuple, not a frozen dataclass: built twice per row (validation and
    publishing), and a frozen dataclass costs ~5x more to build.
    """

    line: int
    id: str
    prompt: str
    height: int
    width: int
    seed: int | None
    num_inference_steps: int
    guidance_scale: float
    # Set only with size buckets: the size the row asked for (height/width: its bucket).
    requested_height: int | None = None
    requested_width: int | None = None
    # Optional so a Prompt can be built from the first eight alone (None: derived from
    # guidance_scale / the run's model, as for an unknown family).
    cfg: bool | None = None
    model: str | None = None
    negative_prompt: str | None = None
    metadata: dict | None = None
    # The row's LoRA adapters, checked and pinned (RowAdapters): rows are batched by them.
    lora: tuple[AdapterRef, ...] = ()


class RowAdapters:
    """A run's LoRA adapters as its rows name them: each row's `lora` (or the run's
    `--lora` default) checked and pinned once per model and spelling (core/adapters.py
    `RunAdapters`: the allow-list, the header, the model's transformer, the revision);
    per model, the layout every shape of it is compiled around once all rows are in."""

    def __init__(self, default: tuple[AdapterRef, ...] = (), allowed_prefixes: tuple[str, ...] | None = None,
                 text_encoder: str = "refuse"):
        from diffq.core.settings import get_settings

        self.default = tuple(default)
        self.text_encoder = text_encoder  # --lora-text-encoder: a file's text-encoder part refused or dropped
        self.allowed = tuple(get_settings().allowed_adapters if allowed_prefixes is None else allowed_prefixes)
        self._runs: dict[str, RunAdapters] = {}
        self._known: dict[tuple, tuple[AdapterRef, ...]] = {}
        self.named = False  # some row (or --lora) named an adapter: the run has a layout

    def refs(self, model: str, value, field: str = "lora") -> tuple[AdapterRef, ...]:
        """A row's adapter set (`value`: its `lora` field), checked and pinned; an
        AdapterError names the field. An absent field (None; an empty CSV cell) takes the
        run's default; `"none"` or `[]` is no adapter, default or not."""
        if value is None:
            if not self.default:
                return ()
            value = [ref.model_dump(exclude_none=True) for ref in self.default]
        elif value == [] or isinstance(value, str) and value.strip().lower() in ("", "none"):
            return ()
        if model is None:
            raise AdapterError(field, "a LoRA adapter is checked against its model's transformer: give --model")
        key = (model, value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
        refs = self._known.get(key)
        if refs is None:
            run = self._runs.get(model)
            if run is None:
                run = self._runs[model] = RunAdapters(model, allowed_prefixes=self.allowed,
                                                      text_encoder=self.text_encoder)
            refs = self._known[key] = run.add(value, field)
            self.named = self.named or bool(refs)  # `[null]` names none: nothing to re-encode for
        return refs

    def layouts(self) -> dict[str, AdapterLayout]:
        """Per model whose rows name adapters: the union of their targets at the padded rank."""
        return {model: run.layout for model, run in sorted(self._runs.items()) if run.layout is not None}

    def scaffold_shares(self) -> dict[str, float]:
        """Per model with a layout: what the swap scaffold adds to each row's linear work."""
        return {model: run.scaffold_share() for model, run in sorted(self._runs.items()) if run.layout is not None}

    def revisions(self) -> dict[str, str]:
        """Every adapter of the run: path -> the revision pinned at submit."""
        return {path: revision for run in self._runs.values() for path, revision in sorted(run.revisions.items())}


def _lora_cell(value):
    """A CSV / Parquet `lora` cell: text is the shorthand, or JSON (an object or a list)."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value  # the spec parser names what is wrong with it
    return value


def detect_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise InputError(path, None, None, f"unknown file type '{suffix}'; use one of {', '.join(FORMATS)}")
    return _SUFFIXES[suffix]


_UTF8_BOM = b"\xef\xbb\xbf"
# Longest first: the UTF-32 LE mark begins with the UTF-16 LE one.
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 LE"), (b"\x00\x00\xfe\xff", "UTF-32 BE"),
              (b"\xff\xfe", "UTF-16 LE"), (b"\xfe\xff", "UTF-16 BE"))


def _wide_encoding(head: bytes) -> str | None:
    """UTF-16 / UTF-32 recognised from a file's first bytes, or None."""
    for mark, name in _WIDE_BOMS:
        if head.startswith(mark):
            return f"{name} (it starts with that byte-order mark)"
    # No mark: UTF-16 of mostly-ASCII text has a NUL in every other byte, on one side
    # (UTF-8 text has none; CJK characters like U+4E00 put a few on the other side).
    pairs = len(head) // 2
    lows, highs = head[0::2].count(0), head[1::2].count(0)
    if pairs and highs * 2 >= pairs and lows * 4 < highs:
        return "UTF-16 LE (NUL bytes between its characters)"
    if pairs and lows * 2 >= pairs and highs * 4 < lows:
        return "UTF-16 BE (NUL bytes between its characters)"
    return None


def _open_text(path: Path) -> io.TextIOWrapper:
    """The file as UTF-8 text, past a leading UTF-8 byte-order mark.

    Spreadsheets ("CSV UTF-8") and Windows editors write that mark; only the file's
    first bytes can be one, so a U+FEFF further in stays what it is (data, or invalid
    JSON). UTF-16 / UTF-32 are refused by name rather than failing as bad UTF-8.
    """
    raw = path.open("rb")
    try:
        head = raw.read(256)
        encoding = _wide_encoding(head)
        if encoding is not None:
            raise InputError(path, None, None, f"the file is {encoding}; save it as UTF-8")
        raw.seek(len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")
    except BaseException:
        raw.close()
        raise


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with _open_text(path) as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)  # faster on short rows (docs/BENCHMARKS.md)
            except orjson.JSONDecodeError:
                # orjson is stricter (NaN, lone surrogates): the standard parser decides,
                # so what is accepted and every error message stay as they were.
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(path, line_no, None,
                                     f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise InputError(path, line_no, None, f"expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def _csv_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with _open_text(path) as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames:
            raise InputError(path, 1, None, "missing CSV header row")
        if "prompt" not in reader.fieldnames:  # said once, not as a missing field on every row
            raise InputError(path, 1, "prompt",
                             f"no 'prompt' column in the header: {', '.join(map(repr, reader.fieldnames))}")
        for row in reader:
            line_no = reader.line_num
            if None in row:
                raise InputError(path, line_no, None, "more values than header columns")
            # An empty cell means "use the default", like an absent JSON field.
            values = {key: value for key, value in row.items() if value not in ("", None)}
            if not values:
                continue
            yield line_no, values


def _txt_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with _open_text(path) as handle:
        for line_no, line in enumerate(handle, start=1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield line_no, {"prompt": text}


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise InputError(path, None, None, f"not a readable Parquet file ({exc})") from None
    row_no = 0
    for batch in parquet.iter_batches(batch_size=8192):
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, {key: value for key, value in row.items() if value is not None}


_READERS = {"jsonl": _jsonl_rows, "csv": _csv_rows, "txt": _txt_rows, "parquet": _parquet_rows}


def iter_raw_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    path = Path(path)
    if not path.is_file():
        raise InputError(path, None, None, "file not found")
    try:
        yield from _READERS[detect_format(path)](path)
    except UnicodeDecodeError as exc:
        raise InputError(path, None, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def generated_id(line: int) -> str:
    """Stable for the same file: a rerun of the same file gives the same ids."""
    return f"line-{line:08d}"


_INT_LIMITS = {"height": bounds(ImageSide), "width": bounds(ImageSide), "seed": bounds(Seed),
               "num_inference_steps": bounds(InferenceSteps)}
_GUIDANCE, _ID_LENGTH, _MODEL_LENGTH = bounds(GuidanceScale), bounds(ItemId), bounds(ModelName)


def _plain_row(raw: dict) -> dict | None:
    """The common case checked in plain Python, ~5x faster than pydantic.

    Exactly the rules of `PromptRow` for already-typed values (JSONL, Parquet);
    anything unusual returns None and goes through pydantic, which then names
    the field and the problem. One look at each present field: rows rarely carry
    more than three or four.
    """
    prompt = raw.get("prompt")
    # isspace() on a non-empty string is "strip() leaves nothing", without the copy.
    if type(prompt) is not str or not 0 < len(prompt) <= MAX_PROMPT_CHARS or prompt.isspace() or "\x00" in prompt:
        return None
    for name, value in raw.items():
        limits = _INT_LIMITS.get(name)
        if limits is not None:
            if value is not None and (type(value) is not int or not limits[0] <= value <= limits[1]):
                return None
        elif name == "id":
            if value is not None and (type(value) is not str or not _ID_LENGTH[0] <= len(value) <= _ID_LENGTH[1]
                                      or not value.isprintable()):
                return None
        elif name == "guidance_scale":
            if value is not None and (type(value) not in (int, float) or not _GUIDANCE[0] <= value <= _GUIDANCE[1]):
                return None
        elif name == "negative_prompt":
            if value is not None and (type(value) is not str or len(value) > MAX_PROMPT_CHARS or "\x00" in value):
                return None
        elif name == "model":
            if value is not None and (type(value) is not str or not _MODEL_LENGTH[0] <= len(value) <= _MODEL_LENGTH[1]):
                return None
        elif name == "metadata":
            if value is not None and type(value) is not dict:
                return None
        elif name != "prompt" and name != "lora":  # an unknown field, even if null (RowAdapters checks `lora`)
            return None
    return raw


def _typed_csv(raw: dict) -> dict:
    """CSV cells are text: plain decimal integers become ints here, what pydantic
    makes of them too, so a CSV row takes the fast check (2x faster per row);
    anything else stays text for pydantic to convert or to refuse by name."""
    for name in _INT_LIMITS:
        value = raw.get(name)
        if value is not None and value.isascii() and value.isdigit() and len(value) <= 20:
            raw[name] = int(value)
    return raw


def _keep(path: str | Path, line: int, raw: dict, keep_columns: tuple[str, ...], parse_metadata: bool) -> dict:
    """Move the `keep_columns` of a row into its `metadata` object (CSV / Parquet).

    In CSV a `metadata` cell is JSON text; in Parquet it may be a struct or JSON text.
    """
    metadata = raw.get("metadata")
    if parse_metadata and isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise InputError(path, line, "metadata", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(metadata, dict):
            raise InputError(path, line, "metadata", f"expected a JSON object, got {type(metadata).__name__}")
    kept = {name: raw[name] for name in keep_columns if name in raw}
    if not kept and metadata is raw.get("metadata"):
        return raw
    row = {name: value for name, value in raw.items() if name not in kept}
    if kept:
        if metadata is not None and not isinstance(metadata, dict):
            return row | {"metadata": metadata}  # the validator names the problem
        clash = sorted(set(kept) & set(metadata or {}))
        if clash:
            raise InputError(path, line, clash[0], "is both a kept column and a key of the row's metadata")
        metadata = (metadata or {}) | kept
    row["metadata"] = metadata
    return row


def read_prompts(path: str | Path, defaults: Defaults = Defaults(),
                 keep_columns: tuple[str, ...] | list[str] = ()) -> Iterator[Prompt]:
    """Validated rows with every default applied. `keep_columns`: CSV / Parquet columns
    moved into the row's `metadata` instead of being refused as unknown."""
    keep_columns = tuple(keep_columns)
    fmt = detect_format(path)
    parse_metadata = fmt in ("csv", "parquet")
    typed = _typed_csv if fmt == "csv" else None
    families: dict[str | None, type[Family] | None] = {}

    def family(model: str | None, line: int, field: str | None) -> type[Family] | None:
        if model not in families:
            try:
                families[model] = family_of(model) if model else None
            except FamilyError as exc:
                raise InputError(path, line if field else None, field, str(exc)) from None
        return families[model]

    family(defaults.model, 0, None)  # a bad --model is reported before any row
    adapters = defaults.adapters if defaults.adapters is not None else RowAdapters(allowed_prefixes=())
    if adapters.default and defaults.model:  # a bad --lora too
        try:
            adapters.refs(defaults.model, None, "--lora")
        except AdapterError as exc:
            raise InputError(path, None, exc.field, exc.message) from None
    buckets = defaults.size_buckets.nearest if defaults.size_buckets is not None else None
    for line, raw in iter_raw_rows(path):
        if keep_columns or (parse_metadata and "metadata" in raw):
            raw = _keep(path, line, raw, keep_columns, parse_metadata)
        row = _plain_row(typed(raw) if typed else raw)
        if row is None:
            try:
                row = PromptRow.model_validate(raw).model_dump()
            except ValidationError as exc:
                raise InputError(path, line, *first_error(exc)) from None
        get = row.get
        model = get("model")
        fam = family(model, line, "model") if model is not None else families[defaults.model]
        model = model if model is not None else defaults.model
        multiple = fam.size_multiple if fam is not None else defaults.size_multiple
        height = get("height") or defaults.height
        width = get("width") or defaults.width
        requested_height = requested_width = None
        if buckets is not None:
            requested_height, requested_width = height, width
            height, width = buckets(height, width)
        elif height % multiple or width % multiple:
            name, value = ("height", height) if height % multiple else ("width", width)
            raise InputError(path, line, name, f"{value} is not a multiple of {multiple}")
        item_id, guidance = get("id"), get("guidance_scale")
        guidance = float(guidance) if guidance is not None else defaults.guidance_scale
        negative, metadata = get("negative_prompt"), get("metadata")
        if metadata is not None and (size := metadata_size(metadata)) > MAX_METADATA_BYTES:
            raise InputError(path, line, "metadata",
                             f"{size} bytes of JSON, over the {MAX_METADATA_BYTES}-byte limit")
        if fam is not None and negative is not None:
            refused = fam.refusal(negative_prompt=negative, guidance_scale=guidance)
            if refused:
                raise InputError(path, line, *refused)
        lora = get("lora")
        if lora is not None or adapters.default:
            try:
                lora = adapters.refs(model, _lora_cell(lora) if parse_metadata else lora)
            except AdapterError as exc:
                raise InputError(path, line, exc.field, exc.message) from None
        else:
            lora = ()
        yield Prompt(  # positional: the field order of Prompt
            line,
            item_id if item_id is not None else generated_id(line),
            row["prompt"],
            height,
            width,
            get("seed"),
            get("num_inference_steps") or defaults.num_inference_steps,
            guidance,
            requested_height,
            requested_width,
            cfg_bit(fam, guidance),
            model,
            negative,
            metadata,
            lora,
        )


def derive_seed(seed_base: str, item_id: str) -> int:
    """A seed fixed at submit from the run (or --seed-base) and the item id."""
    digest = _seed_prefix(seed_base).copy()  # sha256(f"{seed_base}\x00{item_id}")
    digest.update(item_id.encode())
    return int.from_bytes(digest.digest()[:8], "big") >> 1


@functools.lru_cache(maxsize=16)
def _seed_prefix(seed_base: str):
    # A run has one seed base: hashing its prefix once saves a third per row.
    return hashlib.sha256(f"{seed_base}\x00".encode())


class IdChecker:
    """Uniqueness of ids over any number of rows in bounded memory.

    Each id's 64-bit hash and line join an in-memory run; a full run (`spill_rows`)
    is sorted by hash and written to an unnamed temporary file (16 B a row), noting
    where each of `SLICES` equal ranges of the hash space starts in it. `finish()`
    reads one range of every run at a time: memory is one run plus one range, not
    every id (sorted hashes in memory were 8 B an id: ~1 GB of RSS at 100M rows).

    A hash seen twice only makes the later line a candidate: candidates are
    confirmed by their actual ids, one read of the file up to the last of them
    keeping the ids of the rows with a candidate's hash, so two ids whose hashes
    collide are never refused and the error names the first repeating line and the
    line it repeats. A repeat within one run is seen when that run is sorted, so it
    is reported without reading the rest of the file; one across runs by `finish()`,
    which is called before any other row error is reported (the first bad row is
    always the one named).
    """

    SPILL_ROWS = 1 << 21  # rows per sorted run: 16 B a row held, 32 B while it is sorted
    SLICES = 1 << 10  # hash ranges read at a time: a range of 100M rows is ~1.6 MB
    CANDIDATES = 1 << 14  # candidate lines confirmed per read of the file

    def __init__(self, path: str | Path, *, spill_rows: int | None = None, hash_id=None):
        self.path = path
        self._spill_rows = spill_rows or self.SPILL_ROWS
        self._hash = hash_id or hash  # str hashes are SipHash, computed once per string
        self._hashes = array("q")
        self._lines = array("q")
        self._runs: list[_Run] = []
        self._file = None  # the spilled runs, one after another
        self._size = self._spilled = 0
        self._cleared = 0  # proven: no line up to here repeats an earlier id
        self._done = False

    @property
    def spilled_runs(self) -> int:
        """Sorted runs written to the temporary file so far."""
        return self._spilled

    def check(self, prompt: Prompt) -> None:
        self._hashes.append(self._hash(prompt.id))
        self._lines.append(prompt.line)
        if len(self._lines) >= self._spill_rows:
            if self._sort_run(spill=True):
                self._settle()

    def finish(self) -> None:
        """Check every id so far; raises InputError for the first repeating line."""
        try:
            if not self._done:  # after an error nothing is left to check twice
                if self._lines:
                    self._sort_run(spill=False)  # the last run: read from memory
                if self._runs:  # an error on the first row leaves nothing to check
                    self._settle()
        finally:
            self._done = True
            self._runs = []
            if self._file is not None:
                self._file.close()

    def _sort_run(self, spill: bool) -> bool:
        """Turns the pending rows into a sorted run; True if it repeats a hash."""
        import numpy as np

        hashes, lines = np.frombuffer(self._hashes, dtype=np.int64), np.frombuffer(self._lines, dtype=np.int64)
        self._hashes, self._lines = array("q"), array("q")
        order = np.argsort(hashes, kind="stable")  # equal hashes keep line order
        hashes = hashes[order]
        lines = lines[order]
        del order
        starts = np.concatenate([[0], np.searchsorted(hashes, _slice_bounds(self.SLICES)), [len(hashes)]])
        if not spill:
            self._runs.append(_Run(starts, hashes, lines))
            return False
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="diffq-ids-")
        self._file.write(hashes.data)
        self._file.write(lines.data)
        self._file.flush()  # read back with os.pread
        self._runs.append(_Run(starts, self._size, self._size + hashes.nbytes))
        self._size += hashes.nbytes + lines.nbytes
        self._spilled += 1
        return bool((hashes[1:] == hashes[:-1]).any())

    def _settle(self) -> None:
        """Confirms candidate lines, fewest at a time, until none are left."""
        try:
            while True:
                hashes, lines, more = self._candidates()
                if not len(lines):
                    return
                last = int(lines.max())
                self._confirm(set(hashes.tolist()), last)
                self._cleared = last
                if not more:
                    return
        except InputError:
            self._done = True
            raise

    def _candidates(self):
        """(hashes, lines, more): the first CANDIDATES lines after `_cleared` whose hash
        an earlier line has; `more` if later ones were left for another round."""
        import numpy as np

        kept_hashes, kept_lines, more = np.empty(0, np.int64), np.empty(0, np.int64), False
        for index in range(self.SLICES):
            hashes = np.concatenate([run.piece(self._file, index, 0) for run in self._runs])
            if len(hashes) < 2 or not (np.diff(np.sort(hashes)) == 0).any():
                continue  # nearly every range: no hash twice
            # Runs are in line order and sorted stably: equal hashes stay in line order.
            lines = np.concatenate([run.piece(self._file, index, 1) for run in self._runs])
            order = np.argsort(hashes, kind="stable")
            hashes, lines = hashes[order], lines[order]
            later = np.flatnonzero(hashes[1:] == hashes[:-1]) + 1
            later = later[lines[later] > self._cleared]
            kept_hashes = np.concatenate([kept_hashes, hashes[later]])
            kept_lines = np.concatenate([kept_lines, lines[later]])
            if len(kept_lines) > 2 * self.CANDIDATES:
                first = np.argpartition(kept_lines, self.CANDIDATES)[:self.CANDIDATES]
                kept_hashes, kept_lines, more = kept_hashes[first], kept_lines[first], True
        if len(kept_lines) > self.CANDIDATES:
            first = np.argpartition(kept_lines, self.CANDIDATES)[:self.CANDIDATES]
            kept_hashes, kept_lines, more = kept_hashes[first], kept_lines[first], True
        return kept_hashes, kept_lines, more

    def _confirm(self, hashes: set[int], last: int) -> None:
        """Raise for the first row up to `last` whose id an earlier row has, among the
        rows with one of `hashes` (else: only collisions)."""
        first_seen: dict[str, int] = {}
        # Every row up to `last` was valid, so its id is the raw one or generated.
        for line, raw in iter_raw_rows(self.path):
            if line > last:
                return
            item_id = self._row_id(line, raw)
            if self._hash(item_id) in hashes:
                first = first_seen.setdefault(item_id, line)
                if first != line:
                    raise InputError(self.path, line, "id", f"duplicate id '{item_id}' (first seen on line {first})")

    @staticmethod
    def _row_id(line: int, raw: dict) -> str:
        item_id = raw.get("id")
        return item_id if item_id is not None else generated_id(line)


@functools.lru_cache(maxsize=4)
def _slice_bounds(slices: int):
    """Where hash ranges 1 … slices - 1 start: `slices` equal ranges of int64."""
    import numpy as np

    return np.array([(index << 64) // slices - (1 << 63) for index in range(1, slices)], dtype=np.int64)


class _Run(NamedTuple):
    """One sorted run: where each hash range starts, and its hashes and lines (arrays
    in memory, or byte offsets into the spill file)."""

    starts: object
    hashes: object
    lines: object

    def piece(self, file, index: int, which: int):
        """Range `index` of the run's hashes (which=0) or lines (1)."""
        import numpy as np

        start, stop = int(self.starts[index]), int(self.starts[index + 1])
        source = self[1 + which]
        if not isinstance(source, int):
            return source[start:stop]
        data = os.pread(file.fileno(), 8 * (stop - start), source + 8 * start)
        return np.frombuffer(data, dtype=np.int64)
