"""Run report from the run folder alone: text, an HTML page with plots, a contact sheet.

Timings come from the records: each batch's record carries its worker, device,
`generate_s` (the pipeline call), the call's wall-clock span and `finished_at`
(when its images were stored). The progress segments say which process credited
each batch (a segment's writer is one process: host, pid and a token). From those:

- a worker *life* is one process: the batches one progress writer credited, under
  one worker name. Two hosts with the same hostname, or a restarted process, give
  one name several lives. Batches without a writer (credited by reconciliation)
  are split into lives by timing: one process makes one pipeline call at a time,
  so overlapping calls are different processes;
- a life's active span runs from its first call's start to its last batch's
  finish; device-hours are the sum of the spans, one life being one device;
- compile time is estimated per (life, shape) as the first batch's generate_s
  minus the median of the later ones at the same steps (the first call compiles);
- a *wait* is an idle gap before a call of at least `max(WAIT_MIN_S, WAIT_BATCHES ×
  the run's median call)`: ordinary hand-over between batches takes milliseconds;
- a life *stopped early* when its last batch finished a wait's length or more
  before the run's last one;
- a *lost* batch is one whose items had to be done again after their holder was
  gone: a re-done batch (`.r` id: re-enqueued from the run folder by `diffq resume`
  or `diffq run` after a worker death), or a plan batch done after its life waited
  while an earlier life had stopped early (redelivered: the broker gave it back
  once its holder's lease ran out). It waited from the last finish of the latest
  life that stopped before it was done;
- retries: halved batches (`.s` ids, split after an error), retried failures
  (`.f`), failure records and their attempts;
- "storing / idle" is the span minus generate time minus waits: encoding and
  uploads overlap the next batch, so this is what the device spent not generating;
- cost per 1,000 images = price × device-hours / images × 1000;
- flagged images: stored although a degenerate-image check found them degenerate
  (`ImageRecord.degenerate`, `--on-degenerate flag`): counted per check, the first
  FLAGGED_SHOWN listed with a contact sheet of their own;
- with `fleet-plan.json` (`submit`/`run --rates`): planned vs actual device-hours,
  finish time and cost, the plan's model of a fleet's time (FleetPlanFigures).

Memory: one small record per batch, a 16-byte digest per item, a fixed-size sample.
"""

from __future__ import annotations

import base64
import bisect
import html
import io
import random
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from diffq.core import layout
from diffq.core.progress import ProgressSummary, parse_segment
from diffq.core.records import START_PHASES, FailureRecord, FleetPlanFigures, ImageRecord, ShapeSummary, WorkerStart
from diffq.core.runfolder import (ItemSet, failed_items, first_records, read_failures, read_manifest, read_records,
                                  record_keys)
from diffq.core.storage import Storage, open_storage
from diffq.results.by_adapter import SET_HEADERS, ByAdapter, SetCounts, set_cells, set_lines, sets_from_summary

# A gap shorter than both is ordinary scheduling (a broker poll, a hand-over), not a wait.
WAIT_MIN_S = 5.0
WAIT_BATCHES = 10
# Above this many batches the timeline draws each life as one bar (and lost batches).
TIMELINE_BATCHES = 4000
THUMB = 128  # the HTML contact sheet's cell, in CSS pixels
LOST_KINDS = ("re-done", "redelivered")
STORY_LIVES = 10  # stopped processes named one by one in "what happened"
FLAGGED_SHOWN = 48  # flagged images listed (and in their contact sheet); all are counted


@dataclass(slots=True)
class Batch:
    batch_id: str
    finished_at: float
    generate_s: float
    images: int
    worker: str
    device: str
    queue: str
    started: float = 0.0  # the pipeline call's wall-clock span
    ended: float = 0.0
    steps: int = 0
    model: str = ""
    dtype: str | None = None
    writer: str | None = None  # the progress writer (process) that credited it
    life: int = -1  # index into Report.workers
    wait_s: float | None = None  # idle before its call, in its life (None: the life's first call)
    kind: str = ""  # "", "re-done", "redelivered", "halved", "retried", "waited"
    lost_wait_s: float | None = None  # lost batches: from the loss to this batch's call


