"""Parallel export: N `diffq export --shard i/N` processes splitting one run.

A synthesised run folder (images of noise PNG, one record per batch of 8, as the
sink leaves them) is exported once whole, then by N processes at once for each N;
each process is timed as a whole (`/usr/bin/time`: wall, CPU, peak RSS). The union
of the N outputs is checked byte for byte against the single export's. The
exports go to /dev/shm by default: on a shared local disk the writes are the bound.

    python -m bench.export [--images 4000] [--side 512] [--formats webdataset,parquet,imagefolder]
                           [--shards 1,2,4] [--repeats 1] [--json FILE] [--plot PNG]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH = 8


def synthesise(out: str, images: int, side: int, distinct: int = 64) -> int:
    """The run folder; returns its image bytes. `distinct` encoded images are reused
    (their files are distinct) so synthesising stays quick."""
    import numpy as np
    from PIL import Image

    from diffq.core import layout
    from diffq.core.contract import ShapeKey
    from diffq.core.records import ImageRecord, RunManifest, ShapeSummary, jsonl
    from diffq.core.storage import open_storage
    from bench.common import run_defaults

    storage = open_storage(out)
    shape = ShapeKey(model="/models/bench", height=side, width=side, batch_size=BATCH, max_sequence_length=64,
                     cfg=False)
    storage.put_bytes(layout.MANIFEST, RunManifest(
        run_id="bench", created_at=0.0, source="bench.jsonl", out=storage.url, total=images,
        batches=-(-images // BATCH), plan_parts=1, defaults=run_defaults(shape), diffq_version="bench",
        shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=images, batches=-(-images // BATCH))]
    ).model_dump_json().encode())
    rng = np.random.default_rng(0)
    encoded = []
    for _ in range(distinct):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, "PNG", compress_level=1)
        encoded.append(buffer.getvalue())
    total = 0
    for start in range(0, images, BATCH):
        batch_id = f"{side}x{side}-bench0-{start // BATCH:07d}"
        records = []
        for i in range(start, min(start + BATCH, images)):
            key = layout.image_key(f"item-{i:08d}", "png")
            data = encoded[i % distinct]
            storage.put_bytes(key, data)
            total += len(data)
            records.append(ImageRecord(
                file_name=key, id=f"item-{i:08d}", prompt=f"a prompt of about this length, number {i}", seed=i,
                height=side, width=side, steps=4, guidance_scale=1.0, model=shape.model, run_id="bench",
                batch_id=batch_id, queue=shape.queue, device="cpu:0", worker="w@host", generate_s=0.2,
                generate_started_at=1.7e9 + i, generate_ended_at=1.7e9 + i + 0.2, store_s=0.05,
                finished_at=1.7e9 + i + 0.25))
        storage.put_bytes(layout.record_key(batch_id), jsonl(records))
    return total


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def start_cpu_s(repeats: int = 3) -> float:
    """CPU seconds of `diffq export --help`: the interpreter and imports every exporter pays once."""
    cpu = []
    for _ in range(repeats):
        proc = subprocess.run(["/usr/bin/time", "-f", "%U %S", sys.executable, "-m", "diffq", "export", "--help"],
                              capture_output=True, text=True, check=True)
        cpu.append(sum(float(x) for x in proc.stderr.strip().splitlines()[-1].split()))
    return statistics.median(cpu)


def union(dest: Path, n: int) -> dict[str, str]:
    """The files of N shards' outputs DEST/0 … DEST/N-1 together; no file written twice."""
    files: dict[str, str] = {}
    for i in range(n):
        part = digest(dest / str(i))
        assert not files.keys() & part.keys(), "two shards wrote one file"
        files |= part
    return files


