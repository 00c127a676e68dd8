"""What the user is told (issue 39): why storing fails, in `diffq run`'s bar, `diffq
status` and `diffq watch`, once it has failed for over a minute; no Celery shutdown
chatter in `diffq run`'s terminal; a watch's time is the run's.

Storage failures are injected: a storage stand-in whose writes raise ENOSPC the way
LocalStorage reports a full disk (a StorageError raised from the OSError), and a
monkeypatched `shutil.disk_usage` for the reader's own look at a full disk.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from diffq.app import runner
from diffq.app.run_out import TroubleView
from diffq.core import layout, progress
from diffq.core.progress import TROUBLE_AFTER_S, Trouble, TroubleNote, trouble_reason
from diffq.core.storage import StorageError, open_storage
from diffq.core.storage.local import LocalStorage
from diffq.results.status import status
from diffq.results.watch import render, snapshots
from diffq.worker.sink.store import Sink
from tests.helpers import MEASURED, diffq
from tests.test_export import make_run
from tests.test_progress import make_plan

FULL = "storage full: No space left on device"


def enospc(key: str) -> StorageError:
    """What LocalStorage raises when the disk is full."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        try:
            raise StorageError(f"put {key} failed: {exc}") from exc
        except StorageError as wrapped:
            return wrapped


class FullDisk(LocalStorage):
    """A run folder whose writes fail with ENOSPC while `refuse(key)` says so."""

    def __init__(self, root, refuse):
        super().__init__(root)
        self.refuse = refuse

    def put_bytes(self, key, data, **kwargs):
        if self.refuse(key):
            raise enospc(key)
        return super().put_bytes(key, data, **kwargs)


def notes_in(storage) -> list[Trouble]:
    return progress.recorded_troubles(storage)


# The message ------------------------------------------------------------------------
def test_the_message_names_the_reason_and_the_minutes_and_waits_a_minute():
    assert TROUBLE_AFTER_S == 60.0
    trouble = Trouble(reason=FULL, since=1000.0, at=1175.0)
    assert trouble.message(1000.0 + 185) == "storage full: No space left on device — waiting, 3 min"
    assert not trouble.shown(1000.0 + TROUBLE_AFTER_S)  # a minute exactly: not yet
    assert trouble.shown(1000.0 + TROUBLE_AFTER_S + 1)
    # A note its writer stopped refreshing long ago is not news.
    assert not Trouble(reason=FULL, since=0.0, at=10.0).shown(10.0 + progress.TROUBLE_STALE_S)
    assert progress.trouble_message([None, trouble, Trouble("storage failing: x", 1100.0, 1175.0)], 1180.0) \
        == "storage full: No space left on device — waiting, 3 min"  # the longest-failing one


def test_the_reason_comes_from_the_errno_or_the_exception():
    assert trouble_reason(enospc("images/a.png")) == FULL
    assert trouble_reason(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) == "storage full: Disk quota exceeded"
    assert trouble_reason(PermissionError(errno.EACCES, "nope")) == "storage refused: Permission denied"
    assert trouble_reason(ConnectionRefusedError(errno.ECONNREFUSED, "x")) == "storage unreachable: Connection refused"

    class EndpointConnectionError(Exception):  # botocore's, when S3 cannot be reached
        pass

    assert trouble_reason(EndpointConnectionError('Could not connect to "http://s3"')) \
        == 'storage unreachable: EndpointConnectionError: Could not connect to "http://s3"'
    assert trouble_reason(RuntimeError("SlowDown\nmore")) == "storage failing: RuntimeError: SlowDown"


# The writer: the sink's retry loop --------------------------------------------------
def batch(url: str):
    return make_plan(url)[0]


def store(sink: Sink, storage, message) -> None:
    images = [Image.new("RGB", (message.shape.width, message.shape.height)) for _ in message.items]
    handed = sink.submit(storage, message, images, MEASURED)
    handed.stored.result(timeout=60)
    handed.credited.result(timeout=60)


