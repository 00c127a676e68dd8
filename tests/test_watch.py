"""`status --watch`: live progress while batches land, on local and S3 run folders."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import pytest
from rich.console import Console

from diffq.core import layout
from diffq.core.progress import ProgressLog
from diffq.core.records import parse_record
from diffq.results.watch import snapshots, watch
from diffq.core.storage import open_storage
from tests.test_export import make_run


def _hold_back(url: str, keep: int) -> Callable[[], None]:
    """Take back all but `keep` batches (record and credit), as if those were still
    running; returns what lands the next one as its worker would (record, then credit)."""
    storage = open_storage(url)
    keys = sorted(storage.list(layout.RECORDS_PREFIX))
    held = {key: storage.get_bytes(key) for key in keys[keep:]}
    for key in [*held, *storage.list(layout.PROGRESS_PREFIX)]:
        storage.delete(key)
    log = ProgressLog(storage, writer="watch-test")

    def credit(key: str, body: bytes) -> None:
        records = parse_record(body)
        log.add(layout.batch_of_record(key), records[0].queue, [record.id for record in records])
        log.flush()

    for key in keys[:keep]:
        credit(key, storage.get_bytes(key))

    def land() -> None:
        if held:
            key = next(iter(held))
            storage.put_bytes(key, held[key])
            credit(key, held.pop(key))

    return land


def test_snapshots_follow_a_run_while_workers_write(s3_bucket):
    make_run(s3_bucket, 40, failed_batches=1)
    land = _hold_back(s3_bucket, keep=1)
    now = [0.0]

    def sleep(seconds: float) -> None:
        # Each interval, one more batch lands, as a worker would write it.
        now[0] += seconds
        land()

    # The watch begins 2 s after the run's first pipeline call (its first record: 1.7e9 + 9.35).
    first_call = 1.7e9 + 10 - 0.6 - 0.05
    seen = list(snapshots(s3_bucket, interval=2.0, window_s=3.0, clock=lambda: now[0], sleep=sleep,
                          wall=lambda: first_call + 2.0 + now[0]))
    assert [s.status.done for s in seen] == [8, 16, 24, 32, 40]
    assert all(s.status.failed == 8 and s.status.total == 48 for s in seen)
    # Time is the run's: the first refresh already has its rate (8 images in its first 2 s)
    # and its age; then the window slides over what the refreshes saw.
    assert seen[0].images_per_s == 4.0 and seen[0].eta_s == 32 / 4.0
    assert [s.elapsed_s for s in seen] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert seen[2].images_per_s == 4.0 and seen[2].eta_s == 16 / 4.0
    assert seen[-1].status.finished and seen[-1].eta_s == 0.0
    assert sum(shape.done for shape in seen[-1].status.shapes.values()) == 40
    assert seen[-1].to_json()["pending"] == 0


def test_watch_renders_bars_and_per_shape_rows(tmp_path, capsys):
    url = str(tmp_path / "run")
    make_run(url, 16)
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    final = watch(url, interval=0.01, console=console)
    text = console.file.getvalue()
    assert final.done == 16 and final.finished
    assert "16/16 done" in text and "32x32 b8" in text and "32x48 b8" in text and "ETA 0:00:00" in text
    # A finished run: its records' span (first call 1.7e9+9.35, last stored 1.7e9+10.5), not the watcher's.
    assert "13.91 images/s" in text and "elapsed 0:00:01" in text

    watch(url, as_json=True)
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["done"] == 16 and line["eta_s"] == 0.0
    assert line["elapsed_s"] == pytest.approx(1.15, abs=0.051) and line["trouble"] is None
    assert line["images_per_s"] == pytest.approx(16 / 1.15, abs=0.001)


def test_each_refresh_counts_exactly_and_reads_only_what_changed(tmp_path, monkeypatch):
    """A watch over batches landing on three writers: redelivered copies, a split
    batch whose half fails, a v1 segment an older worker left. Each refresh equals a
    full scan of the records and reads exactly the segments that changed since the last."""
    from diffq.core.storage.local import LocalStorage
    from diffq.worker.sink.store import Sink
    from tests.test_progress import FullScan, fail, make_plan, split, store, v1_segment

    out = str(tmp_path / "run")
    plan = make_plan(out)
    storage = open_storage(out)
    store(Sink(), plan[0])  # by a worker of an older diffq: its segment is v1
    for key in storage.list(layout.PROGRESS_PREFIX):
        storage.delete(key)
    storage.put_bytes(layout.progress_key("old", 0), v1_segment(
        "old", {plan[0].shape.queue: [[plan[0].batch_id, len(plan[0].items)]]}))
    sinks = [Sink(), Sink(), Sink()]
    left, right = split(plan[1])
    events = [lambda: store(sinks[0], plan[2]), lambda: store(sinks[1], plan[2]),  # redelivered
              lambda: store(sinks[2], left), lambda: fail(right), lambda: store(sinks[0], plan[0]),
              lambda: store(sinks[1], plan[1]),  # the split batch succeeds whole after all
              *[lambda m=m, i=i: store(sinks[i % 3], m) for i, m in enumerate(plan[3:])]]
    read: list[str] = []
    get_many = LocalStorage.get_many
    monkeypatch.setattr(LocalStorage, "get_many",
                        lambda self, keys, **kw: get_many(self, [*keys], **kw) if not read.extend(keys := [*keys])
                        else None)
    now, changed = [0.0], [set(storage.list(layout.PROGRESS_PREFIX))]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        before = dict(storage.list_with_sizes(layout.PROGRESS_PREFIX))
        if events:
            events.pop(0)()
        after = dict(storage.list_with_sizes(layout.PROGRESS_PREFIX))
        changed.append({key for key, size in after.items() if before.get(key) != size})
        read.clear()

    seen = []
    for snapshot in snapshots(out, interval=1.0, clock=lambda: now[0], sleep=sleep):
        scan = FullScan(storage)
        assert (snapshot.status.done, snapshot.status.failed) == (scan.done, scan.failed)
        assert {key for key in read if key.startswith(layout.PROGRESS_PREFIX)} == changed[-1]
        seen.append((snapshot.status.done, snapshot.status.failed))
    assert seen[0] == (len(plan[0].items), 0) and seen[-1] == (23, 0)
    assert (len(plan[0].items) + len(plan[2].items) + len(left.items), len(right.items)) in seen
