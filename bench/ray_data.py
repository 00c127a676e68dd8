"""Against Ray Data: diffq's steady-state images/s beside `ray.data` `map_batches`
over an actor pool holding the same pipeline, with the same number of processes.

Both sides do the same work per batch: the tiny Flux2-klein pipeline (bench.e2e's
WORKLOAD), one CPU generator per item seeded from the item's seed (derive_seed with
the same seed base on both sides), PIL output, PNG encode at compress_level 1, one
file per image and one record line per image (records/<batch>.jsonl, the run-folder
layout, so bench.e2e's idle-gap reader works on both). Ray reads the same JSONL of
prompts; each actor takes one CPU and one torch thread, like a diffq worker.

Throughput is marginal, as in bench.e2e: runs of N and 2N items, (2N − N) / (t2N − tN),
so start-up (actor or worker spawn, imports, pipeline load) cancels and is reported
on its own. Ray's cluster start (ray.init) happens once and is reported apart.

Needs the bench extra (`pip install -e ".[bench]"`); without Ray it prints why and
returns no rows.

    python -m bench.ray_data [--quick] [--items 192] [--repeats 3] [--workers 1,2]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.e2e import WORKLOAD, diffq_run, marginal, marginal_arguments, timeline, write_prompts

# Both sides derive per-item seeds from this, so they generate the same images.
SEED_BASE = "bench"
FORMAT = "png"


class RayImageWriter:
    """One Ray actor: loads the pipeline once, then generates, encodes and writes
    each batch it is handed, synchronously (what a plain Ray Data user writes)."""

    def __init__(self, model: str, out: str):
        import torch

        torch.set_num_threads(1)
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        self.pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.float32, local_files_only=True)
        self.pipe.set_progress_bar_config(disable=True)
        self.model = model
        self.out = Path(out)
        (self.out / "images").mkdir(parents=True, exist_ok=True)
        (self.out / "records").mkdir(parents=True, exist_ok=True)
        self.worker = f"ray-actor-{os.getpid()}"
        self.batches = 0

    def __call__(self, batch: dict) -> dict:
        import numpy as np
        import torch

        from diffq.core import layout
        from diffq.core.records import ImageRecord, jsonl
        from diffq.producer.sources import derive_seed
        from diffq.worker.sink.store import encode

        ids, prompts = [str(i) for i in batch["id"]], [str(p) for p in batch["prompt"]]
        seeds = [derive_seed(SEED_BASE, item_id) for item_id in ids]
        # Pad like diffq's pipeline host, so a short last batch costs what diffq's does.
        pad = WORKLOAD["batch_size"] - len(ids)
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds + seeds[-1:] * pad]
        started_at, started = time.time(), time.perf_counter()
        with torch.inference_mode():
            images = self.pipe(prompt=prompts + prompts[-1:] * pad, height=WORKLOAD["height"],
                               width=WORKLOAD["width"], num_inference_steps=WORKLOAD["steps"],
                               max_sequence_length=WORKLOAD["max_sequence_length"], guidance_scale=1.0,
                               generator=generators, output_type="pil").images[: len(ids)]
        ended_at, generate_s = time.time(), time.perf_counter() - started
        keys = [layout.image_key(item_id, FORMAT) for item_id in ids]
        for key, image in zip(keys, images):
            (self.out / key).write_bytes(encode(image, FORMAT))
        store_s = round(time.perf_counter() - started - generate_s, 4)
        batch_id = f"{self.worker}-{self.batches:06d}"
        self.batches += 1
        records = [ImageRecord(
            file_name=key, id=item_id, prompt=prompt, seed=seed, height=WORKLOAD["height"],
            width=WORKLOAD["width"], steps=WORKLOAD["steps"], guidance_scale=1.0, model=self.model,
            run_id="ray", batch_id=batch_id, queue="ray", device="cpu:0", worker=self.worker,
            generate_s=round(generate_s, 4), generate_started_at=round(started_at, 4),
            generate_ended_at=round(ended_at, 4), store_s=store_s, finished_at=time.time(),
        ) for key, item_id, prompt, seed in zip(keys, ids, prompts, seeds)]
        (self.out / layout.record_key(batch_id)).write_bytes(jsonl(records))
        # Padding once per batch (on its first row), so the driver's sum counts slots.
        return {"id": np.array(ids), "padded": np.array([pad] + [0] * (len(ids) - 1))}


def ray_run(model: str, workers: int, items: int, out: str, workdir: Path) -> tuple[float, list[float], float]:
    """Wall seconds of one Ray Data pass over `items` prompts, and the idle gaps between batches."""
    import ray.data

    prompts = write_prompts(workdir / f"p{items}.jsonl", items)
    started = time.perf_counter()
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    # from_items, not read_json: a read task needs a CPU slot of its own, and with
    # as many slots as actors it never gets one (the run hangs at 2 actors on 2 CPUs).
    # One block per batch: Ray's default split hands actors short batches that
    # still cost a full padded batch.
    dataset = ray.data.from_items(rows, override_num_blocks=-(-items // WORKLOAD["batch_size"]))
    generated = dataset.map_batches(
        RayImageWriter, fn_constructor_kwargs=dict(model=model, out=out), batch_size=WORKLOAD["batch_size"],
        # `concurrency=workers` says the same; it is deprecated since Ray 2.51.
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1)
    done = padded = 0
    for batch in generated.iter_batches(batch_size=None):
        done += len(batch["id"])
        padded += int(batch["padded"].sum())
    seconds = time.perf_counter() - started
    assert done == items, (done, items)
    if padded:
        print(f"note: Ray's batches were padded with {padded} extra image(s)", file=sys.stderr)
    gaps, in_run = timeline(out)
    return seconds, gaps, in_run


def start_ray(cpus: int) -> float:
    """A local Ray cluster with `cpus` CPU slots, quiet; returns its start-up seconds."""
    # No usage report from a benchmark (and no network here to send it to).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import ray.data

    started = time.perf_counter()
    # Ray's workers start in the driver's folder and import `bench` from there, as the
    # driver does (bench commands run from the repository root).
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=512 * 1024**2)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> list[dict]:
    parser = marginal_arguments(__doc__, items=192)
    parser.add_argument("--quick", action="store_true", help="N = 48 and one repeat (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.repeats = 48, 1
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        print("bench.ray_data skipped: Ray is not installed (pip install -e \".[bench]\")", file=sys.stderr)
        return []

    from diffq.app.tiny import build_tiny_pipeline

    workdir = Path(tempfile.mkdtemp(prefix="diffq-bench-ray-"))
    model = str(build_tiny_pipeline(workdir / "tiny"))
    n = args.items
    counts = [int(w) for w in args.workers.split(",")]
    command = f"python -m bench.ray_data --items {n} --repeats {args.repeats}"
    rows = []
    ray_init_s = start_ray(max(counts))
    try:
        # One untimed batch per side first: Ray's first job pays one-off costs (worker
        # pool, Ray Data imports in workers) that would otherwise land in the N run only
        # and inflate its marginal rate; diffq gets the same warm page cache.
        ray_run(model, 1, WORKLOAD["batch_size"], str(workdir / "ray-warmup"), workdir)
        diffq_run(model, 1, WORKLOAD["batch_size"], str(workdir / "diffq-warmup"), workdir, seed_base=SEED_BASE)
        for workers in counts:
            runs = {"diffq": diffq_run, "ray": ray_run}
            measured = {side: {"rates": [], "startups": [], "gaps": [], "in_run": []} for side in runs}
            for repeat in range(args.repeats):
                # Alternate sides within a repeat so both see the same machine load.
                for side, run in runs.items():
                    def out(items: int) -> str:
                        return str(workdir / f"{side}-w{workers}-r{repeat}-n{items}")

                    kwargs = dict(seed_base=SEED_BASE) if side == "diffq" else {}
                    t1, gaps1, _ = run(model, workers, n, out(n), workdir, **kwargs)
                    t2, gaps2, in_run2 = run(model, workers, 2 * n, out(2 * n), workdir, **kwargs)
                    rate, startup = marginal(n, t1, t2)
                    measured[side]["rates"].append(rate)
                    measured[side]["startups"].append(startup)
                    measured[side]["gaps"] += gaps1 + gaps2
                    # In-run rate of the 2N run: first generate start to last image stored.
                    measured[side]["in_run"].append(2 * n / in_run2)
            summary = {side: dict(images_per_s=statistics.median(m["rates"]),
                                  startup_s=statistics.median(m["startups"]),
                                  idle_gap_ms=1000 * statistics.median(m["gaps"]) if m["gaps"] else None,
                                  in_run=statistics.median(m["in_run"]),
                                  rates=[round(r, 2) for r in m["rates"]])
                       for side, m in measured.items()}
            rows.append(dict(name=f"diffq vs Ray Data, {workers} process(es)", workers=workers,
                             diffq_images_per_s=summary["diffq"]["images_per_s"],
                             ray_images_per_s=summary["ray"]["images_per_s"],
                             ratio=summary["diffq"]["images_per_s"] / summary["ray"]["images_per_s"],
                             diffq_startup_s=summary["diffq"]["startup_s"],
                             ray_startup_s=summary["ray"]["startup_s"], ray_init_s=ray_init_s,
                             diffq_idle_gap_ms=summary["diffq"]["idle_gap_ms"],
                             ray_idle_gap_ms=summary["ray"]["idle_gap_ms"],
                             diffq_rates=summary["diffq"]["rates"], ray_rates=summary["ray"]["rates"],
                             diffq_in_run_images_per_s=summary["diffq"]["in_run"],
                             ray_in_run_images_per_s=summary["ray"]["in_run"],
                             in_run_ratio=summary["diffq"]["in_run"] / summary["ray"]["in_run"],
                             ray_version=ray.__version__, command=f"{command} --workers {workers}"))
    finally:
        ray.shutdown()
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
