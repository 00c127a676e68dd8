"""Re-enqueue what the run folder says is left: `resume` and `retry-failed`.

The plan (every batch as submitted) minus the records is the work left; the broker
is never asked. Batch ids of re-enqueued work derive from the items they carry, so
running the same resume twice publishes the same batch ids, and the second copy of
a batch finds the first one's record and does nothing.

Both read every record (`scan`), so they also reconcile the progress summary with
them (a batch recorded but never credited, its message lost, would otherwise stay
pending in `status` forever); so does the embedded runner, through `scan`.

A `diffq run` again on an OUT that holds a run continues it only if the prompt file
and the options would produce that run: `continuation` compares them with the
manifest and the stored plan, and restores plan parts a killed submit never wrote.
"""

from __future__ import annotations

import getpass
import hashlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from diffq.core import layout
from diffq.core.contract import BatchMessage
from diffq.core.progress import reconcile
from diffq.core.records import CancelMarker, RunDefaults, RunManifest, parse_plan_part, plan_part
from diffq.core.runfolder import failed_items, read_cancel, read_failures, read_manifest, recorded_batches
from diffq.core.storage import NotFound, Storage, open_storage
from diffq.producer.bucketing import RunOptions
from diffq.producer.feed import AUTO, RunFeed, choose_feed, register, start_feed
from diffq.producer.messages import EncodedBatch, batch_id_prefix
from diffq.producer.sources import Defaults, read_prompts
from diffq.producer.submit import (CeleryPublisher, Plan, RunExists, encode_plan, manifest_defaults, plan_parts,
                                   read_plan, write_plan_part)


def _derived_id(batch_id: str, tag: str, item_ids: list[str]) -> str:
    digest = hashlib.sha1("\x00".join(item_ids).encode()).hexdigest()[:8]
    return f"{batch_id}.{tag}{digest}"


def select_batches(storage: Storage, wanted: Callable[[str], bool], tag: str) -> Iterator[BatchMessage]:
    """Plan batches reduced to the items `wanted` accepts, under derived batch ids."""
    for message in read_plan(storage):
        items = [item for item in message.items if wanted(item.id)]
        if items:
            batch_id = _derived_id(message.batch_id, tag, [item.id for item in items])
            yield message.model_copy(update={"items": items, "batch_id": batch_id})


def missing_batches(storage: Storage, skip_ids: set[str]) -> Iterator[BatchMessage]:
    return select_batches(storage, lambda item_id: item_id not in skip_ids, "r")


@dataclass
class Requeued:
    out: str
    items: int
    batches: int
    unpublished: int = 0  # batches the feeder publishes as the window drains
    feeds: str | None = None  # the feeds folder that lists the run for that feeder


def _publish(storage: Storage, messages: Iterator[BatchMessage], broker_url: str,
             transport_options: dict | None, tag: str, window: int | str | None = AUTO,
             feeds: str | None = None) -> Requeued:
    """Through the feeder: what is re-planned is stored as a feed source of its own,
    then a window of it published (`window` None: all of it); the rest waits for the
    feeder, the run listed in the `feeds` folder (DIFFQ_FEEDS, or a live feeder's found
    above the run folder) as `submit` lists it; with no feeder, all of it."""
    chosen = choose_feed(window, feeds, storage.url)
    window, feeds = chosen.window, chosen.feeds
    manifest = read_manifest(storage)
    source = f"{tag}-{time.time_ns()}"
    prefix = layout.feed_parts_prefix(source)
    id_prefixes: dict[str, str] = {}  # queue -> its batches' id prefix (derived ids keep it)

    def encoded(message: BatchMessage) -> EncodedBatch:
        id_prefixes.setdefault(message.shape.queue, batch_id_prefix(message.shape))
        return EncodedBatch.of(message)

    per_queue: dict[str, int] = {}
    items = batches = 0
    for index, part in enumerate(plan_parts(map(encoded, messages))):
        write_plan_part(storage, index, part, prefix)
        for batch in part:
            per_queue[batch.queue] = per_queue.get(batch.queue, 0) + 1
            items += batch.items
            batches += 1
    queues = {queue: (id_prefixes[queue], n) for queue, n in per_queue.items()}
    if not batches:
        return Requeued(out=storage.url, items=0, batches=0)
    start_feed(storage, manifest.run_id, source, queues, window or batches, feeds)
    publisher = CeleryPublisher(broker_url, transport_options)
    try:
        feed = RunFeed(storage, publisher)
        feed.feed_once()
    finally:
        publisher.close()
    listed = feeds if not feed.finished and feeds else None
    if listed:
        register(listed, storage.url, manifest.run_id)
    return Requeued(out=storage.url, items=items, batches=batches, unpublished=sum(feed.unpublished.values()),
                    feeds=listed)


