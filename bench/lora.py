"""LoRA adapters per row: does a run over many adapters keep one adapter's pace?

On the tiny FLUX.1 pipeline, `--compile regional` (CPU Inductor), one worker, the same
items two ways, interleaved (the order alternating per repeat, so a drifting machine
drifts for both):

- many: `--items` rows over `--adapters` adapters in whole batches (each adapter's rows
  together, a multiple of the batch size each, so every batch is one adapter: the
  worker hot-swaps at each change of adapter, worker/device/adapters.py);
- one: the same rows, prompts and seeds, every row with the first adapter.

All adapters have the same rank and targets (`diffq tiny-lora`, seeds differ), so both
runs compile the same graphs and the difference is the swaps. images/s is taken in-run
from the records (from the end of the first batch, its compile left out, to the end of
the last): items after the first batch over that span. The swap cost is said apart: the
sum of the batches' `adapter_swap_s` (the seconds the worker spent swapping, inside
that span) and the graphs any batch after a worker's first compiled (must be 0). The
device's busy share of the span (its turns, each call with its swap) says whether the
swaps cost images or took time the device would have waited anyway.
Goal: many ≥ 0.95 × one.

`--swap-loop N` measures a swap alone instead, in one process and eager: N swaps among
`--adapters` adapters into a pipeline's slot by the worker's path (peft's
`hotswap_adapter_from_state_dict` with the weights converted once, AdapterSlot._swap)
and, interleaved with it, by diffusers' `load_lora_weights(..., hotswap=True)`, the path
before; the median milliseconds of each.

`--modes swap,fuse` compares LoRA modes instead (`--lora-mode`, worker/device/lora_modes.py):
per repeat, the same `--items` rows over `--adapters` adapters of mixed rank (`--ranks`,
cycled: the layout pads every slot to the largest) under each mode, and the same rows
without any adapter (no layout: the base model's graphs). Per mode: s/image with adapters
over s/image without (in-run, as above), and a set change's cost (the records'
`adapter_swap_s`: a hot-swap under swap, a weight write under fuse).

    python -m bench.lora [--items 288] [--adapters 24] [--batch 4] [--size 128] [--steps 4]
                         [--rank 8] [--repeats 3] [--compile regional] [--swap-loop N]
                         [--modes swap,fuse [--ranks 4,8,16,32]] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL = 0.95


def rows_for(count: int, adapters: list[str], many: bool) -> list[dict]:
    """`count` rows; `many`: adapter k for the k-th run of count/len(adapters) rows, else adapter 0."""
    per = count // len(adapters)
    return [{"id": f"p{i:04d}", "prompt": f"a small red house by a lake, study {i}", "seed": 1000 + i,
             "lora": adapters[i // per if many else 0]} for i in range(count)]


def batches_of(out: Path) -> list[dict]:
    """The run's batches from its records, in the order the worker generated them."""
    from diffq.core.runfolder import iter_records
    from diffq.core.storage import open_storage

    found: dict[str, dict] = {}
    for record in iter_records(open_storage(str(out))):
        sets = {tuple(a["path"] for a in record.adapters or ())}
        batch = found.setdefault(record.batch_id, {
            "started": record.generate_started_at, "ended": record.generate_ended_at,
            "worker": record.worker, "swap_s": record.adapter_swap_s,
            "graphs": record.graphs_compiled, "images": 0, "sets": set()})
        batch["images"] += 1
        batch["sets"] |= sets
    return sorted(found.values(), key=lambda batch: batch["started"])


