"""Submit: validate the whole file, write the manifest and plan, publish batches.

One streaming pass over the input validates every row and counts shapes while it
buckets and encodes the batches into a local spill file; only once the last row
passed (nothing is written or enqueued if any row is bad) are the manifest, the
plan and the messages sent. Each plan part is stored before its batches are
published, so the run folder always knows every batch the broker might hold.

Where a feeds folder lists the run for a fleet's feeder (`--feeds`, DIFFQ_FEEDS, or
found by the live feeder's heartbeat above OUT: producer/feed.py `choose_feed`), only
a window of the run goes to the broker, per shape queue: the whole plan is stored
first, then the feeder's first pass publishes the window; the feeder publishes the
rest as it drains. `window=None` (`--window all`, and the default with no feeder to
be found) publishes every batch as the plan is written.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import pickle
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from diffq import __version__
from diffq.core import layout
from diffq.core.adapters import SCAFFOLD_WARN
from diffq.core.contract import BatchMessage, ShapeKey
from diffq.core.model_store import revisions
from diffq.core.options import GenerationOptions
from diffq.core.adapters import set_digest
from diffq.core.records import (AdapterSet, RequestedSize, RunDefaults, RunManifest, ShapeSummary, parse_plan_part,
                                plan_part)
from diffq.core.storage import Storage, open_storage
from diffq.core.transports import transport_for
from diffq.producer.bucketing import RunOptions, bucket, group_key, shape_for
from diffq.producer.feed import AUTO as AUTO_WINDOW, RunFeed, choose_feed, register, start_feed
from diffq.producer.messages import BatchEncoder, EncodedBatch, batch_id_prefix
from diffq.producer.publish import CeleryPublisher
from diffq.producer.sizes import parse_buckets
from diffq.producer.sources import Defaults, IdChecker, InputError, Prompt, RowAdapters, read_prompts

PLAN_PART_BATCHES = 2000
# Requested sizes kept per shape in the manifest and the plan, most common first:
# sizes copied from real datasets are often nearly all distinct, and the manifest
# must stay small (`requested_sizes` counts them all).
MAX_REQUESTED_SIZES = 64
_SIDE_BITS = 15  # a side is at most 16384: (height << 15 | width) orders as (height, width)


class RunExists(RuntimeError):
    pass


@dataclass
class SubmitResult:
    out: str
    run_id: str
    total: int
    batches: int
    queues: dict[str, int] = field(default_factory=dict)  # queue -> batches published
    # Batches stored in OUT's plan that the feeder publishes as the window drains.
    unpublished: int = 0
    feeds: str | None = None  # the feeds folder that lists the run for a feeder
    why: str | None = None  # why every batch went to the broker on the default window

    @property
    def shapes(self) -> int:
        return len(self.queues)

    def summary(self) -> str:
        text = f"{self.total} items, {self.shapes} shapes, {self.batches} batches"
        if self.unpublished:
            text += f" published, {self.unpublished} more in OUT for the feeder"
        return text


@dataclass
class Plan:
    """What the validation pass learned: enough to write the manifest up front."""

    total: int
    batches: int
    shapes: list[ShapeSummary]
    # queue -> steps -> (items, batches): a batch's time scales with its steps (`diffq plan --rates`).
    steps: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # LoRA adapters: per model its layout (the shape keys name it), the run's adapters as
    # checked and pinned (submit reuses them), per adapter set its items and batches.
    adapter_layouts: dict = field(default_factory=dict)
    adapters: RowAdapters | None = None
    adapter_groups: list[AdapterGroup] = field(default_factory=list)
    # Batches and padded slots if rows were not also batched by adapter set: what
    # grouping by adapter set costs is the difference.
    batches_without_adapter_groups: int = 0
    padded_without_adapter_groups: int = 0
    # Per shape queue with adapters, its distinct adapter sets ("none" one of them); per
    # model, what the swap scaffold adds to each row's linear work (core/adapters.py).
    sets_per_queue: dict[str, int] = field(default_factory=dict)
    scaffold_shares: dict[str, float] = field(default_factory=dict)

    @property
    def models(self) -> list[str]:
        return sorted({summary.shape.model for summary in self.shapes})

    @property
    def compiles(self) -> int:
        """What a fleet compiles: one graph per shape per compile cache."""
        return len(self.shapes)

    @property
    def padded_slots(self) -> int:
        return sum(padded_slots(shape) for shape in self.shapes)

    def lora_modes_json(self) -> dict:
        """What each LoRA mode (worker/device/lora_modes.py) is expected to cost this run on a
        fleet taking each queue in order (the plan is grouped by set: `grouped_by_set`):
        set changes (a fleet meets each set of a queue once; a worker at most once per set it
        serves, plus one), compiles (one per shape per compile cache; under compile, where the
        backend bakes the weights, one per (shape, set)) and, for swap, the scaffold's work."""
        changes = sum(self.sets_per_queue.values())
        per_set = changes + self.compiles - len(self.sets_per_queue)
        share = max(self.scaffold_shares.values(), default=0.0)
        swap = {"set_changes": changes, "compiles": self.compiles, "scaffold_percent": round(100 * share, 2)}
        if share > SCAFFOLD_WARN:
            swap["warning"] = (f"the swap scaffold adds {100 * share:.1f} % to every row's linear work (over "
                               f"{100 * SCAFFOLD_WARN:g} %): fuse or compile computes none of it")
        return {"swap": swap,
                "fuse": {"set_changes": changes, "compiles": self.compiles},
                "compile": {"set_changes": changes, "compiles": per_set,
                            "compiles_where_weights_are_graph_inputs": self.compiles}}

    def adapter_sets(self) -> dict[str, AdapterSet]:
        """The manifest's adapter sets: digest -> adapters and items (rows without one are not a set)."""
        return {digest: AdapterSet(adapters=list(group.adapters), items=group.items, batches=group.batches)
                for group in self.adapter_groups if (digest := set_digest(group.adapters)) is not None}

    def adapters_json(self) -> dict:
        """The adapter groups and what batching by them costs in padding (`diffq plan`)."""
        extra = self.batches - self.batches_without_adapter_groups
        return {"layouts": {model: {"label": layout.label, "rank": layout.rank, "targets": len(layout.targets),
                                     "slots": layout.slots,
                                     "scaffold_percent": round(100 * self.scaffold_shares.get(model, 0.0), 2)}
                            for model, layout in self.adapter_layouts.items()},
                "sets_per_queue": dict(sorted(self.sets_per_queue.items())), "modes": self.lora_modes_json(),
                "groups": [group.to_json() for group in self.adapter_groups],
                "batches_without_grouping": self.batches_without_adapter_groups, "extra_batches": extra,
                "extra_padded_slots": self.padded_slots - self.padded_without_adapter_groups}

    def to_json(self) -> dict:
        """`diffq plan --json`: the shape histogram submit would publish (and, for a run
        with LoRA adapters, its adapter groups)."""
        return {
            "total": self.total, "batches": self.batches, "compiles": self.compiles, "models": self.models,
            "padded_slots": self.padded_slots,
            **({"adapters": self.adapters_json()} if self.adapter_layouts else {}),
            "shapes": [{"height": s.shape.height, "width": s.shape.width, "items": s.items,
                        "batches": s.batches, "padded_slots": padded_slots(s), "queue": s.queue,
                        "steps": [{"steps": steps, "items": items, "batches": batches}
                                  for steps, (items, batches) in sorted(self.steps.get(s.queue, {}).items())],
                        **({"requested": [r.model_dump() for r in s.requested],
                            "requested_sizes": s.requested_sizes} if s.requested else {})}
                       for s in self.shapes],
        }


