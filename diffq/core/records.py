"""The run folder's files, each defined once (layout.py says under which key).

Every writer builds these models and every reader parses them: the sink writes
ImageRecords, fetch's metadata.jsonl and export's columns are ImageRecord's
fields, status counts from ProgressSegments. JSON only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

from diffq.core.contract import SCHEMA_VERSION, BatchMessage, ShapeKey, Strict

M = TypeVar("M", bound=BaseModel)


class Dtype(str):
    """A field's Hugging Face `datasets` dtype where its Python type alone would widen it."""


class JsonText(Dtype):
    """An object field that columnar exports store as JSON text (a string column): rows
    may hold different keys, which a streamed shard's schema cannot declare up front."""


# Image sides and step counts fit in 32 bits: export's Parquet columns say so.
Int32 = Annotated[int, Dtype("int32")]
_DTYPES = {str: "string", int: "int64", float: "float64", bool: "bool"}


def jsonl(records: Iterable[BaseModel]) -> bytes:
    # json.dumps escapes non-ASCII, so no prompt character can split a line for a
    # reader that splits on every Unicode line break (str.splitlines does).
    return "".join(json.dumps(record.model_dump(mode="json")) + "\n" for record in records).encode()


def parse_jsonl(model: type[M], body: bytes) -> Iterator[M]:
    for line in body.splitlines():
        if line.strip():
            yield model.model_validate_json(line)


# manifest.json -------------------------------------------------------------------
class RequestedSize(Strict):
    """With size buckets: how many of a shape's items asked for this size."""

    height: int
    width: int
    items: int


class ShapeSummary(Strict):
    shape: ShapeKey
    queue: str
    items: int
    batches: int
    # Size buckets: the most common sizes asked for, and how many distinct ones (0 without).
    requested: list[RequestedSize] = Field(default_factory=list)
    requested_sizes: int = 0


class RunManifest(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str
    created_at: float
    source: str
    out: str
    total: int
    batches: int
    plan_parts: int
    shapes: list[ShapeSummary]
    defaults: dict
    diffq_version: str
    # Every model the run's rows name (rows may name their own): what workers preload.
    models: list[str] = Field(default_factory=list)


# plan/part-NNNNNN.jsonl: one BatchMessage per line, the bytes as published ---------
def plan_part(messages: Iterable[bytes]) -> bytes:
    """A plan part from encoded BatchMessages (submit encodes each once, for the plan and the broker)."""
    return b"".join(message + b"\n" for message in messages)


def parse_plan_part(body: bytes) -> Iterator[BatchMessage]:
    return parse_jsonl(BatchMessage, body)


# records/<batch id>.jsonl: one ImageRecord per image of a finished batch ----------
class ImageRecord(Strict):
    """One image: a line of its batch's record, of `metadata.jsonl` and a row of an export."""

    file_name: str  # the image's key in the run folder (imagefolder's column name)
    id: str
    prompt: str
    seed: int
    height: Int32  # as generated
    width: Int32
    # As the prompt asked; equal to the generated size unless a backend had to round it.
    requested_height: Int32
    requested_width: Int32
    fit: str = "none"  # --fit: how a requested size other than the bucket was stored (none, resize, crop)
    steps: Int32
    guidance_scale: float
    model: str
    run_id: str
    batch_id: str
    queue: str
    device: str  # "<device>:<slot>"
    worker: str
    generate_s: float  # the pipeline call
    generate_started_at: float  # wall clock span of that call: idle gaps are the next start minus this end
    generate_ended_at: float
    store_s: float  # encoding + storing the batch's images (overlaps the next batch)
    finished_at: float  # when the batch's images were stored
    tp_world_size: int = 1  # ranks of a tensor-parallel group that generated it
    tp_ranks_agree: bool = True  # every rank produced the same images (a record exists only then)
    # The row's own fields, null where it set none: `datasets` loads metadata as a struct.
    negative_prompt: Annotated[str | None, Dtype("string")] = None
    metadata: Annotated[dict | None, JsonText("string")] = None

    @model_validator(mode="before")
    @classmethod
    def _requested_defaults_to_generated(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("requested_height" not in data or "requested_width" not in data):
            data = {"requested_height": data.get("height"), "requested_width": data.get("width"), **data}
        return data

    @classmethod
    def fields(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def json_text_fields(cls) -> set[str]:
        return {name for name, info in cls.model_fields.items() if any(isinstance(m, JsonText) for m in info.metadata)}

    @classmethod
    def dtypes(cls) -> dict[str, str]:
        """Each field's Hugging Face `datasets` dtype (export's Parquet columns)."""
        return {name: next((m for m in info.metadata if isinstance(m, Dtype)), None) or _DTYPES[info.annotation]
                for name, info in cls.model_fields.items()}


def parse_record(body: bytes) -> list[ImageRecord]:
    return list(parse_jsonl(ImageRecord, body))


# failures/<batch id>.json ----------------------------------------------------------
class FailureRecord(Strict):
    run_id: str
    batch_id: str
    item_ids: list[str]
    error: str
    attempts: int
    worker: str
    failed_at: float


# progress/<writer>-<n>.json (see progress.py) ---------------------------------------
# A batch's credit: [batch id, items] for a plan batch, [batch id, items, item ids] for
# a derived one (its items are a subset of its root batch's and may overlap others).
Credit = tuple[str, int] | tuple[str, int, list[str]]


class ProgressSegment(Strict):
    v: Literal[1] = 1
    writer: str = Field(min_length=1)
    queues: dict[str, list[Credit]]  # queue -> credits of batches of that queue