def test_a_store_refusing_images_gets_a_note_that_goes_once_images_are_stored(tmp_path, monkeypatch):
    """A quota that refuses images but takes a small file: the sink's retries leave a
    note in OUT and in the runner's folder, and take both back once it stores again."""
    monkeypatch.setattr(progress, "TROUBLE_NOTE_AFTER_S", 0.0)
    local = tmp_path / "broker" / "trouble"
    local.mkdir(parents=True)
    monkeypatch.setenv(progress.TROUBLE_DIR_ENV, str(local))
    url = str(tmp_path / "run")
    message = batch(url)
    refused: list[str] = []
    found: list[tuple[list[Trouble], list[Trouble]]] = []
    lock = threading.Lock()

    def refuse(key: str) -> bool:
        if not key.startswith(layout.IMAGES_PREFIX):
            return False  # small files go in
        with lock:
            if not refused:  # the first image, once
                refused.append(key)
                return True
            if key == refused[0] and not found:  # its retry: what a reader sees now
                found.append((notes_in(storage), progress.local_troubles(local)))
        return False

    storage = FullDisk(url, refuse)
    sink = Sink(threads=1)
    try:
        store(sink, storage, message)
    finally:
        sink.close()
    (in_out, in_local), = found
    assert [t.reason for t in in_out] == [FULL] and [t.reason for t in in_local] == [FULL]
    assert in_out[0].since <= in_out[0].at <= time.time()
    # Stored: no note anywhere, the batch recorded and credited as ever.
    assert notes_in(storage) == [] and progress.local_troubles(local) == []
    assert storage.exists(layout.record_key(message.batch_id))
    assert progress.ProgressSummary(storage).refresh().done == len(message.items)


def test_a_store_that_takes_nothing_still_reaches_the_runners_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "TROUBLE_NOTE_AFTER_S", 0.0)
    local = tmp_path / "trouble"
    local.mkdir()
    url = str(tmp_path / "run")
    make_plan(url)
    storage = FullDisk(url, lambda key: True)
    note = TroubleNote(storage, local=local)
    note.failed(enospc("images/x.png"))  # never raises, though OUT takes nothing
    assert notes_in(storage) == [] and [t.reason for t in progress.local_troubles(local)] == [FULL]
    assert note.trouble is not None and note.trouble.reason == FULL
    storage.refuse = lambda key: False
    note.stored()
    assert progress.local_troubles(local) == [] and note.trouble is None


# The readers: status, watch, the runner's bar ---------------------------------------
def pending_run(url: str) -> None:
    make_run(url, 16, failed_batches=0)
    storage = open_storage(url)
    manifest = json.loads(storage.get_bytes(layout.MANIFEST))
    manifest["total"] += 8  # a batch still to store
    manifest["shapes"][0]["items"] += 8
    storage.put_bytes(layout.MANIFEST, json.dumps(manifest).encode())


def leave_note(url: str, failing_s: float, seen_ago: float = 5.0) -> None:
    now = time.time()
    open_storage(url).put_bytes(f"{progress.TROUBLE_PREFIX}w0.json",
                                Trouble(FULL, since=now - failing_s, at=now - seen_ago).to_json())


def test_status_says_why_storing_fails_once_it_has_for_a_minute(tmp_path):
    url = str(tmp_path / "run")
    pending_run(url)
    assert status(url).trouble is None
    leave_note(url, failing_s=30)
    assert status(url).trouble is None  # a blip, not news
    leave_note(url, failing_s=200)
    st = status(url)
    assert st.trouble == "storage full: No space left on device — waiting, 3 min"
    assert st.to_json()["trouble"] == st.trouble
    proc = diffq("status", url)
    assert "waiting, 3 min" in proc.stdout and "storage full" in proc.stdout
    leave_note(url, failing_s=400, seen_ago=progress.TROUBLE_STALE_S + 1)  # its writer is gone
    assert status(url).trouble is None


def test_a_finished_run_has_no_trouble_to_tell(tmp_path):
    url = str(tmp_path / "run")
    make_run(url, 16)
    leave_note(url, failing_s=200)
    assert status(url).trouble is None


def test_status_sees_a_full_local_disk_for_itself(tmp_path, monkeypatch):
    """A full disk takes no note at all: the reader sees no room left while items are
    pending, failing since the last batch was stored (its progress segment's time)."""
    url = str(tmp_path / "run")
    pending_run(url)
    usage = namedtuple("usage", "total used free")
    free = [10 << 30]
    monkeypatch.setattr(progress.shutil, "disk_usage", lambda path: usage(100 << 30, 90 << 30, free[0]))
    last = time.time() - 190
    for segment in (tmp_path / "run" / layout.PROGRESS_PREFIX).iterdir():
        os.utime(segment, (last, last))
    assert status(url).trouble is None
    free[0] = 0
    assert status(url).trouble == "storage full: No space left on device — waiting, 3 min"


def test_watch_shows_the_trouble_under_its_headline(tmp_path):
    url = str(tmp_path / "run")
    pending_run(url)
    leave_note(url, failing_s=200)
    first = next(snapshots(url))
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    console.print(render(first))
    assert "storage full: No space left on device — waiting, 3 min" in console.file.getvalue()
    assert first.to_json()["trouble"].endswith("waiting, 3 min")


