"""`diffq cancel OUT`: stop a run without touching the broker or anything stored."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from diffq.core.settings import get_settings


def cancel(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Run folder")],
    broker: Annotated[Optional[str], typer.Option("--broker", help="Also show how many of the run's shape queues' messages workers have yet to drop (or DIFFQ_BROKER_URL)")] = None,
) -> None:
    """Cancel a run: workers drop its remaining batches without generating them.

    A marker in OUT that workers check before each batch, and the feeder before publishing
    more of a windowed run (it stops feeding it); `diffq status` counts what is neither
    done nor failed as cancelled; `diffq resume OUT` un-cancels and re-enqueues what is missing.
    """
    from diffq.core.runfolder import NotARun, read_manifest
    from diffq.core.storage import open_storage
    from diffq.producer.resume import cancel as cancel_run
    from diffq.results.status import status

    try:
        fresh = cancel_run(out_dir)
    except NotARun as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    st = status(out_dir)
    typer.echo(f"{st.out}: {'cancelled' if fresh else 'already cancelled'}; "
               f"{st.done} done, {st.failed} failed, {st.cancelled} cancelled")
    broker = broker or get_settings().broker_url
    if broker:
        from diffq.app.queues import queue_report

        queues = [s.queue for s in read_manifest(open_storage(out_dir)).shapes]
        waiting = sum(info.depth for info in queue_report(broker, queues, timeout=0) if info.queue in queues)
        typer.echo(f"{waiting} messages on the run's shape queues (other runs' included) "
                   "are dropped or served as workers reach them")


def register(app: typer.Typer) -> None:
    app.command("cancel")(cancel)