@dataclass
class Recorded:
    """Item ids the run folder's records say are done, and those failed (runfolder.failed_items)."""

    done: set[str]
    failed: set[str]

    @property
    def settled(self) -> set[str]:
        return self.done | self.failed


def scan(storage: Storage) -> Recorded:
    """Read every record and failure; credit recorded batches the progress summary lacks."""
    read_manifest(storage)
    recorded = recorded_batches(storage)
    reconcile(storage, recorded)
    done = {item for _, ids in recorded.values() for item in ids}
    failures = ((failure.batch_id, failure.item_ids) for failure in read_failures(storage))
    return Recorded(done=done, failed=failed_items(failures, lambda batch_id: done))


def cancel(out: str) -> bool:
    """Mark the run cancelled: workers drop its batches as they receive them, without
    generating them; nothing stored is touched. Returns False if it already was."""
    storage = open_storage(out)
    read_manifest(storage)
    marker = CancelMarker(cancelled_at=time.time(), by=f"{getpass.getuser()}@{socket.gethostname()}")
    return storage.put_bytes(layout.CANCEL, marker.model_dump_json().encode(), content_type="application/json",
                             if_absent=True)


def uncancel(storage: Storage) -> bool:
    """Remove the run's cancel marker, then wait out the workers' cached look at it,
    so none drops what is published next. Returns whether the run was cancelled."""
    if read_cancel(storage) is None:
        return False
    storage.delete(layout.CANCEL)
    time.sleep(layout.CANCEL_CHECK_S)
    return True


class PlanIncomplete(RuntimeError):
    pass


def check_plan(storage: Storage, manifest: RunManifest) -> None:
    """`PlanIncomplete` unless OUT holds every plan part its manifest counts: a submit
    killed while writing them leaves batches that only the prompt file knows."""
    parts = sum(1 for _ in storage.list(layout.PLAN_PREFIX))
    if parts < manifest.plan_parts:
        raise PlanIncomplete(
            f"{storage.url} holds {parts} of its run's {manifest.plan_parts} plan parts (its submit stopped "
            f"while writing them): `diffq run` with the run's prompt file and options on this OUT restores "
            f"them and finishes it")


def resume(out: str, broker_url: str, transport_options: dict | None = None, *,
           window: int | str | None = AUTO, feeds: str | None = None) -> Requeued:
    """Re-enqueue exactly the items that are neither done nor failed (a cancelled run
    is un-cancelled first), through the feeder."""
    storage = open_storage(out)
    check_plan(storage, read_manifest(storage))
    settled = scan(storage).settled
    uncancel(storage)
    return _publish(storage, missing_batches(storage, settled), broker_url, transport_options, "resume",
                    window, feeds)


class RunCancelled(RuntimeError):
    pass


def retry_failed(out: str, broker_url: str, transport_options: dict | None = None, *,
                 window: int | str | None = AUTO, feeds: str | None = None) -> Requeued:
    """Re-enqueue the items that failed (and are not done since), through the feeder."""
    storage = open_storage(out)
    recorded = scan(storage)
    if read_cancel(storage) is not None:
        # Workers would drop what this publishes; resume un-cancels and redoes it all.
        raise RunCancelled(f"{storage.url} is cancelled: `diffq resume` re-enqueues everything missing")
    return _publish(storage, select_batches(storage, recorded.failed.__contains__, "f"), broker_url,
                    transport_options, "retry", window, feeds)


class RunDiffers(RunExists):
    """OUT holds a run that this prompt file and these options would not produce."""


def _shown(value) -> str:
    if isinstance(value, list):  # an adapter (--lora) as it is typed: PATH@SCALE
        return ",".join(f"{v['path']}@{v['scale']:g}" if isinstance(v, dict) and "path" in v else str(v)
                        for v in value) or "none"
    return "none" if value is None else str(value)


