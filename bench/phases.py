"""Where the worker's time between two device calls goes (bench only).

With `DIFFQ_BENCH_PHASES=<folder>` in its environment, a stand-in worker
(bench/standin.py's `device_child_main`, through bench/stamps.py) wraps the steps a batch passes through
(reading the next message off the embedded broker, Celery's request, the task body,
the host's preparation of the call, the hand-off to the sink, the held ack), on
whichever thread runs them (the consumer's, or one of the two task threads), so that
each logs a time stamp on entry and exit. With run-ahead (the default) the next
batch's steps run while the device does, and only what lies between one call's end
and the next call's start shows in the gap; `DIFFQ_RUN_AHEAD_S=0` shows the serial
path, every step in it. The stamps go to
`<folder>/<pid>.stamps` (written out while the device runs, so writing them costs the
gap nothing). `breakdown` cuts the time between one call's end and the next call's
start into the segments between consecutive stamps: every millisecond of the gap falls
into exactly one of them.

    python -m bench.phases [--size 512] [--format jpeg] [--device-s 0.02] [--batches 40] [--json]

runs one `diffq run` of the stand-in, device-bound (T per image well above the host
limit, so the gap is the worker's own time, not waiting for the sink), and prints the
median of each segment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.stamps import DEVICE, ENV, PROFILE_SINK


def read_stamps(folder: Path) -> list[list[tuple[float, str]]]:
    """Each worker process's stamps, in order."""
    out = []
    for path in sorted(folder.glob("*.stamps")):
        rows = []
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                continue
            t, _, label = line.partition(" ")
            rows.append((float(t), label))
        out.append(rows)
    return out


def gaps(stamps: list[tuple[float, str]]) -> list[list[tuple[str, float]]]:
    """Per gap (one call's end to the next call's start): (segment, seconds) in order,
    a segment named by the stamps either side of it."""
    calls = [n for n, (_, label) in enumerate(stamps) if label == DEVICE + "<"]
    out = []
    for end, next_end in zip(calls, calls[1:]):
        start = next((n for n in range(end + 1, next_end) if stamps[n][1] == DEVICE + ">"), None)
        if start is None:
            continue
        out.append([(f"{stamps[n][1]} → {stamps[n + 1][1]}", stamps[n + 1][0] - stamps[n][0])
                    for n in range(end, start)])
    return out


def breakdown(per_gap: list[list[tuple[str, float]]], skip: int = 2) -> dict:
    """Median ms per segment over the gaps (the first `skip` left out: start-up), in
    the order they occur, and the median whole gap."""
    per_gap = per_gap[skip:]
    totals: dict[str, list[float]] = {}
    for segments in per_gap:
        seen: dict[str, float] = {}
        for name, seconds in segments:
            seen[name] = seen.get(name, 0.0) + seconds
        for name, seconds in seen.items():
            totals.setdefault(name, []).append(seconds)
    rows = [{"segment": name, "ms": round(1000 * statistics.median(values + [0.0] * (len(per_gap) - len(values))), 3),
             "mean_ms": round(1000 * sum(values) / len(per_gap), 3), "in_gaps": len(values)}
            for name, values in totals.items()]
    whole = [sum(seconds for _, seconds in segments) for segments in per_gap]
    return {"gaps": len(per_gap), "gap_ms_median": round(1000 * statistics.median(whole), 3) if whole else None,
            "gap_ms_mean": round(1000 * statistics.mean(whole), 3) if whole else None, "segments": rows}


