"""The backlog service's run metrics at scale: one /metrics scrape of a run of N items.

A run folder of N items is synthesised as `bench.status` makes it (1,024 writers'
progress segments, redeliveries, failed and split batches), listed in a feeds folder,
and a fresh process serves `diffq fleet backlog`'s /metrics collector
(diffq/app/run_metrics.py) over a private redis-server: the first scrape (cold: every
segment read), then a second (warm: nothing changed), each timed over HTTP, and the
process's peak RSS before and after them. The counts scraped are checked against what
the synthesiser wrote.

    python -m bench.run_metrics [--items 30000000] [--writers 1024] [--repeats 3] [--json FILE]

The figure is the median of `--repeats` fresh processes' first scrapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import redis_server

GOALS = {"scrape_s": 1.0, "scrape_mb": 100}
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "scale_run_metrics.json"

CHILD = r"""
import json, sys, threading, time, urllib.request
from diffq.app.backlog import Backlog, serve
from diffq.app.queues import queue_report
from diffq.app.run_metrics import RunMetrics, registry
from diffq.producer.feed import Feeder, registered
from diffq.core.storage import open_storage
broker, feeds = sys.argv[1], sys.argv[2]
# The peak RSS since exec (VmHWM; ru_maxrss would carry the parent's from the fork).
rss = lambda: next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
runs = lambda: [entry.out for entry in registered(open_storage(feeds))]
collector = RunMetrics(runs, queues=lambda: queue_report(broker, timeout=0))
server = serve(Backlog(lambda: {}), "127.0.0.1", 0, metrics=registry(collector))
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
before = rss()
figures = {"rss_before_mb": before}
for name in ("cold", "warm"):
    started, cpu = time.perf_counter(), time.process_time()
    with urllib.request.urlopen(url, timeout=60) as response:
        text = response.read().decode()
    figures[f"{name}_s"] = time.perf_counter() - started
    figures[f"{name}_cpu_s"] = time.process_time() - cpu
    figures[f"{name}_peak_rss_mb"] = rss()
figures["text"] = text
print(json.dumps(figures))
"""


def measure(items: int, writers: int, workdir: Path, repeats: int = 3) -> dict:
    from bench.status import FleetRun
    from diffq.producer.feed import register

    out, feeds = str(workdir / "run"), str(workdir / "feeds")
    started = time.perf_counter()
    run = FleetRun(out, items, writers)
    synth_s = time.perf_counter() - started
    register(feeds, out, "bench")
    runs = []
    with redis_server(workdir) as broker:
        for _ in range(repeats):  # each a fresh process: every first scrape is cold
            result = subprocess.run([sys.executable, "-c", CHILD, broker, feeds], capture_output=True, text=True,
                                    check=True)
            runs.append(json.loads(result.stdout))
    figures = sorted(runs, key=lambda r: r["cold_s"])[len(runs) // 2]  # the median's
    text = figures.pop("text")
    counts = {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("diffq_run_items{")}
    assert sum(counts.values()) == items, counts
    assert (counts["done"] + counts["pending"], counts["failed"]) == run.expected, (counts, run.expected)
    return {"items": items, "writers": writers, "synthesise_s": round(synth_s, 1),
            "scrape_cold_s": round(figures["cold_s"], 3), "scrape_cold_s_all": [round(r["cold_s"], 3) for r in runs], "scrape_cold_cpu_s": round(figures["cold_cpu_s"], 3),
            "scrape_warm_s": round(figures["warm_s"], 3),
            "rss_before_mb": round(figures["rss_before_mb"], 1),
            "peak_rss_mb": round(figures["warm_peak_rss_mb"], 1),
            "scrape_mb": round(figures["warm_peak_rss_mb"] - figures["rss_before_mb"], 1),
            "counts": counts, "load_average": list(os.getloadavg()),
            "command": f"python -m bench.run_metrics --items {items} --writers {writers}"}


def _saved(row: dict | None = None) -> dict | None:
    if row is None and FIGURES.exists():
        row = json.loads(FIGURES.read_text())
    return row


def scale_section(row: dict | None = None) -> list[str]:
    """"Run metrics at scale" (under "Scale"): what one scrape of the backlog service costs."""
    from bench.common import goal_table

    row = _saved(row)
    if not row:
        return []
    return ["### Run metrics at scale", "",
            "The backlog service's `/metrics` (diffq/app/run_metrics.py) over a run folder of "
            f"{row['items']:,} items credited by {row['writers']:,} writers (bench.status's synthesiser), listed in a "
            "feeds folder, a private redis-server as the broker; each a fresh process over HTTP on loopback, 2 cores "
            "shared with other sessions (load: the 1-minute average after). Cold: the process's first scrape "
            "(every progress segment read); warm: the next (nothing changed). Memory: the process's peak RSS "
            "(VmHWM) after both scrapes minus before them.", "",
            "| items | writers | cold scrape s: median (each run) | its CPU s | warm scrape s | scrape MB | "
            "process peak RSS MB | load | command |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {row['items']:,} | {row['writers']:,} | {row['scrape_cold_s']} "
            f"({', '.join(str(v) for v in row['scrape_cold_s_all'])}) | {row['scrape_cold_cpu_s']} | "
            f"{row['scrape_warm_s']} | {row['scrape_mb']} | {row['peak_rss_mb']} | {row['load_average'][0]:.1f} | "
            f"`{row['command']}` |", "",
            *goal_table(scale_goals(row)), ""]


def scale_goals(row: dict | None = None) -> list[tuple[str, bool, str]]:
    row = _saved(row)
    if not row:
        return []
    return [(f"run metrics at {row['items']:,} items: one scrape ≤ {GOALS['scrape_s']:g} s",
             row["scrape_cold_s"] <= GOALS["scrape_s"],
             f"cold {row['scrape_cold_s']} s median ({row['scrape_cold_cpu_s']} CPU s), warm {row['scrape_warm_s']} s"),
            (f"run metrics at {row['items']:,} items: one scrape ≤ {GOALS['scrape_mb']} MB",
             row["scrape_mb"] <= GOALS["scrape_mb"],
             f"{row['scrape_mb']} MB over the process's {row['rss_before_mb']} MB before it "
             f"(peak {row['peak_rss_mb']} MB)")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=30_000_000)
    parser.add_argument("--writers", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(args.items, args.writers, Path(tmp), args.repeats)
    print(json.dumps(row, indent=1))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return row


if __name__ == "__main__":
    main()
