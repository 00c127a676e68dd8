"""`diffq plan PROMPTS`: the shape histogram of a run before any spend.

The producer's own validation pass (`validate`, the one `submit` and `run` use), so
a plan and the submit that follows cannot disagree; nothing is enqueued or written.
With `--rates` it is also a fleet plan (diffq/app/fleet_plan.py): device time,
devices for a deadline or the finish time for a device count, cost.
"""


import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from diffq.app.options import Generation, Model, Prompts, fail, generation_options, out

# Requested sizes listed per bucket in the text output (--json lists all of them).
SHOWN_REQUESTED = 8
_RATES_HELP = "`diffq qualify --json` or `diffq report --json` output (repeatable)"
Rates = Annotated[Optional[list[Path]], typer.Option("--rates", help=f"{_RATES_HELP}: time each shape from its measured steady seconds per batch and first call")]
# `submit` and `run`: the plan kept in OUT (diffq/app/fleet_plan.py, `keep`).
KeepRates = Annotated[Optional[list[Path]], typer.Option("--rates", help=f"{_RATES_HELP}: keep the fleet plan from these rates in OUT; `diffq report` shows planned vs actual")]


def register(app: typer.Typer) -> None:
    @app.command()
    @generation_options(embed_metadata=False)
    def plan(
        prompts: Prompts,
        model: Model,
        as_json: Annotated[bool, typer.Option("--json", help='{"total": N, "shapes": [{"height", "width", "items", "batches", "padded_slots", "queue", "steps"}…], "adapters": {"layouts", "groups", "extra_batches", "extra_padded_slots", "sets_per_queue", "modes": {"swap"|"fuse"|"compile": {"set_changes", "compiles", …}}} with LoRA adapters, "fleet": {…} with --rates}')] = False,
        rates: Rates = None,
        deadline: Annotated[Optional[str], typer.Option("--deadline", help="With --rates: finish within this long (6h, 90m, 1h30m, seconds): prints the devices and pods needed")] = None,
        devices: Annotated[Optional[int], typer.Option("--devices", min=1, help="With --rates: this many devices; prints the finishing time")] = None,
        price_per_device_hour: Annotated[Optional[float], typer.Option("--price-per-device-hour", min=0.0, help="With --rates: prints the cost and the cost per 1,000 images")] = None,
        warm_cache: Annotated[bool, typer.Option("--warm-cache", help="With --rates: the compile cache already holds every shape (no compile time)")] = False,
        generation: Generation = None,
    ) -> None:
        """Validate PROMPTS like submit (same errors) and print its shapes, batches, padding and compiles; enqueue and write nothing.

        With --rates, also the device time per shape, the devices needed for --deadline or the finishing time on --devices, and the cost.
        """
        from diffq.producer.sources import InputError
        from diffq.producer.submit import plan as plan_file

        if not rates and (deadline or devices or price_per_device_hour is not None or warm_cache):
            fail("--deadline, --devices, --price-per-device-hour and --warm-cache need --rates")
        try:
            result = plan_file(prompts, model=model, options=generation)
            fleet = _fleet(result, rates, deadline, devices, price_per_device_hour, warm_cache) if rates else None
        except (InputError, ValueError) as exc:
            fail(str(exc))
        dtype = _dtype_runs(generation.dtype)
        if as_json:
            sys.stdout.write(json.dumps({**result.to_json(), "dtype": dtype,
                                         **({"fleet": fleet.to_json()} if fleet else {})}) + "\n")
            return
        _print_plan(out, result.to_json(), generation.batch_size)
        out.print(f"dtype {dtype['queue']}: runs as " + "; ".join(
            f"{dt} on {', '.join(devices)}" for dt, devices in _by_value(dtype["runs_at"]).items()), highlight=False)
        if fleet:
            from diffq.app.fleet_plan import render_text

            out.print(render_text(fleet), end="", highlight=False, markup=False, soft_wrap=True)


def _dtype_runs(dtype: str) -> dict:
    """What the queues' dtype runs as on each device (auto: the backend table's default)."""
    from diffq.worker.api import BACKENDS

    return {"queue": dtype, "runs_at": {name: backend.dtype_for(dtype) for name, backend in BACKENDS.items()}}