def measure(size: int, fmt: str, device_s: float, batches: int, batch: int = 8, cores: int = 1,
            profile_sink: bool = False) -> dict:
    """One device-bound stand-in run with the stamps on; its breakdown (and, with
    `profile_sink`, the helper's profile: its top functions by own time per batch)."""
    import tempfile

    from bench import device
    from bench.standin import write_standin

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-phases-"))
    folder = workdir / "stamps"
    os.environ[ENV] = str(folder)
    saved_env = {name: os.environ.get(name) for name in (PROFILE_SINK, "PYTHONPATH")}
    if profile_sink:
        os.environ[PROFILE_SINK] = "1"
        # The helper is started as `python -m bench.profiled_sink`: bench must be importable.
        root = str(Path(__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, saved_env["PYTHONPATH"]]))
    try:
        saved = device.MAX_MEASURED, device.MEASURE_S
        device.MAX_MEASURED, device.MEASURE_S = batches, 1e9  # one segment of `batches` batches
        try:
            with device.stdout_to_stderr():
                row = device.sweep(str(write_standin(workdir / "standin")), workdir, str(workdir / "out"),
                                   height=size, width=size, fmt=fmt, batch=batch, target="local", cores=cores,
                                   grid=(device_s,))
        finally:
            device.MAX_MEASURED, device.MEASURE_S = saved
    finally:
        os.environ.pop(ENV, None)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    per_gap = [gap for stamps in read_stamps(folder) for gap in gaps(stamps)]
    return {"size": size, "format": fmt, "batch": batch, "device_s": device_s, **breakdown(per_gap),
            "records_gap_ms": row["gap_ms"][0][1], "load_average": round(os.getloadavg()[0], 2),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "sink_profile": sink_profile(folder, row["images_stored"] // batch) if profile_sink else None}


def sink_profile(folder: Path, batches: int, top: int = 15) -> list[dict]:
    """The helper's functions with the most own time, in ms per batch (cProfile's
    overhead included: read it for where the time goes, not how much)."""
    import pstats

    paths = sorted(folder.glob("sink-*.prof"))
    if not paths:
        return []
    stats = pstats.Stats(*map(str, paths))
    rows = sorted(((value[2], value[3], key) for key, value in stats.stats.items()), reverse=True)[:top]
    return [{"function": f"{Path(key[0]).name}:{key[1]}({key[2]})", "own_ms_per_batch": round(1000 * own / batches, 3),
             "cumulative_ms_per_batch": round(1000 * cumulative / batches, 3)} for own, cumulative, key in rows]


def render(result: dict) -> list[str]:
    mode = ("" if "run_ahead_s" not in result else
            "serial path (`DIFFQ_RUN_AHEAD_S=0`), " if result["run_ahead_s"] == 0 else "run-ahead (the default), ")
    lines = [f"{mode}{result['size']}² {result['format']}, batch {result['batch']}, T = {1000 * result['device_s']:.0f} ms "
             f"per image: {result['gaps']} gaps, median {result['gap_ms_median']} ms (records: "
             f"{result['records_gap_ms']} ms), load {result['load_average']}", "",
             "| segment (stamp → stamp) | median ms | mean ms |", "|---|---|---|"]
    lines += [f"| {row['segment']} | {row['ms']:.3f} | {row['mean_ms']:.3f} |" for row in result["segments"]]
    if result.get("sink_profile"):
        lines += ["", "Sink helper (cProfile, all threads): own ms per batch", "",
                  "| function | own ms / batch | cumulative ms / batch |", "|---|---|---|"]
        lines += [f"| {row['function']} | {row['own_ms_per_batch']:.3f} | {row['cumulative_ms_per_batch']:.3f} |"
                  for row in result["sink_profile"]]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--format", default="jpeg")
    parser.add_argument("--device-s", type=float, default=0.02, help="seconds per image (device-bound)")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile-sink", action="store_true", help="also profile the sink helper (cProfile)")
    args = parser.parse_args(argv)
    result = measure(args.size, args.format, args.device_s, args.batches, args.batch, profile_sink=args.profile_sink)
    from diffq.core.settings import get_settings

    result["run_ahead_s"] = get_settings().run_ahead_s  # 0: the serial path, one batch in hand
    print(json.dumps(result) if args.json else "\n".join(render(result)))
    return result


if __name__ == "__main__":
    main()
