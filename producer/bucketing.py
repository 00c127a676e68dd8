"""Shape bucketing: a stream of prompts in, full fixed-size batches out.

No global sort: one open batch per (shape, call parameters) group, so memory is
bounded by the number of groups times the batch size, whatever the file size.
A group's last partial batch is flushed at the end; the worker pads it to the
compiled batch size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from diffq.core.contract import AUTO_DTYPE, BatchParams, ShapeKey
from diffq.core.options import AUTO, DEFAULTS
from diffq.producer.sources import Prompt, derive_seed


@dataclass(slots=True)
class Item:
    """One `BatchItem`'s fields, already validated with its row: a pydantic model per
    row (even via model_construct) costs more than reading and checking the row."""

    id: str
    prompt: str
    seed: int


@dataclass(slots=True)
class SizedItem(Item):
    """An item of a bucketed run: it also carries the size its row asked for."""

    requested_height: int
    requested_width: int


@dataclass(slots=True)
class RichItem(SizedItem):
    """An item whose row sets a negative prompt or metadata (kept apart so the common
    item's message carries no null fields); its requested size may be None."""

    negative_prompt: str | None
    metadata: dict | None


@dataclass(frozen=True)
class RunOptions:
    model: str
    # Defaults from the generation options, declared once (core/options.py).
    batch_size: int | str = DEFAULTS.batch_size  # or "auto" (core/options.py AUTO): each shape's from per_size
    max_sequence_length: int = DEFAULTS.max_sequence_length
    dtype: str = DEFAULTS.dtype
    format: str = DEFAULTS.format
    fit: str = DEFAULTS.fit  # none | resize | crop: what the sink does to a bucket's image
    embed_metadata: bool = DEFAULTS.embed_metadata
    speedup: str | None = DEFAULTS.speedup  # canonical (core/speedups.py)
    unreproducible_speedup: bool = DEFAULTS.unreproducible_speedup
    # A speed-up profile's choice per size (core/profile.py): (height, width, speedup,
    # batch size); with it, each shape's speed-up is its own, and its batch size too
    # where batch_size is "auto".
    per_size: tuple[tuple[int, int, str | None, int], ...] = ()
    # Per model with LoRA adapters, its layout's label (core/adapters.py AdapterLayout):
    # every shape of that model names it, rows without an adapter too. Known once every
    # row is read (`with_layouts`).
    adapter_labels: tuple[tuple[str, str], ...] = ()

    def with_layouts(self, layouts: dict) -> RunOptions:
        """These options with the run's adapter layouts (model -> AdapterLayout)."""
        return dataclasses.replace(self, adapter_labels=tuple(sorted((m, lay.label) for m, lay in layouts.items())))

    def choice(self, height: int, width: int) -> tuple[str | None, int]:
        """(speed-up, batch size) of a shape of this size."""
        for h, w, speedup, batch_size in self.per_size:
            if (h, w) == (height, width):
                return speedup, batch_size if self.batch_size == AUTO else self.batch_size
        return self.speedup, self.batch_size


@dataclass
class Batch:
    shape: ShapeKey
    params: BatchParams
    items: list[Item] = field(default_factory=list)
    index: int = 0  # position among its shape's batches, for a readable batch id


@functools.lru_cache(maxsize=4096)
def shape_for(options: RunOptions, model: str | None, height: int, width: int, cfg: bool) -> ShapeKey:
    model = model or options.model
    return ShapeKey(model=model, height=height, width=width,
                    batch_size=options.choice(height, width)[1],
                    max_sequence_length=options.max_sequence_length, cfg=cfg, dtype=options.dtype,
                    lora=dict(options.adapter_labels).get(model))


def _cfg(prompt: Prompt) -> bool:
    # Decided by the row's family when sources knew it; else the conservative rule.
    return prompt.cfg if prompt.cfg is not None else prompt.guidance_scale > 1.0


def shape_of(prompt: Prompt, options: RunOptions) -> ShapeKey:
    # Cached: a run has a handful of shapes and millions of rows.
    return shape_for(options, prompt.model, prompt.height, prompt.width, _cfg(prompt))


@functools.lru_cache(maxsize=4096)
def _params(steps: int, guidance_scale: float, fmt: str, fit: str, embed_metadata: bool, speedup: str | None,
            unreproducible: bool, adapters: tuple = ()) -> BatchParams:
    return BatchParams(num_inference_steps=steps, guidance_scale=guidance_scale, format=fmt, fit=fit,
                       embed_metadata=embed_metadata, speedup=speedup, unreproducible=unreproducible,
                       adapters=adapters)


def group_key(prompt: Prompt) -> tuple:
    """(model, height, width, cfg, steps, guidance, adapters): rows that may share a batch
    (one call: one adapter set, with its scales). Its first four fields are what decides
    the shape (`shape_for`); the validation pass counts batches per group with the same
    key the bucketer batches by."""
    return (prompt.model, prompt.height, prompt.width, _cfg(prompt), prompt.num_inference_steps,
            prompt.guidance_scale, prompt.lora)


class Bucketer:
    def __init__(self, options: RunOptions, seed_base: str):
        self.options = options
        self.seed_base = seed_base
        # Keyed by plain tuples: hashing a pydantic model per row costs more than
        # everything else bucketing does.
        self._open: dict[tuple, Batch] = {}
        self._counts: dict[tuple, int] = {}

    def _group(self, prompt: Prompt) -> tuple[tuple, Batch]:
        group = group_key(prompt)
        shape_key = group[:4]
        batch = self._open.get(group)
        if batch is None:
            index = self._counts.get(shape_key, 0)
            self._counts[shape_key] = index + 1
            params = _params(prompt.num_inference_steps, prompt.guidance_scale, self.options.format,
                             self.options.fit, self.options.embed_metadata,
                             self.options.choice(prompt.height, prompt.width)[0], self.options.unreproducible_speedup,
                             prompt.lora)
            batch = self._open[group] = Batch(shape_of(prompt, self.options), params, index=index)
        return group, batch

    def add(self, prompt: Prompt) -> Batch | None:
        """Add one prompt; returns a batch when it fills up."""
        group, batch = self._group(prompt)
        seed = prompt.seed if prompt.seed is not None else derive_seed(self.seed_base, prompt.id)
        if prompt.negative_prompt is not None or prompt.metadata is not None:
            batch.items.append(RichItem(prompt.id, prompt.prompt, seed, prompt.requested_height,
                                        prompt.requested_width, prompt.negative_prompt, prompt.metadata))
        elif prompt.requested_height is None:
            batch.items.append(Item(prompt.id, prompt.prompt, seed))
        else:
            batch.items.append(SizedItem(prompt.id, prompt.prompt, seed,
                                         prompt.requested_height, prompt.requested_width))
        if len(batch.items) == batch.shape.batch_size:
            del self._open[group]
            return batch
        return None

    def flush(self) -> Iterator[Batch]:
        """The partial batches left at the end of the stream."""
        while self._open:
            _, batch = self._open.popitem()
            yield batch

    @property
    def open_items(self) -> int:
        return sum(len(batch.items) for batch in self._open.values())


def bucket(prompts: Iterable[Prompt], options: RunOptions, seed_base: str) -> Iterator[Batch]:
    bucketer = Bucketer(options, seed_base)
    for prompt in prompts:
        full = bucketer.add(prompt)
        if full is not None:
            yield full
    yield from bucketer.flush()