@dataclass
class AdapterGroup:
    """The rows of one adapter set (with its scales): items, their batches and padding."""

    adapters: tuple
    items: int = 0
    batches: int = 0
    padded_slots: int = 0

    @property
    def label(self) -> str:
        return ", ".join(f"{ref.path}@{ref.scale:g}" for ref in self.adapters) or "none"

    def to_json(self) -> dict:
        return {"label": self.label, "adapters": [ref.model_dump(mode="json") for ref in self.adapters],
                "items": self.items, "batches": self.batches, "padded_slots": self.padded_slots}


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def padded_slots(shape: ShapeSummary) -> int:
    """Batch slots the worker fills with padding: the waste of partial batches."""
    return shape.batches * shape.shape.batch_size - shape.items


class Validation:
    """What the validation pass learns from each row: unique ids, counts per group."""

    def __init__(self, path: str | Path, options: RunOptions, adapters: RowAdapters | None = None):
        self.path, self.options, self.adapters = path, options, adapters
        self._ids = IdChecker(path)
        # Plain tuple keys per row; shape keys are built once per shape at the end.
        self._per_group: Counter = Counter()
        # With size buckets, per (model, bucket height, width, cfg): rows per requested size.
        self._requested: dict[tuple, SizeTally] = {}
        self._total = 0

    def check(self, prompts: Iterable[Prompt]) -> Iterator[Prompt]:
        """Passes each prompt on once it is counted and its id is known unique."""
        check, per_group, requested = self._ids.check, self._per_group, self._requested
        profiled = {(h, w) for h, w, _, _ in self.options.per_size} if self.options.per_size else None
        try:
            for prompt in prompts:
                check(prompt)
                if profiled is not None and (prompt.height, prompt.width) not in profiled:
                    raise InputError(self.path, prompt.line, "height", (
                        f"the speed-up profile has no choice for {prompt.height}x{prompt.width} (it has "
                        f"{', '.join(f'{h}x{w}' for h, w in sorted(profiled))}): run `diffq qualify --speedups` "
                        "for that shape too"))
                group = group_key(prompt)
                per_group[group] += 1
                if prompt.requested_height is not None:
                    sizes = requested.get(group[:4])
                    if sizes is None:
                        sizes = requested[group[:4]] = SizeTally()
                    sizes.add(prompt.requested_height << _SIDE_BITS | prompt.requested_width)
                self._total += 1
                yield prompt
        except InputError:
            self._ids.finish()  # a duplicate id on an earlier line is the first error
            raise
        self._ids.finish()  # ids are checked in chunks: settle the last one

    def plan(self) -> Plan:
        if self._total == 0:
            raise InputError(self.path, None, None, "no prompts in file")
        layouts = self.adapters.layouts() if self.adapters is not None else {}
        options = self.options.with_layouts(layouts) if layouts else self.options
        items: Counter = Counter()
        batches: Counter = Counter()
        shapes: dict[str, ShapeKey] = {}
        per_steps: dict[str, dict[int, tuple[int, int]]] = {}
        groups: dict[tuple, AdapterGroup] = {}
        ungrouped: Counter = Counter()  # rows per group but for the adapter set
        sets: dict[str, set] = {}  # queue -> its adapter sets
        for (model, height, width, cfg, steps, guidance, lora), count in self._per_group.items():
            shape = shape_for(options, model, height, width, cfg)
            shapes[shape.queue] = shape
            items[shape.queue] += count
            made = math.ceil(count / shape.batch_size)
            batches[shape.queue] += made
            seen = per_steps.setdefault(shape.queue, {}).get(steps, (0, 0))
            per_steps[shape.queue][steps] = (seen[0] + count, seen[1] + made)
            if layouts:
                group = groups.get(lora) or groups.setdefault(lora, AdapterGroup(adapters=lora))
                group.items += count
                group.batches += made
                group.padded_slots += made * shape.batch_size - count
                ungrouped[(shape, steps, guidance)] += count
                sets.setdefault(shape.queue, set()).add(lora)
        asked = {shape_for(options, *key).queue: sizes for key, sizes in self._requested.items()}
        mask = (1 << _SIDE_BITS) - 1
        summaries = [ShapeSummary(shape=shapes[q], queue=q, items=items[q], batches=batches[q],
                                  requested=[RequestedSize(height=size >> _SIDE_BITS, width=size & mask, items=n)
                                             for size, n in (asked[q].commonest(MAX_REQUESTED_SIZES)
                                                             if q in asked else ())],
                                  requested_sizes=len(asked[q]) if q in asked else 0)
                     for q in sorted(shapes)]
        without = {key: math.ceil(count / key[0].batch_size) for key, count in ungrouped.items()}
        return Plan(total=self._total, batches=sum(batches.values()), shapes=summaries, steps=per_steps,
                    adapter_layouts=layouts, adapters=self.adapters,
                    adapter_groups=sorted(groups.values(), key=lambda group: (-group.items, group.label)),
                    batches_without_adapter_groups=sum(without.values()),
                    padded_without_adapter_groups=sum(n * key[0].batch_size - ungrouped[key]
                                                      for key, n in without.items()),
                    sets_per_queue={queue: len(found) for queue, found in sets.items()},
                    scaffold_shares=self.adapters.scaffold_shares() if layouts else {})


