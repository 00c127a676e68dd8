"""How fast can a device be before diffq's host side becomes the bottleneck?

A simulated device (bench/standin.py: waits T seconds per image without holding the
GIL, returns realistic H×W images) is driven by a real `diffq run` (embedded
broker, supervisor, Celery worker, batch task, sink helper: encode + store + record
+ credit, then the ack). One run per (size, format, batch, target) sweeps T from
slow to fast, segment by segment (each batch's prompts say its T). Per T:

- busy: time inside the pipeline calls (generate_s) / (that + the idle time between
  them: everything else the worker does, preparing a call included), from the batch
  records (generate_s, generate_ended_at), less what the sink's growing backlog will
  take back: a device faster than the sink stays fed for as long as the buffer
  between them (the stores in flight, a finished batch in each task thread) takes to
  fill, so a window of a few batches would show it fed. Busy is scaled by stored /
  generated over the window (stored: generated less the backlog's growth, from the
  records' finished_at);
- gap: the median idle gap between one call's end and the next call's start;
- knee: the T where busy falls below 0.97 (interpolated between grid points; the grid
  is refined around the host limit measured before the run, `NEAR_HOST`), read on
  busy's monotone fit: a limit never feeds a faster device better than a slower one,
  so a dip in one window is the machine's, not the limit (`monotone`; each pass's
  first crossing of the points as measured is kept beside it);
- host limit: what the host must do for each image the device hands back, in a bare
  loop (no queue, no record, no process boundary), one thread per core given to the
  run: the 8-bit array as an image, encoded with diffq's encoder settings and
  provenance (the same bytes diffq stores), stored.

`--cores N` gives the sink (and the bare loop) N cores of their own and the device loop
(runner, the worker's main thread, Celery) the others, as on an accelerator host; where
the machine has no core beyond N, everything shares N cores. The default, 1, is "one
spare core" (the stand-in itself needs none).

    python -m bench.device [--quick] [--json] [--cores 1] [--sizes 1024,512] [--batches 4,8]
                           [--formats png,jpeg,webp] [--targets local,s3] [--plot PATH]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

from bench.common import s3_bucket
from bench.standin import device_child_main, image_pool, write_standin

# Seconds per image, slow to fast; denser where the 1024² PNG and 512² knees fall.
GRID = (0.4, 0.2, 0.14, 0.1, 0.08, 0.065, 0.05, 0.035, 0.025, 0.015, 0.01, 0.0065, 0.005, 0.004, 0.003, 0.002,
        0.0015, 0.0012, 0.001, 0.0008)
BUSY_GOAL = 0.97
MEASURE_S = 2.0  # device seconds measured per T at least (more batches when T is small)
MIN_MEASURED, MAX_MEASURED = 2, 10  # batches per T
# Near the host limit (NEAR_HOST), where the knee is read: longer windows, of device
# seconds rather than batches. A cap of 16 batches made a 512² JPEG window 0.17 s, in
# which one 5 ms hiccup of the machine read as 3 % of the device lost: jitter, not the
# steady rate the knee stands for.
# And at least MIN_MEASURED_NEAR batches: at 1024² PNG or WebP 6 s are six batches, in
# which one slow store read as 8 % of the device lost and busy went up and down from
# one point to the next.
MEASURE_NEAR_S, MIN_MEASURED_NEAR, MAX_MEASURED_NEAR = 6.0, 16, 256
WARM = 2  # batches per T left out: the sink settles after a change of T
# Grid points added at these multiples of the host limit measured before the run:
# where busy falls, so the knee is read off points, not a line across a wide gap.
NEAR_HOST = (1.5, 1.25, 1.15, 1.1, 1.05, 1.0, 0.9)


def refined(grid: tuple[float, ...], host_s: float) -> tuple[float, ...]:
    """The grid with points near the host limit, slow to fast (five decimals: the
    prompts carry T so)."""
    near = {round(host_s * factor, 5) for factor in NEAR_HOST}
    return tuple(sorted({round(seconds, 5) for seconds in grid} | near, reverse=True))


def segments(grid: tuple[float, ...], batch: int, host_s: float = 0.0) -> list[tuple[float, int]]:
    """(T, batches) per segment, enough for MEASURE_S of wall time where the device
    (T) or the host (`host_s`, the bare loop's time per image) sets the pace; the
    first segment gets one more warm batch (worker start, image pool)."""
    plan = []
    near = (min(NEAR_HOST) * host_s, max(NEAR_HOST) * host_s)
    for index, seconds in enumerate(grid):
        period = max(seconds, host_s) * batch
        measure_s, least, most = ((MEASURE_NEAR_S, MIN_MEASURED_NEAR, MAX_MEASURED_NEAR)
                                  if near[0] <= seconds <= near[1] else (MEASURE_S, MIN_MEASURED, MAX_MEASURED))
        measured = min(most, max(least, math.ceil(measure_s / period)))
        plan.append((seconds, measured + WARM + (1 if index == 0 else 0)))
    return plan


def write_prompts(path: Path, plan: list[tuple[float, int]], batch: int) -> Path:
    with path.open("w") as f:
        for segment, (seconds, batches) in enumerate(plan):
            for i in range(batches * batch):
                f.write(json.dumps({"id": f"s{segment:02d}-{i:04d}", "prompt": f"bench device_s={seconds:.5f} {i}"})
                        + "\n")
    return path


def analyse(records: list, plan: list[tuple[float, int]], cpu: CpuSampler | None = None) -> list[dict]:
    """Busy fraction, idle gaps and host CPU per image for each T, from one run's records."""
    from bench.standin import device_seconds

    calls: dict[str, list] = {}
    stores = [(record.generate_ended_at, record.finished_at, record.store_s) for record in records]

    def backlog(moment: float) -> float:
        """Images generated by `moment` and not yet stored; the batch the sink is on
        counts for the part of its store still to do (a whole batch at a time would
        quantise a window of a few batches)."""
        left = 0.0
        for generated, stored, store_s in stores:
            if generated <= moment < stored:
                left += 1.0 if store_s <= 0 else min(1.0, (stored - moment) / store_s)
        return left

    for record in records:
        # The device is busy inside the pipeline call only (generate_s); the host's own
        # preparation of a call (seeds, arguments) counts as idle, like the gap.
        call = calls.setdefault(record.batch_id, [record.generate_started_at, record.generate_ended_at,
                                                   device_seconds(record.prompt), 0, record.generate_s])
        call[3] += 1  # images
    ordered = sorted(calls.values())
    rows = []
    for index, (seconds, batches) in enumerate(plan):
        positions = [n for n, call in enumerate(ordered) if call[2] == round(seconds, 5)]
        skip = WARM + (1 if index == 0 else 0)
        measured = [n for n in positions[skip:] if n > 0]
        busy_s = sum(ordered[n][4] for n in measured)
        # Previous call's end to this call's end, less the time inside the call.
        gaps = [max(0.0, ordered[n][1] - ordered[n - 1][1] - ordered[n][4]) for n in measured]
        window = (ordered[measured[0] - 1][1], ordered[measured[-1]][1])  # previous call's end → last end
        images = sum(ordered[n][3] for n in measured)
        stored = images - max(0.0, backlog(window[1]) - backlog(window[0]))
        cpu_window = cpu.between(*window) if cpu is not None else None
        cpu_s = cpu_window / images if cpu_window is not None else None
        device_busy = busy_s / (busy_s + sum(gaps))
        rows.append({"device_s": seconds, "batches": len(measured), "busy": device_busy * min(1.0, stored / images),
                     "device_busy": device_busy, "backlog_growth": round(images - stored, 1),
                     "cpu_s_per_image": cpu_s,
                     "gap_ms": 1000 * statistics.median(gaps), "gaps_ms": [round(1000 * g, 1) for g in gaps],
                     "call_s": busy_s / len(measured), "at": (window[0] + window[1]) / 2})
    return rows


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants (Linux /proc), with
    what their exited children spent (cutime, cstime: a helper that ended and was reaped
    mid-window still counts, or the window's CPU would shrink)."""
    parents, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(value) for value in fields[11:15]) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack += children.get(pid, [])
    return total


class CpuSampler:
    """CPU seconds of this process tree over wall-clock time, sampled in a thread, so
    a window of the run (one T) gets the CPU diffq's host side spent in it: unlike wall
    time, that does not grow when other work shares the cores."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)

    def _run(self) -> None:
        def sample() -> None:
            # Less this thread's own CPU: scanning /proc is the sampler's, not diffq's.
            self.samples.append((time.time(), tree_cpu_seconds(os.getpid()) - time.thread_time()))

        sample()
        while not self._stop.wait(self.interval):
            sample()
        sample()  # at the run's end too, or its last window (shorter than an interval) has no reading

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float | None:
        times = [t for t, _ in self.samples]
        values = [v for _, v in self.samples]

        def at(moment: float) -> float:
            index = bisect.bisect_left(times, moment)
            if index == 0:
                return values[0]
            if index >= len(times):
                return values[-1]
            (t0, v0), (t1, v1) = self.samples[index - 1], self.samples[index]
            return v0 + (v1 - v0) * (moment - t0) / (t1 - t0)

        if not times or end > times[-1]:
            return None  # past the last sample: the run ended inside this window, its CPU unread
        return at(end) - at(start)


def host_at(run: dict, moment: float) -> float:
    """The bare loop's seconds per image at `moment` of a run, between its measures
    before and after the run (linear): on these shared cores it drifts by up to a third
    over one run, and a knee read mid-run is that moment's, not the faster end's."""
    before, after = run["host_limit_before_after"]
    if "host_limit_at" not in run:  # a document from before the time stamps
        return min(before, after)
    start, end = run["host_limit_at"]
    share = min(1.0, max(0.0, (moment - start) / (end - start))) if end > start else 0.0
    return before + (after - before) * share


def knee_moment(run: dict, seconds: float) -> float:
    """When a run measured the grid point nearest `seconds`."""
    return min(run["window_at"], key=lambda point: abs(point[0] - seconds))[1]


def monotone(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The closest curve (least squares) on which busy never rises from slow to fast
    (pool-adjacent-violators). A host limit can only feed a faster device as well as a
    slower one or worse; a window the machine stalled in (one store slow, a neighbour
    process busy) is a dip no limit makes, and here it is pooled with its neighbours
    instead of read as where the limit starts."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run of grid points
    for _, fraction in busy:
        blocks.append([fraction, 1])
        while len(blocks) > 1 and blocks[-1][0] / blocks[-1][1] > blocks[-2][0] / blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return [(seconds, fraction) for (seconds, _), fraction in zip(busy, fitted)]


def knee(busy: list[tuple[float, float]], fit: bool = True) -> float | None:
    """Where busy first falls below the goal going from slow to fast, interpolated, on
    its monotone fit (`fit`; the points as measured otherwise); None when it never does
    on the grid."""
    if fit:
        busy = monotone(busy)
    for (slow, busy_slow), (fast, busy_fast) in zip(busy, busy[1:]):
        if busy_fast < BUSY_GOAL <= busy_slow:
            return fast + (slow - fast) * (BUSY_GOAL - busy_fast) / (busy_slow - busy_fast)
    if busy and busy[0][1] < BUSY_GOAL:
        return busy[0][0]
    return None


def host_limit(height: int, width: int, fmt: str, out: str, cores: int, seconds: float = 1.5) -> dict:
    """Seconds per image of what the host must do with each image the device hands
    back, alone: the 8-bit array as an image, encoded with diffq's encoder settings and
    provenance text (the bytes diffq stores), stored with diffq's storage client; a bare
    loop over the stand-in's images on `cores` threads."""
    import numpy as np

    from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
    from diffq.core.layout import IMAGE_FORMATS
    from diffq.core.storage import open_storage
    from diffq.worker.sink.store import _yield_to_generation, as_image, encode, provenance

    storage = open_storage(out)
    pool = [np.asarray(image) for image in image_pool(height, width)]  # as the host receives them
    message = BatchMessage(run_id="host", out=out, batch_id="host", params=BatchParams(num_inference_steps=1, guidance_scale=1.0, format=fmt),
                           shape=ShapeKey(model="standin", height=height, width=width, batch_size=1,
                                          max_sequence_length=64, cfg=False),
                           items=[BatchItem(id="host", prompt="bench device_s=0.00100 0", seed=0)])

    def one(n: int) -> int:
        image = as_image(pool[n % len(pool)])
        data = encode(image, fmt, provenance(message, message.items[0], image.size))
        storage.put_bytes(f"host/{n:06d}.{fmt}", data, content_type=IMAGE_FORMATS[fmt].content_type,
                          if_absent=True)
        return len(data)

    # At the sink's priority: where other work shares the cores, both get the same share.
    with ThreadPoolExecutor(max_workers=cores, initializer=_yield_to_generation) as threads:
        list(threads.map(one, range(cores)))  # warm: encoder tables, the storage client's connection
        done, sizes, started, cpu_started = cores, [], time.perf_counter(), time.process_time()
        while len(sizes) < 2 * len(pool) or time.perf_counter() - started < seconds:
            sizes += list(threads.map(one, range(done, done + 2 * cores)))
            done += 2 * cores
        cpu_s = time.process_time() - cpu_started
    return {"s_per_image": (time.perf_counter() - started) / len(sizes), "cpu_s_per_image": cpu_s / len(sizes),
            "bytes_per_image": int(statistics.mean(sizes))}


def layout(cores: int) -> dict:
    """Where a row runs. With a core to spare beyond `cores`: the device loop (runner,
    worker's main thread, Celery) on the rest and the sink on `cores` cores of its own
    (DIFFQ_SINK_CPUS), as on an accelerator host, where the process driving a device
    has its core and the sink the cores the host has left ("split"). Otherwise
    everything shares `cores` cores ("shared")."""
    available = sorted(os.sched_getaffinity(0))
    if cores > len(available):
        raise SystemExit(f"--cores {cores}: this machine lets us use {len(available)}")
    if cores < len(available):
        return {"layout": "split", "sink_cpus": available[-cores:], "device_cpus": available[:-cores]}
    return {"layout": "shared", "sink_cpus": available, "device_cpus": available}


@contextlib.contextmanager
def pinned(place: dict) -> Iterator[dict]:
    """This thread and what it starts on the device loop's cores; the sink's threads
    (and the bare loop's, which take the sink's placement) on the sink's."""
    original = os.sched_getaffinity(0)
    saved = os.environ.get("DIFFQ_SINK_CPUS")
    os.sched_setaffinity(0, place["device_cpus"])
    os.environ["DIFFQ_SINK_CPUS"] = ",".join(str(cpu) for cpu in place["sink_cpus"])
    try:
        yield place
    finally:
        os.sched_setaffinity(0, original)
        if saved is None:
            os.environ.pop("DIFFQ_SINK_CPUS", None)
        else:
            os.environ["DIFFQ_SINK_CPUS"] = saved


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Children inherit fd 1: keep their chatter out of a --json document."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def timed(measure, *args) -> dict:
    """`measure(*args)` with the middle of its wall time (`at`, epoch seconds, as the records')."""
    started = time.time()
    result = measure(*args)
    return {**result, "at": (started + time.time()) / 2}


def sweep(model: str, workdir: Path, out_base: str, *, height: int, width: int, fmt: str, batch: int,
          target: str, cores: int, grid: tuple[float, ...], refine: bool = True) -> dict:
    """One `diffq run` over the whole grid (`refine`: with points near the host limit
    measured first), with the bare loop before and after it."""
    from diffq.app.runner import run
    from diffq.core.runfolder import iter_records
    from diffq.core.storage import open_storage
    from diffq.worker.process import supervisor

    name = f"{height}x{width}-{fmt}-b{batch}-{target}-c{cores}"
    out = f"{out_base}/{name}-{time.time_ns()}"
    with pinned(layout(cores)), mock.patch.object(supervisor, "child_main", device_child_main):
        # Before and after the run: shared cores drift over minutes.
        limits = [timed(host_limit, height, width, fmt, f"{out}-host0", cores)]
        if refine:
            grid = refined(grid, limits[0]["s_per_image"])
        plan = segments(grid, batch, limits[0]["s_per_image"])
        prompts = write_prompts(workdir / f"{name}.jsonl", plan, batch)
        started = time.perf_counter()
        with CpuSampler() as cpu:
            result = run(prompts, out, model=model, workers=1, progress=False, batch_size=batch, steps=1,
                         height=height, width=width, format=fmt)
        wall = time.perf_counter() - started
        limits.append(timed(host_limit, height, width, fmt, f"{out}-host1", cores))
    if not result.ok:
        raise RuntimeError(f"{name}: {result}")
    records = list(iter_records(open_storage(out)))
    rows = analyse(records, plan, cpu)
    return {
        "busy": [[row["device_s"], round(row["busy"], 4)] for row in rows],
        # The device's own view (no backlog correction), and images generated but not
        # stored by the window's end, beyond those at its start.
        "device_busy": [[row["device_s"], round(row["device_busy"], 4)] for row in rows],
        "backlog_growth": [[row["device_s"], row["backlog_growth"]] for row in rows],
        "gap_ms": [[row["device_s"], round(row["gap_ms"], 2)] for row in rows],
        "gaps_ms": [[row["device_s"], row["gaps_ms"]] for row in rows],
        "host_limit_before_after": [round(limit["s_per_image"], 5) for limit in limits],
        "host_limit_at": [round(limit["at"], 3) for limit in limits],  # the middle of each measure
        "window_at": [[row["device_s"], round(row["at"], 3)] for row in rows],
        # CPU seconds per image: the bare loop's, and the whole run's (runner, worker,
        # sink helper) per T; their ratio is diffq's host overhead, whatever the load.
        "host_cpu_s_per_image": round(min(limit["cpu_s_per_image"] for limit in limits), 5),
        "run_cpu_s_per_image": [[row["device_s"], round(row["cpu_s_per_image"], 5)] for row in rows
                                if row["cpu_s_per_image"] is not None],
        "bytes_per_image": limits[0]["bytes_per_image"],
        # The sink's own encode + store time per image in the run (records' store_s).
        "sink_store_s_per_image": round(statistics.median(r.store_s for r in records) / batch, 5),
        "load_average": round(os.getloadavg()[0], 2),
        "images": result.total, "images_stored": len(records), "run_s": round(wall, 1), "grid": list(grid),
    }


def summarise(config: dict, repeats: list[dict]) -> dict:
    """The best of the repeats: on shared cores other work only ever adds time, to
    the run (gaps) and to the bare loop alike."""
    grid = [seconds for seconds, _ in repeats[0]["busy"]]
    busy = [(seconds, max(r["busy"][n][1] for r in repeats)) for n, seconds in enumerate(grid)]
    found = knee(busy)
    host_cpu = min(r["host_cpu_s_per_image"] for r in repeats)
    # Where the host sets the pace (T below the bare loop's time), per image: the
    # slower T also carry the run's fixed per-second costs (polls, timers).
    # A window shorter than the sampler's interval has no CPU reading (None when none has).
    run_cpu = min((statistics.median([v for t, v in r["run_cpu_s_per_image"] if t < host_cpu]
                                     or [r["run_cpu_s_per_image"][-1][1]])
                   for r in repeats if r["run_cpu_s_per_image"]), default=None)
    # Each pass on its own, against its own bare loop where it read the knee: "steady" is
    # every pass at 1.10 × or below.
    passes = []
    for r in repeats:
        def host_where(seconds: float | None) -> float:
            """The bare loop's time per image when the pass measured `seconds`."""
            return (host_at(r, knee_moment(r, seconds)) if seconds is not None and "window_at" in r
                    else min(r["host_limit_before_after"]))

        own_knee = knee([tuple(point) for point in r["busy"]])
        own_host = host_where(own_knee)
        # Beside it, the first crossing of the points as measured (before the fit).
        crossing = knee([tuple(point) for point in r["busy"]], fit=False)
        crossing_host = host_where(crossing)
        passes.append({"host_limit_s_per_image": round(own_host, 5), "knee_s_per_image": own_knee,
                       "knee_over_host": round(own_knee / own_host, 3) if own_knee is not None else None,
                       "first_crossing_over_host": (round(crossing / crossing_host, 3) if crossing is not None
                                                    else None)})
    host = statistics.median(p["host_limit_s_per_image"] for p in passes)
    goal_busy = all(fraction >= BUSY_GOAL for seconds, fraction in busy if seconds >= 1.1 * host)
    # The goal is one-sided (knee ≤ 1.10 × host): a device fed below the bare
    # loop's time per image is the sink outrunning it, not a miss.
    goal_knee = found / host <= 1.1 if found is not None else host <= 1.1 * min(grid)
    every_pass = all(p["knee_over_host"] is not None and p["knee_over_host"] <= 1.1 for p in passes)
    return {
        **config,
        "host_limit_s_per_image": round(host, 5),
        "knee_s_per_image": round(found, 5) if found is not None else None,
        "passes": passes,
        "busy": [[seconds, fraction] for seconds, fraction in busy],
        "gap_ms": [[seconds, min(r["gap_ms"][n][1] for r in repeats)] for n, seconds in enumerate(grid)],
        "bytes_per_image": repeats[0]["bytes_per_image"],
        "sink_store_s_per_image": min(r["sink_store_s_per_image"] for r in repeats),
        "host_cpu_s_per_image": host_cpu,
        "run_cpu_s_per_image": run_cpu,
        "images": sum(r["images"] for r in repeats), "images_stored": sum(r["images_stored"] for r in repeats),
        "goal": {"busy_while_device_bound": goal_busy, "knee_within_10pct_of_host_limit": goal_knee,
                 "every_pass_within_10pct": every_pass,
                 # Where other work shares the cores the wall-clock knee moves with it; the CPU
                 # the run spends per image, over the bare loop's, does not.
                 "run_cpu_within_10pct_of_bare_loop": run_cpu <= 1.1 * host_cpu},
        "repeats": [{k: v for k, v in r.items() if k != "gaps_ms"} for r in repeats],
    }


def encode_settings(height: int = 1024, width: int = 1024, images: int = 8) -> list[dict]:
    """What each encoder setting costs a core: CPU ms and bytes per image of the
    stand-in's images (the knee on one core follows the encode time). diffq's own
    settings come from its format table (diffq/core/layout.py); the others are for
    comparison."""
    import io

    from diffq.core.layout import IMAGE_FORMATS

    def diffq(fmt: str) -> tuple[str, str, dict]:
        options = IMAGE_FORMATS[fmt].options
        return fmt, ", ".join(f"{k}={v}" for k, v in options.items()) + " (diffq)", options

    pool = image_pool(height, width)[:images]
    settings = [("png", "compress_level=0", {"compress_level": 0}), diffq("png"),
                ("png", "compress_level=6 (PIL default)", {"compress_level": 6}), diffq("jpeg"), diffq("webp"),
                ("webp", "quality=90, method=0", {"quality": 90, "method": 0})]
    rows = []
    for fmt, label, options in settings:
        sizes, started = [], time.thread_time()  # CPU time: other work on the core does not add to it
        for image in pool:
            buffer = io.BytesIO()
            image.save(buffer, format=IMAGE_FORMATS[fmt].pil, **options)
            sizes.append(buffer.tell())
        rows.append({"format": fmt, "setting": label, "size": f"{height}x{width}",
                     "cpu_ms_per_image": round(1000 * (time.thread_time() - started) / len(pool), 1),
                     "kb_per_image": round(statistics.mean(sizes) / 1024)})
    return rows


def per_pass(figures: dict) -> str:
    """A pass's knee / host, and its first crossing as measured where that differs."""
    def ratio(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}"

    fitted, crossing = figures["knee_over_host"], figures.get("first_crossing_over_host", figures["knee_over_host"])
    return ratio(fitted) + (f" ({ratio(crossing)})" if ratio(crossing) != ratio(fitted) else "")


def render(documents: dict[str, dict]) -> list[str]:
    """The docs/BENCHMARKS.md section (bench/__main__.py): every sweep of `documents`
    (name → this module's JSON output)."""
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{1000 * value:.1f}"

    sweeps = [row for document in documents.values() for row in document.get("sweeps", [])]
    loads = [r["load_average"] for row in sweeps for r in row.get("repeats", []) if "load_average" in r]
    lines = [
        "## Keeping a fast device fed (simulated device)", "",
        "How fast can a device be before diffq's host side (encode, store, record, credit, ack) is the",
        "bottleneck? A stand-in pipeline (bench/standin.py; bench only, not a backend) waits T per image",
        "in `time.sleep` — the GIL stays free, as while a kernel runs — and hands back the batch as an",
        "accelerator does for `output_type=\"pt\"`, already 8-bit, photo-like (structure, hard edges,",
        "regional texture, grain; the KB column shows what they weigh). A real `diffq run` drives it",
        "(embedded broker, supervisor, Celery worker, batch task, sink helper, deferred acks); one run",
        "per row sweeps T from 400 ms to 0.8 ms per image, with points added at 0.9–1.5× the host limit",
        "measured just before the run, each measured over 6 s of device time and 16 batches at least.", "",
        "- **busy**: time inside the pipeline calls / (that + everything else between them, the",
        "  worker's preparation of each call included), from the batch records, scaled by stored /",
        "  generated over the window: a device faster than the sink stays fed until the buffer between",
        "  them (two stores in flight, a finished batch in each task thread) is full, so a window of a",
        "  few batches would show it fed; the sink's backlog growing over the window (records'",
        "  `finished_at`, `store_s`) takes that back. The **knee** is where busy falls below 0.97",
        "  (interpolated between grid points).",
        "- **layout** `split`: as on an accelerator host, the device loop (runner, the worker's main",
        "  thread and Celery) has a core of its own and the sink (`DIFFQ_SINK_CPUS`) the row's `cores`",
        "  spare ones; `shared`: everything on the same cores (here: both of this machine's).",
        "- **host limit**: what the host must do with each image the device hands back, in a bare loop",
        "  (no queue, no record, no process boundary) on the sink's cores at the sink's priority, before",
        "  and after each run: the 8-bit array as an image, encoded with diffq's encoder settings and the",
        "  provenance it embeds by default (the same bytes diffq stores), stored with diffq's storage",
        "  client. A pass's knee is set against its bare loop where the pass read it: interpolated",
        "  between the measures before and after the run (the bare loop drifts by up to a third over one run",
        "  on these shared cores; the faster end alone made every pass look that much worse).",
        "- **CPU per image**: CPU seconds of the bare loop, and of the whole run's process tree (runner,",
        "  worker, sink helper) in each T's window, per image: diffq run / bare loop is the host side's",
        "  overhead whatever else shares the machine.",
        "- Figures are the best of the repeats run; **knee / host per pass** is each pass against its",
        "  own bare loop (the goal: every pass at 1.10 × or below), read on the pass's monotone fit of busy",
        "  against T; in brackets where it differs, the first crossing of the points as measured.", "",
        f"Load average during the runs: {min(loads, default=0):.1f}–{max(loads, default=0):.1f} (2 cores).", "",
        "| size | format | batch | store | layout | sink cores | sink | KB/img | host limit ms/img | knee ms/img "
        "| knee / host | knee / host per pass | CPU ms/img bare / run (×) | busy at 2× host limit "
        "| idle gap ms, device-bound | goal met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sweeps:
        host, found = row["host_limit_s_per_image"], row["knee_s_per_image"]
        device_bound = [(t, f) for t, f in row["busy"] if t >= 2 * host] or row["busy"][:1]
        at_2x = min(device_bound, key=lambda point: point[0])
        gaps = [g for t, g in row["gap_ms"] if t >= 2 * host] or [row["gap_ms"][0][1]]
        ratio = f"{found / host:.2f}" if found is not None else "below grid"
        cpu = (f"{ms(row['host_cpu_s_per_image'])} / {ms(row['run_cpu_s_per_image'])} "
               f"({row['run_cpu_s_per_image'] / row['host_cpu_s_per_image']:.2f})"
               if row.get("run_cpu_s_per_image") else "")
        sink = row.get("sink", "process") + (f", {row['sink_threads']} threads" if row.get("sink_threads") else "")
        goal = (row["goal"]["knee_within_10pct_of_host_limit"] and row["goal"]["busy_while_device_bound"]
                and row["goal"].get("every_pass_within_10pct", True))
        passes = ", ".join(per_pass(p) for p in row.get("passes", [])) or "—"
        lines.append(
            f"| {row['height']}² | {row['format']} | {row['batch']} | {row['target']} | {row.get('layout', 'shared')} "
            f"| {row['cores']} | {sink} | {row['bytes_per_image'] // 1024} | {ms(host)} | {ms(found)} | {ratio} | "
            f"{passes} | "
            f"{cpu} | {at_2x[1]:.3f} at {ms(at_2x[0])} ms | {statistics.median(gaps):.1f} | "
            f"{'yes' if goal else '**no**'} |")
    lines += ["", "`python -m bench.device --cores C --sizes S --batches B --formats F --targets T` reproduces a",
              "row (`--quick --json`: the 1024² and 512² PNG, JPEG and WebP rows, batch 8, local, one spare core);",
              "`DIFFQ_SINK=thread` in front for the thread-sink row. Goal: busy ≥ 0.97 while T ≥ 1.1 × the host",
              "limit, i.e. the knee at 1.10 × the host limit or below.", "",
              "![device busy vs device time per image](device.png)", ""]
    lines += findings(documents)
    settings = next((d["encode_settings"] for d in documents.values() if d.get("encode_settings")), [])
    if settings:
        lines += ["Encoder settings, bare, on one core (the stand-in's 1024² images): on one spare core the",
                  "knee follows the encode time, so these are what move it.", "",
                  "| format | setting | CPU ms / image | KB / image |", "|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['setting']} | {r['cpu_ms_per_image']} | {r['kb_per_image']} |"
                  for r in settings]
        lines.append("")
    return lines


def findings(documents: dict[str, dict]) -> list[str]:
    """The note under the table: the figures the issue asks for, in words."""
    sweeps = [row for document in documents.values() for row in document.get("sweeps", [])]

    def find(size: int, fmt: str, batch: int = 8, target: str = "local", layout: str = "split",
             sink: str = "process") -> dict | None:
        return next((r for r in sweeps if (r["height"], r["format"], r["batch"], r["target"], r.get("layout", "shared"),
                                           r.get("sink", "process")) == (size, fmt, batch, target, layout, sink)), None)

    def ms(value: float | None) -> str:
        return "below the grid" if value is None else f"{1000 * value:.1f} ms"

    def cpu(row: dict) -> str:
        if row.get("run_cpu_s_per_image") is None:
            return "no CPU reading (windows shorter than the sampler's interval)"
        return (f"{1000 * row['run_cpu_s_per_image']:.1f} ms of CPU per image against the bare loop's "
                f"{1000 * row['host_cpu_s_per_image']:.1f} ms "
                f"({row['run_cpu_s_per_image'] / row['host_cpu_s_per_image']:.2f}×)")

    def gap(row: dict) -> float:
        bound = [g for t, g in row["gap_ms"] if t >= 2 * row["host_limit_s_per_image"]] or [row["gap_ms"][0][1]]
        return statistics.median(bound)

    def knee(row: dict) -> str:
        found = row["knee_s_per_image"]
        return ms(found) + (f" ({found / row['host_limit_s_per_image']:.2f}× the host limit)" if found else "")

    lines = ["What the figures say:", ""]
    png = find(1024, "png")
    if png:
        lines += [
            f"- **PNG at 1024² on one spare core**: the knee is at {knee(png)} per image against a bare-loop host "
            f"limit of {ms(png['host_limit_s_per_image'])}; diffq's host side spends {cpu(png)}. The device stays "
            f"fed down to about {1000 * (png['knee_s_per_image'] or png['host_limit_s_per_image']):.0f} ms per "
            f"image, ~{1 / (png['knee_s_per_image'] or png['host_limit_s_per_image']):.0f} images/s per spare core; "
            "nearly all of it is the PNG encoder (zlib)."]
    settings = {r["setting"]: r for document in documents.values() for r in document.get("encode_settings", [])}
    level1, level0 = settings.get("compress_level=1 (diffq)"), settings.get("compress_level=0")
    level6 = settings.get("compress_level=6 (PIL default)")
    if level1 and level0 and level6:
        lines += [
            f"- **What moves it**: the encode. PNG compress_level 0 costs {level0['cpu_ms_per_image']} ms for "
            f"{level0['kb_per_image']} KB, diffq's level 1 {level1['cpu_ms_per_image']} ms for "
            f"{level1['kb_per_image']} KB, PIL's default 6 {level6['cpu_ms_per_image']} ms for "
            f"{level6['kb_per_image']} KB (barely smaller): on one spare core the knee moves with those times. "
            "JPEG (quality 90) is an order of magnitude cheaper; WebP (quality 90) costs about what PNG does. "
            "Where the host has more spare cores, `DIFFQ_SINK_THREADS` (default 4) sets how many images of a batch "
            "the sink encodes and uploads at once and `DIFFQ_SINK_CPUS` which cores it runs on."]
    jpeg, jpeg16 = find(1024, "jpeg"), find(1024, "jpeg", batch=16)
    small = find(512, "jpeg")
    if jpeg and small:
        lines += [
            f"- **JPEG** (1024²: {knee(jpeg)}; 512²: {knee(small)}): the host's work per image is a few ms or "
            "less, so the worker's own time between two calls decided the knee before run-ahead (3–6 ms per "
            "batch: Celery fetching and dispatching the next message, the task's bookkeeping, the hand-over to "
            "the sink). Now the next batch is received and its call prepared while the device runs, and waits on "
            f"the device lock: the idle gap while device-bound is {gap(jpeg):.1f} ms (1024²) and {gap(small):.1f} ms "
            "(512²) per batch — the lock's hand-over and a thread switch — so the sink, not the worker, sets the "
            "knee for every format."
            + (f" Batch 16: knee {knee(jpeg16)}." if jpeg16 else "")]
    thread = find(1024, "jpeg", sink="thread")
    if jpeg and thread:
        lines += [
            f"- **Threads instead of the helper** (`DIFFQ_SINK=thread`), on their own core: idle gap "
            f"{gap(thread):.1f} ms per batch against the helper's {gap(jpeg):.1f} ms, knee {knee(thread)}. The "
            "device loop waits for the GIL after each of its own syscalls while the sink's threads hold it; with "
            "the helper, the worker writes the 8-bit arrays' memory to the socket without the GIL."]
    shared = [row for row in sweeps if row.get("layout") == "shared"]
    if shared:
        lines += ["- **Shared cores** (device loop and sink on the same cores): "
                  + "; ".join(f"{row['height']}² {row['format']}: knee {knee(row)}, {cpu(row)}" for row in shared)
                  + ". Here the sink's work and the worker's compete for the same two cores."]
    for fmt in ("png", "jpeg"):
        s3 = find(1024, fmt, target="s3")
        if s3:
            lines += [
                f"- **S3, {fmt.upper()} 1024²** (moto on this machine's cores): knee {knee(s3)}, host limit "
                f"{ms(s3['host_limit_s_per_image'])}, {cpu(s3)}. moto is one Python process sharing the cores and "
                "is counted in the run's CPU (not in the bare loop's), so the ratio overstates diffq's share."]
    bound = [gap(row) for row in sweeps if row.get("layout") == "split" and row.get("sink", "process") == "process"]
    if bound:
        lines += [f"- **Idle gap** while device-bound (split, helper sink): median {statistics.median(bound):.1f} ms "
                  "between two calls."]
    return lines + [""]


def plot(sweeps: list[dict], path: Path) -> None:
    """Busy vs T: colour per size and format, line style per store / cores / sink."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    colors = {(1024, "png"): "#204a87", (1024, "jpeg"): "#ce5c00", (1024, "webp"): "#4e9a06",
              (512, "png"): "#729fcf", (512, "jpeg"): "#fcaf3e", (512, "webp"): "#8ae234"}
    seen = set()
    for row in sweeps:
        sink = row.get("sink", "process")
        key = (row["height"], row["format"], row["batch"], row["target"], row.get("layout"), sink)
        if key in seen:  # the same configuration measured again: the first document's
            continue
        seen.add(key)
        style = ":" if row.get("layout") == "shared" else "--" if row["target"] == "s3" else "-." if sink == "thread" else "-"
        label = (f"{row['height']}² {row['format']} b{row['batch']}"
                 + (f" {row['target']}" if row["target"] != "local" else "")
                 + (" shared cores" if row.get("layout") == "shared" else "") + (f" {sink} sink" if sink != "process" else ""))
        ax.plot([1000 * t for t, _ in row["busy"]], [f for _, f in row["busy"]], style, marker="s" if row["batch"] < 8
                else "o", ms=3, lw=1.2, color=colors.get((row["height"], row["format"]), "#555"), label=label)
    ax.axhline(BUSY_GOAL, color="#888", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("device time per image, ms (one spare core unless labelled)")
    ax.set_ylabel("device busy fraction")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6.5, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path)


# What a run sweeps where --sizes/--batches/--formats/--targets are not given: the full
# layout, or --quick's.
LAYOUTS = {
    False: {"sizes": "1024,512", "batches": "4,8", "formats": "png,jpeg,webp", "targets": "local,s3"},
    True: {"sizes": "1024,512", "batches": "8", "formats": "png,jpeg,webp", "targets": "local"},
}


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1024² and 512², PNG, JPEG and WebP, batch 8, local (several minutes)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    parser.add_argument("--cores", type=int, default=1, help="cores the run and the bare loop may use")
    for name in LAYOUTS[False]:  # unset: the layout's (--quick's or the full one's)
        parser.add_argument(f"--{name}", help=f"default {LAYOUTS[False][name]}; --quick {LAYOUTS[True][name]}")
    parser.add_argument("--repeats", type=int, help="runs per configuration, best kept (default 2; --quick 1)")
    parser.add_argument("--grid", help="seconds per image, comma-separated, slow to fast")
    parser.add_argument("--plot", type=Path, help="write the busy-vs-T plot (PNG) here")
    parser.add_argument("--settings", action="store_true", help="also time each encoder setting (bare, one core)")
    return parser


def configs(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(target, size, batch, format) per sweep, in run order."""
    for name, value in LAYOUTS[args.quick].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    return [(target, int(size), int(batch), fmt) for target in args.targets.split(",")
            for size in args.sizes.split(",") for batch in args.batches.split(",") for fmt in args.formats.split(",")]


def main(argv: list[str] | None = None) -> dict:
    args = main_parser().parse_args(argv)
    plan = configs(args)
    grid = tuple(float(x) for x in args.grid.split(",")) if args.grid else GRID
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-device-"))
    model = str(write_standin(workdir / "standin"))
    measured: dict[tuple, list[dict]] = {config: [] for config in plan}
    with contextlib.ExitStack() as stack:
        stack.enter_context(stdout_to_stderr())
        bucket = stack.enter_context(s3_bucket(workdir)) if any(target == "s3" for target, *_ in plan) else None
        for _ in range(args.repeats):  # interleaved: drift hits every configuration alike
            for target, size, batch, fmt in plan:
                base = bucket if target == "s3" else str(workdir / "out")
                earlier = measured[(target, size, batch, fmt)]
                # Later repeats sweep the first one's grid: the best of them is taken per point.
                row = sweep(model, workdir, base, height=size, width=size, fmt=fmt, batch=batch, target=target,
                            cores=args.cores, grid=tuple(earlier[0]["grid"]) if earlier else grid,
                            refine=not earlier and not args.grid)
                print(json.dumps({"target": target, "size": size, "batch": batch, "format": fmt, **row}),
                      file=sys.stderr, flush=True)
                measured[(target, size, batch, fmt)].append(row)
    sweeps = [summarise({"height": size, "width": size, "format": fmt, "batch": batch, "target": target,
                         "cores": args.cores, "layout": layout(args.cores)["layout"]}, rows)
              for (target, size, batch, fmt), rows in measured.items()]
    if args.plot:
        plot(sweeps, args.plot)
    from diffq.core.settings import get_settings

    for row in sweeps:
        row.update(sink=get_settings().sink, sink_threads=get_settings().sink_threads)
    document = {"sweeps": sweeps, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.settings:
        with pinned(layout(args.cores)):
            document["encode_settings"] = encode_settings()
    print(json.dumps(document) if args.json else json.dumps(document, indent=1))
    return document


if __name__ == "__main__":
    main()
