"""Where a `diffq run`'s host CPU goes per batch, counted rather than timed (bench only).

    python -m bench.host_profile --diffq A=.venv/bin/diffq --diffq B=/work/base/.venv/bin/diffq \\
        --model DIR --prompts FILE [--workdir DIR] [--marks 0.1,0.9]

Each side's `diffq run` (1 worker; bench/e2e.py's WORKLOAD: 128², batch 8, 4 steps) runs
with every Python process under cProfile through a `sitecustomize` on PYTHONPATH: the
runner, its worker child and the child's sink helper, on either commit, with nothing in
diffq's code. Each thread has its own profiler on its own CPU clock (`time.thread_time`),
so waiting, and the other processes of a loaded machine, cost nothing; the calls are
counted exactly. When the run folder holds the first and the second mark's share of its
records, the bench asks every process for a snapshot (a file the hook's thread watches
for); the difference of the two is the steady state: start-up and shutdown cancel. Per
batch: the worker's and the sink helper's by their own count of batches between the
marks (calls of the task body and of the writer's store), the runner's by records.

Printed per process: CPU µs per batch on each side, and per function (matched across
module moves by `git diff -M` between the sides' commits) its calls and own µs per
batch, largest differences first. cProfile's own cost per call inflates the Python
rows of both sides alike: read the differences, and the counts.
"""

from __future__ import annotations

import argparse
import json
import marshal
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.e2e import WORKLOAD

ENV = "DIFFQ_HOST_PROFILE"  # the folder the hook writes its snapshots to and watches for marks

# The sitecustomize every process of a profiled run imports at start (self-contained: it
# runs in either side's interpreter, where this module is not importable).
HOOK = r'''
import os as _os

if _os.environ.get("DIFFQ_HOST_PROFILE"):
    def _diffq_host_profile():
        import cProfile, gc, marshal, sys, threading, time

        folder = _os.environ["DIFFQ_HOST_PROFILE"]
        profiles, lock = [], threading.Lock()

        def snapshot(mark):
            enabled = gc.isenabled()
            gc.disable()  # no finalizer runs (and no thread switch) while a profile is read
            try:
                with lock:
                    taken = list(profiles)
                threads = {}
                for index, (name, profile) in enumerate(taken):
                    profile.snapshot_stats()
                    threads[f"{index}:{name}"] = {func: row[:4] for func, row in profile.stats.items()}
            finally:
                if enabled:
                    gc.enable()
            path = _os.path.join(folder, f"{_os.getpid()}-{mark}")
            with open(path + ".tmp", "wb") as file:
                marshal.dump({"argv": list(sys.orig_argv), "pid": _os.getpid(), "threads": threads}, file)
            _os.replace(path + ".tmp", path + ".prof")

        def watch():  # not profiled: started before the hook below
            seen = set()
            while True:
                try:
                    marks = sorted(n for n in _os.listdir(folder) if n.startswith("mark-") and n not in seen)
                except OSError:
                    marks = []
                for name in marks:
                    seen.add(name)
                    snapshot(name[len("mark-"):])
                time.sleep(0.05)

        threading.Thread(target=watch, name="host-profile-watch", daemon=True).start()

        def start(*_event):  # a new thread's first profile event
            sys.setprofile(None)
            profile = cProfile.Profile(time.thread_time)
            with lock:
                profiles.append((threading.current_thread().name, profile))
            profile.enable()

        threading.setprofile(start)
        main = cProfile.Profile(time.thread_time)
        profiles.append(("main", main))
        main.enable()

    _diffq_host_profile()
'''

# Once per batch in each process, the denominator of its per-batch figures.
PER_BATCH = {"worker": "_generate_batch", "sink helper": "_store_and_credit"}


def kind(argv: list[str]) -> str:
    text = " ".join(argv)
    if "resource_tracker" in text:
        return "resource tracker"
    if "spawn_main" in text:
        return "worker"
    if "-m" in argv and "sink" in argv[argv.index("-m") + 1]:
        return "sink helper"
    return "runner"