class SizeTally:
    """Rows per packed requested size, in 12 B a distinct size: sizes copied from real
    datasets are often nearly all distinct, and a Counter held ~80 B each (300 MB
    more RSS for 3M rows of varied sizes). Sizes wait in an int32 array and are
    folded into sorted (size, rows) arrays every FOLD of them."""

    FOLD = 1 << 20

    def __init__(self):
        import numpy as np

        self._pending = array("i")
        self._sizes, self._rows = np.empty(0, np.int32), np.empty(0, np.int64)

    def add(self, size: int) -> None:
        self._pending.append(size)
        if len(self._pending) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        import numpy as np

        if not self._pending:
            return
        pending, self._pending = np.frombuffer(self._pending, dtype=np.int32), array("i")
        sizes, rows = np.unique(pending, return_counts=True)
        sizes, where = np.unique(np.concatenate([self._sizes, sizes]), return_inverse=True)
        self._rows = np.bincount(where, weights=np.concatenate([self._rows, rows]),
                                 minlength=len(sizes)).astype(np.int64)  # exact below 2**53 rows
        self._sizes = sizes

    def __len__(self) -> int:
        self._fold()
        return len(self._sizes)

    def commonest(self, n: int) -> list[tuple[int, int]]:
        """(size, rows) of the n commonest sizes, most rows first, then the smaller size."""
        import numpy as np

        self._fold()
        first = np.lexsort((self._sizes, -self._rows))[:n]
        return [(int(self._sizes[i]), int(self._rows[i])) for i in first]


