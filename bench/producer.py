"""Producer at scale.

Default: submit 100k and 1M prompts over 8 shapes to a private Redis. Each size runs
in a fresh process so its peak RSS is its own. Goals: ≥ 50,000 prompts/s, peak RSS
≤ 300 MB, memory flat in the number of prompts.

    python -m bench.producer [--sizes 100000,1000000] [--batch-size 8]

`--scale`: 10M–100M rows, each measured as a whole process under /usr/bin/time
(docs/BENCHMARKS.md "Scale" → "Producer at 100M rows"; goals ≥ 50,000 rows/s and
peak RSS ≤ 500 MB at 100M): `diffq plan` (the validation pass, nothing written)
per size; submit with a publisher that discards (validation, plan parts written to a
local run folder, messages encoded: the producer's own cost without a broker's) per
size up to `--submit-max`; the real `diffq submit` to a private Redis at
`--redis-rows` (a real publish of 100M rows would need ~30 GB of Redis); and
`diffq plan` of the same rows as CSV, TXT and Parquet at `--format-rows`, and of rows
with random sizes (nearly all distinct) under size buckets at `--varied-rows`. Files
are written under --workdir (default: a new folder in the temp dir) and removed after.

    python -m bench.producer --scale 10000000,30000000,100000000 [--submit-max N]
        [--redis-rows 10000000] [--format-rows 10000000] [--formats csv,txt,parquet]
        [--varied-rows 10000000] [--json docs/scale_producer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import peak_rss_mb, redis_server

SIZES = [(64, 64), (128, 128), (64, 128), (128, 64), (256, 256), (96, 96), (160, 160), (192, 192)]
MODEL = "/models/bench"
BLOCK = 100_000  # rows formatted per write when generating files
VARIED_BUCKETS = "aspect-1024"  # with --varied-rows: bench/plan.py's random sizes, bucketed


def _fields(i: int) -> tuple[str, str, int, int]:
    h, w = SIZES[i % len(SIZES)]
    return f"i{i:08d}", f"a photo of item {i} in style {i % 97}", h, w


def write_rows(path: Path, n: int, fmt: str = "jsonl") -> Path:
    """n rows over 8 shapes: JSONL, CSV (id, prompt, height, width), TXT (prompts only,
    so ids are generated from lines) or Parquet (row groups of 1M)."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        for start in range(0, n, 1_000_000):
            columns = list(zip(*map(_fields, range(start, min(n, start + 1_000_000)))))
            table = pa.table(dict(zip(("id", "prompt", "height", "width"), columns)))
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
        writer.close()
        return path
    line = {"jsonl": '{{"id": "{}", "prompt": "{}", "height": {}, "width": {}}}\n',
            "csv": "{},{},{},{}\n", "txt": "{1}\n"}[fmt]
    with path.open("w") as handle:
        if fmt == "csv":
            handle.write("id,prompt,height,width\n")
        for start in range(0, n, BLOCK):
            handle.write("".join(line.format(*_fields(i)) for i in range(start, min(n, start + BLOCK))))
    return path


def write_prompts(path: Path, n: int) -> Path:
    return write_rows(path, n, "jsonl")


def one(prompts: str, broker: str, out: str, batch_size: int) -> dict:
    """Runs in its own process: submit, then report speed and this process's peak RSS."""
    from diffq.producer.submit import submit

    started = time.perf_counter()
    # Every batch to the broker, as these figures were taken (bench/window.py: the window).
    result = submit(prompts, out, model=MODEL, broker_url=broker, batch_size=batch_size, window=None)
    seconds = time.perf_counter() - started
    import redis

    queued = sum(redis.Redis.from_url(broker).llen(q) for q in result.queues)
    return {"prompts": result.total, "shapes": result.shapes, "batches": result.batches, "queued": queued,
            "seconds": round(seconds, 2), "prompts_per_s": round(result.total / seconds),
            "peak_rss_mb": peak_rss_mb()}




class Discard:
    """A publisher that keeps nothing: submit's own cost without a broker's."""

    def __init__(self):
        self.messages = self.bytes = 0

    def publish_encoded(self, message) -> None:
        self.messages += 1
        self.bytes += len(message.json)


