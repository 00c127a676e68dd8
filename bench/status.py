"""`diffq status` at scale: a synthesised run folder of N items, read locally and from S3.

The folder holds what workers write (one record file per batch of 8, and each
worker process's progress segments crediting its batches, byte for byte what the
sink leaves), plus a few batches that failed, were split, and half failed again
(derived batches and failure files, the exact-count path that needs item ids).
Images are not written: status never reads them.

    python -m bench.status [--items 1000000] [--s3-items 100000] [--s3-summary-items 1000000]
                           [--workers 16] [--failed-batches 10]

`--scale ITEMS:WRITERS,...` (and `--s3-scale`) measures the summary alone at fleet
size, as a user meets it: `python -m diffq status --json OUT` as a whole process
(wall clock, CPU time and peak RSS, median of 5), then a watch's refreshes in process: nothing
changed, one writer credited one more batch, every writer did. Batches go to writers
at random (a writer's batches are not evenly spaced), a share of them is delivered
twice to two writers, and the split and failed batches are spread over the run.

    python -m bench.status --scale 10000000:256,30000000:1024,100000000:1000 \\
                           --s3-scale 100000000:1000 --json docs/scale_status.json --plot docs/scale_status.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import run_defaults, s3_bucket

BATCH = 8
# status before the packed summary (issue 27's table: main with bench.status's
# synthesiser, whole process): items, writers, wall s, peak RSS MB.
BEFORE = [(10_000_000, 256, 3.1, 232), (30_000_000, 1024, 7.5, 620)]
GOALS = {"status_s": 2.0, "peak_rss_mb": 300}


def synthesise(out: str, items: int, workers: int = 16, failed_batches: int = 10,
               records: bool = True) -> tuple[int, int]:
    """Write the run folder; returns the (done, failed) items status must report."""
    from diffq.core import layout
    from diffq.core.contract import ShapeKey
    from diffq.core.progress import ProgressLog
    from diffq.core.records import FailureRecord, ImageRecord, RunManifest, ShapeSummary, jsonl
    from diffq.core.storage import open_storage

    storage = open_storage(out)
    shape = ShapeKey(model="/models/bench", height=128, width=128, batch_size=BATCH, max_sequence_length=64, cfg=False)
    batches = items // BATCH
    manifest = RunManifest(run_id="bench", created_at=time.time(), source="bench.jsonl", out=storage.url,
                           total=items, batches=batches, plan_parts=0,
                           shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=items, batches=batches)],
                           defaults=run_defaults(shape), diffq_version="bench")
    storage.put_bytes(layout.MANIFEST, manifest.model_dump_json().encode())
    # Spread the failing batches over the run; each splits, its first half is done,
    # its second half fails.
    failing = {round(k * batches / failed_batches) for k in range(failed_batches)} if failed_batches else set()

    def item_ids(batch: int) -> list[str]:
        return [f"i{batch * BATCH + k}" for k in range(BATCH)]

    def done_batches() -> list[tuple[str, list[str]]]:
        out = []
        for batch in range(batches):
            ids = item_ids(batch)
            out.append((f"b{batch:07d}.s0", ids[:BATCH // 2]) if batch in failing else (f"b{batch:07d}", ids))
        return out

    done = done_batches()

    def write_record(pair: tuple[str, list[str]]) -> None:
        batch_id, ids = pair
        records = [ImageRecord(file_name=f"images/{i}.png", id=i, prompt="p", seed=1, height=128, width=128,
                               steps=4, guidance_scale=1.0, model=shape.model, run_id="bench", batch_id=batch_id,
                               queue=shape.queue, device="cpu:0", worker="w", generate_s=0.2,
                               generate_started_at=0.0, generate_ended_at=0.2, store_s=0.0, finished_at=0.0)
                   for i in ids]
        storage.put_bytes(layout.record_key(batch_id), jsonl(records), if_absent=True)

    def write_failure(batch: int) -> None:
        batch_id = f"b{batch:07d}.s1"
        storage.put_bytes(layout.failure_key(batch_id), FailureRecord(
            run_id="bench", batch_id=batch_id, item_ids=item_ids(batch)[BATCH // 2:], error="OOM",
            attempts=3, worker="w", failed_at=0.0).model_dump_json().encode(), if_absent=True)

    with ThreadPoolExecutor(32) as pool:
        if records:  # status never reads them; they only make moto's listings slower
            list(pool.map(write_record, done, chunksize=64))
        list(pool.map(write_failure, failing))
    # Batches go round-robin to the workers; each credits its own in its segments.
    # The sink rewrites a segment after every batch; the last rewrite is this (less the
    # few trailing spaces that keep each rewrite longer than the one before).
    logs = [ProgressLog(storage, writer=f"bench-w{w:03d}") for w in range(workers)]
    for index, (batch_id, ids) in enumerate(done):
        logs[index % workers].add(batch_id, shape.queue, ids)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(ProgressLog.flush, logs))
    failed = len(failing) * (BATCH - BATCH // 2)
    return items - failed, failed


def timed_status(out: str, repeats: int = 3) -> tuple[float, int, int]:
    from diffq.results.status import status

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        st = status(out)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2], st.done, st.failed


def measure(where: str, out: str, items: int, command: str, **options) -> dict:
    from diffq.core import layout
    from diffq.core.storage import open_storage

    started = time.perf_counter()
    expected = synthesise(out, items, **options)
    synth_s = time.perf_counter() - started
    seconds, done, failed = timed_status(out)
    assert (done, failed) == expected, f"status says {(done, failed)}, the folder holds {expected}"
    segments = sum(1 for _ in open_storage(out).list(layout.PROGRESS_PREFIX))
    record_files = items // BATCH if options.get("records", True) else 0
    row = {"where": where, "items": items, "record_files": record_files, "progress_segments": segments,
           "done": done, "failed": failed, "status_s": round(seconds, 2), "synthesise_s": round(synth_s, 1),
           "command": command}
    print(json.dumps(row), flush=True)
    return row


# --scale: the summary alone at fleet size -------------------------------------------
class V1Log:
    """A writer of v1 segments (every credit spelled out, rolled over at 256 KiB), as
    diffq wrote them before packed credits: what a run begun by older workers holds."""

    SEGMENT_BYTES = 256 * 1024

    def __init__(self, storage, writer: str):
        self.storage, self.writer, self.segment = storage, writer, 0
        self.queues: dict[str, list] = {}
        self.bytes = 0

    def add(self, batch_id: str, queue: str, item_ids: list[str]) -> None:
        if self.bytes >= self.SEGMENT_BYTES:
            self.flush()
            self.segment, self.queues, self.bytes = self.segment + 1, {}, 0
        credit = [batch_id, len(item_ids), list(item_ids)] if "." in batch_id else [batch_id, len(item_ids)]
        self.queues.setdefault(queue, []).append(credit)
        self.bytes += len(json.dumps(credit, separators=(",", ":"))) + 1

    def flush(self) -> None:
        from diffq.core import layout
        from diffq.core.records import ProgressSegment

        self.storage.put_bytes(layout.progress_key(self.writer, self.segment),
                               ProgressSegment(writer=self.writer, queues=self.queues).model_dump_json().encode())


class FleetRun:
    """A run of `items` items whose `writers` worker processes credited every batch but
    one each, held back to land while a watch refreshes (`land`); `v1`: segments in
    the old format."""

    def __init__(self, out: str, items: int, writers: int, *, failed_batches: int = 100,
                 redelivered: float = 0.01, seed: int = 0, v1: bool = False, sets: int = 0):
        import numpy as np

        from diffq.core import layout
        from diffq.core.contract import ShapeKey
        from diffq.core.progress import ProgressLog
        from diffq.core.contract import AdapterRef
        from diffq.core.records import AdapterSet, FailureRecord, RunManifest, ShapeSummary
        from diffq.core.storage import open_storage
        from diffq.producer.messages import batch_id_prefix

        self.storage = storage = open_storage(out)
        shape = ShapeKey(model="/models/bench", height=1024, width=1024, batch_size=BATCH, max_sequence_length=512,
                         cfg=False)
        self.queue = shape.queue
        batches = items // BATCH
        # `sets` LoRA adapter sets, batch i under set i % sets (credits and failures name it).
        self.sets = [f"{n:08x}" for n in range(sets)]
        adapter_sets = {digest: AdapterSet(adapters=[AdapterRef(path=f"s3://loras/style-{n}.safetensors",
                                                                revision=f"sha256:{n:032x}")],
                                           items=len(range(n, batches, sets)) * BATCH,
                                           batches=len(range(n, batches, sets)))
                        for n, digest in enumerate(self.sets)}
        storage.put_bytes(layout.MANIFEST, RunManifest(
            run_id="bench", created_at=time.time(), source="bench.jsonl", out=storage.url, total=items,
            batches=batches, plan_parts=0, shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=items,
                                                                batches=batches)],
            defaults=run_defaults(shape), diffq_version="bench",
            adapter_sets=adapter_sets).model_dump_json().encode())
        rng = np.random.default_rng(seed)
        owner = rng.integers(0, writers, batches, dtype=np.int32)
        again = rng.random(batches) < redelivered  # a second copy, to another writer
        second = (owner + 1 + rng.integers(0, max(1, writers - 1), batches, dtype=np.int32)) % writers
        failing = np.unique(np.linspace(0, batches - 1, failed_batches).astype(np.int64)) if failed_batches else []
        self.failing = {int(b) for b in failing}
        prefix = batch_id_prefix(shape)
        self.id = lambda index: f"{prefix}{index:07d}"  # producer.messages.batch_id
        for b in self.failing:  # split; the first half done, the second failed
            storage.put_bytes(layout.failure_key(self.id(b) + ".s1"), FailureRecord(
                run_id="bench", batch_id=self.id(b) + ".s1", item_ids=self._items(b)[BATCH // 2:], error="OOM",
                attempts=3, worker="w", failed_at=0.0, adapter_set=self._set(b)).model_dump_json().encode())
        # Each writer's batches in queue order (as it took them), the copies among them.
        credits = np.concatenate([np.arange(batches), np.flatnonzero(again)])
        holders = np.concatenate([owner, second[again]])
        order = np.lexsort((credits, holders))
        credits, holders = credits[order], holders[order]
        bounds = np.searchsorted(holders, np.arange(writers + 1))
        self.logs = [(V1Log if v1 else ProgressLog)(storage, writer=f"bench-w{w:04d}") for w in range(writers)]
        self.held: list[int] = []
        self.held_by: list[int | None] = []
        full = ["x"] * BATCH  # a plan batch's credit keeps its item count only
        for w, log in enumerate(self.logs):
            mine = credits[bounds[w]:bounds[w + 1]].tolist()
            # Its last batch held by it alone lands later, in the watch.
            hold = next((i for i in reversed(mine) if not again[i] and i not in self.failing), None)
            if hold is not None:
                mine.remove(hold)
                self.held.append(hold)
            self.held_by.append(hold)
            for index in mine:
                self._credit(log, index, full)
            log.flush()
        self.failed = len(self.failing) * (BATCH - BATCH // 2)
        self.expected = (items - self.failed, self.failed)
        self.items, self.writers = items, writers

    @staticmethod
    def _items(batch: int) -> list[str]:
        return [f"i{batch * BATCH + k}" for k in range(BATCH)]

    def _set(self, index: int) -> str | None:
        return self.sets[index % len(self.sets)] if self.sets else None

    def _credit(self, log, index: int, full: list[str]) -> None:
        named = {"adapter_set": self._set(index), "mode": "swap"} if self.sets else {}
        if index in self.failing:
            log.add(self.id(index) + ".s0", self.queue, self._items(index)[:BATCH // 2], **named)
        else:
            log.add(self.id(index), self.queue, full, **named)

    def land(self, writers: range) -> None:
        """These writers credit their held-back batch and rewrite their segment, as the sink does."""
        def one(w: int) -> None:
            if self.held_by[w] is not None:
                self._credit(self.logs[w], self.held_by[w], ["x"] * BATCH)
                self.logs[w].flush()

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, writers))


def bytecode_cached() -> dict[str, str]:
    """This environment (read now: s3_bucket sets the AWS_* variables), for a diffq that
    starts as an installed one does, its bytecode cached (outside the tree, in a
    prefix folder) where PYTHONDONTWRITEBYTECODE would recompile it at every start."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
            "PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "diffq-bench-status-pycache")}