def validate(path: str | Path, options: RunOptions, defaults: Defaults, keep_columns=()) -> Plan:
    validation = Validation(path, options, defaults.adapters)
    for _ in validation.check(read_prompts(path, defaults, keep_columns)):
        pass
    return validation.plan()


def make_options(*, model: str, options: GenerationOptions, size_multiple: int = 16) -> tuple[RunOptions, Defaults]:
    """The run-wide options (shape and output) and the per-row defaults, from the
    generation options (core/options.py: validated there, once, where they were typed).

    A bad `size_buckets` spec raises `BucketSpecError` before any row is read.
    """
    o = options
    per_size = tuple((s.height, s.width, s.chosen.speedup, s.chosen.batch_size)
                     for s in o.profile.shapes) if o.profile is not None else ()  # each shape's choice
    return (
        RunOptions(model=model, batch_size=o.batch_size, max_sequence_length=o.max_sequence_length,
                   dtype=o.dtype, format=o.format, fit=o.fit, embed_metadata=o.embed_metadata,
                   speedup=None if per_size else o.speedup, unreproducible_speedup=o.unreproducible_speedup,
                   per_size=per_size),
        Defaults(height=o.height, width=o.width, num_inference_steps=o.steps,
                 guidance_scale=o.guidance_scale, size_multiple=size_multiple,
                 size_buckets=parse_buckets(o.size_buckets, size_multiple) if o.size_buckets else None,
                 model=model, adapters=RowAdapters(o.lora, text_encoder=o.lora_text_encoder)),
    )


def plan(prompts: str | Path, *, model: str, options: GenerationOptions | None = None, **generation) -> Plan:
    """`diffq plan`: what `submit` with these options would publish (the same
    validation pass, the same errors); nothing is written or enqueued. `options`: the
    generation options as built where typed, or `generation` as keyword arguments."""
    options = GenerationOptions.given(options, generation)
    run_options, defaults = make_options(model=model, options=options)
    return validate(prompts, run_options, defaults, options.keep_columns)


def manifest_defaults(options: RunOptions, defaults: Defaults, seed_base: str, keep_columns=()) -> RunDefaults:
    """The run's options as its manifest records them (a continued run must match them)."""
    return RunDefaults(
        model=options.model, batch_size=options.batch_size, steps=defaults.num_inference_steps,
        guidance_scale=defaults.guidance_scale, max_sequence_length=options.max_sequence_length,
        height=defaults.height, width=defaults.width, format=options.format, dtype=options.dtype,
        seed_base=seed_base, fit=options.fit,
        # Resolved (a preset's sizes, not its name): the run folder says what was used.
        size_buckets=[f"{h}x{w}" for h, w in defaults.size_buckets.sizes] if defaults.size_buckets else None,
        keep_columns=list(keep_columns), embed_metadata=options.embed_metadata,
        # A profile's choices, each shape's own (its batches and records carry them).
        speedup=options.speedup or ("; ".join(f"{h}x{w} b{b}: {spec or 'none'}" for h, w, spec, b in options.per_size)
                                    if options.per_size else None),
        unreproducible_speedup=options.unreproducible_speedup,
        lora=list(defaults.adapters.default) if defaults.adapters is not None else [])


