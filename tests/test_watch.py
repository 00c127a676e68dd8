"""`status --watch`: live progress while batches land, on local and S3 run folders."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

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

    seen = list(snapshots(s3_bucket, interval=2.0, clock=lambda: now[0], sleep=sleep))
    assert [s.status.done for s in seen] == [8, 16, 24, 32, 40]
    assert all(s.status.failed == 8 and s.status.total == 48 for s in seen)
    assert seen[0].eta_s is None and seen[2].images_per_s == 4.0 and seen[2].eta_s == 16 / 4.0
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

    watch(url, as_json=True)
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["done"] == 16 and line["eta_s"] == 0.0