def profiled_run(name: str, diffq: str, model: str, prompts: Path, workdir: Path, marks: list[float]) -> dict:
    """One side's `diffq run`, snapshots taken at each mark; what was asked when."""
    side = workdir / name
    hook, profiles, out = side / "hook", side / "profiles", side / "out"
    for folder in (hook, profiles):
        folder.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    items = sum(1 for line in prompts.read_text().splitlines() if line.strip())
    batches = -(-items // WORKLOAD["batch_size"])
    env = dict(os.environ, PYTHONPATH=str(hook), **{ENV: str(profiles)})
    command = [diffq, "run", str(prompts), "--out", str(out), "--model", model, "--workers", "1",
               "--batch-size", str(WORKLOAD["batch_size"]), "--steps", str(WORKLOAD["steps"]),
               "--height", str(WORKLOAD["height"]), "--width", str(WORKLOAD["width"]),
               "--max-sequence-length", str(WORKLOAD["max_sequence_length"])]
    log = (side / "run.log").open("w")
    started = time.monotonic()
    # Run from the side's own folder: a helper started with `python -m` puts its working
    # directory first on sys.path, and one inside a checkout would import that tree's diffq.
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=side)
    asked = []
    pending = list(enumerate(marks))
    while proc.poll() is None:
        records = out / "records"
        done = len(os.listdir(records)) if records.is_dir() else 0
        while pending and done >= pending[0][1] * batches:
            index, share = pending.pop(0)
            (profiles / f"mark-{index}").touch()
            asked.append({"mark": index, "share": share, "records": done, "at_s": round(time.monotonic() - started, 1)})
        time.sleep(0.05)
    if proc.returncode != 0 or pending:
        raise SystemExit(f"{name}: diffq run exited {proc.returncode} with marks {pending} not reached; see {side}/run.log")
    run = {"side": name, "diffq": diffq, "items": items, "batches": batches, "marks": asked,
           "wall_s": round(time.monotonic() - started, 1)}
    (side / "run.json").write_text(json.dumps(run, indent=1))
    return run


