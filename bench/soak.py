"""Soak: does a worker's memory creep over many batches? (issue 64)

Runs the worker's host side for N batches (default 20,000) in this process: each batch
over one of several LoRA adapter sets (more sets than the metrics label, so the `other`
cap is crossed), its images stored, recorded and credited by the real sink
(worker/sink/store.py: encode, put, progress log), its metrics observed as the batch
hook does (per queue and per set), and every `--refresh-every` batches the progress
summary refreshed as `status`, `watch` and the runner do. The process's RSS is sampled
every `--sample-every` batches; the report is the peak and the growth per 1,000 batches
after warm-up (a least-squares slope over the samples after the first quarter).

Then the backlog service's run metrics (diffq/app/run_metrics.py, the collector its
/metrics serves) over a simulated day of scrapes (`--scrapes`, default 5,760: one per
15 s): a run starts every simulated hour and is credited a few batches a scrape, leaves
the feeds listing finished after three hours, and every fourth one leaves unfinished
and then has its folder deleted (an abandoned run); RSS per 1,000 scrapes the same way.

Not in it: the pipeline itself (its memory is the device's and is fixed once compiled).

`--whole`: the worker as it runs, instead: a real `diffq run` on the embedded broker (the
runner with its supervisor, the worker process with the pipeline, its sink helper
process) over the tiny pipeline (built offline, `diffq tiny-pipeline`), 2 images a batch
round robin over 40 tiny LoRA adapter sets (`diffq tiny-lora`), a quarter of the batches
at a second size whose speed-up differs (a hand-written speed-up profile: a speed-up is
per run, or per shape through a profile, never per row). Every `--every` seconds the RSS
of each process in the run's tree is read from /proc, by role (runner, worker, sink
helper, multiprocessing's resource tracker; device memory per process from nvidia-smi
where there is one), against the batches done (the run's progress summary). The report
per role: RSS at its first sample, the peak, the growth per 1,000 batches after warm-up.

    python -m bench.soak                 # 20,000 batches, a day of scrapes
    python -m bench.soak --quick         # 600 batches, 600 scrapes: a smoke run
    python -m bench.soak --whole         # a real `diffq run` of 20,000 batches, per process
    python -m bench.soak --whole --quick # 200 batches of it
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

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int | str = "self") -> float:
    """A process's resident set in MB (OSError once it is gone)."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


def growth_per_1000(samples: list[tuple[int, float]], warmup: float = 0.25) -> float:
    """MB per 1,000 batches: the slope of RSS over batches after the first `warmup` of the run."""
    kept = [(b, mb) for b, mb in samples if b >= warmup * samples[-1][0]]
    if len(kept) < 2:
        return 0.0
    x, y = np.array([b for b, _ in kept], float), np.array([mb for _, mb in kept])
    return float(np.polyfit(x, y, 1)[0] * 1000)


def soak(out: str, batches: int, sets: int = 40, items: int = 2, side: int = 16, sample_every: int = 100,
         refresh_every: int = 50) -> dict:
    from diffq.core.adapters import set_digest
    from diffq.core.contract import AdapterRef, BatchItem, BatchMessage, BatchParams, ShapeKey
    from diffq.core.progress import ProgressSummary
    from diffq.core.storage import open_storage
    from diffq.worker.observe import metrics
    from diffq.worker.sink.store import Sink

    storage = open_storage(out)
    shape = ShapeKey(model="soak", height=side, width=side, batch_size=items, max_sequence_length=64, cfg=False)
    adapter_sets = [(AdapterRef(path=f"s3://loras/style-{n}.safetensors", revision=f"sha256:{n:032x}",
                                scale=1.0),) for n in range(sets)]
    params = [BatchParams(num_inference_steps=2, guidance_scale=1.0, adapters=refs) for refs in adapter_sets]
    digests = [set_digest(refs) for refs in adapter_sets]
    images = [np.full((side, side, 3), n, np.uint8) for n in range(items)]
    measures = {"device": "cpu:0", "worker": "soak", "generate_s": 0.01, "generate_started_at": 1.7e9,
                "generate_ended_at": 1.7e9 + 0.01, "lora_mode": "swap"}
    sink, summary = Sink(threads=2), ProgressSummary(storage)
    samples: list[tuple[int, float]] = [(0, rss_mb())]
    started = time.perf_counter()
    try:
        for b in range(batches):
            n = b % sets
            message = BatchMessage(run_id="soak", out=storage.url, batch_id=f"{shape.height}x{shape.width}-soak-{b:07d}",
                                   shape=shape, params=params[n],
                                   items=[BatchItem(id=f"i{b}-{k}", prompt="p", seed=k) for k in range(items)])
            handed = sink.submit(storage, message, images, measures)
            handed.stored.result(timeout=120)
            handed.credited.result(timeout=120)
            metrics.observe_batch(shape.queue, items, 0.01, digests[n])
            if (b + 1) % refresh_every == 0:
                summary.refresh()
            if (b + 1) % sample_every == 0:
                samples.append((b + 1, rss_mb()))
    finally:
        sink.close()
    summary.refresh()
    return {"batches": batches, "sets": sets, "done": summary.done,
            "done_per_set": len([d for d in summary.done_per_set if d]),
            "seconds": round(time.perf_counter() - started, 1), "rss_start_mb": round(samples[0][1], 1),
            "rss_peak_mb": round(max(mb for _, mb in samples), 1),
            "growth_mb_per_1000_batches": round(growth_per_1000(samples), 3)}