def encode_plan(prompts: Iterable[Prompt], options: RunOptions, seed_base: str, run_id: str,
                out: str, *, by_set: bool = True) -> Iterator[EncodedBatch]:
    """The run's batches as plan lines and messages (the same bytes for the same rows, in
    the same order). A run with LoRA adapters has them grouped by adapter set
    (`grouped_by_set`; the manifest's `plan_by_set`): the plan's order is what submit and
    the feeder publish. `by_set=False`: the bucketing's order, as a LoRA run planned
    before grouping stored it (continuing one compares its plan with this)."""
    encode = BatchEncoder(run_id, out).encode
    batches = bucket(prompts, options, seed_base)
    if not (by_set and options.adapter_labels):
        return map(encode, batches)
    return grouped_by_set((batch.params.adapters, encode(batch)) for batch in batches)


def grouped_by_set(keyed: Iterable[tuple[tuple, EncodedBatch]]) -> Iterator[EncodedBatch]:
    """Every batch of one adapter set after the other, sets in the order their first batch
    came (stable: the same rows give the same order). A worker takes its queue in order,
    one batch at a time (prefetch 1), so it stays on a set while the queue has batches of
    it: under fuse and compile a set change is a weight write or a compile, and it then
    changes sets about once per set it serves, not once per batch; under swap the order
    costs nothing. Every batch waits in a local temporary file before the first is yielded
    (memory: 8 bytes a batch): disk of about the plan's own size plus 140 bytes a batch
    (measured 1,907 bytes a batch of 4 rows of 200-character prompts: docs/prompts.md)."""
    with tempfile.TemporaryFile(prefix="diffq-sets-") as spill:
        offsets: dict[tuple, array] = {}
        for key, message in keyed:
            offsets.setdefault(key, array("q")).append(spill.tell())
            pickle.dump(tuple(message), spill, protocol=pickle.HIGHEST_PROTOCOL)
        for positions in offsets.values():
            for position in positions:
                spill.seek(position)
                yield EncodedBatch(*pickle.load(spill))


def write_plan_part(storage: Storage, part: int, messages: list[EncodedBatch],
                    prefix: str = layout.PLAN_PREFIX) -> None:
    storage.put_bytes(layout.plan_key(part, prefix), plan_part(message.json for message in messages),
                      content_type="application/jsonl")


def read_plan(storage: Storage) -> Iterator[BatchMessage]:
    for key in sorted(storage.list(layout.PLAN_PREFIX)):
        yield from parse_plan_part(storage.get_bytes(key))


def submit(
    prompts: str | Path,
    out: str,
    *,
    model: str,
    broker_url: str | None = None,
    transport_options: dict | None = None,
    publisher=None,
    run_id: str | None = None,
    seed_base: str | None = None,
    size_multiple: int = 16,
    on_published: Callable[[int], None] | None = None,
    plan: Plan | None = None,
    window: int | str | None = AUTO_WINDOW,
    feeds: str | None = None,
    options: GenerationOptions | None = None,
    **generation,
) -> SubmitResult:
    """Validate `prompts`, write the run folder's manifest and plan, publish batches:
    a `window` of batches per shape queue (None: all of them; AUTO: a window where a
    feeder will feed the rest, else all); a run with more is listed in the `feeds`
    folder (DIFFQ_FEEDS, else a live fleet feeder's above OUT) for that feeder.
    `options`: the generation options (core/options.py) as built where they were typed;
    or, from the Python API, `generation` as keyword arguments (their defaults where absent).

    Raises `InputError` (nothing written, nothing enqueued) on any bad row and
    `RunExists` if OUT already holds a run: nothing produced is ever overwritten.
    """
    chosen = GenerationOptions.given(options, generation)
    run_options, defaults = make_options(model=model, options=chosen, size_multiple=size_multiple)
    return submit_to(open_storage(out), prompts, run_options, defaults, keep_columns=chosen.keep_columns,
                     broker_url=broker_url, transport_options=transport_options, publisher=publisher, run_id=run_id,
                     seed_base=seed_base, on_published=on_published, plan=plan, window=window, feeds=feeds)