def diffq_run(model: str, rows: list[dict], root: Path, args, lora_mode: str | None = None) -> dict:
    """One `diffq run`: its in-run rate and swap cost, from the records."""
    source = root / f"prompts-{time.monotonic_ns()}.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = root / f"run-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "diffq", "run", str(source), "--model", model, "--out", str(out),
               "--workers", "1", "--batch-size", str(args.batch), "--steps", str(args.steps), "--height",
               str(args.size), "--width", str(args.size), "--compile", args.compile, "--no-progress",
               *(("--lora-mode", lora_mode) if lora_mode else ())]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"diffq run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    batches = batches_of(out)
    mixed = [sorted(batch["sets"]) for batch in batches if len(batch["sets"]) != 1]
    if mixed:
        raise RuntimeError(f"batches with more than one adapter set: {mixed[:3]}")
    firsts = {}
    for batch in batches:  # each worker's first batch compiles
        firsts.setdefault(batch["worker"], batch)
    later = batches[1:]
    span = batches[-1]["ended"] - batches[0]["ended"]
    items = sum(batch["images"] for batch in later)
    changes = sum(1 for before, batch in zip([None, *batches], batches)
                  if before is None or batch["sets"] != before["sets"])
    swap_s = sum(batch["swap_s"] for batch in later)
    # The device's turns (each call with its swap) over the span: below 1, the device
    # waited for the rest of the worker, and a swap can take time it would have idled.
    busy = sum(batch["ended"] - batch["started"] for batch in later) / span if span > 0 else None
    return {"images": sum(batch["images"] for batch in batches), "batches": len(batches),
            "process_s": round(wall, 2), "span_s": round(span, 4),
            "images_per_s": round(items / span, 3) if span > 0 else None,
            "busy": round(busy, 3) if busy is not None else None, "adapter_changes": changes, "swaps": sum(1 for batch in batches if batch["swap_s"] > 0),
            "swap_s_total": round(swap_s, 4),
            "swap_s_first_batch": round(batches[0]["swap_s"], 4),
            "swap_s_median": round(statistics.median([b["swap_s"] for b in later if b["swap_s"] > 0] or [0.0]), 4),
            "graphs_after_first": sum(batch["graphs"] for batch in batches
                                      if batch is not firsts[batch["worker"]])}


def modes_bench(model: str, adapters: list[str], root: Path, args) -> dict:
    """Each mode's run over the adapters against the same rows without adapters, interleaved."""
    modes = [mode for mode in args.modes.split(",") if mode]
    many = rows_for(args.items, adapters, True)
    bare = [{key: value for key, value in row.items() if key != "lora"} for row in many]
    load = [round(os.getloadavg()[0], 2)]
    runs: dict[str, list[dict]] = {name: [] for name in ["none", *modes]}
    for repeat in range(args.repeats):
        order = ["none", *modes] if repeat % 2 == 0 else [*modes[::-1], "none"]
        for name in order:
            runs[name].append(diffq_run(model, bare if name == "none" else many, root, args,
                                        None if name == "none" else name))
            print(json.dumps({name: runs[name][-1]}), file=sys.stderr, flush=True)
    load.append(round(os.getloadavg()[0], 2))
    per_image = {name: [1 / run["images_per_s"] for run in found] for name, found in runs.items()}
    return {"modes": modes, "ranks": args.ranks, "items": args.items, "adapters": args.adapters, "batch": args.batch,
            "size": args.size, "steps": args.steps, "repeats": args.repeats, "compile": args.compile,
            "load_average": load, "runs": runs,
            "s_per_image": {name: round(statistics.median(values), 5) for name, values in per_image.items()},
            "over_none": {mode: [round(w / n, 3) for w, n in zip(per_image[mode], per_image["none"])]
                          for mode in modes},
            "change_s_median": {mode: statistics.median(run["swap_s_median"] for run in runs[mode]) for mode in modes},
            "graphs_after_first": {name: max(run["graphs_after_first"] for run in found) for name, found in runs.items()},
            "command": f"python -m bench.lora --modes {args.modes} --ranks {args.ranks} --items {args.items} "
                       f"--adapters {args.adapters} --batch {args.batch} --size {args.size} --steps {args.steps} "
                       f"--repeats {args.repeats}"}


def render_modes(result: dict) -> list[str]:
    lines = [f"`{result['command']}` (load average {result['load_average'][0]} → {result['load_average'][1]}):", "",
             "| mode | s/image (median) | with / without adapters, per repeat | set change s (median) "
             "| graphs after the first batch |", "|---|---|---|---|---|"]
    for name, seconds in result["s_per_image"].items():
        ratios = ", ".join(f"{r:.3f}" for r in result["over_none"].get(name, [])) or "—"
        change = f"{result['change_s_median'][name]:.4f}" if name in result["change_s_median"] else "—"
        lines.append(f"| {name} | {seconds:.5f} | {ratios} | {change} | {result['graphs_after_first'][name]} |")
    return lines