def one_discard(prompts: str, out: str, batch_size: int) -> dict:
    """Runs in its own process: submit to `Discard`; how long the final id check took."""
    from diffq.producer import sources
    from diffq.producer.submit import submit

    finish, timed = sources.IdChecker.finish, {}

    def timed_finish(checker):
        started = time.perf_counter()
        try:
            finish(checker)
        finally:
            timed.update(id_finish_s=round(time.perf_counter() - started, 2), id_runs=checker.spilled_runs)

    sources.IdChecker.finish = timed_finish
    publisher = Discard()
    result = submit(prompts, out, model=MODEL, publisher=publisher, batch_size=batch_size, window=None)
    plan_bytes = sum(path.stat().st_size for path in (Path(out) / "plan").rglob("*") if path.is_file())
    return {"rows": result.total, "batches": result.batches, "published": publisher.messages,
            "message_mb": round(publisher.bytes / 2**20), "plan_mb": round(plan_bytes / 2**20), **timed}


def measured(command: list[str], stdout=subprocess.DEVNULL) -> dict:
    """A whole process's wall and CPU seconds and peak RSS (GNU time's, so the figure
    is the command's own), with the load average around it (shared cores)."""
    load = os.getloadavg()[0]
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        started = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%U %S %M", *command],
                              stdout=stdout, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
        user, system, peak_kb = report.read().split()[-3:]
    return {"wall_s": round(wall, 1), "cpu_s": round(float(user) + float(system), 1),
            "peak_rss_mb": round(int(peak_kb) / 1024, 1),
            "load": f"{load:.1f}–{os.getloadavg()[0]:.1f}", "nice": os.nice(0), "stdout": proc.stdout}


def _row(case: str, fmt: str, rows: int, figures: dict, command: str, **extra) -> dict:
    figures.pop("stdout", None)
    row = {"case": case, "format": fmt, "rows": rows, **figures,
           "rows_per_s": round(rows / figures["wall_s"]), "rows_per_cpu_s": round(rows / figures["cpu_s"]),
           **extra, "command": command}
    print(json.dumps(row), flush=True)
    return row


def diffq() -> str:
    return str(Path(sys.executable).with_name("diffq"))


def plan_row(prompts: Path, fmt: str, rows: int, batch_size: int, buckets: str | None = None) -> dict:
    options = ["--model", MODEL, "--batch-size", str(batch_size), "--json"]
    options += ["--size-buckets", buckets] if buckets else []
    figures = measured([diffq(), "plan", str(prompts), *options], stdout=subprocess.PIPE)
    plan = json.loads(figures["stdout"])
    assert plan["total"] == rows, (plan["total"], rows)
    extra = {"requested_sizes": sum(s.get("requested_sizes", 0) for s in plan["shapes"])} if buckets else {}
    return _row("plan, random sizes" if buckets else "plan", fmt, rows, figures,
                f"diffq plan {prompts.name} {' '.join(options)}", **extra)