def submit_to(
    storage: Storage,
    prompts: str | Path,
    options: RunOptions,
    defaults: Defaults,
    *,
    keep_columns: tuple[str, ...] | list[str] = (),
    broker_url: str | None = None,
    transport_options: dict | None = None,
    publisher=None,
    run_id: str | None = None,
    seed_base: str | None = None,
    on_published: Callable[[int], None] | None = None,
    plan: Plan | None = None,
    window: int | str | None = AUTO_WINDOW,
    feeds: str | None = None,
) -> SubmitResult:
    """`submit` into OUT opened once by the caller (`storage`), with the run's options made
    once by it (`make_options`): `diffq run` opens OUT to hold it and validates the file
    before it submits, and hands both on."""
    feed = choose_feed(window, feeds, storage.url)
    run_id = run_id or new_run_id()
    seed_base = seed_base or run_id

    def encoded(prompts_in: Iterable[Prompt], layouts: dict) -> Iterator[EncodedBatch]:
        return encode_plan(prompts_in, options.with_layouts(layouts) if layouts else options, seed_base, run_id,
                           storage.url)

    with contextlib.ExitStack() as stack:
        if plan is None:
            plan, parts = _validated_parts(prompts, options, defaults, keep_columns, encoded, stack)
        else:  # validated by the caller: its adapters are checked and pinned
            defaults = replace(defaults, adapters=plan.adapters or defaults.adapters)
            parts = plan_parts(encoded(read_prompts(prompts, defaults, keep_columns), plan.adapter_layouts))
        if publisher is None and broker_url:
            check_queue_names(plan, broker_url)
        manifest = write_manifest(storage, prompts, plan, run_id,
                                  defaults=manifest_defaults(options, defaults, seed_base, keep_columns))
        if publisher is None:
            if not broker_url:
                raise ValueError("submit needs a broker URL (--broker or DIFFQ_BROKER_URL)")
            publisher = CeleryPublisher(broker_url, transport_options)
            stack.callback(publisher.close)  # sends what is still buffered
        result = SubmitResult(out=manifest.out, run_id=run_id, total=plan.total, batches=0, why=feed.why)
        if feed.window is None:
            _publish_parts(storage, parts, publisher, result, on_published)
        else:
            _publish_window(storage, plan, parts, publisher, result, on_published, feed.window, run_id, feed.feeds)
    return result


def check_queue_names(plan: Plan, broker_url: str) -> None:
    """Every shape queue's name within what the broker takes (SQS: 80 characters), before
    anything is written or enqueued: a run cut off at its first long queue would be half
    published. The model folder's last part (up to 24 characters) is the name's variable part."""
    transport = transport_for(broker_url)
    limit = transport.max_queue_name
    if limit is None:
        return
    for shape in plan.shapes:
        if len(shape.queue) > limit:
            raise ValueError(f"queue {shape.queue} is {len(shape.queue)} characters; {transport.name} "
                             f"takes at most {limit}: give the model a folder with a shorter last part (it is "
                             "the name's longest part)")


def _publish_window(storage: Storage, plan: Plan, parts: Iterable[list[EncodedBatch]], publisher,
                    result: SubmitResult, on_published, window: int, run_id: str, feeds: str | None) -> None:
    """The whole plan stored, then the feeder's first pass: a window per shape queue."""
    for index, part in enumerate(parts):
        write_plan_part(storage, index, part)
    start_feed(storage, run_id, layout.PLAN_SOURCE,
               {s.queue: (batch_id_prefix(s.shape), s.batches) for s in plan.shapes}, window, feeds)
    feed = RunFeed(storage, _Encoding(publisher), on_published)
    feed.feed_once()
    result.queues = {queue: n for queue, n in feed.published.items() if n}
    result.batches = sum(feed.published.values())
    result.unpublished = sum(feed.unpublished.values())
    if result.unpublished and feeds:
        register(feeds, storage.url, run_id)
        result.feeds = feeds


class _Encoding:
    """Any publisher as the feeder's: ready-encoded batches (any publisher takes
    BatchMessage models; ours also takes them ready-encoded) and a flush."""

    def __init__(self, publisher):
        self.inner = publisher
        self.publish_encoded = getattr(publisher, "publish_encoded", None) or self._as_model

    def _as_model(self, encoded: EncodedBatch) -> None:
        self.inner.publish(BatchMessage.model_validate_json(encoded.json))

    def flush(self) -> None:
        if hasattr(self.inner, "flush"):
            self.inner.flush()



