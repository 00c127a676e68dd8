"""`status --watch`: live progress while records appear, on local and S3 run folders."""

from __future__ import annotations

import io
import json

from rich.console import Console

from diffq.core import layout
from diffq.results.watch import snapshots, watch
from diffq.core.storage import open_storage
from test_export import make_run


def _hide_records(url: str, keep: int) -> dict[str, bytes]:
    """Remove all but `keep` record files, as if those batches were still running."""
    storage = open_storage(url)
    keys = sorted(storage.list(layout.RECORDS_PREFIX))
    held = {key: storage.get_bytes(key) for key in keys[keep:]}
    for key in held:
        storage.delete(key)
    return held


def test_snapshots_follow_a_run_while_workers_write(s3_bucket):
    make_run(s3_bucket, 40, failed_batches=1)
    held = _hide_records(s3_bucket, keep=1)
    storage = open_storage(s3_bucket)
    now = [0.0]

    def sleep(seconds: float) -> None:
        # Each interval, one more batch lands, as a worker would write it.
        now[0] += seconds
        if held:
            key = next(iter(held))
            storage.put_bytes(key, held.pop(key))

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