def differences(manifest: RunManifest, *, source: str, out: str, plan: Plan, defaults: RunDefaults,
                run_id: str | None, seed_base: str | None) -> list[str]:
    """What a `diffq run` with these would do differently from the run in OUT, each as
    "--option: <in the manifest> in OUT's manifest, <now> now"."""
    found = []
    if Path(source).name != manifest.source:
        found.append(f"prompt file: {manifest.source} in OUT's manifest, {Path(source).name} now")
    if out != manifest.out:  # batches name where they store: they would write to the old place
        found.append(f"OUT: {manifest.out} in OUT's manifest, {out} now")
    if run_id is not None and run_id != manifest.run_id:
        found.append(f"--run-id: {manifest.run_id} in OUT's manifest, {run_id} now")
    # JSON's view of both sides (tuples are lists, as the manifest stores them).
    now = defaults.model_dump(mode="json")
    for key, recorded in manifest.defaults.recorded().items():  # a key older manifests lack is not compared
        if now[key] != recorded:
            given = _shown(now[key]) if key != "seed_base" or seed_base is not None else "not given"
            found.append(f"--{key.replace('_', '-')}: {_shown(recorded)} in OUT's manifest, {given} now")
    if not found:  # the same options: the same file gives the same shapes
        recorded_items = {shape.queue: shape.items for shape in manifest.shapes}
        items_now = {shape.queue: shape.items for shape in plan.shapes}
        if plan.total != manifest.total:
            found.append(f"prompt file: {manifest.total} items in OUT's manifest, {plan.total} now")
        for queue in sorted(recorded_items.keys() | items_now.keys()):
            if recorded_items.get(queue, 0) != items_now.get(queue, 0):
                found.append(f"prompt file: {recorded_items.get(queue, 0)} items of {queue} in OUT's "
                             f"manifest, {items_now.get(queue, 0)} now")
    return found


def _first_difference(stored: bytes, body: bytes) -> str | None:
    """The first batch two plan parts disagree on, as messages (not bytes: key order or
    a field a newer diffq adds with its default changes no batch); None if none."""
    old, new = list(parse_plan_part(stored)), list(parse_plan_part(body))
    for before, now in zip(old, new):
        if before != now:
            return before.batch_id
    extra = old[len(new):] or new[len(old):]
    return extra[0].batch_id if extra else None


def restore_plan(storage: Storage, manifest: RunManifest, prompts: str | Path, options: RunOptions,
                 defaults: Defaults, keep_columns=()) -> int:
    """Encode the file's plan again under the manifest's run id and seed base (the seeds
    of a random run id derive from it, so never new ones): a part OUT holds must be the
    same, a part it lacks is written, in the order the manifest says the plan has (a LoRA
    run planned before grouping by set keeps the bucketing's). Returns the parts written."""
    written = 0
    batches = encode_plan(read_prompts(prompts, defaults, keep_columns), options,
                          manifest.defaults.seed_base, manifest.run_id, manifest.out, by_set=manifest.plan_by_set)
    for index, part in enumerate(plan_parts(batches)):
        try:
            stored = storage.get_bytes(layout.plan_key(index))
        except NotFound:
            write_plan_part(storage, index, part)
            written += 1
            continue
        body = plan_part(message.json for message in part)
        if stored != body and (batch_id := _first_difference(stored, body)):
            raise RunDiffers(f"{storage.url} holds a run of other rows: batch {batch_id} of OUT's plan differs "
                             f"from what {Path(prompts).name} gives now (the file changed since the run began); "
                             f"continue it with the file it began with, or use a new OUT")
    return written


def continuation(storage: Storage, manifest: RunManifest, *, prompts: str | Path, plan: Plan,
                 options: RunOptions, defaults: Defaults, run_id: str | None = None,
                 seed_base: str | None = None, keep_columns=()) -> int:
    """Check that this file and these options continue the run in OUT (`RunDiffers`
    naming each difference if not); restore plan parts it lacks. Returns those restored."""
    # Not given, the run id and the seed base are the run's own (a random run id was
    # drawn once, by the run that began it).
    own_seed_base = seed_base or run_id or manifest.run_id
    found = differences(manifest, source=str(prompts), out=storage.url, plan=plan,
                        defaults=RunDefaults.model_validate(
                            manifest_defaults(options, defaults, own_seed_base, keep_columns)),
                        run_id=run_id, seed_base=seed_base)
    if found:
        raise RunDiffers(f"{storage.url} holds a run with other options or rows, so it is not continued "
                         f"(run again with the same ones, or use a new OUT): " + "; ".join(found))
    return restore_plan(storage, manifest, prompts, options, defaults, keep_columns)