def swap_loop(model: str, adapters: list[str], swaps: int) -> dict:
    """Median ms of a swap by the worker's path and by diffusers' hot-swap, interleaved."""
    from diffusers import DiffusionPipeline

    from diffq.core import adapters as A
    from diffq.core.contract import AdapterRef
    from diffq.worker.device.adapters import AdapterCache, AdapterSlot

    layout = A.layout(A.inspect(path) for path in adapters)
    refs = [AdapterRef(path=path, revision=A.revision(path)) for path in adapters]
    paths = {}
    for name in ("peft", "diffusers"):
        pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True)
        paths[name] = (pipe, AdapterSlot.install(pipe, layout, AdapterCache()))

    def diffusers_swap(self, pipe, name, loaded):
        pipe.load_lora_weights(loaded.state_dict, adapter_name=name, hotswap=True)

    times: dict[str, list[float]] = {name: [] for name in paths}
    peft_swap = AdapterSlot._swap
    for k in range(swaps + len(refs)):  # the first pass over the adapters fills the caches: not counted
        for name, (pipe, slot) in paths.items():
            AdapterSlot._swap = peft_swap if name == "peft" else diffusers_swap
            try:
                seconds = slot.apply(pipe, (refs[k % len(refs)],))
            finally:
                AdapterSlot._swap = peft_swap
            if k >= len(refs):
                times[name].append(seconds * 1000)
    return {"swaps": swaps, "adapters": len(adapters),
            "swap_ms_median": {name: round(statistics.median(values), 3) for name, values in times.items()},
            "swap_ms_range": {name: [round(min(values), 3), round(max(values), 3)] for name, values in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    from diffq.app.tiny import build_tiny_lora, build_tiny_pipeline

    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=288)
    parser.add_argument("--adapters", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", default="regional")
    parser.add_argument("--swap-loop", type=int, default=0, metavar="N")
    parser.add_argument("--modes", default="", help="LoRA modes to compare, e.g. swap,fuse")
    parser.add_argument("--ranks", default="4,8,16,32", help="with --modes: the adapters' ranks, cycled")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.swap_loop:
        with tempfile.TemporaryDirectory(prefix="diffq-bench-lora-") as tmp:
            root = Path(tmp)
            model = str(build_tiny_pipeline(root / "model", family="flux"))
            adapters = [str(build_tiny_lora(model, root / "loras" / f"a{k:02d}.safetensors", rank=args.rank, seed=k))
                        for k in range(args.adapters)]
            load = round(os.getloadavg()[0], 2)
            result = {**swap_loop(model, adapters, args.swap_loop), "rank": args.rank,
                      "load_average": [load, round(os.getloadavg()[0], 2)]}
        print(json.dumps(result))
        return result
    per = args.items // args.adapters
    if args.items % args.adapters or per % args.batch:
        parser.error(f"--items {args.items} over --adapters {args.adapters} must be whole batches of {args.batch}")
    if args.modes:
        ranks = [int(rank) for rank in args.ranks.split(",")]
        with tempfile.TemporaryDirectory(prefix="diffq-bench-lora-") as tmp:
            root = Path(tmp)
            model = str(build_tiny_pipeline(root / "model", family="flux"))
            adapters = [str(build_tiny_lora(model, root / "loras" / f"a{k:02d}.safetensors",
                                            rank=ranks[k % len(ranks)], seed=k)) for k in range(args.adapters)]
            result = modes_bench(model, adapters, root, args)
        print(json.dumps(result) if args.json else "\n".join(render_modes(result)))
        return result
    with tempfile.TemporaryDirectory(prefix="diffq-bench-lora-") as tmp:
        root = Path(tmp)
        model = str(build_tiny_pipeline(root / "model", family="flux"))
        adapters = [str(build_tiny_lora(model, root / "loras" / f"a{k:02d}.safetensors", rank=args.rank, seed=k))
                    for k in range(args.adapters)]
        cases = {"many": rows_for(args.items, adapters, True), "one": rows_for(args.items, adapters, False)}
        load = [round(os.getloadavg()[0], 2)]
        runs: dict[str, list[dict]] = {name: [] for name in cases}
        for repeat in range(args.repeats):  # interleaved, the order alternating
            for name in (("many", "one") if repeat % 2 == 0 else ("one", "many")):
                runs[name].append(diffq_run(model, cases[name], root, args))
                print(json.dumps({name: runs[name][-1]}), file=sys.stderr, flush=True)
        load.append(round(os.getloadavg()[0], 2))
    ratios = [many["images_per_s"] / one["images_per_s"] for many, one in zip(runs["many"], runs["one"])]
    ratio = statistics.median(ratios)

    def median(name: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[name]), 4)

    result = {"items": args.items, "adapters": args.adapters, "batch": args.batch, "size": args.size,
              "steps": args.steps, "rank": args.rank, "repeats": args.repeats, "compile": args.compile,
              "goal": GOAL, "load_average": load, "runs": runs,
              "ratios": [round(r, 3) for r in ratios], "ratio": round(ratio, 3), "met": ratio >= GOAL,
              "images_per_s": {name: median(name, "images_per_s") for name in runs},
              "swap_s_total": {name: median(name, "swap_s_total") for name in runs},
              "swap_share": round(median("many", "swap_s_total") / median("many", "span_s"), 4),
              "graphs_after_first": {name: max(run["graphs_after_first"] for run in runs[name]) for name in runs},
              "command": (f"python -m bench.lora --items {args.items} --adapters {args.adapters} --batch {args.batch} "
                          f"--size {args.size} --steps {args.steps} --rank {args.rank} --repeats {args.repeats}"
                          + (f" --compile {args.compile}" if args.compile != "regional" else ""))}
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(render(result)))
    return result


