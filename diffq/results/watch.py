"""`diffq status --watch`: live progress of a run from its run folder, while workers write.

Built on the progress summary, so each refresh lists the progress segments and
failures and reads only what changed: a watch costs a listing per interval, on
local, S3 or GCS alike. The rate is measured over a sliding window, so the ETA
follows the fleet as workers join or leave.
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

from diffq.core.progress import ProgressSummary
from diffq.core.runfolder import read_manifest
from diffq.results.status import Status, make_status
from diffq.core.storage import open_storage


@dataclass
class Snapshot:
    status: Status
    labels: dict[str, str]
    elapsed_s: float
    images_per_s: float

    @property
    def eta_s(self) -> float | None:
        if self.status.finished:
            return 0.0
        return self.status.pending / self.images_per_s if self.images_per_s else None

    def to_json(self) -> dict:
        return self.status.to_json() | {"images_per_s": round(self.images_per_s, 3),
                                        "eta_s": None if self.eta_s is None else round(self.eta_s, 1)}


def snapshots(out: str, *, interval: float = 2.0, window_s: float = 30.0,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> Iterator[Snapshot]:
    """A Snapshot every `interval` seconds, the last one when nothing is pending."""
    storage = open_storage(out)
    manifest = read_manifest(storage)
    labels = {s.queue: f"{s.shape.height}x{s.shape.width} b{s.shape.batch_size}" for s in manifest.shapes}
    tracker = ProgressSummary(storage)
    started = clock()
    samples: deque[tuple[float, int]] = deque()
    while True:
        tracker.refresh()
        now = clock()
        samples.append((now, tracker.done))
        while len(samples) > 2 and now - samples[1][0] >= window_s:
            samples.popleft()
        span = now - samples[0][0]
        rate = (tracker.done - samples[0][1]) / span if span > 0 else 0.0
        status = make_status(storage.url, manifest, tracker)
        yield Snapshot(status=status, labels=labels, elapsed_s=now - started, images_per_s=rate)
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