@dataclass
class WorkerFigures:
    """One worker life: a process under a worker name."""

    worker: str
    device: str
    writer: str | None = None
    life: int = 1  # which life of this worker name (1 = earliest)
    lives: int = 1  # how many lives this worker name had
    images: int = 0
    batches: int = 0
    generate_s: float = 0.0
    compile_s: float = 0.0
    waited_s: float = 0.0  # idle gaps of at least a wait's length
    start: float = float("inf")
    end: float = 0.0
    stopped_early: bool = False

    @property
    def label(self) -> str:
        return f"{self.worker} #{self.life}" if self.lives > 1 else self.worker

    @property
    def process(self) -> str:
        """Host and pid of its progress writer (`progress.default_writer`: the sink's process,
        one per worker process), or "by timing" for a life found from its calls alone."""
        if not self.writer:
            return "by timing"
        parts = self.writer.rsplit("-", 2)
        return f"{parts[0]} pid {parts[1]}" if len(parts) == 3 and parts[1].isdigit() else self.writer

    @property
    def active_s(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def other_s(self) -> float:
        return max(0.0, self.active_s - self.generate_s - self.waited_s)

    @property
    def images_per_s(self) -> float:
        return self.images / self.active_s if self.active_s else 0.0


@dataclass
class ShapeFigures:
    label: str
    queue: str
    total: int
    done: int = 0
    # Size buckets: (height, width, items) of the sizes asked for; empty without.
    requested: list[tuple[int, int, int]] = field(default_factory=list)
    requested_sizes: int = 0  # distinct sizes asked for (the manifest keeps the commonest)
    # The speed-ups its batches ran with (core/speedups.py, canonical; None: full compute).
    speedups: set = field(default_factory=set)

    def speedups_text(self) -> str:
        return ", ".join(sorted(spec or "none (full compute)" for spec in self.speedups))

    def requested_text(self, limit: int = 8) -> str:
        shown = ", ".join(f"{h}x{w} ({n})" for h, w, n in self.requested[:limit])
        more = self.requested_sizes - min(limit, len(self.requested))
        return shown + (f", +{more} more sizes" if more > 0 else "")


@dataclass
class Planned:
    """The kept fleet plan next to what the run did, over the shapes the plan covered."""

    figures: FleetPlanFigures
    devices: int  # planned for, or the most lives at once
    actual_busy_s: float  # pipeline calls of the covered shapes
    actual_finish_s: float  # manifest written -> last image stored
    price: float | None

    @property
    def planned_finish_s(self) -> float:
        return self.figures.finish_s(self.devices)

    def cost(self, finish_s: float) -> float | None:
        return self.price * self.devices * finish_s / 3600 if self.price is not None else None

    def rows(self) -> list[list[str]]:
        f = self.figures
        rows = [["busy device-hours", f"{f.device_s / 3600:.4f}", f"{self.actual_busy_s / 3600:.4f}",
                 _ratio(self.actual_busy_s, f.device_s)],
                ["finish", duration_text(self.planned_finish_s), duration_text(self.actual_finish_s),
                 _ratio(self.actual_finish_s, self.planned_finish_s)]]
        planned, actual = self.cost(self.planned_finish_s), self.cost(self.actual_finish_s)
        if planned is not None:
            rows.append([f"cost ({_count(self.devices, 'device')} at {self.price:g}/device-hour)", f"{planned:.4f}",
                         f"{actual:.4f}", _ratio(actual, planned)])
        return rows

    def to_json(self) -> dict:
        return {"devices": self.devices, "warm_cache": self.figures.warm_cache, "items": self.figures.items,
                "planned_device_s": self.figures.device_s, "actual_device_s": self.actual_busy_s,
                "planned_finish_s": self.planned_finish_s, "actual_finish_s": self.actual_finish_s,
                "planned_cost": self.cost(self.planned_finish_s), "actual_cost": self.cost(self.actual_finish_s),
                "uncovered": [u.model_dump() for u in self.figures.uncovered]}


@dataclass
class Report:
    out: str
    run_id: str
    created_at: float
    total: int
    done: int
    failed: int
    shapes: list[ShapeFigures]
    workers: list[WorkerFigures]  # one per life
    batches: list[Batch]
    failures: list[FailureRecord]
    sample: list[ImageRecord]
    price_per_device_hour: float | None = None
    errors: Counter = field(default_factory=Counter)
    wait_threshold_s: float = WAIT_MIN_S
    rates: list[dict] = field(default_factory=list)
    planned: Planned | None = None
    flagged: list[ImageRecord] = field(default_factory=list)  # the first FLAGGED_SHOWN read, sorted by id
    flagged_kinds: Counter = field(default_factory=Counter)  # check -> images it flagged
    starts: list[WorkerStart] = field(default_factory=list)  # each worker life's time to first image
    # Images per LoRA adapter set, and graphs compiled per shape (results/by_adapter.py).
    by_adapter: ByAdapter = field(default_factory=ByAdapter)
    # Done / failed / pending per adapter set, from the progress summary (None: the
    # manifest lists no sets).
    adapter_sets: list[SetCounts] | None = None

    @property
    def median_time_to_first_image_s(self) -> float | None:
        return statistics.median(s.time_to_first_image_s for s in self.starts) if self.starts else None

    @property
    def device_seconds_starting(self) -> float:
        """Device-seconds the fleet paid before each life's first image."""
        return sum(s.time_to_first_image_s for s in self.starts)

    def start_rows(self) -> list[list[str]]:
        """Per worker life: its phases' seconds, time to first image, its fetches."""
        return [[s.worker, s.device, *(f"{s.phases.get(p, 0.0):.1f}" for p in START_PHASES),
                 f"{s.time_to_first_image_s:.1f}", _fetch_text(s.fetches)]
                for s in sorted(self.starts, key=lambda s: s.began_at)]

    def start_summary(self) -> str:
        return (f"median time to first image {self.median_time_to_first_image_s:.1f} s over "
                f"{_count(len(self.starts), 'worker life', 'worker lives')}; "
                f"{self.device_seconds_starting:.1f} device-seconds spent starting")

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed

    @property
    def device_hours(self) -> float:
        return sum(w.active_s for w in self.workers) / 3600

    @property
    def wall_s(self) -> float:
        if not self.batches:
            return 0.0
        return max(b.finished_at for b in self.batches) - min(b.started for b in self.batches)

    @property
    def images_per_s(self) -> float:
        return self.done / self.wall_s if self.wall_s else 0.0

    @property
    def cost_per_1000(self) -> float | None:
        if self.price_per_device_hour is None or not self.done:
            return None
        return self.price_per_device_hour * self.device_hours / self.done * 1000

    @property
    def stopped(self) -> list[WorkerFigures]:
        return [w for w in self.workers if w.stopped_early]

    @property
    def lost(self) -> list[Batch]:
        return [b for b in self.batches if b.kind in LOST_KINDS]

    @property
    def waits(self) -> list[Batch]:
        """Long waits no stopped holder explains."""
        return [b for b in self.batches if b.kind == "waited"]

    @property
    def retries(self) -> dict[str, int]:
        kinds = Counter(b.kind for b in self.batches)
        return {"halved": kinds["halved"], "retried_failures": kinds["retried"], "failure_records": len(self.failures),
                "failed_attempts": sum(f.attempts for f in self.failures)}

    def per_device(self) -> dict[str, dict]:
        devices: dict[str, dict] = defaultdict(lambda: {"workers": 0, "images": 0, "generate_s": 0.0, "active_s": 0.0})
        for w in self.workers:
            d = devices[w.device]
            d["workers"] += 1
            d["images"] += w.images
            d["generate_s"] += w.generate_s
            d["active_s"] += w.active_s
        ran: dict[str, set] = defaultdict(set)  # the dtypes that really ran (auto resolved by the worker)
        for batch in self.batches:
            ran[batch.device].add(batch.dtype or "unrecorded")
        for name, d in devices.items():
            d["dtypes"] = sorted(ran.get(name, ()))
        return dict(devices)

    def throughput(self, bins: int = 40) -> tuple[list[float], list[float]]:
        """(seconds since the first batch started, images/s) per time bin."""
        if not self.batches:
            return [], []
        # Fewer bins than batches would show gaps between batches, not a rate.
        bins = max(1, min(bins, len(self.batches) // 2))
        start = min(b.started for b in self.batches)
        width = max(self.wall_s / bins, 1e-3)
        counts = [0] * bins
        for b in self.batches:
            counts[min(bins - 1, int((b.finished_at - start) / width))] += b.images
        return [width * (i + 0.5) for i in range(bins)], [c / width for c in counts]

    def story(self) -> list[str]:
        """What happened, in sentences: lives, stopped processes, lost batches, retries."""
        t0 = min((b.started for b in self.batches), default=0.0)
        names = Counter(w.worker for w in self.workers)
        lines = [f"{_count(len(self.workers), 'worker process', 'worker processes')} under "
                 f"{_count(len(names), 'worker name')}"
                 + ("".join(f"; {name} ran {n} times" for name, n in sorted(names.items()) if n > 1))
                 + " (one process = one progress writer; see Worker lives)."]
        for w in self.stopped[:STORY_LIVES]:
            lines.append(f"{w.label} ({w.process}) stopped early: its last batch was stored at "
                         f"+{w.end - t0:.1f} s, {self._run_end - w.end:.1f} s before the run's last.")
        if len(self.stopped) > STORY_LIVES:  # a fleet scaling down: the lives table has them all
            lines.append(f"… and {len(self.stopped) - STORY_LIVES} more processes stopped early.")
        lost = self.lost
        if lost:
            waits = [b.lost_wait_s for b in lost if b.lost_wait_s is not None]
            kinds = Counter(b.kind for b in lost)
            span = (f"{min(waits):.1f} s" if f"{min(waits):.1f}" == f"{max(waits):.1f}"
                    else f"{min(waits):.1f} to {max(waits):.1f} s") if waits else ""
            lines.append(f"{_count(len(lost), 'lost batch', 'lost batches')} ({sum(b.images for b in lost)} images) "
                         f"done again (" + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) + ")"
                         + (f" after waiting {span}" if span else "") + ".")
        waited = self.waits
        if waited:
            lines.append(f"{_count(len(waited), 'batch', 'batches')} came after a wait of "
                         f"{min(b.wait_s for b in waited):.1f} s or more with no stopped process to explain it.")
        r = self.retries
        if r["halved"] or r["retried_failures"] or r["failure_records"]:
            lines.append(f"Retries: {_count(r['halved'], 'batch', 'batches')} halved after an error, "
                         f"{_count(r['retried_failures'], 'retried failure')}, "
                         f"{_count(r['failure_records'], 'failure record')} ({r['failed_attempts']} attempts in all).")
        if self.flagged_kinds:
            lines.append(f"{_count(sum(self.flagged_kinds.values()), 'image')} stored flagged as degenerate ("
                         + ", ".join(f"{n} {kind}" for kind, n in sorted(self.flagged_kinds.items()))
                         + "): see Flagged images.")
        if not (self.stopped or lost or waited or r["halved"] or r["retried_failures"] or r["failure_records"]):
            lines.append(f"No process stopped early, no batch waited {self.wait_threshold_s:.1f} s or more, "
                         "no retries.")
        return lines

    @property
    def _run_end(self) -> float:
        return max((b.finished_at for b in self.batches), default=0.0)


def _fetch_text(fetches: list[dict]) -> str:
    return "; ".join(f"{'hit' if f['hit'] else 'miss'} {f['bytes'] / 1e6:.1f} MB {f['seconds']:.1f} s "
                     f"{f['mb_per_s']:.0f} MB/s" for f in fetches) or "–"


def _starts(storage: Storage) -> list[WorkerStart]:
    keys = list(storage.list(layout.STARTS_PREFIX))
    return [WorkerStart.model_validate_json(body) for _, body in storage.get_many(keys)]


START_HEADER = ["worker", "device", *(p.replace("_", " ") + " s" for p in START_PHASES), "first image s", "fetch"]


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _ratio(actual: float | None, planned: float | None) -> str:
    return f"{actual / planned:.2f}×" if actual is not None and planned else "-"


def duration_text(seconds: float | None) -> str:
    """A duration for people: seconds, minutes or hours."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


# --- reading ------------------------------------------------------------------------


def _writers(storage: Storage) -> dict[str, str]:
    """batch id -> the progress writer that credited it first (reconciliation is no process)."""
    found: dict[str, str] = {}
    keys = [key for key in storage.list(layout.PROGRESS_PREFIX) if key.endswith(".json")]
    for key, body in storage.get_many(keys):
        writer = key[len(layout.PROGRESS_PREFIX):].rsplit("-", 1)[0]  # layout.progress_key's name
        if writer.startswith("reconcile-"):
            continue
        for batch_id, _, _, _ in parse_segment(body):
            found.setdefault(batch_id, writer)
    return found


def _chains(batches: list[Batch]) -> list[list[Batch]]:
    """Split one worker name's batches into processes: a process makes one call at a time."""
    chains: list[list[Batch]] = []
    for b in sorted(batches, key=lambda b: b.started):
        free = [chain for chain in chains if chain[-1].ended <= b.started + 1e-6]
        if free:
            max(free, key=lambda chain: chain[-1].ended).append(b)
        else:
            chains.append([b])
    return chains


def _lives(batches: list[Batch]) -> list[WorkerFigures]:
    groups: dict[tuple[str, str | None], list[Batch]] = defaultdict(list)
    for b in batches:
        groups[(b.worker, b.writer)].append(b)
    chains = []
    for (worker, writer), group in groups.items():
        for chain in ([sorted(group, key=lambda b: b.started)] if writer else _chains(group)):
            chains.append((worker, writer, chain))
    chains.sort(key=lambda c: (c[0], c[2][0].started))
    lives: list[WorkerFigures] = []
    per_name = Counter(worker for worker, _, _ in chains)
    seen: Counter = Counter()
    for worker, writer, chain in chains:
        seen[worker] += 1
        life = WorkerFigures(worker=worker, device=chain[0].device, writer=writer, life=seen[worker],
                             lives=per_name[worker])
        index = len(lives)
        previous = None
        for b in chain:
            b.life = index
            b.wait_s = b.started - previous.ended if previous is not None else None
            previous = b
            life.images += b.images
            life.batches += 1
            life.generate_s += b.generate_s
            life.start = min(life.start, b.started)
            life.end = max(life.end, b.finished_at)
        life.compile_s = _compile_estimate(chain)
        lives.append(life)
    return lives


def _compile_estimate(chain: list[Batch]) -> float:
    """Per shape: the first call minus the median later call at the same steps."""
    by_queue: dict[str, list[Batch]] = defaultdict(list)
    for b in chain:
        by_queue[b.queue].append(b)
    total = 0.0
    for group in by_queue.values():
        first, later = group[0], [b.generate_s for b in group[1:] if b.steps == group[0].steps]
        if later:
            total += max(0.0, first.generate_s - statistics.median(later))
    return total


def _classify(batches: list[Batch], lives: list[WorkerFigures]) -> float:
    """Mark waits, stopped lives and lost batches; returns the wait threshold used."""
    if not batches:
        return WAIT_MIN_S
    threshold = max(WAIT_MIN_S, WAIT_BATCHES * statistics.median(b.generate_s for b in batches))
    run_end = max(b.finished_at for b in batches)
    for life in lives:
        life.stopped_early = life.end < run_end - threshold
    stopped_ends = sorted(life.end for life in lives if life.stopped_early)  # bisected per batch
    for b in batches:
        waited = b.wait_s is not None and b.wait_s >= threshold
        if waited:
            lives[b.life].waited_s += b.wait_s
        tag = b.batch_id.rpartition(".")[2][:1] if "." in b.batch_id else ""
        before = bisect.bisect_right(stopped_ends, b.started)
        lost_at = stopped_ends[before - 1] if before else None
        if tag == "r":
            b.kind = "re-done"
        elif tag == "s":
            b.kind = "halved"
        elif tag == "f":
            b.kind = "retried"
        elif waited:
            b.kind = "redelivered" if lost_at is not None else "waited"
        if b.kind in LOST_KINDS:
            b.lost_wait_s = b.started - lost_at if lost_at is not None else b.wait_s
    return threshold


def _rates(batches: list[Batch], lives: list[WorkerFigures], shapes: dict[str, ShapeSummary]) -> list[dict]:
    """Per shape and steps: the steady call and the first call, as `diffq qualify` reports them
    (`diffq plan --rates` reads these)."""
    firsts: dict[str, list[float]] = defaultdict(list)  # queue -> compile estimates per life
    steady: dict[tuple[str, int], list[float]] = defaultdict(list)
    first_calls: dict[tuple[str, int], list[float]] = defaultdict(list)
    by_life_queue: dict[tuple[int, str], list[Batch]] = defaultdict(list)
    for b in batches:
        by_life_queue[(b.life, b.queue)].append(b)
    for (_, queue), group in by_life_queue.items():
        group.sort(key=lambda b: b.started)
        first_calls[(queue, group[0].steps)].append(group[0].generate_s)
        for b in group[1:]:
            steady[(queue, b.steps)].append(b.generate_s)
        later = [b.generate_s for b in group[1:] if b.steps == group[0].steps]
        if later:
            firsts[queue].append(max(0.0, group[0].generate_s - statistics.median(later)))
    rates = []
    for queue, steps in sorted(set(steady) | set(first_calls)):
        summary = shapes.get(queue)
        if summary is None:
            continue
        # A shape no life ran twice has first calls only: its compile stays in its steady time.
        calls = steady.get((queue, steps)) or first_calls[(queue, steps)]
        sample = next(b for b in batches if b.queue == queue and b.steps == steps)
        median = statistics.median(calls)
        key = summary.shape
        rates.append({"queue": queue, "model": key.model, "dtype": sample.dtype or key.dtype,
                      "height": key.height, "width": key.width, "batch_size": key.batch_size, "steps": steps,
                      "cfg": key.cfg, "device_kind": sample.device.partition(":")[0],
                      "first_call_s": median + (statistics.median(firsts[queue]) if firsts[queue] else 0.0),
                      "steady_s": {"median": median, "p90": _p90(calls), "calls": len(calls)},
                      "from_first_calls": (queue, steps) not in steady,
                      "images_per_s": key.batch_size / median if median > 0 else None})
    return rates


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _planned(storage: Storage, created_at: float, batches: list[Batch], lives: list[WorkerFigures],
             price: float | None) -> Planned | None:
    if not storage.exists(layout.FLEET_PLAN):
        return None
    figures = FleetPlanFigures.model_validate_json(storage.get_bytes(layout.FLEET_PLAN))
    covered = {(s.queue, s.steps) for s in figures.shapes}
    busy = sum(b.generate_s for b in batches if (b.queue, b.steps) in covered)
    finish = max((b.finished_at for b in batches), default=created_at) - created_at
    return Planned(figures=figures, devices=figures.devices or _most_at_once(lives), actual_busy_s=busy,
                   actual_finish_s=finish, price=price if price is not None else figures.price_per_device_hour)


def _most_at_once(lives: list[WorkerFigures]) -> int:
    events = sorted([(w.start, 1) for w in lives] + [(w.end, -1) for w in lives])
    most = running = 0
    for _, delta in events:
        running += delta
        most = max(most, running)
    return max(1, most)


def build_report(out: str, *, price_per_device_hour: float | None = None, sample_size: int = 24,
                 seed: int = 0) -> Report:
    """Read the run folder once (records, progress, failures) and compute every figure of the report."""
    storage = open_storage(out)
    manifest = read_manifest(storage)
    summaries = {s.queue: s for s in manifest.shapes}
    shapes = {s.queue: ShapeFigures(label=f"{s.shape.height}x{s.shape.width}", queue=s.queue, total=s.items,
                                    requested=[(r.height, r.width, r.items) for r in s.requested],
                                    requested_sizes=s.requested_sizes)
              for s in manifest.shapes}
    writers = _writers(storage)
    batches: list[Batch] = []
    seen = ItemSet()
    sample: list[ImageRecord] = []
    flagged: list[ImageRecord] = []
    flagged_kinds: Counter = Counter()
    rng = random.Random(seed)
    by_adapter = ByAdapter()
    for new in first_records((records for _, records in read_records(storage, record_keys(storage))), seen):
        head = new[0]
        by_adapter.add(new)
        batches.append(Batch(batch_id=head.batch_id, finished_at=head.finished_at, generate_s=head.generate_s,
                             images=len(new), worker=head.worker, device=head.device, queue=head.queue,
                             started=head.generate_started_at, ended=head.generate_ended_at, steps=head.steps,
                             model=head.model, dtype=head.dtype,
                             writer=writers.get(head.batch_id)))
        if head.queue in shapes:
            shapes[head.queue].done += len(new)
            shapes[head.queue].speedups.add(head.speedup)
        for record in new:
            if record.degenerate:
                flagged_kinds[record.degenerate] += 1
                if len(flagged) < FLAGGED_SHOWN:
                    flagged.append(record)
        # Reservoir sampling: a uniform sample whatever the run size.
        for n, record in enumerate(new, start=len(seen) - len(new) + 1):
            if len(sample) < sample_size:
                sample.append(record)
            elif (j := rng.randrange(n)) < sample_size:
                sample[j] = record
    lives = _lives(batches)
    threshold = _classify(batches, lives)
    failures = list(read_failures(storage))
    failed_ids = failed_items(((f.batch_id, f.item_ids) for f in failures), lambda batch_id: seen)
    batches.sort(key=lambda b: b.finished_at)
    sample.sort(key=lambda r: r.id)
    return Report(out=storage.url, run_id=manifest.run_id, created_at=manifest.created_at, total=manifest.total,
                  done=len(seen), failed=len(failed_ids), shapes=list(shapes.values()), workers=lives,
                  batches=batches, failures=failures, sample=sample, price_per_device_hour=price_per_device_hour,
                  errors=Counter(f.error for f in failures), wait_threshold_s=threshold,
                  rates=_rates(batches, lives, summaries),
                  planned=_planned(storage, manifest.created_at, batches, lives, price_per_device_hour),
                  flagged=sorted(flagged, key=lambda r: r.id), flagged_kinds=flagged_kinds,
                  starts=_starts(storage), by_adapter=by_adapter,
                  adapter_sets=sets_from_summary(manifest, ProgressSummary(storage).refresh()))


# --- text ---------------------------------------------------------------------------


def render_text(report: Report) -> str:
    lines = [f"run {report.run_id}  ·  {report.out}",
             f"items      {report.done}/{report.total} done, {report.failed} failed, "
             f"{report.pending} pending",
             f"throughput {report.images_per_s:.2f} images/s over {report.wall_s:.1f} s",
             f"devices    {len(report.workers)} worker processes, {report.device_hours:.4f} device-hours"]
    if report.cost_per_1000 is not None:
        lines.append(f"cost       {report.cost_per_1000:.4f} per 1,000 images "
                     f"at {report.price_per_device_hour:g} per device-hour")
    lines += ["", "what happened"] + [f"  {line}" for line in report.story()]
    for b in report.lost:
        lines.append(f"  lost {b.batch_id} ({b.kind}, {b.images} images): waited {b.lost_wait_s or 0:.1f} s, "
                     f"done by {report.workers[b.life].label}")
    if report.planned:
        p = report.planned
        rows = p.rows()
        width = max(len(row[0]) for row in rows)
        lines += ["", f"planned vs actual ({p.figures.items} items the rates covered, "
                      f"{_count(p.devices, 'device')})"]
        lines += [f"  {name:<{width}}  planned {planned:>10}  actual {actual:>10}  {ratio}"
                  for name, planned, actual, ratio in rows]
        if p.figures.uncovered:
            lines.append("  not planned: " + ", ".join(f"{u.height}x{u.width} {u.steps} steps ({u.items} items)"
                                                         for u in p.figures.uncovered))
    lines += ["", "shapes"]
    for s in report.shapes:
        lines.append(f"  {s.label:>11}  {s.done:>7}/{s.total:<7} {s.queue}")
        if s.requested:  # size buckets: generated at s.label, asked for at these sizes
            lines.append(f"  {'':>11}  requested {s.requested_text()}")
        if s.speedups - {None}:
            lines.append(f"  {'':>11}  speed-up {s.speedups_text()}")
        if (graphs := report.by_adapter.graphs.get(s.queue)) and graphs.steady:
            lines.append(f"  {'':>11}  RECOMPILED {graphs.steady} graph(s) after a worker's first batch "
                         f"({graphs.compiled} compiled in all)")
    lines += report.by_adapter.lines()
    if report.adapter_sets is not None:
        lines += ["", *set_lines(report.adapter_sets)]
    lines += ["", "worker lives          progress writer      device   images  batches  img/s  compile_s  "
                  "generate_s  waiting_s  storing/idle_s"]
    lines += [f"  {w.label:<20} {w.process[:20]:<20} {w.device:<7} {w.images:>6} {w.batches:>8} "
              f"{w.images_per_s:>6.2f} {w.compile_s:>10.1f} {w.generate_s - w.compile_s:>11.1f} {w.waited_s:>10.1f} "
              f"{w.other_s:>15.1f}" + ("  stopped early" if w.stopped_early else "") for w in report.workers]
    if report.starts:
        lines += ["", f"time to first image ({report.start_summary()})", "  " + "  ".join(START_HEADER)]
        lines += ["  " + "  ".join(row) for row in report.start_rows()]
    lines += ["", "devices"]
    lines += [f"  {name:<10} {', '.join(d['dtypes'])}, {d['workers']} process(es), {d['images']} images, "
              f"{d['active_s'] / 3600:.4f} device-hours"
              for name, d in report.per_device().items()]
    if report.flagged_kinds:
        lines += ["", f"flagged images ({_flagged_summary(report)}): stored, a check found them degenerate"]
        lines += [f"  {r.id:<24} {r.degenerate:<9} {r.height}x{r.width}  {r.file_name}  {r.prompt[:60]!r}"
                  for r in report.flagged]
        if len(report.flagged) < sum(report.flagged_kinds.values()):
            lines.append(f"  … and {sum(report.flagged_kinds.values()) - len(report.flagged)} more")
    if report.failures:
        lines += ["", f"failures ({len(report.failures)} batches)"]
        lines += [f"  {count} × {error}" for error, count in report.errors.most_common(10)]
    return "\n".join(lines) + "\n"


def _flagged_summary(report: Report) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(report.flagged_kinds.items()))


# --- images -------------------------------------------------------------------------


def contact_sheet(storage: Storage, records: list[ImageRecord], *, thumb: int = 112, columns: int = 8,
                  gap: int = 8) -> bytes:
    """A PNG grid of `records`' images, each scaled into a thumb × thumb cell with its id
    below, `gap` pixels between cells (full-size neighbours never touch)."""
    from PIL import Image, ImageDraw

    label = 14
    rows = max(1, -(-len(records) // columns))
    sheet = Image.new("RGB", (columns * (thumb + gap) - gap, rows * (thumb + label + gap) - gap), "white")
    draw = ImageDraw.Draw(sheet)
    images = dict(storage.get_many(r.file_name for r in records))
    for n, record in enumerate(records):
        image = Image.open(io.BytesIO(images[record.file_name])).convert("RGB")
        image.thumbnail((thumb, thumb))
        x, y = (n % columns) * (thumb + gap), (n // columns) * (thumb + label + gap)
        sheet.paste(image, (x + (thumb - image.width) // 2, y + (thumb - image.height) // 2))
        text = record.id
        while text and draw.textlength(text, font_size=10) > thumb - 6:  # a label never runs into the next cell
            text = text[:-1]
        draw.text((x + 3, y + thumb), text, fill="black", font_size=10)
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def thumbnails(storage: Storage, records: list[ImageRecord], side: int = THUMB) -> list[tuple[ImageRecord, bytes]]:
    """Each record's image scaled to fit side × side (PNG): what the HTML contact sheet shows."""
    from PIL import Image

    images = dict(storage.get_many(r.file_name for r in records))
    out = []
    for record in records:
        image = Image.open(io.BytesIO(images[record.file_name])).convert("RGB")
        image.thumbnail((side, side))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append((record, buffer.getvalue()))
    return out


def _figure_png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()


def _legend_above(ax, ncol: int = 3) -> None:
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=ncol, fontsize=8, frameon=False)


def charts(report: Report) -> dict[str, bytes]:
    """Title → PNG: throughput over time, worker lives over time, time per life, progress per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out = {}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    x, y = report.throughput()
    ax.step(x, y, where="mid", color="#3465a4")
    ax.fill_between(x, y, step="mid", alpha=0.25, color="#3465a4")
    ax.set_xlabel("seconds since the first batch started")
    ax.set_ylabel("images/s")
    out["Images per second over time"] = _figure_png(fig)

    names = [w.label for w in report.workers]
    height = 1.0 + 0.45 * max(1, len(names))
    if report.batches:
        fig, ax = plt.subplots(figsize=(7, height))
        t0 = min(b.started for b in report.batches)
        each = len(report.batches) <= TIMELINE_BATCHES
        for row, w in enumerate(report.workers):
            if not each:
                ax.broken_barh([(w.start - t0, w.active_s)], (row - 0.3, 0.6), color="#4e9a06")
            if w.stopped_early:
                ax.plot([w.end - t0], [row], marker="x", color="#cc0000", markersize=9)
        colours = {"": "#4e9a06", "halved": "#c4a000", "retried": "#c4a000", "waited": "#75507b"}
        for b in report.batches:
            if each or b.kind in LOST_KINDS:
                ax.broken_barh([(b.started - t0, max(b.ended - b.started, 1e-3))], (b.life - 0.3, 0.6),
                               color=colours.get(b.kind, "#f57900"))
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.7, len(names) - 0.3)
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first batch started")
        handles = [Patch(color="#4e9a06", label="batch"), Patch(color="#f57900", label="lost batch done again"),
                   Line2D([], [], marker="x", color="#cc0000", linestyle="", label="stopped early")]
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, fontsize=8, frameon=False)
        out["Worker lives over time"] = _figure_png(fig)

    fig, ax = plt.subplots(figsize=(7, height))
    parts = [("compile (est.)", [w.compile_s for w in report.workers], "#cc0000"),
             ("generate", [w.generate_s - w.compile_s for w in report.workers], "#4e9a06"),
             ("waiting (lost / late batches)", [w.waited_s for w in report.workers], "#f57900"),
             ("storing / idle", [w.other_s for w in report.workers], "#babdb6")]
    left = [0.0] * len(names)
    for title, values, color in parts:
        ax.barh(names, values, left=left, label=title, color=color)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    _legend_above(ax, ncol=2)
    out["Time per worker life"] = _figure_png(fig)

    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.45 * max(1, len(report.shapes))))
    labels = [s.label for s in report.shapes]
    ax.barh(labels, [s.total for s in report.shapes], color="#d3d7cf", label="total")
    ax.barh(labels, [s.done for s in report.shapes], color="#3465a4", label="done")
    ax.set_xlabel("images")
    _legend_above(ax)
    out["Images per shape"] = _figure_png(fig)
    return out


# --- HTML ---------------------------------------------------------------------------


def _table(header: list[str] | None, rows: list[list]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _data_url(png: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="{_data_url(png)}">'


def sheet_html(thumbs: list[tuple[ImageRecord, bytes]]) -> str:
    """A contact sheet as a grid of fixed cells: an image of any size or aspect is scaled
    into its cell, and its caption is cut to the cell's width, so nothing overlaps."""
    cells = []
    for record, png in thumbs:
        caption = f"{record.id} · {record.height}x{record.width}"  # HxW, as shapes are named
        cells.append(f'<figure title="{html.escape(record.prompt[:300])}"><div class="cell">'
                     f'<img alt="{html.escape(record.id)}" src="{_data_url(png)}"></div>'
                     f'<figcaption>{html.escape(caption)}</figcaption></figure>')
    return f'<div class="sheet">{"".join(cells)}</div>'


STYLE = f"""
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 980px; padding: 0 12px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 24px; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; font-size: 13px; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }} .wide {{ overflow-x: auto; }}
.story li {{ margin: 2px 0; }} .stopped {{ color: #a40000; }}
.sheet {{ display: grid; grid-template-columns: repeat(auto-fill, {THUMB}px); gap: 10px; }}
.sheet figure {{ margin: 0; width: {THUMB}px; min-width: 0; }}
.sheet .cell {{ width: {THUMB}px; height: {THUMB}px; display: flex; align-items: center; justify-content: center;
  background: #f3f3f3; overflow: hidden; }}
.sheet .cell img {{ max-width: {THUMB}px; max-height: {THUMB}px; width: auto; height: auto; display: block; }}
.sheet figcaption {{ font-size: 11px; color: #555; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
"""


def render_html(report: Report, thumbs: list[tuple[ImageRecord, bytes]] | None = None,
                flagged_thumbs: list[tuple[ImageRecord, bytes]] | None = None) -> str:
    """One self-contained page: figures, tables, and the plots and contact sheet as data URLs."""
    cost = (f"{report.cost_per_1000:.4f} per 1,000 images at {report.price_per_device_hour:g} per device-hour"
            if report.cost_per_1000 is not None else "pass --price-per-device-hour")
    summary = _table(None, [
        ["items", f"{report.done} / {report.total} done, {report.failed} failed, "
                  f"{report.pending} pending"],
        ["throughput", f"{report.images_per_s:.2f} images/s over {report.wall_s:.1f} s"],
        ["device-hours", f"{report.device_hours:.4f} ({len(report.workers)} worker processes)"],
        ["cost", cost]])
    story = "<ul class=story>" + "".join(f"<li>{html.escape(line)}</li>" for line in report.story()) + "</ul>"
    label = {s.queue: s.label for s in report.shapes}
    lost = (_table(["batch", "kind", "shape", "images", "waited s", "done by"],
                   [[b.batch_id, b.kind, label.get(b.queue, b.queue), b.images, f"{b.lost_wait_s or 0:.1f}",
                     report.workers[b.life].label] for b in report.lost[:200]]) if report.lost else "")
    t0 = min((b.started for b in report.batches), default=0.0)
    lives = _table(["worker", "progress writer", "device", "from s", "to s", "images", "batches", "images/s",
                    "compile s (est.)", "generate s", "waiting s", "storing / idle s", "ended"],
                   [[w.label, w.process, w.device, f"{w.start - t0:.1f}", f"{w.end - t0:.1f}", w.images, w.batches,
                     f"{w.images_per_s:.2f}", f"{w.compile_s:.1f}", f"{w.generate_s - w.compile_s:.1f}",
                     f"{w.waited_s:.1f}", f"{w.other_s:.1f}", "stopped early" if w.stopped_early else "with the run"]
                    for w in report.workers])
    starts = (f"<p>{html.escape(report.start_summary())}.</p><div class=wide>"
              + _table(START_HEADER, report.start_rows()) + "</div>") if report.starts else "<p>no worker life recorded its start</p>"
    devices = _table(["device", "dtype", "processes", "images", "device-hours"],
                     [[name, ", ".join(d["dtypes"]), d["workers"], d["images"], f"{d['active_s'] / 3600:.4f}"]
                      for name, d in report.per_device().items()])
    shapes = _table(["shape", "done", "total", "queue", "requested sizes (items)", "speed-up"],
                    [[s.label, s.done, s.total, s.queue, s.requested_text() or "as generated",
                      s.speedups_text() or "–"] for s in report.shapes])
    failures = (_table(["batch", "items", "attempts", "worker", "error"],
                       [[f.batch_id, len(f.item_ids), f.attempts, f.worker, f.error[:200]]
                        for f in report.failures[:50]]) if report.failures else "<p>none</p>")
    by_adapter = ""
    if report.by_adapter.with_adapters:
        by_adapter = "<h2>Adapters</h2><div class=wide>" + _table(
            report.by_adapter.HEADERS, report.by_adapter.cells()) + "</div>"
    if report.adapter_sets is not None:
        by_adapter += ("<h2>Adapter sets</h2><div class=wide>" + _table(SET_HEADERS, set_cells(report.adapter_sets))
                       + "</div>")
    if recompiled := [(label.get(q, q), g) for q, g in sorted(report.by_adapter.graphs.items()) if g.steady]:
        by_adapter += "<h2>Recompiles after a worker's first batch</h2>" + _table(
            ["shape", "graphs after the first batch", "graphs in all"],
            [[shape, g.steady, g.compiled] for shape, g in recompiled])
    planned = ""
    if report.planned:
        p = report.planned
        planned = (f"<h2>Planned vs actual</h2><p>{p.figures.items} items the rates covered, on {p.devices} devices"
                   f"{', warm compile cache' if p.figures.warm_cache else ''}.</p>"
                   + _table(["", "planned", "actual", "actual / planned"], p.rows()))
    plots = "".join(f"<h2>{html.escape(title)}</h2>{_img(png, title)}" for title, png in charts(report).items())
    sheet = f"<h2>Sample ({len(thumbs)} images)</h2>{sheet_html(thumbs)}" if thumbs else ""
    flagged = "<p>none</p>"
    if report.flagged_kinds:
        shown = len(report.flagged)
        more = sum(report.flagged_kinds.values()) - shown
        flagged = (f"<p>{html.escape(_flagged_summary(report))}: stored, a check found them degenerate"
                   + (f"; {shown} of them shown" if more else "") + ".</p><div class=wide>"
                   + _table(["item", "check", "shape", "batch", "file", "prompt"],
                            [[r.id, r.degenerate, f"{r.height}x{r.width}", r.batch_id, r.file_name, r.prompt[:120]]
                             for r in report.flagged]) + "</div>"
                   + (sheet_html(flagged_thumbs) if flagged_thumbs else ""))
    title = html.escape(f"diffq run {report.run_id}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head><body>
<h1>{title}</h1><p><code>{html.escape(report.out)}</code></p>
{summary}
<h2>What happened</h2>{story}{lost}
{planned}
<h2>Shapes</h2><div class=wide>{shapes}</div>
{by_adapter}
<h2>Worker lives</h2><div class=wide>{lives}</div>
<h2>Time to first image</h2>{starts}
<h2>Devices</h2>{devices}
<h2>Failures</h2><div class=wide>{failures}</div>
<h2>Flagged images</h2>{flagged}
{plots}
{sheet}
</body></html>
"""


def report(out: str, *, html_path: str | Path | None = None, contact_sheet_path: str | Path | None = None,
           price_per_device_hour: float | None = None, sample_size: int = 24) -> Report:
    """Build the report; write the HTML page and/or the contact sheet PNG when given paths."""
    result = build_report(out, price_per_device_hour=price_per_device_hour, sample_size=sample_size)
    if contact_sheet_path and result.sample:
        Path(contact_sheet_path).write_bytes(contact_sheet(open_storage(out), result.sample))
    if html_path:
        storage = open_storage(out)
        thumbs = thumbnails(storage, result.sample) if result.sample else None
        flagged = thumbnails(storage, result.flagged) if result.flagged else None
        Path(html_path).write_text(render_html(result, thumbs, flagged))
    return result


def to_json(report: Report) -> dict:
    """The headline figures, for scripts; `rates` is what `diffq plan --rates` reads."""
    t0 = min((b.started for b in report.batches), default=0.0)
    return {"run_id": report.run_id, "total": report.total, "done": report.done, "failed": report.failed,
            "images_per_s": report.images_per_s, "wall_s": report.wall_s, "device_hours": report.device_hours,
            "cost_per_1000": report.cost_per_1000,
            "workers": [{"worker": w.worker, "life": w.life, "process": w.process, "writer": w.writer,
                         "device": w.device, "images": w.images, "batches": w.batches, "compile_s": w.compile_s,
                         "generate_s": w.generate_s, "waited_s": w.waited_s, "active_s": w.active_s,
                         "start_s": w.start - t0, "end_s": w.end - t0, "stopped_early": w.stopped_early}
                        for w in report.workers],
            "lost": [{"batch_id": b.batch_id, "kind": b.kind, "queue": b.queue, "images": b.images,
                      "waited_s": b.lost_wait_s, "done_by": report.workers[b.life].label} for b in report.lost],
            "waits": [{"batch_id": b.batch_id, "waited_s": b.wait_s} for b in report.waits],
            "wait_threshold_s": report.wait_threshold_s,
            "retries": report.retries,
            "shapes": [{"shape": s.label, "queue": s.queue, "done": s.done, "total": s.total,
                        "requested": [{"height": h, "width": w, "items": n} for h, w, n in s.requested]}
                       for s in report.shapes],
            "rates": report.rates,
            "planned": report.planned.to_json() if report.planned else None,
            "failures": dict(report.errors),
            "flagged": {"kinds": dict(report.flagged_kinds), "items": [r.id for r in report.flagged]},
            **report.by_adapter.to_json(),
            "adapter_sets": [row.to_json() for row in report.adapter_sets] if report.adapter_sets is not None else None,
            "starts": {"median_time_to_first_image_s": report.median_time_to_first_image_s,
                       "device_seconds_starting": report.device_seconds_starting,
                       "lives": [s.model_dump(mode="json") for s in report.starts]}}


__all__ = ["Report", "build_report", "charts", "contact_sheet", "render_html", "render_text", "report",
           "sheet_html", "thumbnails", "to_json"]
