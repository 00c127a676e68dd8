"""Dataset commands: `diffq export`, `diffq report`, `diffq watch` (= `status --watch`)."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from diffq.app.options import err, fail, out
from diffq.results.writers import DEFAULT_FORMAT, FORMATS, formats_help

OutArg = Annotated[str, typer.Argument(metavar="OUT", help="Run folder: path, s3://… or gs://…")]
# `export` and `fetch`: N machines each take one part; their outputs together are a single run's.
ShardOpt = Annotated[Optional[str], typer.Option(
    "--shard", metavar="I/N", help="Only part I of N (0 ≤ I < N) of the output, e.g. $(JOB_COMPLETION_INDEX)/8 in "
                                   "an indexed Kubernetes Job: N such exports together write a single export's files")]


def parse_shard(text: str | None):
    """The --shard option as export's Shard (the whole output without it); a bad one exits 2."""
    from diffq.results.export import WHOLE, Shard

    if text is None:
        return WHOLE
    try:
        return Shard.parse(text)
    except ValueError as exc:
        fail(str(exc))


def shard_note(shard, run_images: int) -> str:
    return f" (shard {shard} of {run_images} images)" if not shard.whole else ""


# The choices are the writer table's formats (writers.WRITERS).
ExportFormat = Enum("ExportFormat", {name: name for name in FORMATS}, type=str)


def register(app: typer.Typer) -> None:

    @app.command()
    def export(
        out_dir: OutArg,
        dest: Annotated[str, typer.Argument(help="Destination: path, s3://bucket/prefix or gs://bucket/prefix")],
        format: Annotated[ExportFormat, typer.Option("--format", "-f", help=formats_help())] = ExportFormat(DEFAULT_FORMAT),
        shard_size: Annotated[int, typer.Option("--shard-size", min=1, help="Images per tar / Parquet file")] = 1000,
        shard: ShardOpt = None,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
    ) -> None:
        """Export finished images as a dataset, streaming (memory does not grow with the run)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from diffq.results.export import export as export_run
        from diffq.core.runfolder import NotARun

        part = parse_shard(shard)
        bar = Progress(TextColumn(f"[bold]export {format.value}"), BarColumn(), MofNCompleteColumn(),
                       TimeRemainingColumn(), console=err, disable=not progress, transient=True)
        task = bar.add_task("export", total=None)
        try:
            with bar:
                result = export_run(out_dir, dest, format=format.value, shard_size=shard_size, shard=part,
                                    on_progress=lambda done, total: bar.update(
                                        task, completed=done, total=-(-total // part.count)))
        except NotARun as exc:
            fail(str(exc))
        out.print(f"{result.images} images ({result.bytes / 1e6:.1f} MB) as {result.format} in {result.dest}"
                  f" ({len(result.files)} files){shard_note(part, result.run_images)}")

    @app.command()
    def report(
        out_dir: OutArg,
        html: Annotated[Optional[Path], typer.Option("--html", help="Write an HTML page with plots and a contact sheet")] = None,
        contact_sheet: Annotated[Optional[Path], typer.Option("--contact-sheet", help="Write a contact sheet PNG of a sample")] = None,
        price_per_device_hour: Annotated[Optional[float], typer.Option("--price-per-device-hour", min=0.0, help="Price of one device-hour: prints the cost per 1,000 images")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Headline figures as JSON")] = False,
    ) -> None:
        """Run report: items, shapes, images/s over time, compile vs generate vs storing, workers, devices, failures, cost."""
        from diffq.results.report import render_text, report as build, to_json
        from diffq.core.runfolder import NotARun

        try:
            result = build(out_dir, html_path=html, contact_sheet_path=contact_sheet,
                           price_per_device_hour=price_per_device_hour)
        except NotARun as exc:
            fail(str(exc))
        if as_json:
            sys.stdout.write(json.dumps(to_json(result)) + "\n")
        else:
            sys.stdout.write(render_text(result))
        for path in (html, contact_sheet):
            if path:
                err.print(f"wrote {path}")

    @app.command()
    def watch(
        out_dir: OutArg,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes")] = 2.0,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON line per refresh")] = False,
    ) -> None:
        """Live progress of a run (same as `diffq status OUT --watch`)."""
        from diffq.core.runfolder import NotARun
        from diffq.results.watch import watch as watch_run

        try:
            watch_run(out_dir, interval=interval, console=out, as_json=as_json)
        except NotARun as exc:
            fail(str(exc))