def _validated_parts(prompts, options: RunOptions, defaults: Defaults, keep_columns, encoded,
                     stack: contextlib.ExitStack) -> tuple[Plan, Iterator[list[EncodedBatch]]]:
    """One read of the file: rows are validated, bucketed and encoded together, and the
    encoded plan parts wait on local disk (closed with `stack`) until the last row passed.
    A run with LoRA adapters is encoded again, its rows read a second time: its shape keys
    name the adapter layout, which only the last row settles."""
    validation = Validation(prompts, options, defaults.adapters)
    spill = stack.enter_context(PlanSpill())
    checked = validation.check(read_prompts(prompts, defaults, keep_columns))
    batches = encoded(checked, {})
    if defaults.adapters is not None:  # encoding stops at the first adapter: those batches would be discarded
        batches = itertools.takewhile(lambda _: not defaults.adapters.named, batches)
    for part in plan_parts(batches):
        spill.add(part)
    for _ in checked:  # the rows after it: validated, not encoded
        pass
    plan = validation.plan()
    # Encoding stopped where a row named an adapter: whatever the layouts, the rest is encoded again.
    if plan.adapter_layouts or (defaults.adapters is not None and defaults.adapters.named):
        return plan, plan_parts(encoded(read_prompts(prompts, defaults, keep_columns), plan.adapter_layouts))
    return plan, spill.parts()


def _publish_parts(storage: Storage, parts: Iterable[list[EncodedBatch]], publisher, result: SubmitResult,
                   on_published: Callable[[int], None] | None) -> None:
    """Each plan part written before its batches are published: the run folder always
    knows every batch the broker might hold."""
    publish_encoded = _Encoding(publisher).publish_encoded
    for index, part in enumerate(parts):
        write_plan_part(storage, index, part)
        for message in part:
            publish_encoded(message)
            result.batches += 1
            result.queues[message.queue] = result.queues.get(message.queue, 0) + 1
            if on_published:
                on_published(message.items)

def plan_parts(batches: Iterable[EncodedBatch]) -> Iterator[list[EncodedBatch]]:
    part: list[EncodedBatch] = []
    for message in batches:
        part.append(message)
        if len(part) == PLAN_PART_BATCHES:
            yield part
            part = []
    if part:
        yield part


class PlanSpill:
    """Encoded plan parts parked in an unnamed local temporary file (gone on close).

    Keeps memory flat however long the file, at the cost of the plan's size on
    local disk until submit returns.
    """

    def __init__(self):
        self._file = tempfile.TemporaryFile(prefix="diffq-plan-")

    def add(self, part: list[EncodedBatch]) -> None:
        pickle.dump([tuple(message) for message in part], self._file, protocol=pickle.HIGHEST_PROTOCOL)

    def parts(self) -> Iterator[list[EncodedBatch]]:
        self._file.seek(0)
        while True:
            try:
                rows = pickle.load(self._file)
            except EOFError:
                return
            yield [EncodedBatch(*row) for row in rows]

    def __enter__(self) -> PlanSpill:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def write_manifest(storage: Storage, prompts: str | Path, plan: Plan, run_id: str,
                   defaults: RunDefaults) -> RunManifest:
    """Stores the manifest; `RunExists` if OUT already holds one."""
    manifest = RunManifest(
        run_id=run_id,
        created_at=time.time(),
        source=Path(prompts).name,
        out=storage.url,
        total=plan.total,
        batches=plan.batches,
        plan_parts=math.ceil(plan.batches / PLAN_PART_BATCHES),
        shapes=plan.shapes,
        defaults=defaults,
        diffq_version=__version__,
        models=plan.models,
        model_revisions=revisions(plan.models),  # pinned: workers load these or refuse
        adapter_layouts=plan.adapter_layouts,
        adapter_revisions=plan.adapters.revisions() if plan.adapters is not None else {},
        adapter_sets=plan.adapter_sets(),
        plan_by_set=bool(plan.adapter_layouts),  # encode_plan grouped it (its options carry the layouts)
    )
    body = json.dumps(manifest.model_dump(mode="json"), indent=2).encode()
    if not storage.put_bytes(layout.MANIFEST, body, content_type="application/json", if_absent=True):
        raise RunExists(f"{storage.url} already holds a run; use a new OUT, or `diffq resume {storage.url}`")
    return manifest