def _by_value(mapping: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for key, value in mapping.items():
        grouped.setdefault(value, []).append(key)
    return grouped


def _fleet(result, rates, deadline, devices, price, warm_cache):
    from diffq.app.fleet_plan import fleet_plan, parse_duration

    return fleet_plan(result, rates, deadline_s=parse_duration(deadline) if deadline else None, devices=devices,
                      price_per_device_hour=price, warm_cache=warm_cache)


def _print_adapters(console, adapters: dict) -> None:
    """The adapter groups (rows are batched by adapter set and scale) and their padding."""
    from rich.table import Table

    table = Table(title="LoRA adapter groups (a batch holds one adapter set)")
    for column in ("adapters", "items", "batches", "padded slots"):
        table.add_column(column, justify="left" if column == "adapters" else "right", overflow="fold")
    for group in adapters["groups"]:
        table.add_row(group["label"], str(group["items"]), str(group["batches"]), str(group["padded_slots"]))
    console.print(table)
    for model, layout in adapters["layouts"].items():
        console.print(f"layout {layout['label']} ({model}): {layout['targets']} target modules at rank "
                      f"{layout['rank']}" + (f", {layout['slots']} slots (sets stack up to {layout['slots']} adapters)"
                                         if layout["slots"] > 1 else ""), highlight=False)
    console.print(f"grouping by adapter set costs {adapters['extra_batches']} batches and "
                  f"{adapters['extra_padded_slots']} padded slots ({adapters['batches_without_grouping']} batches "
                  f"without it)", highlight=False)
    _print_lora_modes(console, adapters["modes"])


def _print_lora_modes(console, modes: dict) -> None:
    """Per --lora-mode, what the run is expected to cost (producer/submit.py `lora_modes_json`)."""
    from rich.table import Table

    table = Table(title="per --lora-mode (each queue's batches published grouped by set)")
    for column in ("mode", "set changes", "compiles", "per row"):
        table.add_column(column, justify="left" if column in ("mode", "per row") else "right", overflow="fold")
    swap, fuse, compile_ = modes["swap"], modes["fuse"], modes["compile"]
    table.add_row("swap", f"{swap['set_changes']} (hot-swaps)", f"{swap['compiles']} (0 after a shape's first)",
                  f"+{swap['scaffold_percent']:g} % linear work (the scaffold)")
    table.add_row("fuse", f"{fuse['set_changes']} (weight writes)", str(fuse["compiles"]), "the base model's")
    table.add_row("compile", str(compile_["set_changes"]),
                  f"{compile_['compiles']} (per shape and set where weights are baked; "
                  f"{compile_['compiles_where_weights_are_graph_inputs']} where they are graph inputs)",
                  "the base model's")
    console.print(table)
    console.print("set changes: a fleet meets each set of a queue once; a worker at most once per set it serves, "
                  "plus one", highlight=False)
    if "warning" in swap:
        console.print(f"warning: {swap['warning']}", style="yellow", highlight=False)


def _print_plan(console, plan: dict, batch_size: int) -> None:
    from rich.table import Table

    def pct(padded: int, batches: int) -> str:
        return f"{100 * padded / (batches * batch_size):.1f}%" if batches else "-"

    table = Table(title=f"plan: {plan['total']} items, batch size {batch_size}")
    for column in ("shape", "items", "batches", "padded slots", "queue"):
        table.add_column(column, justify="left" if column in ("shape", "queue") else "right",
                         overflow="fold")  # queue names have no spaces to wrap at
    for shape in plan["shapes"]:
        table.add_row(f"{shape['height']}x{shape['width']}", str(shape["items"]), str(shape["batches"]),
                      f"{shape['padded_slots']} ({pct(shape['padded_slots'], shape['batches'])})", shape["queue"])
    table.add_section()
    table.add_row("total", str(plan["total"]), str(plan["batches"]),
                  f"{plan['padded_slots']} ({pct(plan['padded_slots'], plan['batches'])})",
                  f"{len(plan['shapes'])} queues")
    console.print(table)
    if any("requested" in shape for shape in plan["shapes"]):
        console.print("size buckets: bucket <- requested sizes (items)")
        for shape in plan["shapes"]:
            asked = shape.get("requested", [])
            shown = ", ".join(f"{r['height']}x{r['width']} ({r['items']})" for r in asked[:SHOWN_REQUESTED])
            more = shape.get("requested_sizes", 0) - min(len(asked), SHOWN_REQUESTED)
            console.print(f"  {shape['height']}x{shape['width']} <- {shown}"
                          + (f", +{more} more sizes" if more > 0 else ""), highlight=False)
    if "adapters" in plan:
        _print_adapters(console, plan["adapters"])
    console.print(f"{plan['compiles']} compiles: one per shape per compile cache (a fleet sharing one cache "
                  f"compiles each shape once)", highlight=False)
