"""`diffq run`: the embedded default. The fleet's code, with no servers.

The same submit, the same Celery task and the same worker processes as a fleet,
over kombu's filesystem transport in a temporary folder. Two things differ, both
from ../shared/CELERY.md: the backlog is published in waves (every fetch lists the
whole queue folder, so a deep backlog slows consumers), and a batch in flight when
its worker dies is lost by this transport, so once the queues drain the runner
re-enqueues whatever the run folder says is neither done nor failed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diffq.core import layout
from diffq.core.broker import embedded_broker
from diffq.core.families import compile_refusal
from diffq.core.progress import ProgressSummary
from diffq.core.runfolder import iter_records
from diffq.core.transports import transport_for
from diffq.producer.resume import missing_batches, scan
from diffq.core.runfolder import read_cancel
from diffq.producer.submit import CeleryPublisher, RunExists, make_options, submit, validate
from diffq.core.storage import open_storage
from diffq.worker.backends import get_backend
from diffq.worker.models import resolve_model
from diffq.worker.supervisor import Supervisor, plan_children


class RunFailed(RuntimeError):
    pass


@dataclass
class RunResult:
    out: str
    run_id: str
    total: int
    done: int
    failed: int
    seconds: float
    reenqueued: int

    @property
    def ok(self) -> bool:
        return self.done == self.total

    @property
    def images_per_s(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


class BoundedPublisher:
    """Blocks while the embedded queue already holds `max_backlog` messages."""

    def __init__(self, inner: CeleryPublisher, queue_dir: Path, max_backlog: int, stop: threading.Event):
        self.inner, self.queue_dir, self.max_backlog, self.stop = inner, queue_dir, max_backlog, stop

    def depth(self) -> int:
        with os.scandir(self.queue_dir) as entries:
            return sum(1 for entry in entries if entry.name.endswith(".msg"))

    def _wait_for_room(self) -> None:
        # A backlog of 4 batches per worker outlasts a 0.2 s poll; polling faster
        # only takes CPU from the workers on small machines.
        while self.depth() >= self.max_backlog:
            if self.stop.wait(0.2):
                raise RunFailed("run stopped")

    def publish(self, message) -> None:
        self._wait_for_room()
        self.inner.publish(message)

    def publish_encoded(self, encoded) -> None:
        """The producer's ready-encoded batches (no pydantic round trip per batch)."""
        self._wait_for_room()
        self.inner.publish_encoded(encoded)

    def close(self) -> None:
        self.inner.close()


def run(
    prompts: str | Path,
    out: str,
    *,
    model: str,
    workers: int = 1,
    device: str = "cpu",
    devices: list[int] | None = None,
    compile: str = "none",
    compile_cache: str | None = None,
    offload: str | None = None,
    warmup: list[str] | None = None,
    threads: int = 1,
    progress: bool = True,
    console: Console | None = None,
    run_id: str | None = None,
    seed_base: str | None = None,
    keep_columns: tuple[str, ...] | list[str] = (),
    **generation,
) -> RunResult:
    console = console or Console(stderr=True)
    started = time.monotonic()
    resolve_model(model)
    options, defaults = make_options(model=model, **generation)
    plan = validate(prompts, options, defaults, keep_columns)
    for name in plan.models:
        if name != model:
            resolve_model(name)
    # A compile mode a family cannot take fails here, not in every worker.
    if reason := compile_refusal(plan.models, compile):
        raise ValueError(reason)
    storage = open_storage(out)
    if storage.exists(layout.MANIFEST):
        raise RunExists(f"{storage.url} already holds a run; use a new OUT, or `diffq resume {storage.url}`")

    broker_dir = Path(tempfile.mkdtemp(prefix="diffq-broker-"))
    broker_url, transport_options = embedded_broker(broker_dir)
    # This transport loses a batch in flight when its worker dies (the table says
    # so): the runner re-enqueues from the run folder instead.
    reconciles = transport_for(broker_url).loses_inflight_on_kill
    backend = get_backend(device)
    specs = plan_children(
        device=backend.name,
        devices=devices if devices is not None else list(range(workers)),
        broker_url=broker_url,
        transport_options=transport_options,
        queues=[shape.queue for shape in plan.shapes],
        threads=threads,
        compile=compile,
        compile_cache=compile_cache,
        offload=offload,
        warmup=warmup or [],
        models=plan.models,
        dtype=options.dtype,
    )
    supervisor = Supervisor(specs)
    stop = threading.Event()
    publisher = BoundedPublisher(CeleryPublisher(broker_url, transport_options),
                                 broker_dir / "queue", max(16, 4 * len(specs)), stop)
    submitted: dict = {}

    def publish_all() -> None:
        try:
            submitted["result"] = submit(prompts, out, model=model, publisher=publisher, plan=plan,
                                         run_id=run_id, seed_base=seed_base, keep_columns=keep_columns,
                                         **generation)
        except BaseException as exc:  # reported by the main thread
            submitted["error"] = exc

    tracker = ProgressSummary(storage)
    reenqueued = 0
    supervisor.start()
    publishing = threading.Thread(target=publish_all, name="diffq-publish", daemon=True)
    publishing.start()
    bar = Progress(TextColumn("[bold]diffq run"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]:.1f} img/s · failed {task.fields[failed]}"),
                   TimeElapsedColumn(), console=console, disable=not progress, transient=False)
    try:
        with bar:
            task = bar.add_task("run", total=plan.total, rate=0.0, failed=0)
            last_progress, deaths_seen, batch_time = time.monotonic(), 0, None
            next_cancel_check = 0.0
            while True:
                before = tracker.done + tracker.failed
                tracker.refresh()
                now = time.monotonic()
                if tracker.done + tracker.failed != before:
                    last_progress = now
                elapsed = now - started
                bar.update(task, completed=tracker.done, failed=tracker.failed,
                           rate=tracker.done / elapsed if elapsed else 0.0)
                if tracker.done + tracker.failed >= plan.total:
                    break
                # `diffq cancel` from elsewhere: the workers drop what is queued.
                if now >= next_cancel_check:
                    next_cancel_check = now + layout.CANCEL_CHECK_S
                    if "result" in submitted and publisher.depth() == 0 and read_cancel(storage) is not None:
                        break
                if "error" in submitted:
                    raise submitted["error"]
                supervisor.poll()
                if supervisor.all_fatal:
                    raise RunFailed("every worker failed to start; see the errors above")
                # A worker died with a batch in hand: this transport lost it. Once the
                # queue is empty and the others have had time to finish theirs,
                # re-enqueue what the run folder says is missing. `scan` also credits
                # a batch recorded but not credited (killed in between), which would
                # otherwise stay pending.
                if (reconciles and supervisor.deaths > deaths_seen and "result" in submitted
                        and publisher.depth() == 0):
                    if batch_time is None:  # read once per death, not every poll
                        batch_time = max((record.generate_s for record in iter_records(storage)), default=5.0)
                    if now - last_progress > max(5.0, 3 * batch_time):
                        deaths_seen, batch_time = supervisor.deaths, None
                        for message in missing_batches(storage, scan(storage).settled):
                            publisher.publish(message)
                            reenqueued += len(message.items)
                        last_progress = now
                time.sleep(0.2)
    finally:
        stop.set()
        supervisor.stop()
        publishing.join(timeout=5)
        publisher.close()
        shutil.rmtree(broker_dir, ignore_errors=True)
    run_id = submitted["result"].run_id if "result" in submitted else ""
    return RunResult(out=storage.url, run_id=run_id, total=plan.total, done=tracker.done,
                     failed=tracker.failed, seconds=time.monotonic() - started, reenqueued=reenqueued)