def test_a_finished_600_item_run_is_timed_by_its_records_not_the_watcher(tmp_path, monkeypatch):
    """Sampled records (the first and last of each queue): the span is still exact."""
    from diffq.results import watch

    monkeypatch.setattr(watch, "RECORDS_SAMPLED", 20)
    url = str(tmp_path / "run")
    make_run(url, 600)
    (only,) = snapshots(url)
    first_call, last_stored = 1.7e9 + 10 - 0.6 - 0.05, 1.7e9 + 10 + 0.5 * 74
    assert only.elapsed_s == pytest.approx(last_stored - first_call)
    assert only.images_per_s == pytest.approx(600 / (last_stored - first_call))
    text = io.StringIO()
    Console(file=text, width=160).print(render(only))
    assert "15.94 images/s" in text.getvalue() and "elapsed 0:00:37" in text.getvalue()


def test_the_runners_bar_says_it_from_the_workers_notes(tmp_path, monkeypatch):
    """What the workers' sinks leave in the broker folder reaches `diffq run`'s bar,
    though OUT itself takes nothing; without a bar it is said once as a line."""
    url = str(tmp_path / "run")
    make_plan(url)
    folder = tmp_path / "broker" / "trouble"
    view = TroubleView(open_storage(url), folder)
    assert view.look(0.0, pending=5) is None
    now = time.time()
    (folder / "w.json").write_bytes(Trouble(FULL, since=now - 125, at=now - 1).to_json())
    assert view.look(1.0, pending=5) is None  # looked at every LOOK_S
    message = view.look(1.0 + view.LOOK_S, pending=5)
    assert message == "storage full: No space left on device — waiting, 2 min"
    assert view.look(10 + view.LOOK_S, pending=0) is None  # nothing left to store
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    bar = runner.progress_bar(console)
    task = bar.add_task("run", total=10, completed=3, rate=1.5, failed=0, trouble=message)
    console.print(bar.make_tasks_table([bar.tasks[task]]))
    assert "3/10" in console.file.getvalue() and message in console.file.getvalue()
    quiet = Console(file=io.StringIO(), width=200)
    view.say(quiet, message, 0.0)
    view.say(quiet, message, 1.0)
    assert quiet.file.getvalue().count("waiting, 2 min") == 1


def test_the_bar_is_drawn_where_it_shows_and_ends_drawn_everywhere():
    """Redirected (not a terminal), the bar is not rendered for nobody while the run goes
    on, and is written once as it ended; on a terminal it is redrawn as the loop updates it."""
    redirected = Console(file=io.StringIO(), width=200, force_terminal=False)
    with runner.progress_bar(redirected) as bar:
        bar.add_task("run", total=10, completed=3, rate=1.5, failed=0, trouble="")
        assert not bar.live.auto_refresh
        assert redirected.file.getvalue() == ""
    assert "3/10" in redirected.file.getvalue()
    live = runner.progress_bar(Console(file=io.StringIO(), force_terminal=True)).live
    assert live.auto_refresh and live.refresh_per_second == 1 / runner.LOOP_S


# Celery's shutdown lines --------------------------------------------------------------
CHILD = """
import sys
print("worker: Warm shutdown (MainProcess)", flush=True)
print("\\nworker: Hitting Ctrl+C again will terminate all running tasks!", flush=True)
print('{"event": "warm", "worker": "w"}', flush=True)
print("Traceback: a real error", file=sys.stderr, flush=True)
"""


def test_workers_stdout_keeps_all_but_celerys_shutdown_lines(tmp_path, capfd):
    output = runner._WorkerOutput(tmp_path / "workers.out")
    with output.spawning():
        child = subprocess.Popen([sys.executable, "-c", CHILD])
    assert child.wait(timeout=60) == 0
    output.close()
    captured = capfd.readouterr()
    assert "Warm shutdown" not in captured.out and "Hitting Ctrl+C" not in captured.out
    assert '{"event": "warm", "worker": "w"}' in captured.out
    assert "Traceback: a real error" in captured.err  # stderr is never held back


@pytest.mark.slow
def test_a_run_prints_no_warm_shutdown(tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"i{i}", "prompt": f"p {i}", "height": 64, "width": 64}) + "\n"
                               for i in range(4)))
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", tiny_model, "--out", str(out), "--workers", "2",
                 "--batch-size", "2", "--steps", "1")
    assert "4/4 images, 0 failed" in proc.stdout
    assert "Warm shutdown" not in proc.stdout + proc.stderr
    assert not (Path(str(out)) / progress.TROUBLE_PREFIX).exists()
