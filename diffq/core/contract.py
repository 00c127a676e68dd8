"""The queue contract shared by producer and worker: one pydantic schema, JSON only.

Everything that crosses the broker is one of these models (the run folder's files
are in records.py).
The shape key is the heart of it: every field of it changes a compiled graph on a
static-shape backend, so it names the queue a batch goes to.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diffq.core.layout import IMAGE_FORMATS

SCHEMA_VERSION = 1
# A queued message sits in the broker's memory until a worker takes it: the cap
# stops a runaway prompt (or a hostile producer) from filling the broker.
MAX_MESSAGE_BYTES = 256 * 1024
MAX_PROMPT_CHARS = 16_000
# A row's `metadata` object, as compact JSON: carried in every message and record,
# so it is capped like the prompt.
MAX_METADATA_BYTES = 8 * 1024
# Pipeline dtypes a worker runs, each with its short tag in queue names: the one list
# of them (the backend table's dtypes and the worker's torch dtypes read it).
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# "auto": the dtype belongs to the device. The producer does not know which device
# will serve a batch, so an unpinned shape key says auto and each worker runs it at
# its backend's default_dtype (bfloat16 on accelerators, float32 on cpu).
AUTO_DTYPE = "auto"
# What a shape key, a queue name and the CLI's --dtype may say.
SHAPE_DTYPE_TAGS = {AUTO_DTYPE: AUTO_DTYPE, **DTYPE_TAGS}
Dtype = Literal[tuple(SHAPE_DTYPE_TAGS)]
# A LoRA layout's label (core/adapters.py AdapterLayout.label): r<padded rank>[x<slots>]-<targets' digest>.
LORA_LABEL = r"^r\d+(?:x\d+)?-[0-9a-f]{8}$"


# The bounds of the values a batch carries, declared once: the shape key and batch
# parameters below, and the generation options (core/options.py) take them.
ImageSide = Annotated[int, Field(gt=0, le=16384)]
BatchSize = Annotated[int, Field(gt=0, le=1024)]
SequenceLength = Annotated[int, Field(gt=0, le=4096)]
InferenceSteps = Annotated[int, Field(gt=0, le=1000)]
GuidanceScale = Annotated[float, Field(ge=0, le=100)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
ItemId = Annotated[str, Field(min_length=1, max_length=200)]
ModelName = Annotated[str, Field(min_length=1, max_length=1024)]


def bounds(kind) -> tuple:
    """The inclusive (low, high) of one of the bounded types above: its values' for a
    number, its length's for a string (for checks that skip pydantic, and command
    lines); None where unbounded. The tightest where several bounds apply."""
    import annotated_types as at

    lows, highs = [], []
    for item in (m for info in get_args(kind)[1:] for m in getattr(info, "metadata", [info])):
        if isinstance(item, at.Gt):
            lows.append(item.gt + 1 if isinstance(item.gt, int) else item.gt)
        elif isinstance(item, at.Ge):
            lows.append(item.ge)
        elif isinstance(item, at.MinLen):
            lows.append(item.min_length)
        elif isinstance(item, at.Lt):
            highs.append(item.lt - 1 if isinstance(item.lt, int) else item.lt)
        elif isinstance(item, at.Le):
            highs.append(item.le)
        elif isinstance(item, at.MaxLen):
            highs.append(item.max_length)
    return max(lows, default=None), min(highs, default=None)


def effective_dtype(dtype: str, device_default: str) -> str:
    """The dtype a worker runs a shape at: the pinned one, or its device's default."""
    return device_default if dtype == AUTO_DTYPE else dtype