def exporters(run: str, dest: Path, fmt: str, n: int, shard_size: int, at_once: bool = True) -> list[dict]:
    """N export processes, shard i/N each into DEST/i, all at once or one after
    another (each alone: what one exporter does with a core of its own); their timings."""
    procs, done = [], []
    for i in range(n):
        command = ["/usr/bin/time", "-f", "%e %U %S %M", sys.executable, "-m", "diffq", "export", run,
                   str(dest / str(i)), "--format", fmt, "--shard-size", str(shard_size), "--no-progress"]
        if n > 1:
            command += ["--shard", f"{i}/{n}"]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if not at_once:
            done.append(procs[-1].communicate())
    rows = []
    for proc, outputs in zip(procs, done or [proc.communicate() for proc in procs]):
        stdout, stderr = outputs
        if proc.returncode:
            raise RuntimeError(f"export failed: {stderr}")
        wall, user, system, kb = stderr.strip().splitlines()[-1].split()
        images = int(stdout.split()[0])
        rows.append({"wall_s": float(wall), "cpu_s": float(user) + float(system), "peak_rss_mb": int(kb) / 1024,
                     "images": images})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Images/s of N exporters at once, of N × one part run alone (N free cores), and
    N × the single export (dotted: linear scaling)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    for fmt, color in zip(sorted({r["format"] for r in rows}), ("#3465a4", "#73d216", "#f57900")):
        mine = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["exporters"])
        ns = [r["exporters"] for r in mine]
        ax.plot(ns, [r["images_per_s"] for r in mine], "o-", color=color, label=f"{fmt}, N at once")
        ax.plot(ns, [r["alone_per_exporter_images_per_s"] * r["exporters"] for r in mine], "s--", color=color,
                lw=0.8, label=f"{fmt}, N × one part alone")
        ax.plot(ns, [mine[0]["images_per_s"] * n for n in ns], ":", color=color, lw=0.6)
    ax.axvline(os.cpu_count() or 1, color="#888a85", lw=0.8, ls="--", label="cores")
    ax.set_xticks(sorted({r["exporters"] for r in rows}))
    ax.set_xlabel("exporters N (--shard i/N)")
    ax.set_ylabel("images/s, all exporters")
    ax.set_ylim(0, None)
    ax.legend(fontsize=7)
    loads = ", ".join(f"{r['load_average'][0]:.1f}" for r in rows)
    ax.set_title(f"export scaling, 2 shared cores (dotted: N × one exporter)\n1-min load average per point: {loads}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def render(rows: list[dict]) -> list[str]:
    """The Scale section's export table (Markdown lines)."""
    lines = ["| format | N | at once: images/s, all (× one) | at once: per exporter | alone: images/s per "
             "exporter | alone: CPU s of all N parts (× single; less start-ups) | peak RSS MB | union = single "
             "| load average | command |", "|---|---|---|---|---|---|---|---|---|---|"]
    one = {r["format"]: r["images_per_s"] for r in rows if r["exporters"] == 1}
    for r in rows:
        lines.append(f"| {r['format']} | {r['exporters']} | {r['images_per_s']:.0f} "
                     f"({r['images_per_s'] / one[r['format']]:.2f}) | {r['per_exporter_images_per_s']:.0f} | "
                     f"{r['alone_per_exporter_images_per_s']:.0f} | {r['alone_cpu_s_all']:.1f} "
                     f"({r['alone_cpu_over_single']:.2f}; {r['alone_net_cpu_over_single']:.2f}) | "
                     f"{r['peak_rss_mb']:.0f} | "
                     f"{'yes' if r['union_identical'] else 'no'} | {' '.join(f'{x:.1f}' for x in r['load_average'])} "
                     f"| `{r['command']}` |")
    return lines


# The Scale section's part (docs/BENCHMARKS.md), from the rows `--json` keeps.
SCALE_JSON = Path(__file__).resolve().parents[1] / "docs" / "scale_export.json"
SCALE_PROSE = """`diffq export OUT DEST --shard I/N` writes the files of a single export whose number k
has k mod N = I (imagefolder: the images at positions k·`--shard-size` …; part 0 also
writes `metadata.jsonl`); `diffq fetch --shard I/N` splits the same way. Each part
reads every record file (a record's position is the count of images before it) and
parses, fetches and writes only its own; a root batch's records sort together, so items
are deduplicated per root instead of by a run-wide set. How to run N parts as an
indexed Kubernetes Job (`completionMode: Indexed`, `--shard $(JOB_COMPLETION_INDEX)/N`):
docs/fleet.md "Exporting with N machines: an indexed Job". Each row: noise PNGs (see its command)
from a local run folder into /dev/shm (the local disk, shared with the other jobs,
bounded the writes), N exporters at once (median of 2), then each of the N parts alone
one after another; the union of the N outputs was checked byte for byte against the
single export's at every N, for each format. Machine and load: as in the status part
above."""
LIMITS = """Limits: every part lists and reads every record file (at 10M images, 1.25M small GETs
per part), so past a few dozen parts the record reads, not the images, bound a part;
parquet holds a row group of `chunk` (128) images and its writer's buffers (its peak
RSS above). Exporters that see different records (a run still going) disagree on
positions: export a finished run, and check that every part prints the same `of T
images`."""


def scale_goals(rows: list[dict] | None = None) -> list[tuple[str, bool, str]]:
    """Issue 27's export goals, judged on the rows (default: docs/scale_export.json)."""
    rows = json.loads(SCALE_JSON.read_text()) if rows is None else rows
    one = {r["format"]: r["images_per_s"] for r in rows if r["exporters"] == 1}
    split = [r for r in rows if r["exporters"] > 1]
    ratios = [r["images_per_s"] / one[r["format"]] for r in split]
    net = [r["alone_net_cpu_over_single"] for r in split]
    loads = [r["load_average"][0] for r in rows]
    scaled = all(r["images_per_s"] >= 0.8 * one[r["format"]] * min(r["exporters"], os.cpu_count() or 1)
                 for r in split)
    return [("export: the union of N shards' output is byte-identical to a single export's",
             all(r["union_identical"] for r in rows),
             f"every row of the export table ({', '.join(sorted(one))}; N = "
             f"{', '.join(str(n) for n in sorted({r['exporters'] for r in split}))}); tests/test_export.py also for "
             "40 shards of 20 files, shards writing at once into one S3 prefix, and fetch"),
            ("export: images/s per exporter scales with N up to the cores", scaled,
             f"not shown here: with the cores already taken (load {min(loads):.0f}–{max(loads):.0f}), N at once "
             f"shares what is left: {min(ratios):.2f}–{max(ratios):.2f} × one exporter. What splitting costs is "
             f"small: the N parts run alone took {min(net):.1f}–{max(net):.1f} × the single export's CPU once each "
             f"process's start (~{rows[0]['start_cpu_s']:.1f} CPU s) is taken off, within this machine's run-to-run "
             "spread (two runs of the single export differ by up to 30 % in CPU). Parts share nothing but the "
             "storage, so on free cores the rate is N × one part's" if not scaled else
             f"N at once: {min(ratios):.2f}–{max(ratios):.2f} × one exporter")]


def scale_section(rows: list[dict] | None = None) -> list[str]:
    """The Scale section's export part: prose, table, plot, goals, limits."""
    from bench.common import goal_table

    rows = json.loads(SCALE_JSON.read_text()) if rows is None else rows
    return ["### Parallel export and fetch", "", *SCALE_PROSE.splitlines(), "", *render(rows), "",
            "![export scaling](scale_export.png)", "", *goal_table(scale_goals(rows)), "", *LIMITS.splitlines(), ""]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--side", type=int, default=512, help="image side (noise PNG: about side² × 3 bytes)")
    parser.add_argument("--formats", default="webdataset,parquet,imagefolder")
    parser.add_argument("--shards", default="1,2,4", help="exporter counts N")
    parser.add_argument("--shard-size", type=int, default=100, help="images per tar / Parquet file")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each N (the median's figures are kept)")
    parser.add_argument("--dest-root", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                        help="where the exports are written (default /dev/shm: a local disk shared with other "
                             "jobs bounds the writes, not the exporters)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--plot", type=Path, help="plot the rows here")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-export-"))
    outputs = Path(tempfile.mkdtemp(prefix="diffq-bench-export-", dir=args.dest_root))
    run = str(workdir / "run")
    image_bytes = synthesise(run, args.images, args.side)
    start = start_cpu_s()
    rows = []
    try:
        for fmt in args.formats.split(","):
            reference = None
            # N = 1 first: the single export the others' unions must equal.
            for n in sorted({1, *(int(x) for x in args.shards.split(","))}):
                dest = outputs / f"{fmt}-{n}"
                walls, runs = [], []
                for _ in range(args.repeats):
                    shutil.rmtree(dest, ignore_errors=True)
                    started = time.perf_counter()
                    runs.append(exporters(run, dest, fmt, n, args.shard_size))
                    walls.append(time.perf_counter() - started)
                wall = statistics.median(walls)
                timings = runs[walls.index(sorted(walls)[len(walls) // 2])]
                files = union(dest, n)
                if reference is None:
                    reference, single_cpu = files, timings[0]["cpu_s"]
                assert files == reference, f"{fmt}: the union of {n} shards differs from a single export"
                assert sum(t["images"] for t in timings) == args.images
                shutil.rmtree(dest)
                alone = exporters(run, dest, fmt, n, args.shard_size, at_once=False)
                assert union(dest, n) == reference
                row = {"format": fmt, "exporters": n, "images": args.images, "image_mb": round(image_bytes / 1e6),
                       "wall_s": round(wall, 2), "wall_s_all": [round(w, 2) for w in walls],
                       "images_per_s": round(args.images / wall, 1),
                       "per_exporter_images_per_s": round(args.images / n / max(t["wall_s"] for t in timings), 1),
                       "cpu_s_per_exporter": round(max(t["cpu_s"] for t in timings), 2),
                       # Each exporter alone (one after another): its rate, and the CPU of all N
                       # parts over the single export's (what splitting costs: start-up, counting).
                       "alone_per_exporter_images_per_s": round(statistics.mean(
                           t["images"] / t["wall_s"] for t in alone), 1),
                       "alone_cpu_s_all": round(sum(t["cpu_s"] for t in alone), 2),
                       "alone_cpu_over_single": round(sum(t["cpu_s"] for t in alone) / single_cpu, 2),
                       # The same less each process's start (`diffq export --help`): the split's own cost.
                       "start_cpu_s": start,
                       "alone_net_cpu_over_single": round((sum(t["cpu_s"] for t in alone) - n * start)
                                                          / (single_cpu - start), 2),
                       "peak_rss_mb": round(max(t["peak_rss_mb"] for t in timings), 1),
                       "union_identical": True, "files": len(files), "dest": str(args.dest_root or "tmp"),
                       "load_average": [round(x, 2) for x in os.getloadavg()],
                       "command": f"python -m bench.export --images {args.images} --side {args.side} "
                                  f"--formats {fmt} --shards {args.shards} --repeats {args.repeats}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(outputs, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    print("\n".join(render(rows)))
    return rows


if __name__ == "__main__":
    main()
