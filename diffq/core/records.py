"""The run folder's files, each defined once (layout.py says under which key).

Every writer builds these models and every reader parses them: the sink writes
ImageRecords, fetch's metadata.jsonl and export's columns are ImageRecord's
fields, status counts from ProgressSegments. JSON only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

from diffq.core.adapters import AdapterLayout
from diffq.core.contract import (AUTO_DTYPE, SCHEMA_VERSION, AdapterRef, BatchMessage, BatchSize, GuidanceScale,
                                 ImageSide, InferenceSteps, SequenceLength, ShapeKey, Strict)
from diffq.core.options import AUTO

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


class RunDefaults(Strict):
    """The run's options as its manifest records them (producer/submit.py
    manifest_defaults); a continued run must match them. Fields a later diffq added
    default to how a run behaved before it, and a manifest that lacks one leaves it
    unset: `recorded` leaves it out, so nothing is compared against a value the run
    never stated."""

    # The generation options' own types and bounds (core/options.py, core/contract.py).
    model: str
    batch_size: BatchSize | Literal[AUTO]  # type: ignore[valid-type]  # auto: from the speed-up profile
    steps: InferenceSteps
    guidance_scale: GuidanceScale
    max_sequence_length: SequenceLength
    height: ImageSide
    width: ImageSide
    format: str
    dtype: str = AUTO_DTYPE
    seed_base: str
    fit: str = "none"
    size_buckets: list[str] | None = None  # resolved sizes, "HxW" (a preset's, not its name)
    keep_columns: list[str] = Field(default_factory=list)
    embed_metadata: bool = True
    speedup: str | None = None  # canonical (core/speedups.py)
    unreproducible_speedup: bool = False
    lora: list[AdapterRef] = Field(default_factory=list)  # --lora: rows without their own `lora`

    def recorded(self) -> dict[str, Any]:
        """The options the manifest states, as JSON values."""
        return self.model_dump(mode="json", include=self.model_fields_set)


class AdapterSet(Strict):
    """One adapter set of a run (RunManifest.adapter_sets): its adapters, pinned, and items."""

    adapters: list[AdapterRef]
    items: int = Field(ge=0)
    batches: int = Field(ge=0)


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
    defaults: RunDefaults
    diffq_version: str
    # Every model the run's rows name (rows may name their own): what workers preload.
    models: list[str] = Field(default_factory=list)
    # Object-storage models pinned at submit: URL -> revision (core/model_store.py).
    # Workers load that revision or refuse the run's batches.
    model_revisions: dict[str, str] = Field(default_factory=dict)
    # LoRA adapters (absent without any): per model the layout its shapes are compiled
    # around (a worker loads its scaffold before compiling), and every adapter's path ->
    # the revision pinned at submit (each batch names it too; a worker refuses an adapter
    # not pinned here, or at another revision).
    adapter_layouts: dict[str, AdapterLayout] = Field(default_factory=dict, exclude_if=lambda v: not v)
    adapter_revisions: dict[str, str] = Field(default_factory=dict, exclude_if=lambda v: not v)
    # Each adapter set of the run (core/adapters.py set_digest -> its adapters and items):
    # what `status --by-adapter` counts pending against (credits and failures carry the
    # digest). Absent in runs submitted before it: status says so.
    adapter_sets: dict[str, AdapterSet] = Field(default_factory=dict, exclude_if=lambda v: not v)
    # The plan holds each adapter set's batches together (producer/submit.py grouped_by_set).
    # Absent in LoRA runs planned before grouping, whose plan keeps the bucketing's order:
    # `diffq run` continuing one re-encodes its plan in that order to compare it.
    plan_by_set: bool = Field(default=False, exclude_if=lambda v: not v)


# cancel.json: `diffq cancel`'s marker ---------------------------------------------
class CancelMarker(Strict):
    cancelled_at: float
    by: str  # user@host


# feed.json and feed/<source>/state.json: what the feeder has published (producer/feed.py)
class FeedPointer(Strict):
    """feed.json: which source the run is fed from now (written by submit and resume
    only, never by a feeder, so a feeder's late write cannot undo a resume)."""

    v: Literal[1] = 1
    run_id: str
    source: str  # a name: "plan", or the source a resume or retry-failed wrote


class FeedQueue(Strict):
    """One shape queue of a fed run: its batches in the source, in order, and how many
    of the first ones are published (never more than were: marked after publishing)."""

    prefix: str  # the batch id prefix of this queue's batches (producer/messages.py)
    total: int = Field(ge=0)
    published: int = Field(default=0, ge=0)

    @property
    def unpublished(self) -> int:
        return max(0, self.total - self.published)


class FeedState(Strict):
    v: Literal[1] = 1
    run_id: str
    # Batches of this run each shape queue may hold at once (queued or in a worker's hand).
    window: int = Field(gt=0)
    queues: dict[str, FeedQueue]
    # The feeds folder that lists the run for a feeder (None: fed by `diffq feed` or
    # nobody): `status` says "waiting for a feeder" while no live heartbeat is there,
    # nor in the run folder (`diffq feed`'s own, layout.FEEDER).
    feeds: str | None = None

    @property
    def unpublished(self) -> int:
        return sum(queue.unpublished for queue in self.queues.values())


class FeedHeartbeat(Strict):
    """A fleet feeder's heartbeat in its feeds folder: when it last said it is alive."""

    at: float  # wall-clock seconds (time.time) of the feeder's host
    host: str
    pid: int
    every_s: float


class FeedEntry(Strict):
    """A run in the feeds folder (`DIFFQ_FEEDS`): one file per run the feeder serves."""

    out: str
    run_id: str


# starts/<worker life>.json: a worker life's time to its first image ----------------
START_PHASES = ("imports", "compile_cache_pull", "weights_fetch", "load", "warmup", "first_batch_stored")


class WorkerStart(Strict):
    """Where a worker life's seconds went, from its process start to its first batch
    stored (worker/observe/startup.py), written into the run folder of that batch."""

    worker: str
    pid: int
    device: str
    began_at: float  # the process start (wall clock)
    first_image_at: float
    time_to_first_image_s: float
    phases: dict[str, float]  # START_PHASES -> seconds, in that order
    # Each object-storage model fetched: model, revision, hit, bytes, seconds, mb_per_s.
    fetches: list[dict] = Field(default_factory=list)


# plan/part-NNNNNN.jsonl: one BatchMessage per line, the bytes as published ---------
def plan_part(messages: Iterable[bytes]) -> bytes:
    """A plan part from encoded BatchMessages (submit encodes each once, for the plan and the broker)."""
    return b"".join(message + b"\n" for message in messages)


def parse_plan_part(body: bytes) -> Iterator[BatchMessage]:
    return parse_jsonl(BatchMessage, body)


# records/<batch id>.jsonl: one ImageRecord per image of a finished batch ----------
# What each degenerate-image check finds, in the order they take precedence (a NaN
# image converts to a flat black one). The worker runs them (worker/device/pipeline_host.py
# checked_arrays) and `--on-degenerate` decides what becomes of the image (worker/delivery/spec.py
# DEGENERATE_POLICIES); the key is what ImageRecord.degenerate and FailureRecord.degenerate say.
FLAT_MAX_LEVELS = 2  # a channel whose values span at most this many 8-bit levels is flat
DEGENERATE_CHECKS = {
    "nonfinite": "non-finite values (NaN or infinity) in the pipeline's output",
    "flat": f"a flat image (each channel spans at most {FLAT_MAX_LEVELS} of its 256 levels)",
}


class BatchMeasures(Strict):
    """What the worker measured of one batch: handed to the sink with its images (its own
    schema across the sink process) and spread over every ImageRecord of the batch."""

    device: str  # "<device>:<slot>"
    dtype: str | None = None  # what ran (an auto queue at its device's default)
    worker: str
    generate_s: float
    generate_started_at: float
    generate_ended_at: float
    tp_world_size: int = 1
    tp_ranks_agree: bool = True
    graph_fallbacks: int = 0
    degenerate: dict[str, str] = Field(default_factory=dict)  # item id -> the check a stored image failed
    model_revision: str | None = None  # an object-storage model's (core/model_store.py)
    graphs_compiled: int = 0  # graphs the batch's call compiled (dynamo's unique_graphs)
    adapter_swap_s: float = 0.0  # the batch's LoRA hot-swap (worker/device/adapters.py)
    lora_mode: str | None = None  # how its adapter set went in (worker/device/lora_modes.py); a LoRA run's only
    # The transformer's parameters and buffers as stored (quantized under a quant: scheme).
    transformer_weight_bytes: int | None = None


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
    # The dtype the pipeline ran at: the queue's, or its device's default for an auto
    # queue. Records written before dtypes could be auto carry none.
    dtype: Annotated[str | None, Dtype("string")] = None
    worker: str
    generate_s: float  # the pipeline call
    generate_started_at: float  # wall clock span of that call: idle gaps are the next start minus this end
    generate_ended_at: float
    store_s: float  # encoding + storing the batch's images (overlaps the next batch)
    finished_at: float  # when the batch's images were stored
    tp_world_size: int = 1  # ranks of a tensor-parallel group that generated it
    tp_ranks_agree: bool = True  # every rank produced the same images (a record exists only then)
    # Compiled-graph calls that failed on the device and re-ran uncompiled, op by op,
    # while generating this batch (only with `diffq worker --allow-fallback`).
    graph_fallbacks: int = 0
    # The row's own fields, null where it set none: `datasets` loads metadata as a struct.
    negative_prompt: Annotated[str | None, Dtype("string")] = None
    metadata: Annotated[dict | None, JsonText("string")] = None
    # Stored although a check found it degenerate (a DEGENERATE_CHECKS key, "flat"), per
    # --on-degenerate; null for an image no check flagged.
    degenerate: Annotated[str | None, Dtype("string")] = None
    # The speed-up the call ran with (core/speedups.py, canonical), null for full compute;
    # False where the user let a cache that decides from the whole batch run: this
    # image may then depend on its batch neighbours.
    speedup: Annotated[str | None, Dtype("string")] = None
    reproducible: bool = True
    # The revision of an object-storage model the image was made with (the listing's
    # digest, core/model_store.py); null for a local folder or hub model.
    model_revision: Annotated[str | None, Dtype("string")] = None
    # Graphs the batch's pipeline call compiled (dynamo's unique_graphs counter): a shape's
    # first batch compiles, every later one should say 0 (a recompile otherwise).
    graphs_compiled: int = 0
    # The LoRA adapters the image was made with (path, scale, revision), null for none,
    # and the seconds the batch's hot-swap took (0 when the slot already held them).
    adapters: Annotated[list | None, JsonText("string")] = None
    adapter_swap_s: float = 0.0
    # How the worker put the set in (swap, fuse, compile: worker/device/lora_modes.py);
    # null outside a LoRA run.
    lora_mode: Annotated[str | None, Dtype("string")] = None
    # The bytes of the transformer's weights the call ran with, as stored: a `quant:`
    # scheme's (worker/device/quantize.py) shows here; null in records of older workers.
    transformer_weight_bytes: Annotated[int | None, Dtype("int64")] = None

    @model_validator(mode="before")
    @classmethod
    def _requested_defaults_to_generated(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("requested_height" not in data or "requested_width" not in data):
            data = {"requested_height": data.get("height"), "requested_width": data.get("width"), **data}
        return data

    @classmethod
    def of(cls, message: BatchMessage, item, file_name: str, measures: BatchMeasures, *, store_s: float,
           finished_at: float) -> ImageRecord:
        """The one place an image's record is made: the batch's message and measures, the
        item, where its image was stored."""
        shape, params = message.shape, message.params
        return cls(
            file_name=file_name, id=item.id, prompt=item.prompt, seed=item.seed, height=shape.height,
            width=shape.width,
            # The size the row asked for (size buckets); the generated one without.
            requested_height=item.requested_height or shape.height, requested_width=item.requested_width or shape.width,
            fit=params.fit, steps=params.num_inference_steps, guidance_scale=params.guidance_scale, model=shape.model,
            run_id=message.run_id, batch_id=message.batch_id, queue=shape.queue, finished_at=finished_at,
            store_s=store_s, negative_prompt=item.negative_prompt, metadata=item.metadata,
            degenerate=measures.degenerate.get(item.id), speedup=params.speedup,
            reproducible=not (params.unreproducible and _batch_dependent(params.speedup)),
            adapters=[adapter.model_dump(mode="json") for adapter in params.adapters] or None,
            **measures.model_dump(exclude={"degenerate"}))

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
    # Items failed by a degenerate-image check, without a retry: item id -> the check
    # (a DEGENERATE_CHECKS key). None for a failure of the pipeline call.
    degenerate: dict[str, str] | None = None
    # The batch's adapter set (core/adapters.py set_digest); absent without adapters.
    adapter_set: str | None = Field(default=None, exclude_if=lambda v: v is None)


# progress/<writer>-<n>.json (see progress.py) ---------------------------------------
# A batch's credit: [batch id, items] for a plan batch, [batch id, items, item ids] for
# a derived one (its items are a subset of its root batch's and may overlap others).
Credit = tuple[str, int] | tuple[str, int, list[str]]


class ProgressSegment(Strict):
    """v1: every credit spelled out (still read; no longer written)."""

    v: Literal[1] = 1
    writer: str = Field(min_length=1)
    queues: dict[str, list[Credit]]  # queue -> credits of batches of that queue


class NumberedCredits(Strict):
    """Plan batches `<prefix><index>` of one queue (the index zero-padded to `width`
    digits), each of `items` items: `count` indexes from `start` on, the gaps between
    them packed as progress.py says (zlib-compressed or not)."""

    queue: str
    prefix: str
    width: int = Field(ge=1, le=20)
    items: int = Field(ge=1)
    count: int = Field(ge=1)
    start: int = Field(ge=0)
    gaps: str
    zlib: bool = False
    # The batches' adapter set (core/adapters.py set_digest) and how it went in
    # (lora_mode); absent without adapters and in segments written before them.
    set: str | None = Field(default=None, exclude_if=lambda v: v is None)
    mode: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ProgressSegmentV2(Strict):
    """v2: plan batches as packed indexes, the other credits (derived batches, batch ids
    not of the numbered form) spelled out as in v1."""

    v: Literal[2] = 2
    writer: str = Field(min_length=1)
    numbered: list[NumberedCredits] = Field(default_factory=list)
    queues: dict[str, list[Credit]] = Field(default_factory=dict)
    # Spelled-out credits' adapter sets: batch id -> [set digest, lora_mode or null].
    sets: dict[str, tuple[str, str | None]] = Field(default_factory=dict, exclude_if=lambda v: not v)
    # When its writer last added a credit (Unix seconds): the run's last progress
    # survives any reader's restart (the backlog service's stall clock). None: written
    # before this field.
    at: float | None = None


AnyProgressSegment = Annotated[ProgressSegment | ProgressSegmentV2, Field(discriminator="v")]


# fleet-plan.json: what `diffq plan --rates` planned, kept by `submit`/`run --rates` ---
class PlanRow(Strict):
    """One shape at one step count of a plan."""

    queue: str
    height: int
    width: int
    batch_size: int
    steps: int
    items: int
    batches: int


class PlannedShape(PlanRow):
    """A plan row timed from a measured rate."""

    steady_s: float  # one batch's pipeline call in the steady state
    compile_s: float  # first call minus steady: once per shape per compile cache
    source: str  # the rates file it came from

    @property
    def device_s(self) -> float:
        return self.batches * self.steady_s


class UncoveredShape(PlanRow):
    """A plan row the rates do not cover: named, left out of every figure."""

    reason: str


class FleetPlanFigures(Strict):
    """Device time of a run from measured rates; `finish_s` and `devices_for` are the
    one model of a fleet's time (`diffq plan`, `diffq report`'s planned vs actual)."""

    v: Literal[1] = 1
    device_kind: str
    warm_cache: bool  # True: every shape is already in the compile cache, no compile time
    startup_s: float = 0.0  # loading the pipeline, once per device, in parallel (0: the rates do not say)
    shapes: list[PlannedShape]
    uncovered: list[UncoveredShape] = Field(default_factory=list)
    devices: int | None = None  # what it was planned for (--devices, --deadline, run --workers)
    deadline_s: float | None = None
    price_per_device_hour: float | None = None

    @property
    def items(self) -> int:
        return sum(shape.items for shape in self.shapes)

    @property
    def work_s(self) -> float:
        return sum(shape.device_s for shape in self.shapes)

    def _compile_per_queue(self) -> dict[str, float]:
        compiles: dict[str, float] = {}
        for shape in self.shapes:
            compiles[shape.queue] = max(compiles.get(shape.queue, 0.0), 0.0 if self.warm_cache else shape.compile_s)
        return compiles

    @property
    def compile_s(self) -> float:
        """One compile per shape: the fleet shares one compile cache."""
        return sum(self._compile_per_queue().values())

    @property
    def device_s(self) -> float:
        return self.work_s + self.compile_s

    @property
    def floor_s(self) -> float:
        """No fleet is faster than a shape's compile plus one of its batches."""
        compiles = self._compile_per_queue()
        return max((compiles[shape.queue] + shape.steady_s for shape in self.shapes), default=0.0)

    def finish_s(self, devices: int) -> float:
        """Start-up, then the device time spread over `devices`, never below `floor_s`."""
        return self.startup_s + max(self.device_s / max(1, devices), self.floor_s)

    def devices_for(self, deadline_s: float) -> int | None:
        """The fewest devices that finish by `deadline_s`; None when no number can."""
        budget = deadline_s - self.startup_s
        if not self.shapes:
            return 0
        if budget <= 0 or budget < self.floor_s:
            return None
        return max(1, math.ceil(self.device_s / budget))


def _batch_dependent(spec: str | None) -> bool:
    from diffq.core.speedups import parse

    speedup = parse(spec)
    return speedup is not None and speedup.batch_dependent