def whole_process_status(out: str, repeats: int = 5, args: tuple[str, ...] = ("--json",)) -> dict:
    """`python -m diffq status --json OUT` as its own process: median wall, peak RSS
    (after one unmeasured run, which caches the bytecode)."""
    walls, cpu, rss, last = [], [], [], None
    for n in range(repeats + 1):
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", sys.executable, "-m", "diffq", "status", *args,
                               out], capture_output=True, text=True, check=True, env=bytecode_cached())
        if not n:
            continue
        wall, user, system, kb = proc.stderr.strip().splitlines()[-1].split()
        walls.append(float(wall))
        cpu.append(float(user) + float(system))
        rss.append(int(kb) / 1024)
        last = json.loads(proc.stdout) if "--json" in args else {}
    # On shared cores the wall clock waits for a core; CPU time is what the process used.
    return {"status_s": statistics.median(walls), "status_s_all": walls, "cpu_s": statistics.median(cpu),
            "peak_rss_mb": round(max(rss), 1), "done": last.get("done"), "failed": last.get("failed")}


def measure_scale(where: str, out: str, items: int, writers: int, command: str, v1: bool = False) -> dict:
    from diffq.core import layout
    from diffq.core.progress import ProgressSummary

    started = time.perf_counter()
    run = FleetRun(out, items, writers, v1=v1)
    synth_s = time.perf_counter() - started
    storage = run.storage
    read: list[int] = []
    get_many = storage.get_many

    def counted(keys, **kw):
        for key, body in get_many(keys, **kw):
            read.append(len(body))
            yield key, body

    storage.get_many = counted  # what a refresh reads
    summary = ProgressSummary(storage)

    def refresh() -> tuple[float, int, int]:
        read.clear()
        started = time.perf_counter()
        summary.refresh()
        return time.perf_counter() - started, len(read), sum(read)

    cold = refresh()
    held = len(run.held) * BATCH
    assert (summary.done, summary.failed) == (run.expected[0] - held, run.expected[1]), "cold read miscounted"
    unchanged = refresh()
    run.land(range(1))
    one = refresh()
    run.land(range(1, writers))
    every = refresh()
    assert (summary.done, summary.failed) == run.expected, f"{summary.done, summary.failed} != {run.expected}"
    storage.get_many = get_many
    listing = list(storage.list_with_sizes(layout.PROGRESS_PREFIX))
    whole = whole_process_status(out)
    assert (whole["done"], whole["failed"]) == run.expected
    # The command's own start (interpreter, imports, no run read), at the same moment.
    start = whole_process_status(out, args=("--help",))
    row = {"where": where, "items": items, "writers": writers, "batches": items // BATCH,
           "progress_segments": len(listing), "segment_mb": round(sum(size for _, size in listing) / 1e6, 2),
           **whole, "cli_start_s": start["status_s"], "cli_start_cpu_s": start["cpu_s"],
           "in_process_cold_s": round(cold[0], 3),
           "watch_unchanged_ms": round(unchanged[0] * 1e3, 1),
           "watch_one_writer_ms": round(one[0] * 1e3, 1), "watch_one_writer_read": [one[1], one[2]],
           "watch_every_writer_ms": round(every[0] * 1e3, 1), "watch_every_writer_read": [every[1], every[2]],
           "synthesise_s": round(synth_s, 1), "load_average": [round(x, 2) for x in os.getloadavg()],
           "command": command}
    print(json.dumps(row), flush=True)
    return row


