"""`diffq plan PROMPTS`: the shape histogram of a run before any spend.

The producer's own validation pass (`validate`, the one `submit` and `run` use), so
a plan and the submit that follows cannot disagree; nothing is enqueued or written.
"""


import json
import sys
from typing import Annotated

import typer

from diffq.app.options import Generation, Model, Prompts, fail, generation_options, out

# Requested sizes listed per bucket in the text output (--json lists all of them).
SHOWN_REQUESTED = 8


def register(app: typer.Typer) -> None:
    @app.command()
    @generation_options(embed_metadata=False)
    def plan(
        prompts: Prompts,
        model: Model,
        as_json: Annotated[bool, typer.Option("--json", help='{"total": N, "shapes": [{"height", "width", "items", "batches", "padded_slots", "queue"}…]}')] = False,
        generation: Generation = None,
    ) -> None:
        """Validate PROMPTS like submit (same errors) and print its shapes, batches, padding and compiles; enqueue and write nothing."""
        from diffq.producer.sources import InputError
        from diffq.producer.submit import plan as plan_file

        try:
            result = plan_file(prompts, model=model, **generation.kwargs())
        except (InputError, ValueError) as exc:
            fail(str(exc))
        if as_json:
            sys.stdout.write(json.dumps(result.to_json()) + "\n")
            return
        _print_plan(out, result.to_json(), generation.batch_size)


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
    console.print(f"{plan['compiles']} compiles: one per shape per compile cache (a fleet sharing one cache "
                  f"compiles each shape once)", highlight=False)
