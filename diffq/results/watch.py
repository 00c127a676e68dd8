"""`diffq status --watch`: live progress of a run from its run folder, while workers write.

Built on the progress summary, so each refresh lists the progress segments and
failures and reads only what changed: a watch costs a listing per interval, on
local, S3 or GCS alike. The rate is measured over a sliding window, so the ETA
follows the fleet as workers join or leave.

Time is the run's, not the watcher's: its records say when its first pipeline call
began and when its last batch was stored (`run_span`, read once, from a sample of
the records on a large run). On a run already finished that span is the elapsed
time and its images/s; on a live one elapsed counts from that first call, and the
window opens at it (nothing done then), so the first refresh already shows the
run's rate so far. Why storing fails, once it has for over a minute, comes with
the status (results/status.py).
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from diffq.core import layout
from diffq.core.progress import ProgressSummary, plan_number, root_batch
from diffq.core.runfolder import read_manifest, read_records, record_keys
from diffq.core.storage import Storage, open_storage
from diffq.results.status import Status, make_status

# Records read to find a run's span: every one up to this many, else the first and
# last of each queue's batches (the ones published first and last) and an even spread.
RECORDS_SAMPLED = 256
_ENDS_PER_QUEUE = 8


@dataclass(frozen=True)
class RunSpan:
    """Wall-clock times from a run's records: its first pipeline call's start and its
    last batch's store (None without records)."""

    started: float | None = None
    ended: float | None = None


def _sample(keys: list[str], most: int) -> list[str]:
    if len(keys) <= most:
        return keys
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):  # sorted: a queue's plan batches in index order
        root = root_batch(layout.batch_of_record(key))
        number = plan_number(root)
        groups.setdefault(number[0] if number else "", []).append(index)
    chosen = {i for indexes in groups.values() for i in (*indexes[:_ENDS_PER_QUEUE], *indexes[-_ENDS_PER_QUEUE:])}
    room = most - len(chosen)
    if room > 0:
        chosen.update(round(k * (len(keys) - 1) / room) for k in range(room))
    return [keys[i] for i in sorted(chosen)]


def run_span(storage: Storage, most: int = RECORDS_SAMPLED) -> RunSpan:
    """When the run began and last stored, from its records (a sample past `most`)."""
    started = ended = None
    for _, records in read_records(storage, _sample(record_keys(storage), most)):
        for record in records:
            started = record.generate_started_at if started is None else min(started, record.generate_started_at)
            ended = record.finished_at if ended is None else max(ended, record.finished_at)
    return RunSpan(started=started, ended=ended)


@dataclass
class Snapshot:
    status: Status
    labels: dict[str, str]
    elapsed_s: float | None  # the run's: from its first pipeline call (None: no record says)
    images_per_s: float

    @property
    def eta_s(self) -> float | None:
        if self.status.finished:
            return 0.0
        return self.status.pending / self.images_per_s if self.images_per_s else None

    def to_json(self) -> dict:
        return self.status.to_json() | {
            "images_per_s": round(self.images_per_s, 3), "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "elapsed_s": None if self.elapsed_s is None else round(self.elapsed_s, 1)}


def snapshots(out: str, *, interval: float = 2.0, window_s: float = 30.0,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep,
              wall: Callable[[], float] = time.time) -> Iterator[Snapshot]:
    """A Snapshot every `interval` seconds, the last one when nothing is pending.
    `clock` paces the window, `wall` is the clock the records' times are on."""
    storage = open_storage(out)
    manifest = read_manifest(storage)
    labels = {s.queue: f"{s.shape.height}x{s.shape.width} b{s.shape.batch_size}" for s in manifest.shapes}
    tracker = ProgressSummary(storage)
    samples: deque[tuple[float, int]] = deque()
    span: RunSpan | None = None
    while True:
        tracker.refresh()
        now, wall_now = clock(), wall()
        status = make_status(storage.url, manifest, tracker, now=wall_now)
        if span is None:  # the first look: the run's own times, once
            span = run_span(storage)
            if status.finished:  # done before the watch: the records' span says it all
                elapsed = None if span.started is None else max(0.0, span.ended - span.started)
                rate = tracker.done / elapsed if elapsed else 0.0
                yield Snapshot(status=status, labels=labels, elapsed_s=elapsed, images_per_s=rate)
                return
            if span.started is not None:  # the window opens at the run's first call, nothing done then
                samples.append((now - max(0.0, wall_now - span.started), 0))
        samples.append((now, tracker.done))
        while len(samples) > 2 and now - samples[1][0] >= window_s:
            samples.popleft()
        spanned = now - samples[0][0]
        rate = (tracker.done - samples[0][1]) / spanned if spanned > 0 else 0.0
        elapsed = None if span.started is None else max(0.0, wall_now - span.started)
        yield Snapshot(status=status, labels=labels, elapsed_s=elapsed, images_per_s=rate)
        if status.finished:
            return
        sleep(interval)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def render(snapshot: Snapshot) -> Group:
    st = snapshot.status
    headline = Text.assemble(
        (f"run {st.run_id}", "bold"), f"  ·  {st.out}\n",
        (f"{st.done}", "green"), f"/{st.total} done  ·  ", (f"{st.failed} failed", "red" if st.failed else ""),
        f"  ·  {snapshot.images_per_s:.2f} images/s  ·  ETA {_duration(snapshot.eta_s)}"
        f"  ·  elapsed {_duration(snapshot.elapsed_s)}")
    if st.trouble and not st.finished:
        headline.append("\n")
        headline.append(st.trouble, "bold yellow")
    table = Table(box=None, padding=(0, 1), show_header=True, header_style="bold")
    table.add_column("shape")
    table.add_column("progress", width=42)
    table.add_column("done", justify="right")
    table.add_row("all", ProgressBar(total=max(st.total, 1), completed=st.done + st.failed, width=40),
                  f"{st.done}/{st.total}")
    for queue, shape in st.shapes.items():
        table.add_row(snapshot.labels.get(queue, queue), ProgressBar(total=max(shape.total, 1),
                      completed=shape.done, width=40), f"{shape.done}/{shape.total}")
    return Group(headline, table)


def watch(out: str, *, interval: float = 2.0, console: Console | None = None, as_json: bool = False,
          **options) -> Status:
    """Show live progress until nothing is pending (or Ctrl-C); returns the last status.

    as_json prints one JSON object per refresh instead, for scripts.
    """
    stream = snapshots(out, interval=interval, **options)
    last = next(stream)
    try:
        if as_json:
            for snapshot in chain([last], stream):
                last = snapshot
                sys.stdout.write(json.dumps(snapshot.to_json()) + "\n")
                sys.stdout.flush()
            return last.status
        with Live(render(last), console=console, refresh_per_second=4, transient=False) as live:
            for snapshot in stream:
                last = snapshot
                live.update(render(snapshot))
    except KeyboardInterrupt:
        pass
    return last.status