def render_scale(rows: list[dict]) -> list[str]:
    """The Scale section's status table (Markdown lines)."""
    lines = ["| where | items | writers | segments | segments MB | status s, whole process: median (each run) "
             "| CPU s | `status --help` s / CPU s | peak RSS MB "
             "| watch refresh ms: none / one / every writer changed (segments read) "
             "| load average | command |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = ["local", "local (v1 segments)", "s3 (moto, loopback)"]
    for r in sorted(rows, key=lambda r: (order.index(r["where"]) if r["where"] in order else 9, r["items"])):
        start = f"{r['cli_start_s']:.2f} / {r['cli_start_cpu_s']:.2f}" if "cli_start_s" in r else "–"
        lines.append(
            f"| {r['where']} | {r['items']:,} | {r['writers']:,} | {r['progress_segments']:,} | {r['segment_mb']} | "
            f"{r['status_s']:.2f} ({', '.join(f'{s:.2f}' for s in r['status_s_all'])}) | {r['cpu_s']:.2f} | "
            f"{start} | {r['peak_rss_mb']:.0f} | "
            f"{r['watch_unchanged_ms']:.0f} / {r['watch_one_writer_ms']:.0f} ({r['watch_one_writer_read'][0]}) / "
            f"{r['watch_every_writer_ms']:.0f} ({r['watch_every_writer_read'][0]:,}) | "
            f"{' '.join(f'{x:.1f}' for x in r['load_average'])} | `{r['command']}` |")
    return lines


def plot_scale(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)
    for ax, key, label in ((axes[0], "status_s", "status, whole process (s)"),
                           (axes[1], "peak_rss_mb", "peak RSS (MB)")):
        for where, marker, color in (("local", "o", "#3465a4"), ("s3 (moto, loopback)", "s", "#f57900"),
                                     ("local (v1 segments)", "^", "#75507b")):
            mine = sorted((r for r in rows if r["where"] == where), key=lambda r: r["items"])
            if mine:
                x = [r["items"] / 1e6 for r in mine]
                ax.plot(x, [r[key] for r in mine], marker + "-", color=color, label=f"{where}: wall (median)")
                if key == "status_s":
                    ax.plot(x, [r["cpu_s"] for r in mine], marker + "--", color=color, lw=0.8,
                            label=f"{where}: CPU")
        column = 2 if key == "status_s" else 3
        ax.plot([b[0] / 1e6 for b in BEFORE], [b[column] for b in BEFORE], "x:", color="#a40000",
                label="before: v1 reader (issue 27, local)")
        ax.axhline(GOALS[key], color="#888a85", lw=0.8, ls="--", label="goal")
        ax.set_xlabel("items (millions)")
        ax.set_ylabel(label)
        ax.set_xlim(0, 105)
        ax.set_ylim(0, None)
    axes[0].legend(fontsize=6, loc="center")  # clear of the points: low left, high right
    loads = ", ".join(f"{r['load_average'][0]:.1f}" for r in rows)
    fig.suptitle(f"diffq status at scale: 2 shared cores (1-min load average at each point: {loads})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# The Scale section's part (docs/BENCHMARKS.md), from the rows `--scale --json` keeps.
SCALE_JSON = Path(__file__).resolve().parents[1] / "docs" / "scale_status.json"
LOAD_NOTE = """What fleets run: 10–100 million items, about a thousand worker processes, exports of
terabytes (issue 27). Measured on this machine's 2 cores **while other engineers' test
suites and benchmarks ran on them**: each row gives the load average (1, 5 and 15 min)
when it was taken (2.0 would already mean both cores busy), and on a busy core the wall
clock mostly waits for the core, so CPU seconds (user + system) stand beside it. The
rows' data are in `docs/scale_status.json`."""
SCALE_PROSE = """A plan batch's id ends in its index within its queue (`1024x1024-3f2a1c-0001234`), so a
progress credit is that index: a writer's segment holds, per queue and item count, the
gaps between its sorted indexes as 1-, 2- or 4-byte integers, base64 (zlib only where
that halves them: runs of consecutive batches), 2.7 bytes a batch with a thousand
writers where v1 spelled out ~35 (diffq/core/progress.py). The reader keeps one byte
per plan batch (which item count is credited there), so redeliveries fold into one cell
and memory follows the plan, not the writers or the copies; split and resumed batches
still carry item ids, and failures count against them as before. One writer per
segment and the run folder as the only truth are kept, and v1 segments are still read,
folded into the same arrays, at about main's v1 reader's cost (in process, one 2M-item
v1 folder, 3 runs each: 0.93–1.26 CPU s, HEAD's diffq/core/progress.py 0.85–1.19; the
v1 row below has the 24-character batch ids of real runs).

The synthesiser (`python -m bench.status --scale ITEMS:WRITERS`) gives batches to
writers at random, delivers 1 % of them twice to two writers, and splits 100 batches
with one half failed; every figure is checked against the counts it wrote. `status` is
`python -m diffq status --json OUT` as a whole process, 5 runs after an unmeasured one
(which caches its bytecode, as an installed diffq has it); `status --help` is the same
command's start alone (interpreter and imports, nothing read), at the same moment.
The watch columns are `ProgressSummary.refresh()` in one process: nothing changed, one
writer credited one more batch, then every other writer did."""
BEFORE_NOTE = """Before (issue 27, main's v1 reader, its synthesiser's shorter batch ids, whole process):
10M items / 256 writers 3.1 s and 232 MB; 30M / 1,024 7.5 s (11.8 s under load) and
620 MB; 100M extrapolated to 25–40 s and ~2 GB."""


def scale_goals(rows: list[dict] | None = None) -> list[tuple[str, bool, str]]:
    """The goals of issue 27's read side, judged on the rows (default: docs/scale_status.json)."""
    rows = json.loads(SCALE_JSON.read_text()) if rows is None else rows
    local = max((r for r in rows if r["where"] == "local"), key=lambda r: r["items"])
    read_s = local["status_s"] - local.get("cli_start_s", 0.0)
    read_cpu = local["cpu_s"] - local.get("cli_start_cpu_s", 0.0)
    scale = f"{local['items'] / 1e6:.0f}M items"
    checks = [
        (f"status at {scale}, {local['writers']:,} writers ≤ {GOALS['status_s']:.0f} s cold (whole process)",
         local["status_s"] <= GOALS["status_s"],
         f"median {local['status_s']:.2f} s wall, {local['cpu_s']:.2f} CPU s at load "
         f"{local['load_average'][0]:.1f}; the command's start alone took {local.get('cli_start_s', 0):.2f} s wall / "
         f"{local.get('cli_start_cpu_s', 0):.2f} CPU s then, so reading the summary is ~{read_s:.1f} s wall / "
         f"~{read_cpu:.1f} CPU s (in process: {local['in_process_cold_s']:.1f} s for {local['batches'] / 1e6:.1f}M "
         "credits)")]
    biggest = [r for r in rows if r["items"] >= local["items"]]
    checks.append((f"status at {scale} ≤ {GOALS['peak_rss_mb']} MB",
                   all(r["peak_rss_mb"] <= GOALS["peak_rss_mb"] for r in biggest),
                   ", ".join(f"{r['where']}: {r['peak_rss_mb']:.0f} MB peak RSS" for r in biggest)))
    checks.append(("status: exact counts unchanged (redeliveries, splits, failures)", True,
                   "every row equals what the synthesiser wrote (the bench asserts it); tests/test_progress.py and "
                   "tests/test_watch.py compare with a full scan of the records, v1 segments included"))
    checks.append(("watch refreshes read only what changed", local["watch_one_writer_read"][0] == 1,
                   f"nothing changed: the listings only ({local['watch_unchanged_ms']:.0f} ms at {scale}); one "
                   f"writer changed: its one segment ({local['watch_one_writer_read'][1] / 1e3:.0f} KB, "
                   f"{local['watch_one_writer_ms']:.0f} ms); a refresh reads every segment whose size changed, so "
                   "with a thousand writers crediting between two refreshes it reads them all "
                   f"({local['watch_every_writer_ms'] / 1e3:.1f} s)"))
    for r in (r for r in rows if r["where"].startswith("s3")):
        checks.append((f"status from S3 at {r['items'] / 1e6:.0f}M (the largest size here) ≤ "
                       f"{GOALS['status_s']:.0f} s", r["status_s"] <= GOALS["status_s"],
                       f"{r['status_s']:.1f} s median ({r['cpu_s']:.1f} CPU s) at load {r['load_average'][0]:.1f} "
                       "with moto on the same 2 cores: a GET per writer's segment, ~"
                       f"{(r['cpu_s'] - r.get('cli_start_cpu_s', 0.0)) / r['progress_segments'] * 1e3:.0f} ms of "
                       "the command's CPU each here (botocore, beside the decoding); a thousand writers are a "
                       "thousand objects at least (one writer per segment)"))
    return checks


def scale_section(rows: list[dict] | None = None) -> list[str]:
    """The Scale section's status part: prose, table, plot, goals."""
    from bench.common import goal_table

    rows = json.loads(SCALE_JSON.read_text()) if rows is None else rows
    return ["### Status and watch at 100M items and 1,000 writers", "", *LOAD_NOTE.splitlines(), "",
            *SCALE_PROSE.splitlines(), "", *render_scale(rows), "", *BEFORE_NOTE.splitlines(), "",
            "![status at scale](scale_status.png)", "", *goal_table(scale_goals(rows)), ""]


def measure_sets(out: str, items: int, writers: int, sets: int) -> dict:
    """`diffq status --by-adapter --json` of a run over `sets` adapter sets, its own process."""
    run = FleetRun(out, items, writers, sets=sets)
    run.land(range(writers))
    measured = whole_process_status(out, repeats=3, args=("--json", "--by-adapter"))
    last = json.loads(subprocess.run([sys.executable, "-m", "diffq", "status", "--json", "--by-adapter", out],
                                     capture_output=True, text=True, check=True, env=bytecode_cached()).stdout)
    rows = [row for row in last["adapter_sets"] if row["set"]]
    assert len(rows) == sets and sum(r["done"] for r in rows) == last["done"], "per-set counts add up"
    assert sum(r["failed"] for r in rows) == last["failed"] == run.failed
    row = {"items": items, "writers": writers, "sets": sets, **{k: measured[k] for k in
                                                                 ("status_s", "cpu_s", "peak_rss_mb")},
           "command": f"python -m bench.status --scale {items}:{writers} --sets {sets}"}
    print(json.dumps(row))
    return row


def _sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split(":")) for pair in text.split(",") if pair]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--s3-items", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=16, help="worker processes that wrote the run")
    parser.add_argument("--failed-batches", type=int, default=10, help="batches split with one half failed")
    parser.add_argument("--s3-summary-items", type=int, default=0,
                        help="also an S3 folder of this many items holding only what status reads (progress "
                             "segments, failures): writing 125,000 records into moto takes ~8 min per 1M items")
    parser.add_argument("--scale", help="ITEMS:WRITERS,...: the summary alone at fleet size, locally")
    parser.add_argument("--s3-scale", help="ITEMS:WRITERS,...: the same on moto's S3 server")
    parser.add_argument("--v1", action="store_true", help="--scale: segments in the old format (every credit "
                                                          "spelled out), as older workers wrote them")
    parser.add_argument("--sets", type=int, default=0,
                        help="--scale: the run's batches over this many LoRA adapter sets, and time "
                             "`status --by-adapter --json` as its own process (issue 64's goal: 10M items, 20 sets, "
                             "<= 2 s, <= 300 MB)")
    parser.add_argument("--json", type=Path, help="--scale: also write the rows here (added to what it holds)")
    parser.add_argument("--plot", type=Path, help="--scale: plot the rows of --json here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-status-"))
    try:
        return measure_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure_all(args, workdir: Path) -> list[dict]:
    if args.sets:
        return [measure_sets(str(workdir / f"run-{items}-{writers}"), items, writers, args.sets)
                for items, writers in _sizes(args.scale or "10000000:100")]
    if args.scale or args.s3_scale:
        rows = []
        v1, flag = (" (v1 segments)", " --v1") if args.v1 else ("", "")
        for items, writers in _sizes(args.scale or ""):
            rows.append(measure_scale(f"local{v1}", str(workdir / f"run-{items}-{writers}"), items, writers,
                                      f"python -m bench.status --scale {items}:{writers}{flag}", v1=args.v1))
        for items, writers in _sizes(args.s3_scale or ""):
            with s3_bucket(workdir / f"s3-{items}") as bucket:
                rows.append(measure_scale(f"s3 (moto, loopback){v1}", f"{bucket}/run", items, writers,
                                          f"python -m bench.status --s3-scale {items}:{writers}{flag}", v1=args.v1))
        if args.json:
            kept = json.loads(args.json.read_text()) if args.json.exists() else []
            fresh = {(r["where"], r["items"], r["writers"]) for r in rows}
            rows = [r for r in kept if (r["where"], r["items"], r["writers"]) not in fresh] + rows
            args.json.write_text(json.dumps(rows, indent=1))
        if args.plot:
            plot_scale(rows, args.plot)
        print("\n".join(render_scale(rows)))
        return rows
    options = {"workers": args.workers, "failed_batches": args.failed_batches}
    rows = []
    if args.items:
        rows.append(measure("local", str(workdir / "run"), args.items,
                            f"python -m bench.status --items {args.items}", **options))
    if args.s3_items:
        with s3_bucket(workdir) as bucket:
            rows.append(measure("s3 (moto, loopback)", f"{bucket}/run", args.s3_items,
                                f"python -m bench.status --s3-items {args.s3_items}", **options))
    if args.s3_summary_items:
        with s3_bucket(workdir) as bucket:
            rows.append(measure("s3 (moto), summary only", f"{bucket}/run", args.s3_summary_items,
                                f"python -m bench.status --s3-summary-items {args.s3_summary_items}",
                                records=False, **options))
    return rows


if __name__ == "__main__":
    main()
