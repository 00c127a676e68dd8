"""Status from the progress summary: exact counts after redeliveries, crashes between
record and credit, splits, failures, resume and retry-failed; always equal to a full
scan of the records. Workers are simulated with the real sink (and, for a
redelivered batch, the real task body); storage is local, moto S3 or fake GCS."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffq.core import layout, progress
from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.progress import ProgressSummary, reconcile
from diffq.core.records import RunManifest, ShapeSummary
from diffq.core.runfolder import read_failures, recorded_batches
from diffq.producer.resume import missing_batches, resume, retry_failed, select_batches
from diffq.results.status import status
from diffq.producer.messages import EncodedBatch, batch_id
from diffq.producer.submit import write_plan_part
from diffq.core.storage import open_storage
from diffq.worker.sink.store import Sink
from tests.helpers import MEASURED
from tests.test_export import run_defaults

SHAPES = [ShapeKey(model="tiny", height=32, width=32, batch_size=4, max_sequence_length=64, cfg=False),
          ShapeKey(model="tiny", height=32, width=48, batch_size=4, max_sequence_length=64, cfg=False)]
PARAMS = BatchParams(num_inference_steps=2, guidance_scale=1.0)


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("s3_bucket")


def make_plan(url: str, items_per_shape=(14, 9)) -> list[BatchMessage]:
    """Manifest and plan of a run, as submit writes them; returns the plan's batches."""
    storage = open_storage(url)
    messages = []
    for shape, n in zip(SHAPES, items_per_shape):
        for index, start in enumerate(range(0, n, shape.batch_size)):
            items = [BatchItem(id=f"{shape.width}-{i}", prompt=f"p{i}", seed=i)
                     for i in range(start, min(start + shape.batch_size, n))]
            messages.append(BatchMessage(run_id="r", out=url, batch_id=batch_id(shape, index), shape=shape,
                                         params=PARAMS, items=items))
    storage.put_bytes(layout.MANIFEST, RunManifest(
        run_id="r", created_at=0.0, source="p.jsonl", out=url, total=sum(items_per_shape), batches=len(messages),
        plan_parts=1, defaults=run_defaults(SHAPES[0]), diffq_version="test",
        shapes=[ShapeSummary(shape=s, queue=s.queue, items=n, batches=-(-n // s.batch_size))
                for s, n in zip(SHAPES, items_per_shape)]).model_dump_json().encode())
    write_plan_part(storage, 0, [EncodedBatch.of(message) for message in messages])
    return messages


def store(sink: Sink, message: BatchMessage):
    """A worker generating and storing a batch (images, record, credit), as the task does."""
    images = [Image.new("RGB", (message.shape.width, message.shape.height)) for _ in message.items]
    handed = sink.submit(open_storage(message.out), message, images, MEASURED)
    handed.credited.result()  # what the ack waits for
    return handed.stored.result()


def split(message: BatchMessage) -> list[BatchMessage]:
    """The worker's own split (tasks.split) of a failing batch: the halves as it
    publishes them, through a task whose app records what it sends."""
    from diffq.core.brokers.base import TASK_NAME
    from diffq.worker.delivery import tasks

    sent = []
    task = SimpleNamespace(app=SimpleNamespace(send_task=lambda name, **options: sent.append((name, options))))
    children = tasks.split(task, message)
    published = [BatchMessage.model_validate(options["kwargs"]["batch"]) for _, options in sent]
    assert published == children and {name for name, _ in sent} == {TASK_NAME}
    assert all(options["queue"] == message.shape.queue for _, options in sent)
    return published


def fail(message: BatchMessage) -> None:
    from diffq.worker.delivery.tasks import write_failure

    write_failure(open_storage(message.out), message, "RuntimeError: poison", attempts=2, worker="w@h")


class FullScan:
    """The reference the summary must equal: every record and failure file read."""

    def __init__(self, storage):
        self.done_ids: set[str] = set()
        self.done_per_queue: dict[str, int] = {}
        for queue, item_ids in recorded_batches(storage).values():
            for item in set(item_ids) - self.done_ids:
                self.done_ids.add(item)
                self.done_per_queue[queue] = self.done_per_queue.get(queue, 0) + 1
        self.failed_ids = {item for failure in read_failures(storage) for item in failure.item_ids}
        self.done = len(self.done_ids)
        self.failed = len(self.failed_ids - self.done_ids)


def counts(url: str) -> tuple[int, int, dict[str, int]]:
    """(done, failed, done per queue) from status, which reads the summary and must
    agree with a full scan of every record."""
    scan = FullScan(open_storage(url))
    st = status(url)
    summary = (st.done, st.failed, {q: s.done for q, s in st.shapes.items() if s.done})
    assert summary == (scan.done, scan.failed, {q: n for q, n in scan.done_per_queue.items() if n})
    return summary


def test_normal_run_counts_from_the_summary(out):
    plan = make_plan(out)
    sink = Sink()
    for message in plan[:-1]:
        store(sink, message)
    done, failed, per_queue = counts(out)
    assert (done, failed) == (23 - len(plan[-1].items), 0)
    assert per_queue == {SHAPES[0].queue: 14, SHAPES[1].queue: 9 - len(plan[-1].items)}
    store(sink, plan[-1])
    st = status(out)
    assert (st.done, st.failed, st.pending, st.finished) == (23, 0, 0, True)
    # One progress segment per worker process, nothing else read but the failures.
    assert len(list(open_storage(out).list(layout.PROGRESS_PREFIX))) == 1


def test_duplicate_and_redelivered_batches_count_once(out):
    plan = make_plan(out)
    first, second = Sink(), Sink()  # two worker processes
    for message in plan:
        store(first, message)
    store(second, plan[0])  # a copy delivered twice, to another worker
    store(first, plan[1])  # and to the same one
    assert counts(out)[:2] == (23, 0)
    assert len(list(open_storage(out).list(layout.PROGRESS_PREFIX))) == 2


class NoCredits:
    """A storage whose progress writes fail: the worker dies between record and credit."""

    def __init__(self, storage):
        self._storage = storage

    def put_bytes(self, key, data, **kwargs):
        if key.startswith(layout.PROGRESS_PREFIX):
            raise OSError("killed before the credit")
        return self._storage.put_bytes(key, data, **kwargs)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def redeliver(message: BatchMessage, sink: Sink) -> dict:
    """The real task body receiving a redelivered copy of `message`."""
    from diffq.worker.delivery import tasks

    runtime = tasks.Runtime(spec=SimpleNamespace(allowed_out_prefixes=[]), host=None, sink=sink)
    task = SimpleNamespace(runtime=runtime,
                           request=SimpleNamespace(id="task-1", retries=0, delivery_info={"redelivered": True}))
    result = tasks.generate_batch(task, message.model_dump(mode="json"))
    runtime.line.expected("task-1").result()  # what the ack waits for
    return result


def test_crash_between_record_and_credit_heals_on_redelivery(out, monkeypatch):
    plan = make_plan(out)
    sink = Sink()
    for message in plan[1:]:
        store(sink, message)
    dying = Sink(retry_for_s=0)
    images = [Image.new("RGB", (32, 32)) for _ in plan[0].items]
    handed = dying.submit(NoCredits(open_storage(out)), plan[0], images, MEASURED)
    assert handed.stored.result().written == len(plan[0].items)
    with pytest.raises(OSError):
        handed.credited.result()  # the ack never happens: the broker delivers the batch again
    storage = open_storage(out)
    assert storage.exists(layout.record_key(plan[0].batch_id))
    summary = ProgressSummary(storage)
    summary.refresh()
    assert summary.done == 23 - len(plan[0].items)  # in flight until credited

    assert redeliver(plan[0], Sink())["skipped"]
    assert counts(out)[:2] == (23, 0)


def test_a_copy_not_flagged_redelivered_credits_too(tmp_path):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    for message in plan[1:]:
        store(Sink(), message)
    images = [Image.new("RGB", (32, 32)) for _ in plan[0].items]
    with pytest.raises(OSError):
        Sink(retry_for_s=0).submit(NoCredits(open_storage(out)), plan[0], images, MEASURED).credited.result()
    outcome = store(Sink(), plan[0])  # generated again: nothing new stored but the credit
    assert outcome.written == 0
    assert counts(out)[:2] == (23, 0)


def test_resume_reconciles_a_batch_whose_message_was_lost(tmp_path, redis_server):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    sink = Sink()
    for message in plan[2:]:
        store(sink, message)
    images = [Image.new("RGB", (32, 32)) for _ in plan[0].items]
    with pytest.raises(OSError):
        Sink(retry_for_s=0).submit(NoCredits(open_storage(out)), plan[0], images, MEASURED).credited.result()
    # The broker lost both plan[0] (recorded, never credited) and plan[1] (never run).
    assert status(out).done == 23 - len(plan[0].items) - len(plan[1].items)
    requeued = resume(out, redis_server)
    assert (requeued.items, requeued.batches) == (len(plan[1].items), 1)
    assert status(out).done == 23 - len(plan[1].items)  # plan[0] credited by resume
    # A worker runs what resume published: the same derived batch resume computes.
    storage = open_storage(out)
    (resumed,) = missing_batches(storage, _done_ids(storage))
    assert resumed.batch_id.startswith(plan[1].batch_id + ".r")
    store(sink, resumed)
    assert counts(out)[:2] == (23, 0)
    assert reconcile(storage, _recorded(storage)) == 0  # nothing left to reconcile


def _scan(storage) -> FullScan:
    return FullScan(storage)


def _done_ids(storage) -> set[str]:
    scan = _scan(storage)
    return scan.done_ids | scan.failed_ids


def _recorded(storage):
    return recorded_batches(storage)


def test_resumed_copy_overlapping_its_still_running_original_counts_once(out):
    plan = make_plan(out)
    sink = Sink()
    storage = open_storage(out)
    # Resume while plan[0] is still queued: its derived copy carries all its items...
    resumed = [m for m in missing_batches(storage, set()) if m.batch_id.startswith(plan[0].batch_id)]
    store(sink, resumed[0])
    assert counts(out)[0] == len(plan[0].items)
    # ...then the original runs too, and so does a copy of the copy.
    store(sink, plan[0])
    store(Sink(), resumed[0])
    assert counts(out)[0] == len(plan[0].items)


def test_splits_failures_and_retry_failed(out, redis_server):
    plan = make_plan(out)
    sink = Sink()
    poisoned = plan[0]  # 4 items: halves of 2, then the poison item alone
    for message in plan[1:]:
        store(sink, message)
    left, right = split(poisoned)
    store(sink, left)
    right_left, right_right = split(right)
    store(sink, right_left)
    fail(right_right)
    fail(poisoned.model_copy(update={"items": right.items, "batch_id": right.batch_id + "x"}))  # an overlap
    done, failed, _ = counts(out)
    assert (done, failed) == (23 - 1, 1)

    # The fault is fixed; retry-failed re-enqueues the poison item alone.
    assert (retry_failed(out, redis_server).items) == 1
    failed_ids = _scan(open_storage(out)).failed_ids - _scan(open_storage(out)).done_ids
    (retried,) = select_batches(open_storage(out), failed_ids.__contains__, "f")
    store(sink, retried)
    assert counts(out)[:2] == (23, 0)
    # A duplicate of the original batch succeeding late changes nothing.
    store(Sink(), poisoned)
    assert counts(out)[:2] == (23, 0)


def test_permanent_failure_then_done_elsewhere(tmp_path):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    fail(plan[0])  # a plan batch fails whole (a permanent error)...
    store(Sink(), plan[1])
    assert counts(out)[:2] == (len(plan[1].items), len(plan[0].items))
    store(Sink(), plan[0])  # ...and a copy of it succeeds on another worker
    assert counts(out)[:2] == (len(plan[0].items) + len(plan[1].items), 0)


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_match_a_full_scan(tmp_path, seed):
    """Splits, failures, resumes, retries and duplicates in random order, several
    workers: the summary always equals reading every record."""
    rng = random.Random(seed)
    out = str(tmp_path / "run")
    plan = make_plan(out, items_per_shape=(rng.randint(5, 20), rng.randint(1, 12)))
    storage = open_storage(out)
    sinks = [Sink() for _ in range(3)]
    queue = list(plan)
    for _ in range(60):
        if not queue:
            break
        message = queue.pop(rng.randrange(len(queue)))
        roll = rng.random()
        if roll < 0.15 and len(message.items) > 1:
            queue.extend(split(message))
        elif roll < 0.25:
            fail(message)
        elif roll < 0.35:
            queue.append(message)  # delivered again later
            store(rng.choice(sinks), message)
        elif roll < 0.45:
            scan = _scan(storage)
            queue.extend(missing_batches(storage, scan.done_ids | scan.failed_ids))
            queue.append(message)
        elif roll < 0.5:
            scan = _scan(storage)
            queue.extend(select_batches(storage, (scan.failed_ids - scan.done_ids).__contains__, "f"))
            queue.append(message)
        else:
            store(rng.choice(sinks), message)
        counts(out)


def test_segments_roll_over_and_refresh_reads_only_what_changed(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "SEGMENT_BYTES", 2 * progress.NUMBERED_CREDIT_BYTES)  # two credits each
    out = str(tmp_path / "run")
    plan = make_plan(out, items_per_shape=(40, 40))
    sink = Sink()
    for message in plan[:12]:
        store(sink, message)
    storage = open_storage(out)
    segments = sorted(storage.list(layout.PROGRESS_PREFIX))
    assert len(segments) > 3
    read = []
    get_many = storage.get_many
    monkeypatch.setattr(storage, "get_many", lambda keys, **kw: (read.extend(keys := list(keys)), get_many(keys))[1])
    summary = ProgressSummary(storage)
    summary.refresh()
    assert summary.done == 48 and sorted(read) == segments
    read.clear()
    for message in plan[12:]:
        store(sink, message)
    summary.refresh()
    assert summary.done == 80
    # New segments are read; sealed ones (all but perhaps the last) are not read again.
    assert set(read) - set(segments) and not set(read) & set(segments[:-1])
    body = json.loads(storage.get_bytes(segments[0]))
    assert body["v"] == 2 and sum(credits["count"] for credits in body["numbered"]) == 2


def test_plan_batch_ids_and_their_numbers():
    assert progress.plan_number(batch_id(SHAPES[0], 1234)) == (batch_id(SHAPES[0], 0)[:-7], 7, 1234)
    assert progress.plan_number(batch_id(SHAPES[0], 12_345_678))[1:] == (8, 12_345_678)  # past 7 digits
    for spelled in ("b1", "b01", "b000001", "0000", "x-12-0009", batch_id(SHAPES[1], 3)):
        prefix, width, index = progress.plan_number(spelled)
        assert f"{prefix}{index:0{width}d}" == spelled  # the number spells the id again
    # Not numbered: derived, no trailing digits, or beyond what the reader's arrays span.
    for other in ("b0000001.s0", "abc", "b-", f"b{progress.MAX_INDEX + 1}"):
        assert progress.plan_number(other) is None


@pytest.mark.parametrize("seed", range(4))
def test_packed_indexes_round_trip(seed):
    rng = np.random.default_rng(seed)
    indexes = rng.choice(progress.MAX_INDEX + 1, size=int(rng.integers(1, 5000)), replace=False)
    start, count, gaps, compressed = progress.pack_indexes(list(indexes) + list(indexes[:7]))  # duplicates fold
    assert (start, count) == (indexes.min(), len(indexes))
    assert progress.unpack_indexes(start, count, gaps, compressed).tolist() == sorted(indexes.tolist())
    if count > 2:
        with pytest.raises(ValueError):
            progress.unpack_indexes(start, count + 1, gaps, compressed)
    # Gaps pack in as few bytes as the largest needs.
    for gap in (1, 255, 256, 65_535, 65_536):
        assert progress.unpack_indexes(*progress.pack_indexes([5, 5 + gap, 5 + 2 * gap])).tolist() == \
            [5, 5 + gap, 5 + 2 * gap]
    # A writer's run of consecutive batches compresses; a thousand writers' gaps do not.
    assert progress.pack_indexes(range(1000, 5000))[3]
    assert not progress.pack_indexes(np.cumsum(rng.integers(1, 2000, 5000)))[3]


def test_a_writers_credits_pack_small(tmp_path):
    """What makes status cheap at 100M items: a plan batch's credit is under 3 bytes,
    not a spelled-out id (v1: ~35)."""
    storage = open_storage(str(tmp_path / "run"))
    log = progress.ProgressLog(storage, writer="w")
    # One writer of a thousand: every ~1,000th batch of the queue, at random gaps.
    indexes = np.cumsum(np.random.default_rng(0).integers(1, 2000, 12_500))
    for index in indexes.tolist():
        log.add(batch_id(SHAPES[0], index), SHAPES[0].queue, ["x"] * 4)
    log.flush()
    (key,) = storage.list(layout.PROGRESS_PREFIX)
    assert len(storage.get_bytes(key)) < 3 * len(indexes)
    summary = ProgressSummary(storage).refresh()
    assert summary.done == 4 * len(indexes) and summary.done_per_queue == {SHAPES[0].queue: 4 * len(indexes)}
    assert all(summary.credited(batch_id(SHAPES[0], i)) for i in indexes[:100].tolist())
    assert not summary.credited(batch_id(SHAPES[0], int(indexes[0]) + 1))


def test_every_rewrite_of_a_segment_is_longer(tmp_path):
    """Readers find changed segments by their listed size; consecutive batches pack to
    the same compressed size, so the writer pads each rewrite past the last."""
    storage = open_storage(str(tmp_path / "run"))
    log = progress.ProgressLog(storage, writer="w")
    summary = ProgressSummary(storage)
    sizes = []
    for index in range(300):
        log.add(batch_id(SHAPES[0], index), SHAPES[0].queue, ["x"] * 4)
        log.flush()
        (size,) = [size for _, size in storage.list_with_sizes(layout.PROGRESS_PREFIX)]
        sizes.append(size)
        assert summary.refresh().done == 4 * (index + 1)
    assert all(a < b for a, b in zip(sizes, sizes[1:]))


def test_indexes_past_seven_digits_cost_what_they_hold(tmp_path):
    """Batch 10,000,000 of a queue has an 8-digit id: its array starts near there, not at 0."""
    import tracemalloc

    storage = open_storage(str(tmp_path / "run"))
    log = progress.ProgressLog(storage, writer="w")
    around = range(9_999_990, 10_000_010)
    for index in around:
        log.add(batch_id(SHAPES[0], index), SHAPES[0].queue, ["x"] * 4)
    log.flush()
    tracemalloc.start()
    try:
        summary = ProgressSummary(storage).refresh()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.done == 4 * len(around)
    assert all(summary.credited(batch_id(SHAPES[0], i)) for i in around)
    assert not summary.credited(batch_id(SHAPES[0], 9_999_989)) and not summary.credited(batch_id(SHAPES[0], 0))
    assert peak < 2_000_000  # two arrays from a multiple of 65,536 near there; from 0, 10 MB each


def v1_segment(writer: str, credits: dict[str, list]) -> bytes:
    """A segment as diffq wrote them before packed credits (the v1 writer's own call)."""
    from diffq.core.records import ProgressSegment

    return ProgressSegment(writer=writer, queues=credits).model_dump_json().encode()


def test_v1_credits_of_every_form_fold_in(tmp_path):
    """A v1 segment's spelled-out credits, in any mix: ids of another width or item
    count between runs of alike ones, ids not numbered, a duplicate, a derived batch."""
    storage = open_storage(str(tmp_path / "run"))
    queue = SHAPES[0].queue
    credits = [["p-0000001", 4], ["p-0000002", 4], ["p-0000003", 3], ["p-0000004", 4], ["p-10000000", 4],
               ["p-0000005", 4], ["weird", 4], ["p-0000002", 4], ["p-x5", 2], ["p-0000009.s0", 2, ["a", "b"]],
               ["p-0000006", 4]]
    storage.put_bytes(layout.progress_key("old", 0), v1_segment("old", {queue: credits}))
    summary = ProgressSummary(storage).refresh()
    assert summary.done == 4 * 7 + 3 + 2 + 2 and summary.done_per_queue == {queue: summary.done}
    for credited, *_ in credits:
        assert summary.credited(credited)
    for absent in ("p-0000007", "p-1000000", "p-0000009", "p-00000001"):
        assert not summary.credited(absent)


def test_old_segments_count_with_new_ones(out):
    """A run whose workers were upgraded midway: v1 segments (every credit spelled out)
    beside packed ones, crediting some batches in both, with splits and failures."""
    plan = make_plan(out)
    storage = open_storage(out)
    old, both, new = plan[:2], plan[2:4], plan[4:]
    left, right = split(plan[0])
    store(Sink(), left)  # the record a v1 worker wrote, then its credit below
    fail(right)
    for message in [*old[1:], *both]:
        store(Sink(), message)
    for key in storage.list(layout.PROGRESS_PREFIX):
        storage.delete(key)
    credits: dict[str, list] = {left.shape.queue: [[left.batch_id, len(left.items), [i.id for i in left.items]]]}
    for message in [*old[1:], *both]:
        credits.setdefault(message.shape.queue, []).append([message.batch_id, len(message.items)])
    storage.put_bytes(layout.progress_key("old-worker", 0), v1_segment("old-worker", credits))
    sink = Sink()
    for message in [*both, *new]:  # redelivered to an upgraded worker
        store(sink, message)
    done, failed, _ = counts(out)
    assert (done, failed) == (23 - len(right.items), len(right.items))
    assert sorted(b for b, *_ in progress.parse_segment(storage.get_bytes(layout.progress_key("old-worker", 0)))) \
        == sorted([m.batch_id for m in [*old[1:], *both]] + [left.batch_id])
    store(Sink(), plan[0])  # the whole batch succeeds after all
    assert counts(out)[:2] == (23, 0)


def test_a_run_with_no_segment_yet_has_nothing_done(tmp_path):
    from tests.test_export import make_run

    out = str(tmp_path / "run")
    make_run(out, 24, failed_batches=1)
    assert (status(out).done, status(out).failed) == (24, 8)
    storage = open_storage(out)
    for key in storage.list(layout.PROGRESS_PREFIX):
        storage.delete(key)
    st = status(out)  # records alone are not read: status costs a listing, not a scan
    assert (st.total, st.done, st.failed, st.pending) == (32, 0, 8, 24)


def test_gcs_summary(gcs_bucket, monkeypatch):
    plan = make_plan(gcs_bucket)
    sink = Sink()
    for message in plan:
        store(sink, message)
    store(Sink(), plan[0])
    assert counts(gcs_bucket)[:2] == (23, 0)


def test_watch_follows_credits_as_workers_write(tmp_path):
    from diffq.results.watch import snapshots

    out = str(tmp_path / "run")
    plan = make_plan(out)
    sink = Sink()
    store(sink, plan[0])
    left = list(plan[1:])
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if left:
            store(sink, left.pop(0))  # one more batch lands each interval

    seen = [s.status.done for s in snapshots(out, interval=1.0, clock=lambda: now[0], sleep=sleep)]
    assert seen == [sum(len(m.items) for m in plan[:k]) for k in range(1, len(plan) + 1)]


class RewriteLimited:
    """A store that allows one write of an object per `min_rewrite_interval_s` (GCS:
    about 1 s); counts the progress segment writes."""

    def __init__(self, storage, interval: float):
        self._storage = storage
        self.min_rewrite_interval_s = interval
        self.segment_writes = 0

    def put_bytes(self, key, data, **kwargs):
        if key.startswith(layout.PROGRESS_PREFIX):
            self.segment_writes += 1
        return self._storage.put_bytes(key, data, **kwargs)

    def __getattr__(self, name):
        return getattr(self._storage, name)


def test_credits_within_the_rewrite_interval_are_written_together(out):
    """Images and records are stored at once (back-pressure waits on those), but a
    credit waits for the store's next allowed rewrite of the segment, and so does
    the batch's ack; a warm shutdown (flush) writes what is waiting."""
    plan = make_plan(out)
    storage = RewriteLimited(open_storage(out), interval=3600)
    sink = Sink()
    images = {m.batch_id: [Image.new("RGB", (m.shape.width, m.shape.height)) for _ in m.items] for m in plan}
    handed = [sink.submit(storage, m, images[m.batch_id], MEASURED) for m in plan]
    assert [h.stored.result(timeout=60).written for h in handed] == [len(m.items) for m in plan]
    handed[0].credited.result(timeout=60)  # the first write is free
    assert not any(h.credited.done() for h in handed[1:])  # acks held: not credited yet
    assert storage.segment_writes == 1
    summary = ProgressSummary(open_storage(out))
    summary.refresh()
    assert summary.done == len(plan[0].items)  # the rest is in flight until credited
    sink.flush()
    assert all(h.credited.result(timeout=0) is None for h in handed)
    assert storage.segment_writes == 2
    assert counts(out)[:2] == (23, 0)


def test_waiting_credits_are_written_when_the_interval_has_passed(tmp_path):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    storage = RewriteLimited(open_storage(out), interval=0.2)
    sink = Sink()
    handed = [sink.submit(storage, m, [Image.new("RGB", (32, 32)) for _ in m.items], MEASURED) for m in plan]
    for h in handed:
        h.credited.result(timeout=60)  # no flush: the timer writes them
    assert counts(out)[:2] == (23, 0)
    assert storage.segment_writes <= len(plan)


def test_gcs_declares_its_rewrite_limit():
    # "There is a maximum rate of one write per second to the same object name"
    # (cloud.google.com/storage/quotas): the sink batches credits to respect it.
    from diffq.core.storage.gcs import GCSStorage
    from diffq.core.storage.local import LocalStorage

    assert GCSStorage.min_rewrite_interval_s == 1.0
    assert LocalStorage.min_rewrite_interval_s == 0.0


def test_a_stream_of_batches_shares_its_segment_writes(tmp_path):
    """Batches stored faster than CREDITS_EVERY_S apart (a fast device): their credits
    go in fewer segment writes than batches, and every one is credited."""
    out = str(tmp_path / "run")
    plan = make_plan(out)
    storage = RewriteLimited(open_storage(out), interval=0.0)  # a local folder's: no limit of its own
    sink = Sink()
    handed = [sink.submit(storage, m, [Image.new("RGB", (32, 32)) for _ in m.items], MEASURED) for m in plan]
    for h in handed:
        h.credited.result(timeout=60)  # no flush: the timer writes them
    assert counts(out)[:2] == (23, 0)
    assert 1 <= storage.segment_writes < len(plan)


def test_a_fetch_note_shows_while_its_worker_lives(tmp_path):
    """`diffq run`'s bar shows a worker's model fetch; a worker killed mid-fetch leaves its
    note behind, which is no fetch now."""
    import subprocess
    import sys

    from diffq.core.progress import FETCH_NOTE, fetch_notes

    (tmp_path / FETCH_NOTE.format(pid=os.getpid())).write_text("fetching weights: 1.0 of 3.0 GB")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / FETCH_NOTE.format(pid=gone.pid)).write_text("fetching weights: 2.0 of 3.0 GB")
    assert fetch_notes(tmp_path) == ["fetching weights: 1.0 of 3.0 GB"]


def test_a_summary_codes_as_many_kinds_of_credit_as_batches():
    """A run whose batches each name their own adapter set has a kind of credit (item
    count, set, mode) per batch: the codes widen past 255 and past 65,535 kinds, each
    index keeps its own kind, and a kind met again keeps its code (issue 64)."""
    numbered = progress._Numbered()
    kinds = [(1 + i % 4, f"{i:08x}", "hotswap") for i in range(65_540)]
    widths = {}
    for i, kind in enumerate(kinds):
        numbered.credit(np.array([i]), kind)
        widths[i + 1] = numbered.codes.dtype  # its code is i + 1
    assert (widths[255], widths[256], widths[65_535], widths[65_536]) == (np.uint8, np.uint16, np.uint16, np.uint32)
    assert numbered.counts() == [(kind, 1) for kind in kinds]
    assert numbered.done == sum(kind[0] for kind in kinds)
    numbered.credit(np.array([0, len(kinds) - 1]), kinds[1])  # credited again (a redelivery), a kind seen
    assert len(numbered.kinds) == len(kinds) + 1 and numbered.counts()[:2] == [(kinds[0], 0), (kinds[1], 3)]
    assert numbered.counts()[-1] == (kinds[-1], 0)
    assert numbered.done == sum(kind[0] for kind in kinds) - kinds[0][0] - kinds[-1][0] + 2 * kinds[1][0]


def test_a_kind_past_the_widest_code_is_refused_not_wrapped():
    """Past its widest code (uint32 in a summary; uint8 here, to reach it cheaply) a new
    kind is refused, and nothing credited already changes kind."""
    numbered = progress._Numbered()
    numbered.WIDTHS = (np.uint8,)
    kinds = [(1, f"{i:08x}", None) for i in range(255)]
    for i, kind in enumerate(kinds):
        numbered.credit(np.array([i]), kind)
    with pytest.raises(ValueError, match="past the 255 kinds"):
        numbered.credit(np.array([255]), (1, "ffffffff", None))
    assert numbered.counts() == [(kind, 1) for kind in kinds] and not numbered.has(255)