class Strict(BaseModel):
    """Unknown fields are errors: a typo in a message must not pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ShapeKey(Strict):
    """Everything that forces a recompile. Steps and prompt text do not belong here."""

    model: ModelName
    height: ImageSide
    width: ImageSide
    batch_size: BatchSize
    max_sequence_length: SequenceLength
    # CFG doubles the effective batch inside the pipeline; decided as guidance_scale
    # > 1. For distilled models that ignore it this only splits queues, never mixes
    # graphs, so the conservative rule is safe.
    cfg: bool
    dtype: Dtype = AUTO_DTYPE
    # The run's LoRA layout for this model (core/adapters.py AdapterLayout.label: padded
    # rank and a digest of the union of target modules): the scaffold the graphs are
    # compiled around. Which adapter a batch swaps in is not here (BatchParams.adapters):
    # one compiled worker serves every adapter of a shape. None (and absent from the
    # message) for a run without adapters.
    lora: str | None = Field(default=None, pattern=LORA_LABEL, exclude_if=lambda lora: lora is None)

    @property
    def queue(self) -> str:
        return queue_name(self)

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}.b{self.batch_size}"


def model_slug(model: str) -> str:
    """Readable, short, unique: last path part plus a hash of the whole reference.

    Two different local paths both ending in ``tiny`` must not share a queue.
    """
    tail = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    tail = re.sub(r"[^a-z0-9-]+", "-", tail.lower()).strip("-")[:24] or "model"
    digest = hashlib.sha1(model.encode()).hexdigest()[:6]
    return f"{tail}-{digest}"


# Every diffq queue's name starts with this (shape queues, the dead letters): brokers
# list diffq's queues by it (core/transports.py).
QUEUE_PREFIX = "diffq."
# The queue name, written once: `queue_name` fills it in, its pattern reads it back.
QUEUE_FORMAT = QUEUE_PREFIX + "{slug}.{height}x{width}.b{batch}.l{seq}.{cfg}.{dtype}"
# What a shape with a LoRA layout adds to its queue's name (nothing without one).
LORA_SUFFIX = ".{lora}"
_QUEUE_FIELDS = {"slug": "[a-z0-9-]+", "height": r"\d+", "width": r"\d+", "batch": r"\d+", "seq": r"\d+",
                 "cfg": "cfg|nocfg", "dtype": "|".join(SHAPE_DTYPE_TAGS.values()), "lora": LORA_LABEL[1:-1]}


def _pattern(dot: str) -> re.Pattern:
    """QUEUE_FORMAT (and the optional LORA_SUFFIX) as a regex, its dots spelled `dot`
    (kombu's SQS names use '-')."""
    def regex(template: str) -> str:
        return "".join(re.escape(text.replace(".", dot)) + (f"(?P<{name}>{_QUEUE_FIELDS[name]})" if name else "")
                       for text, name, _, _ in string.Formatter().parse(template))

    return re.compile(f"{regex(QUEUE_FORMAT)}(?:{regex(LORA_SUFFIX)})?")


def _format(fields: dict) -> str:
    """A queue's name from its fields (the pattern's groups: `lora` None without a layout)."""
    name = QUEUE_FORMAT.format(**fields)
    return name + LORA_SUFFIX.format(lora=fields["lora"]) if fields.get("lora") else name


_QUEUE_RE = _pattern(".")
_ENTITY_RE = _pattern("-")


@functools.lru_cache(maxsize=4096)
def queue_name(shape: ShapeKey) -> str:
    """``diffq.<model>.<H>x<W>.b<B>.l<L>.<cfg|nocfg>.<dtype>`` (dtype: auto, fp32, bf16, fp16),
    and ``.<lora layout>`` for a shape compiled around a LoRA scaffold.

    Only ``[a-z0-9.-]``: a plain Redis list (what KEDA's redis-list scaler reads),
    a valid RabbitMQ queue, and an SQS one (kombu maps '.' to '-') where it is at most 80
    characters: a long model folder name, a big shape and a LoRA layout can pass that, and
    submit refuses it on SQS before anything is written (transports.py `max_queue_name`).
    """
    return _format(dict(slug=model_slug(shape.model), height=shape.height, width=shape.width,
                        batch=shape.batch_size, seq=shape.max_sequence_length,
                        cfg="cfg" if shape.cfg else "nocfg", dtype=SHAPE_DTYPE_TAGS[shape.dtype], lora=shape.lora))


def without_layout(queue: str) -> str:
    """A shape queue's name without its LoRA layout suffix (the queue a fleet renders for
    that shape: its pool serves every layout of the model); other names as they are."""
    match = _QUEUE_RE.fullmatch(queue)
    return _format({**match.groupdict(), "lora": None}) if match else queue


def queue_from_entity_name(name: str) -> str | None:
    """A shape queue's name back from its SQS spelling, or None if it is not one."""
    match = _ENTITY_RE.fullmatch(name)
    return _format(match.groupdict()) if match else None


def is_shape_queue(queue: str, models: list[str] | None = None, dtypes: tuple[str, ...] | None = None) -> bool:
    """A diffq shape queue; with `models`, only one of theirs (its slug matches); with
    `dtypes`, only one whose dtype (auto, float32, ...) is among them."""
    match = _QUEUE_RE.fullmatch(queue)
    return (bool(match) and (not models or match["slug"] in {model_slug(m) for m in models})
            and (dtypes is None or _dtype_of_tag(match["dtype"]) in dtypes))


def queue_slug(queue: str) -> str | None:
    """The model slug a shape queue's name carries, None if not a shape queue."""
    match = _QUEUE_RE.fullmatch(queue)
    return match["slug"] if match else None


def queue_dtype(queue: str) -> str | None:
    """The dtype a shape queue's name carries (auto, float32, ...), None if not a shape queue."""
    match = _QUEUE_RE.fullmatch(queue)
    return _dtype_of_tag(match["dtype"]) if match else None


def _dtype_of_tag(tag: str) -> str:
    return next(name for name, known in SHAPE_DTYPE_TAGS.items() if known == tag)


def shape_from_queue(queue: str, models: list[str]) -> ShapeKey | None:
    """The shape a queue carries (the inverse of `queue_name`, given the models whose
    slugs may appear), or None if it is not a shape queue of these models."""
    match = _QUEUE_RE.fullmatch(queue)
    if not match:
        return None
    model = next((m for m in models if model_slug(m) == match["slug"]), None)
    if model is None:
        return None
    dtype = _dtype_of_tag(match["dtype"])
    return ShapeKey(model=model, height=int(match["height"]), width=int(match["width"]),
                    batch_size=int(match["batch"]), max_sequence_length=int(match["seq"]),
                    cfg=match["cfg"] == "cfg", dtype=dtype, lora=match["lora"])


def metadata_size(value: dict) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


class BatchItem(Strict):
    id: ItemId
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    seed: Seed
    # Size buckets: the size the row asked for (the shape's size is what is generated).
    requested_height: ImageSide | None = None
    requested_width: ImageSide | None = None
    # Optional per-item fields; absent from messages of rows that do not set them.
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    metadata: dict | None = None  # the row's own object, carried unchanged into the record

    @field_validator("metadata")
    @classmethod
    def _metadata_capped(cls, value: dict | None) -> dict | None:
        if value is not None and (size := metadata_size(value)) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes of JSON, over the {MAX_METADATA_BYTES}-byte limit")
        return value


# --fit: how a requested size other than the bucket's is stored (the one list of them).
FITS = ("none", "resize", "crop")

# A LoRA adapter's scale: diffusers sets no bound; this one catches a typo (80 for 0.8)
# before a run of noise. Negative scales are in use (slider adapters).
AdapterScale = Annotated[float, Field(ge=-4, le=4)]


class AdapterRef(Strict):
    """One LoRA adapter of a batch (core/adapters.py reads and checks it): where it is,
    the revision the run pinned (core/adapters.py `revision`: an object-storage listing's
    digest, a local file's content digest, a Hub commit; None: not pinned, served as it
    is) and the scale its weights are applied at."""

    path: str = Field(min_length=1, max_length=2048)
    scale: AdapterScale = 1.0
    revision: str | None = Field(default=None, max_length=128)
    # The layout the file came in where it is not diffusers' own (core/adapters.py
    # FILE_LAYOUTS), set at submit; the worker converts it. Absent: diffusers' layout.
    file_layout: str | None = Field(default=None, max_length=32, exclude_if=lambda value: value is None)
    # A row may say "drop": the file's text-encoder part is left out (it cannot be
    # hot-swapped). Pinned, "drop" stays only where the file has such a part, so every
    # record of it says that part was dropped.
    text_encoder: Literal["drop", "refuse"] | None = Field(default=None, exclude_if=lambda value: value is None)


class BatchParams(Strict):
    """Per-call arguments that do not change the graph but must be uniform in a call."""

    num_inference_steps: InferenceSteps
    guidance_scale: GuidanceScale
    format: Literal[tuple(IMAGE_FORMATS)] = "png"  # type: ignore[valid-type]
    # What the sink stores for an item whose requested size differs from the shape's:
    # the bucket's image as generated, resized, or scaled and centre-cropped to it.
    fit: Literal[FITS] = "none"  # type: ignore[valid-type]
    # Provenance (prompt, seed, steps, ...) inside each image file: PNG text chunks,
    # EXIF UserComment for JPEG and WebP.
    embed_metadata: bool = True
    # The run's speed-up, canonical (core/speedups.py): a step cache and/or attention
    # backend the worker applies for this call. Not part of the shape key: a cache
    # changes no compiled graph (measured: docs/speedups.md), and each call sets it.
    speedup: str | None = Field(default=None, max_length=1024)
    # The user gave up reproducibility by name (--unreproducible-speedup): a cache that
    # decides from the whole batch may run, and its records say so.
    unreproducible: bool = False
    # The batch's LoRA adapters (one set per batch: rows are batched by it), applied by
    # a hot-swap into the compiled graphs (worker/device/adapters.py); none by default,
    # and then absent from the message, which stays as it was before adapters.
    adapters: tuple[AdapterRef, ...] = Field(default=(), exclude_if=lambda adapters: not adapters)

    @model_validator(mode="after")
    def _speedup_canonical(self) -> BatchParams:
        from diffq.core.speedups import canonical

        if self.speedup is not None and canonical(self.speedup, unreproducible=self.unreproducible) != self.speedup:
            raise ValueError(f"speedup '{self.speedup}' is not in canonical form")
        return self


class BatchMessage(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    out: str = Field(min_length=1, max_length=2048)
    batch_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    shape: ShapeKey
    params: BatchParams
    items: list[BatchItem] = Field(min_length=1)

    @field_validator("items")
    @classmethod
    def _unique_ids(cls, items: list[BatchItem]) -> list[BatchItem]:
        ids = [item.id for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError("item ids in a batch must be unique")
        return items

    @model_validator(mode="after")
    def _fits_shape(self) -> BatchMessage:
        if len(self.items) > self.shape.batch_size:
            raise ValueError(
                f"batch {self.batch_id} has {len(self.items)} items, more than its "
                f"shape's batch size {self.shape.batch_size}"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json_payload(cls, payload: dict | str | bytes) -> BatchMessage:
        """Validate a message on receipt, refusing oversized ones before parsing (a dict
        already parsed by the broker client is measured as compact JSON)."""
        if isinstance(payload, dict):
            size = len(json.dumps(payload, separators=(",", ":")).encode())
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
            return cls.model_validate(payload)
        if len(payload) > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return cls.model_validate_json(payload)