def backlog_soak(root: str, scrapes: int, every_s: float = 15.0, sample_every: int = 50) -> dict:
    from prometheus_client import generate_latest

    from bench.common import run_defaults
    from diffq.app.run_metrics import RunMetrics, registry
    from diffq.core import layout
    from diffq.core.contract import ShapeKey
    from diffq.core.progress import ProgressLog
    from diffq.core.records import RunManifest, ShapeSummary
    from diffq.core.storage import open_storage

    shape = ShapeKey(model="soak", height=64, width=64, batch_size=4, max_sequence_length=64, cfg=False)
    per_hour, life_scrapes, batches = int(3600 / every_s), int(3 * 3600 / every_s), 2000
    listed: dict[str, tuple] = {}  # out -> (log, next batch, scrape it started, abandoned)
    clock = [1.7e9]
    metrics = RunMetrics(runs=lambda: list(listed), clock=lambda: clock[0])
    reg = registry(metrics)
    samples: list[tuple[int, float]] = [(0, rss_mb())]
    started, runs = time.perf_counter(), 0
    for n in range(scrapes):
        clock[0] += every_s
        if n % per_hour == 0:
            out = str(Path(root) / f"run-{runs}")
            storage = open_storage(out)
            storage.put_bytes(layout.MANIFEST, RunManifest(
                run_id=f"soak-{runs}", created_at=clock[0], source="soak.jsonl", out=storage.url,
                total=batches * 4, batches=batches, plan_parts=0,
                shapes=[ShapeSummary(shape=shape, queue=shape.queue, items=batches * 4, batches=batches)],
                defaults=run_defaults(shape), diffq_version="soak").model_dump_json().encode())
            listed[out] = (ProgressLog(storage, writer="w"), 0, n, runs % 4 == 3)
            runs += 1
        for out, (log, at, since, abandoned) in list(listed.items()):
            rate = max(1, batches // life_scrapes + 1)
            take = min(batches - at, rate // 2 if abandoned else rate)  # an abandoned run never finishes
            for index in range(at, at + take):
                log.add(f"soak-{index:05d}", shape.queue, ["x"] * 4)
            if take:
                log.flush()
            listed[out] = (log, at + take, since, abandoned)
            if n - since >= life_scrapes:
                del listed[out]  # leaves the feeds listing: finished, or abandoned and deleted
                if abandoned:
                    shutil.rmtree(out, ignore_errors=True)
        generate_latest(reg)
        if (n + 1) % sample_every == 0:
            samples.append((n + 1, rss_mb()))
    return {"scrapes": scrapes, "runs": runs, "runs_held": len(metrics._runs),
            "seconds": round(time.perf_counter() - started, 1), "rss_start_mb": round(samples[0][1], 1),
            "rss_peak_mb": round(max(mb for _, mb in samples), 1),
            "growth_mb_per_1000_scrapes": round(growth_per_1000(samples), 3)}


# --- the whole worker (--whole): a real `diffq run`, each process of its tree ---------------

RUNNER, WORKER, SINK_HELPER, TRACKER = "runner", "worker", "sink helper", "resource tracker"


def role_of(cmdline: list[str], is_root: bool) -> str:
    """What a process of a `diffq run` tree is, from its command line: the root is the
    runner (it holds the supervisor); the supervisor's children are spawned by
    multiprocessing (worker/process/supervisor.py), the sink helper is started as a
    module (worker/sink/helper.py), and spawning starts multiprocessing's resource
    tracker. Anything else is named by its program."""
    joined = " ".join(cmdline)
    if is_root:
        return RUNNER
    if "diffq.worker.sink.helper" in joined:
        return SINK_HELPER
    if "resource_tracker" in joined:
        return TRACKER
    if "multiprocessing.spawn" in joined or "--multiprocessing-fork" in cmdline:
        return WORKER
    return "other: " + (Path(cmdline[0]).name if cmdline else "?")


def process_tree(root: int) -> dict[int, list[str]]:
    """pid -> command line, for `root` and every process below it (read from /proc: the
    parent of each process, in field 4 of its stat, after the command's parentheses)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    parents[int(entry.name)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                tree[pid] = [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
        except OSError:
            continue
        frontier.extend(child for child, parent in parents.items() if parent == pid)
    return tree


def device_mb() -> dict[int, float]:
    """pid -> device memory in MB where nvidia-smi answers; {} elsewhere."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in text.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and used.strip().replace(".", "", 1).isdigit():
            found[int(pid)] = float(used)
    return found


def sample_tree(root: int) -> dict[str, dict]:
    """role -> {"rss_mb": summed over its processes, "pids": [...], "device_mb"?} for the
    processes under `root` now (one process per role in a healthy run; a restarted
    sink helper shows as another pid)."""
    device = device_mb()
    roles: dict[str, dict] = {}
    for pid, cmdline in process_tree(root).items():
        try:
            rss = rss_mb(pid)
        except OSError:
            continue  # gone meanwhile
        role = roles.setdefault(role_of(cmdline, pid == root), {"rss_mb": 0.0, "pids": []})
        role["rss_mb"] += rss
        role["pids"].append(pid)
        if pid in device:
            role["device_mb"] = role.get("device_mb", 0.0) + device[pid]
    return roles


def roles_report(samples: list[tuple[int, dict[str, dict]]], warmup: float = 0.25) -> dict[str, dict]:
    """Per role over the samples (batches done, sample_tree's answer): RSS at its first
    sample, the peak, growth per 1,000 batches after the first `warmup` of the run (the
    slope `growth_per_1000` fits), the pids it had; device memory the same where sampled."""
    last = samples[-1][0] if samples else 0
    report: dict[str, dict] = {}
    for role in sorted({role for _, roles in samples for role in roles}):
        for key, suffix in (("rss_mb", "rss"), ("device_mb", "device")):
            series = [(batches, roles[role][key]) for batches, roles in samples if key in roles.get(role, {})]
            if not series:
                continue
            kept = [(b, mb) for b, mb in series if b >= warmup * last]
            entry = report.setdefault(role, {})
            entry.update({f"{suffix}_start_mb": round(series[0][1], 1),
                          f"{suffix}_peak_mb": round(max(mb for _, mb in series), 1),
                          f"{suffix}_growth_mb_per_1000_batches": round(growth_per_1000(kept, warmup=0.0), 3)})
        report[role]["pids"] = sorted({pid for _, roles in samples for pid in roles.get(role, {}).get("pids", ())})
    return report


# The second size's speed-up: a step cache whose hooks and state live across calls
# (diffusers' TaylorSeer, reset before every call by worker/device/speedups.py).
WHOLE_SPEEDUP = "taylorseer:use_lite_mode=true"


def whole_inputs(root: Path, model: str, batches: int, sets: int, batch_size: int, sizes: tuple[int, int],
                 steps: int) -> tuple[Path, Path]:
    """The prompts (round robin over `sets` tiny adapters, `batch_size` rows a set each
    round, every 4th round at the second size: each set at both sizes) and the speed-up
    profile that gives the second size its speed-up."""
    from diffq.app.tiny import build_tiny_lora
    from diffq.core.profile import Budget, Candidate, ShapeChoice, SpeedupProfile

    adapters = [str(build_tiny_lora(model, root / "loras" / f"a{k:02d}.safetensors", rank=4, seed=k))
                for k in range(sets)]
    profile = root / "profile.json"
    SpeedupProfile(model=model, device="cpu", compile="none", steps=steps, budget=Budget(min_psnr=0, min_ssim=0),
                   shapes=[ShapeChoice(height=side, width=side, chosen=Candidate(
                       speedup=spec, batch_size=batch_size, seconds_per_image=0.0))
                       for side, spec in ((sizes[0], None), (sizes[1], WHOLE_SPEEDUP))]).dump(profile)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as rows:
        for i in range(batches * batch_size):
            side = sizes[1] if (i // (batch_size * sets)) % 4 == 3 else sizes[0]
            rows.write(json.dumps({"id": f"r{i:07d}", "prompt": f"a small red house, study {i}", "seed": i,
                                   "height": side, "width": side, "lora": adapters[i % sets]}) + "\n")
    return prompts, profile


def whole_soak(root: str | Path, batches: int, *, model: str | None = None, sets: int = 40, batch_size: int = 2,
               sizes: tuple[int, int] = (16, 32), steps: int = 1, compile: str = "none", every_s: float = 5.0) -> dict:
    """A real `diffq run` of `batches` batches; its process tree's memory by role every
    `every_s` seconds (see the module's docstring)."""
    from diffq.app.tiny import build_tiny_pipeline
    from diffq.core import layout
    from diffq.core.progress import ProgressSummary
    from diffq.core.runfolder import read_manifest
    from diffq.core.storage import open_storage

    root = Path(root)
    model = model or str(build_tiny_pipeline(root / "model"))
    prompts, profile = whole_inputs(root, model, batches, sets, batch_size, sizes, steps)
    out, log_path = root / "run", root / "run.log"
    command = [sys.executable, "-m", "diffq", "run", str(prompts), "--model", model, "--out", str(out),
               "--workers", "1", "--batch-size", "auto", "--speedup", str(profile), "--steps", str(steps),
               "--compile", compile, "--no-progress"]
    summary, samples = None, []
    load = [round(os.getloadavg()[0], 2)]
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            while proc.poll() is None:
                if summary is None and (out / layout.MANIFEST).exists():
                    summary = ProgressSummary(open_storage(str(out)))
                done = summary.refresh().done // batch_size if summary is not None else 0
                roles = sample_tree(proc.pid)
                if roles and proc.poll() is None:
                    samples.append((done, roles))
                time.sleep(every_s)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=120)
    wall = time.perf_counter() - started
    load.append(round(os.getloadavg()[0], 2))
    if proc.returncode:
        raise RuntimeError(f"diffq run failed ({proc.returncode}): {log_path.read_text()[-3000:]}")
    storage = open_storage(str(out))
    summary, planned = ProgressSummary(storage).refresh(), read_manifest(storage).batches
    # Warm-up counts from the first batch done: loading the model and the adapters
    # before it is start-up, not growth.
    working = [(b, roles) for b, roles in samples if b > 0]
    return {"batches": planned, "images": summary.done, "failed": summary.failed, "sets": sets,
            "sizes": [f"{side}x{side}" for side in sizes], "speedup": {f"{sizes[1]}x{sizes[1]}": WHOLE_SPEEDUP},
            "steps": steps, "compile": compile, "seconds": round(wall, 1), "samples": len(samples),
            "batches_per_s": round(planned / wall, 2), "load_average": load,
            "processes": roles_report(working),
            "series": {role: [[b, round(roles[role]["rss_mb"], 1)] for b, roles in samples if role in roles]
                       for role in sorted({role for _, roles in samples for role in roles})}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--sets", type=int, default=40, help="adapter sets, round robin (past the 32-label cap)")
    parser.add_argument("--scrapes", type=int, default=5760, help="backlog scrapes, 15 s apart (a day: 5,760)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 600 batches and 600 scrapes (--whole: 200 batches)")
    parser.add_argument("--out", help="run folder (--whole: the folder of the model, adapters and run; default: "
                                       "a temporary one, removed after)")
    parser.add_argument("--whole", action="store_true",
                        help="a real `diffq run` (runner, worker, sink helper), each process's memory")
    parser.add_argument("--every", type=float, default=5.0, help="--whole: seconds between samples")
    parser.add_argument("--steps", type=int, default=1, help="--whole: denoising steps")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="diffq-soak-"))
    if args.whole:
        batches = 200 if args.quick else args.batches
        try:
            result = {"whole": whole_soak(args.out or workdir, batches, sets=args.sets, steps=args.steps,
                                          every_s=args.every)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        result["command"] = "python -m bench.soak --whole" + (" --quick" if args.quick else f" --batches {batches}")
        print(json.dumps(result))
        return result
    batches = 600 if args.quick else args.batches
    try:
        result = {"worker": soak(args.out or str(workdir / "run"), batches, sets=args.sets,
                                 sample_every=max(10, batches // 200))}
        scrapes = 600 if args.quick else args.scrapes
        if scrapes:
            result["backlog"] = backlog_soak(str(workdir / "backlog"), scrapes, sample_every=max(10, scrapes // 200))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["command"] = "python -m bench.soak" + (" --quick" if args.quick else f" --batches {batches}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