def scale(args) -> list[dict]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="diffq-bench-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows, b = [], str(args.batch_size)
    sizes = [int(s) for s in args.scale.split(",")]
    try:
        for n in sizes:
            prompts = write_rows(workdir / f"p{n}.jsonl", n)
            rows.append(plan_row(prompts, "jsonl", n, args.batch_size))
            if n <= args.submit_max:
                out = workdir / f"run{n}"
                figures = measured([sys.executable, "-m", "bench.producer", "--batch-size", b, "--discard",
                                    str(prompts), str(out)], stdout=subprocess.PIPE)
                detail = json.loads(figures["stdout"].strip().splitlines()[-1])
                assert detail["rows"] == n and detail["published"] == detail["batches"], detail
                rows.append(_row("submit (discard)", "jsonl", n, figures,
                                 f"python -m bench.producer --scale {n} (submit to a discarding publisher)",
                                 **{k: detail[k] for k in ("plan_mb", "id_finish_s", "id_runs")}))
                shutil.rmtree(out)
            if n == args.redis_rows:
                rows.append(redis_row(prompts, workdir, n, args.batch_size))
            if n == args.format_rows:
                for fmt in filter(None, args.formats.split(",")):
                    other = write_rows(workdir / f"p{n}.{fmt}", n, fmt)
                    rows.append(plan_row(other, fmt, n, args.batch_size))
                    other.unlink()
            if n == args.varied_rows:  # sizes nearly all distinct: the plan counts each one
                from bench.plan import write_rows as write_varied

                varied = write_varied(workdir / f"varied{n}.jsonl", n, tidy=False)
                rows.append(plan_row(varied, "jsonl", n, args.batch_size, buckets=VARIED_BUCKETS))
                varied.unlink()
            prompts.unlink()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def redis_row(prompts: Path, workdir: Path, n: int, batch_size: int) -> dict:
    import redis

    with redis_server(workdir) as broker:
        out = workdir / f"redis-run{n}"
        figures = measured([diffq(), "submit", str(prompts), "--out", str(out), "--model", MODEL,
                            "--broker", broker, "--batch-size", str(batch_size), "--window", "all"])
        client = redis.Redis.from_url(broker)
        queued = sum(client.llen(key) for key in client.scan_iter("diffq.*", _type="list"))
        redis_mb = round(client.info("memory")["used_memory"] / 2**20)
        batches = json.loads((out / "manifest.json").read_text())["batches"]
        assert queued == batches, (queued, batches)
        client.flushall()
    shutil.rmtree(out)
    return _row("submit (Redis)", "jsonl", n, figures,
                f"diffq submit {prompts.name} --out OUT --model {MODEL} --broker redis://… --batch-size {batch_size} "
                "--window all",
                queued=queued, redis_mb=redis_mb)


# The Scale section's part (docs/BENCHMARKS.md), from the rows `--scale --json` keeps.
SCALE_JSON = Path(__file__).resolve().parents[1] / "docs" / "scale_producer.json"


def _saved(rows: list[dict] | None) -> list[dict]:
    if rows is None:
        return json.loads(SCALE_JSON.read_text()) if SCALE_JSON.exists() else []
    return rows


def _detail(row: dict) -> str:
    parts = []
    if "plan_mb" in row:
        parts.append(f"plan parts {row['plan_mb']:,} MB")
    if "queued" in row:
        parts.append(f"{row['queued']:,} messages queued, Redis {row['redis_mb']:,} MB")
    if "id_runs" in row:
        parts.append(f"{row['id_runs']} id runs spilled, final id check {row['id_finish_s']} s")
    if "requested_sizes" in row:
        parts.append(f"{row['requested_sizes']:,} requested sizes")
    return "; ".join(parts) or "–"


def render_scale(rows: list[dict]) -> list[str]:
    """The Scale section's producer table (Markdown lines)."""
    if not rows:
        return []
    lines = ["Whole processes under `/usr/bin/time` (`python -m bench.producer --scale …`): rows over 8 shapes,",
             "batch 8, ids given. rows/s is wall clock on 2 cores shared with other sessions (load: the",
             "1-minute load average before–after; nice: the benchmark's niceness, so a busy core went to the",
             "others first); rows per CPU second is what one core does unshared.", "",
             "| case | format | rows | wall s | CPU s | rows/s | rows per CPU s | peak RSS MB | written, ids "
             "| load (nice) | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['format']} | {r['rows']:,} | {r['wall_s']} | {r['cpu_s']} | {r['rows_per_s']:,} | "
              f"{r['rows_per_cpu_s']:,} | {r['peak_rss_mb']} | {_detail(r)} | {r['load']} ({r.get('nice', 0)}) | "
              f"`{r['command']}` |" for r in rows]
    return lines


SCALE_PROSE = """`diffq plan` is the validation pass alone (each row parsed, checked, counted per shape; ids
checked unique); `submit (discard)` is `submit` with a publisher that keeps nothing, so the
producer's whole cost (plan parts written to the run folder, every message encoded) without a
broker's; `submit (Redis)` is the real command against a private redis-server. Ids are made
unique without holding them all: each id's 64-bit hash and line go into a run of 2M rows, which
is sorted and spilled to a temporary file (16 B a row), and the runs are merged one slice of the
hash space at a time at the end (`id runs`: the runs spilled), so memory is one run and one
slice whatever the file's length (producer/sources.py `IdChecker`). The real submit ran at
10M rows only: Redis holds ~2.6 KB a message (3,142 MiB for 10M rows at batch 8), ~31 GiB at
100M. The 100M-row JSONL is ~9.2 GiB; MB in the table are MiB."""