def repo_root(diffq: str) -> Path | None:
    """The source tree the side's editable install points at (its `diffq` package's parent)."""
    python = Path(diffq).with_name("python")
    found = subprocess.run([str(python), "-c", "import diffq, pathlib; print(pathlib.Path(diffq.__file__).parents[1])"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""), cwd="/")
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def renames(a_root: Path, b_root: Path) -> dict[str, str]:
    """B's path -> A's, for the modules moved between the two commits (git's rename detection)."""
    b_commit = subprocess.run(["git", "-C", str(b_root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    listed = subprocess.run(["git", "-C", str(a_root), "diff", "-M", "--name-status", b_commit, "HEAD"],
                            capture_output=True, text=True).stdout
    moved = {}
    for line in listed.splitlines():
        parts = line.split("\t")
        if parts[0].startswith("R") and len(parts) == 3:
            moved[parts[1]] = parts[2]
    return moved


def short(filename: str, root: Path | None, moved: dict[str, str]) -> str:
    """A function's file as both sides can name it: a package's path in site-packages,
    `py:` and the standard library's, or the repository's (B's under A's name if moved)."""
    for marker in ("site-packages/", "/lib/python3."):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else "py:" + tail.split("/", 1)[-1]
    if root is not None and filename.startswith(str(root) + "/"):
        path = filename[len(str(root)) + 1:]
        return moved.get(path, path)
    return filename


def load(side: Path, root: Path | None, moved: dict[str, str]) -> dict[tuple[str, str], dict]:
    """(process kind, mark) -> function (file, name) -> [calls, own seconds], summed over
    the process's threads (and over processes of one kind)."""
    found: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for path in sorted((side / "profiles").glob("*.prof")):
        with path.open("rb") as file:
            snap = marshal.load(file)
        mark = path.stem.split("-", 1)[1]
        table = found[(kind(snap["argv"]), mark)]
        for stats in snap["threads"].values():
            for (filename, _line, function), (_cc, calls, own, _cum) in stats.items():
                row = table[(short(filename, root, moved), function)]
                row[0] += calls
                row[1] += own
    return found


def steady(found: dict, process: str, marks: list[dict]) -> tuple[dict, float, float]:
    """Function -> (calls, own µs) per batch between the first and last mark, the batches,
    and the start's CPU seconds (before the first mark, less its batches at the steady rate)."""
    first, last = str(marks[0]["mark"]), str(marks[-1]["mark"])
    before, after = found.get((process, first), {}), found.get((process, last), {})
    per = PER_BATCH.get(process)

    def done(table: dict, records: int) -> int:
        return sum(table[key][0] for key in table if key[1] == per) if per else records

    batches = done(after, marks[-1]["records"]) - done(before, marks[0]["records"])
    rows = {}
    for key, (calls, own) in after.items():
        calls0, own0 = before.get(key, (0, 0.0))
        if calls - calls0 or own - own0 > 0:
            rows[key] = ((calls - calls0) / batches, (own - own0) * 1e6 / batches)
    per_batch_s = sum(own for _, own in rows.values()) / 1e6
    start_s = sum(own for _, own in before.values()) - done(before, marks[0]["records"]) * per_batch_s
    return rows, batches, start_s


def ours(file: str) -> bool:
    """diffq's own code (either side's tree), not a library's."""
    return file.split("/", 1)[0] in ("diffq", "worker", "producer") or file.startswith("/")


def compare(workdir: Path, sides: list[str], roots: dict[str, Path | None], top: int) -> dict:
    moved = renames(roots[sides[0]], roots[sides[1]]) if len(sides) == 2 and all(roots.values()) else {}
    runs = {name: json.loads((workdir / name / "run.json").read_text()) for name in sides}
    tables = {name: load(workdir / name, roots[name], moved if index else {}) for index, name in enumerate(sides)}
    report: dict = {"runs": runs, "processes": {}}
    for process in ("worker", "sink helper", "runner"):
        per_side = {name: steady(tables[name], process, runs[name]["marks"]) for name in sides}
        keys = set().union(*(rows for rows, _, _ in per_side.values()))
        rows = []
        for key in keys:
            values = [per_side[name][0].get(key, (0.0, 0.0)) for name in sides]
            rows.append({"file": key[0], "function": key[1],
                         **{f"calls_{name}": round(v[0], 2) for name, v in zip(sides, values)},
                         **{f"own_us_{name}": round(v[1], 1) for name, v in zip(sides, values)}})
        delta = (lambda r: r[f"own_us_{sides[0]}"] - r[f"own_us_{sides[1]}"]) if len(sides) == 2 else \
            (lambda r: r[f"own_us_{sides[0]}"])
        rows.sort(key=lambda r: -abs(delta(r)))
        report["processes"][process] = {
            "batches": {name: per_side[name][1] for name in sides},
            "cpu_us_per_batch": {name: round(sum(v[1] for v in per_side[name][0].values()), 1) for name in sides},
            "diffq_us_per_batch": {name: round(sum(v[1] for key, v in per_side[name][0].items() if ours(key[0])), 1)
                                   for name in sides},
            "start_cpu_s": {name: round(per_side[name][2], 2) for name in sides},
            "functions": rows}
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    print(render(report, sides, top))
    return report


def render(report: dict, sides: list[str], top: int) -> str:
    lines = []
    for process, table in report["processes"].items():
        cpu = "  ".join(f"{name} {table['cpu_us_per_batch'][name]:,.0f}" for name in sides)
        own = "  ".join(f"{name} {table['diffq_us_per_batch'][name]:,.0f}" for name in sides)
        start = "  ".join(f"{name} {table['start_cpu_s'][name]:,.2f}" for name in sides)
        batches = "  ".join(f"{name} {table['batches'][name]}" for name in sides)
        lines += ["", f"{process}: CPU µs per batch {cpu}; in diffq's own code {own}; start CPU s {start} "
                      f"(batches between the marks: {batches})",
                  f"  {'own µs/batch':>{13 * len(sides)}}  {'calls/batch':>{11 * len(sides)}}  function"]
        rows = table["functions"]
        for row in [r for r in rows if ours(r["file"])][:top] + [r for r in rows if not ours(r["file"])][:top]:
            own = "".join(f"{row[f'own_us_{name}']:>13,.1f}" for name in sides)
            calls = "".join(f"{row[f'calls_{name}']:>11,.2f}" for name in sides)
            lines.append(f"  {own}  {calls}  {row['file']}:{row['function']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diffq", action="append", required=True, metavar="NAME=PATH",
                        help="a side: its name and its venv's diffq (one or two)")
    parser.add_argument("--model", help="the tiny pipeline's folder (diffq tiny-pipeline DIR --family flux2-klein)")
    parser.add_argument("--prompts", type=Path, help="the prompt file (bench.e2e's write_prompts form)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/diffq-host-profile"))
    parser.add_argument("--marks", default="0.1,0.9", help="the two shares of the run's records between which it counts")
    parser.add_argument("--top", type=int, default=40, help="functions shown per process")
    parser.add_argument("--report-only", action="store_true", help="compare the profiles already in --workdir")
    args = parser.parse_args(argv)
    sides = dict(spec.split("=", 1) for spec in args.diffq)
    marks = [float(share) for share in args.marks.split(",")]
    if not args.report_only:
        if not args.model or not args.prompts:
            parser.error("--model and --prompts are needed to run")
        for name, diffq in sides.items():
            run = profiled_run(name, diffq, args.model, args.prompts, args.workdir, marks)
            print(f"{name}: {run['wall_s']} s, marks {run['marks']}", file=sys.stderr)
    compare(args.workdir, list(sides), {name: repo_root(diffq) for name, diffq in sides.items()}, args.top)


if __name__ == "__main__":
    main()