def render(result: dict | None) -> list[str]:
    if not result:
        return []
    many, one = result["runs"]["many"], result["runs"]["one"]
    lines = ["## LoRA adapters per row", "",
             f"`{result['command']}`: tiny FLUX.1, {result['size']}², batch {result['batch']}, {result['steps']} "
             f"steps, `--compile {result['compile']}` (CPU Inductor), one worker; {result['items']} items over "
             f"{result['adapters']} adapters of rank {result['rank']} in whole batches (each adapter's rows together: "
             f"every batch one adapter, hot-swapped at each change) against the same items with one adapter, "
             f"{result['repeats']} interleaved repeats. images/s in-run, from the records (first batch's end to the "
             f"last's: the compile left out, the swaps inside); swap seconds are the records' `adapter_swap_s` "
             f"summed over the batches after the first. Load average {result['load_average'][0]} → "
             f"{result['load_average'][1]} (2 cores).", "",
             "| repeat | many: images/s | one: images/s | many / one | many: swaps, s in all (median s) "
             "| one: swaps, s | device busy (many, one) | graphs after a worker's first batch (many, one) "
             "| whole `diffq run` s (many, one) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for index, (m, o, r) in enumerate(zip(many, one, result["ratios"]), 1):
        lines.append(f"| {index} | {m['images_per_s']:.2f} | {o['images_per_s']:.2f} | {r:.3f} | {m['swaps']}, "
                     f"{m['swap_s_total']:.3f} ({m['swap_s_median']:.4f}) | {o['swaps']}, {o['swap_s_total']:.3f} | "
                     f"{m['busy']:.2f}, {o['busy']:.2f} | {m['graphs_after_first']}, {o['graphs_after_first']} | {m['process_s']:.1f}, "
                     f"{o['process_s']:.1f} |")
    changes = ", ".join(str(m["adapter_changes"]) for m in many)
    lines += ["", f"Median ratio **{result['ratio']:.3f}** (goal ≥ {result['goal']}); the swaps took "
              f"{100 * result['swap_share']:.1f} % of the many-adapter run's in-run span. A swap happens at each "
              f"change of adapter between consecutive batches: {result['adapters']} at the least, {changes} here "
              "(the order the worker took the batches in). The tiny model's call is a tenth of a second, so a swap "
              "weighs far more here than beside a real model's seconds-long call.", ""]
    return lines


def goal(result: dict | None) -> tuple[str, bool | str, str]:
    what = (f"LoRA: {result['items'] if result else 288} items over {result['adapters'] if result else 24} adapters "
            f"(whole batches) ≥ {GOAL} × the same items with one adapter, images/s, 0 graphs after the first batch")
    if not result:
        return what, "pending", "not measured in these figures"
    met = result["met"] and not any(result["graphs_after_first"].values())
    return (what, met, f"{result['ratio']:.3f} ({', '.join(f'{r:.3f}' for r in result['ratios'])}); swaps "
            f"{100 * result['swap_share']:.1f} % of the span; graphs after the first batch "
            f"{result['graphs_after_first']['many']}, {result['graphs_after_first']['one']}; load "
            f"{result['load_average'][0]}–{result['load_average'][1]}")


if __name__ == "__main__":
    main()