def scale_section(rows: list[dict] | None = None) -> list[str]:
    """docs/BENCHMARKS.md's "Producer at 100M rows" (under "Scale"): prose, table, goals."""
    from bench.common import goal_table

    rows = _saved(rows)
    if not rows:
        return []
    return ["### Producer at 100M rows", "", *SCALE_PROSE.splitlines(), "", *render_scale(rows), "",
            *goal_table(scale_goals(rows)), ""]


def scale_goals(rows: list[dict] | None = None) -> list[tuple[str, bool, str]]:
    """Issue 27's producer goals on the largest JSONL size measured (default: docs/scale_producer.json)."""
    rows = _saved(rows)
    jsonl = [r for r in rows if r["format"] == "jsonl"]
    if not jsonl:
        return []
    largest = max(r["rows"] for r in jsonl)
    at = [r for r in jsonl if r["rows"] == largest]
    label = f"{largest:,} rows"
    return [(f"producer at {label}: ≥ 50,000 rows/s", min(r["rows_per_s"] for r in at) >= 50_000,
             ", ".join(f"{r['case']}: {r['rows_per_s']:,} ({r['rows_per_cpu_s']:,} per CPU s)" for r in at)),
            (f"producer at {label}: peak RSS ≤ 500 MB", max(r["peak_rss_mb"] for r in at) <= 500,
             ", ".join(f"{r['case']}: {r['peak_rss_mb']} MB" for r in at)),
            ("producer at scale: a duplicate id is still refused with both line numbers", True,
             "tests/test_producer_scale.py: ids checked in sorted runs spilled to disk, as at these sizes, with "
             "repeats within a run and across runs, colliding hashes, and every input format")]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--scale", help="comma-separated row counts: the whole-process scale runs")
    parser.add_argument("--submit-max", type=int, default=10**9, help="with --scale: submit only up to this size")
    parser.add_argument("--redis-rows", type=int, default=10_000_000, help="with --scale: the size also submitted to Redis")
    parser.add_argument("--format-rows", type=int, default=10_000_000, help="with --scale: the size also planned as --formats")
    parser.add_argument("--formats", default="csv,txt,parquet")
    parser.add_argument("--varied-rows", type=int, default=10_000_000,
                        help=f"with --scale: the size also planned with random sizes and --size-buckets {VARIED_BUCKETS}")
    parser.add_argument("--workdir", help="with --scale: where the files go (kept)")
    parser.add_argument("--json", type=Path, help="with --scale: also write the rows here (replacing those of "
                                                  "the same case, format and rows)")
    parser.add_argument("--one", nargs=3, metavar=("PROMPTS", "BROKER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--discard", nargs=2, metavar=("PROMPTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one, args.batch_size)))
        return []
    if args.discard:
        print(json.dumps(one_discard(*args.discard, args.batch_size)))
        return []
    if args.scale:
        rows = scale(args)
        if args.json:
            kept = json.loads(args.json.read_text()) if args.json.exists() else []
            fresh = {(r["case"], r["format"], r["rows"]) for r in rows}
            rows = [r for r in kept if (r["case"], r["format"], r["rows"]) not in fresh] + rows
            args.json.write_text(json.dumps(rows, indent=1))
        print("\n".join(render_scale(rows)))
        return rows

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-producer-"))
    rows = []
    with redis_server(workdir) as broker:
        for n in [int(s) for s in args.sizes.split(",")]:
            prompts = write_prompts(workdir / f"p{n}.jsonl", n)
            proc = subprocess.run([sys.executable, "-m", "bench.producer", "--batch-size", str(args.batch_size),
                                   "--one", str(prompts), broker, str(workdir / f"run{n}")],
                                  capture_output=True, text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["command"] = f"python -m bench.producer --sizes {n}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            import redis

            redis.Redis.from_url(broker).flushall()
    return rows


if __name__ == "__main__":
    main()
