"""`diffq run`: the embedded default. The fleet's code, with no servers.

The same submit, the same Celery task and the same worker processes as a fleet,
over kombu's filesystem transport in a temporary folder. Two things differ, both
from ../shared/CELERY.md: the backlog is published in waves (kombu's channel lists the
whole queue folder on every fetch; diffq's lists it once per pass, and the waves grow
to what the workers drain between two looks), and a batch in flight when
its worker dies is lost by this transport, so once the queues drain the runner
re-enqueues whatever the run folder says is neither done nor failed.

A run killed part-way (Ctrl-C, OOM, a reboot) is finished the same way: `run` again
with the same file and options on the same OUT, or `resume` (`diffq resume OUT`
without a broker), publishes the plan minus the records to a fresh embedded broker
under the run's own run id and seeds; nothing stored is generated again.

What the user sees is the progress bar: when storing has been failing for longer
than a minute it says why ("storage full: No space left on device — waiting, 3 min"),
from the notes the workers' sinks leave in the broker's own folder (a local disk, so
it works when OUT takes nothing), OUT's trouble notes and the runner's own look at a
local OUT's disk (diffq/core/progress.py). The workers' stdout, where Celery says
"worker: Warm shutdown (MainProcess)" at every stop, goes to a file in the broker
folder; every other line there is passed on to the runner's stdout, and their stderr
(errors, warnings) is the runner's own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diffq.app.run_out import RunBusy, RunFailed, RunOut
from diffq.core.brokers.embedded import embedded_broker
from diffq.core.families import compile_refusal
from diffq.core.profile import lora_mode_and_profile
from diffq.core.progress import TROUBLE_DIR_ENV
from diffq.core.options import GenerationOptions
from diffq.core.records import RunManifest
from diffq.core.transports import transport_for
from diffq.producer.resume import check_plan, continuation, uncancel
from diffq.producer.submit import CeleryPublisher, make_options, new_run_id, submit_to, validate
from diffq.worker.api import RunScope
from diffq.worker.api import local_refusal
from diffq.worker.api import get_backend
from diffq.worker.api import lora_modes
from diffq.worker.api import resolve_model
from diffq.worker.api import DEFAULT_DEGENERATE_POLICY
from diffq.worker.api import Supervisor, plan_children
from diffq.worker.api import Outcome, Republished, end

__all__ = ["RunBusy", "RunFailed", "RunResult", "LocalWorkers", "run", "resume"]


@dataclass
class RunResult:
    out: str
    run_id: str
    total: int
    done: int
    failed: int
    seconds: float
    reenqueued: int
    # A continued run: what OUT held before this call began.
    already_done: int = 0
    already_failed: int = 0

    @property
    def ok(self) -> bool:
        return self.done == self.total

    @property
    def images_per_s(self) -> float:
        """Of the images this call made."""
        return (self.done - self.already_done) / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        counts = f"{self.done}/{self.total} images, {self.failed} failed"
        if self.already_done + self.already_failed >= self.total:
            return f"{counts}: nothing left to run"
        return (f"{counts}, {self.seconds:.1f}s, {self.images_per_s:.1f} images/s"
                + (f", continued: {self.already_done} were done before" if self.already_done else "")
                + (f", {self.reenqueued} re-enqueued" if self.reenqueued else ""))


class BoundedPublisher:
    """Publishes in waves: blocks while the embedded queue already holds `max_backlog`
    messages, and doubles `max_backlog` (up to MOST_BACKLOG) whenever a look finds the
    queue drained since the last one: the workers may have waited for the next wave.

    The first bound (4 batches per worker) suits a slow device; a fast one drains it
    well within one look (16 batches of 512² JPEG at 1.2 ms an image: 0.15 s), and
    every wave that came late was a pause of the whole run (docs/BENCHMARKS.md). A deep
    backlog costs the consumers little: the embedded channel lists the queue folder
    once per pass, not once per message (core/brokers/embedded.py)."""

    POLL_S = 0.2  # between looks at a full queue: faster only takes CPU from the workers
    MOST_BACKLOG = 4096

    def __init__(self, inner: CeleryPublisher, queue_dir: Path, max_backlog: int, stop: threading.Event):
        self.inner, self.queue_dir, self.max_backlog, self.stop = inner, queue_dir, max_backlog, stop
        self._room = 0  # messages that may go before the folder is counted again

    def depth(self) -> int:
        with os.scandir(self.queue_dir) as entries:
            return sum(1 for entry in entries if entry.name.endswith(".msg"))

    def _wait_for_room(self) -> None:
        if self._room > 0:  # the queue only shrank since it was counted
            self._room -= 1
            return
        depth = self.depth()
        while depth >= self.max_backlog:
            if self.stop.wait(self.POLL_S):
                raise RunFailed("run stopped")
            depth = self.depth()
            if depth == 0:
                self.max_backlog = min(2 * self.max_backlog, self.MOST_BACKLOG)
        self._room = self.max_backlog - depth - 1

    def publish(self, message) -> None:
        self._wait_for_room()
        self.inner.publish(message)

    def publish_encoded(self, encoded) -> None:
        """The producer's ready-encoded batches (no pydantic round trip per batch)."""
        self._wait_for_room()
        self.inner.publish_encoded(encoded)

    def close(self) -> None:
        self.inner.close()


@dataclass
class LocalWorkers:
    """The worker processes of an embedded run: what `run` and `resume` take alike."""

    workers: int = 1
    device: str = "cpu"
    devices: list[int] | None = None
    compile: str = "none"
    compile_cache: str | None = None
    offload: str | None = None
    warmup: list[str] | None = None
    threads: int = 1
    allow_fallback: bool = False
    on_degenerate: str = DEFAULT_DEGENERATE_POLICY
    lora_mode: str = lora_modes.DEFAULT_LORA_MODE  # a mode, auto, or a LoRA profile FILE.json

    def resolved_lora_mode(self, models: list[str] | None = None) -> str:
        """The mode the workers serving `models` will run (`auto` through the profile given, if any)."""
        mode, profile = lora_mode_and_profile(self.lora_mode)
        return lora_modes.resolve(get_backend(self.device), self.compile, mode, profile, models=models)[0]

    def check(self, models: list[str], speedups=(), adapters: bool = False) -> None:
        # A compile mode, speed-up or LoRA mode the family or device cannot take fails
        # here, not in every worker.
        if reason := (compile_refusal(models, self.compile) or local_refusal(models, speedups, self.device,
                                                                              self.compile, adapters)
                      or (adapters and lora_modes.refusal(get_backend(self.device), self.compile,
                                                          self.resolved_lora_mode(models)))):
            raise ValueError(reason)

    def specs(self, broker_url: str, transport_options: dict, queues: list[str], models: list[str], dtype: str,
              runs: list[RunScope] = (), adapter_layouts: dict | None = None, schemes: list | None = None):
        return plan_children(
            device=get_backend(self.device).name,
            devices=self.devices if self.devices is not None else list(range(self.workers)),
            broker_url=broker_url, transport_options=transport_options, queues=queues, threads=self.threads,
            compile=self.compile, compile_cache=self.compile_cache, offload=self.offload,
            warmup=self.warmup or [], models=models, dtype=dtype, allow_fallback=self.allow_fallback,
            on_degenerate=self.on_degenerate, runs=list(runs), adapter_layouts=adapter_layouts or {},
            schemes=schemes, lora_mode=self.resolved_lora_mode(models))


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
    allow_fallback: bool = False,
    on_degenerate: str = DEFAULT_DEGENERATE_POLICY,
    lora_mode: str = lora_modes.DEFAULT_LORA_MODE,
    progress: bool = True,
    console: Console | None = None,
    run_id: str | None = None,
    seed_base: str | None = None,
    options: GenerationOptions | None = None,
    **generation,
) -> RunResult:
    """Submit `prompts` to OUT and produce it here. If OUT already holds the run these
    would produce, finish it instead (`RunDiffers`, a `RunExists`, names what differs).
    `options`: the generation options as built where typed (core/options.py), or
    `generation` as keyword arguments (the Python API)."""
    started = time.monotonic()
    local = LocalWorkers(workers=workers, device=device, devices=devices, compile=compile,
                         compile_cache=compile_cache, offload=offload, warmup=warmup, threads=threads,
                         allow_fallback=allow_fallback, on_degenerate=on_degenerate, lora_mode=lora_mode)
    resolve_model(model)
    chosen = GenerationOptions.given(options, generation)
    keep_columns = chosen.keep_columns
    options, defaults = make_options(model=model, options=chosen)
    plan = validate(prompts, options, defaults, keep_columns)
    for name in plan.models:
        if name != model:
            resolve_model(name)
    local.check(plan.models, speedups_of(options), adapters=bool(plan.adapter_layouts))
    folder = RunOut(out)
    new_id = run_id or new_run_id()  # known before submitting: the workers serve this run only

    def publish_all(publisher) -> str:
        # Every batch to the runner's own publisher: its waves are this run's feeder.
        return submit_to(folder.storage, prompts, options, defaults, keep_columns=keep_columns, publisher=publisher,
                         plan=plan, run_id=new_id, seed_base=seed_base, window=None).run_id

    with folder.sole_runner():
        if (manifest := folder.manifest()) is not None:
            continuation(folder.storage, manifest, prompts=prompts, plan=plan,
                         options=options.with_layouts(plan.adapter_layouts), defaults=defaults,
                         run_id=run_id, seed_base=seed_base, keep_columns=keep_columns)
            return _finish(folder, manifest, local, progress=progress, console=console, started=started)
        return _serve(folder, local, queues=[shape.queue for shape in plan.shapes], models=plan.models,
                      adapter_layouts=plan.adapter_layouts, schemes=schemes_of(options),
                      run_id=new_id, dtype=options.dtype, total=plan.total, publish_all=publish_all,
                      progress=progress, console=console, started=started)


def resume(out: str, *, progress: bool = True, console: Console | None = None, **workers) -> RunResult:
    """Finish the run in OUT here, without servers: `diffq resume OUT` with no broker.
    Needs no prompt file: the run folder's plan and manifest say what is left and how.
    `workers`: the worker options `run` takes (`LocalWorkers`' fields)."""
    started = time.monotonic()
    local = LocalWorkers(**workers)
    folder = RunOut(out)
    manifest = folder.read_manifest()
    for name in manifest.models:
        resolve_model(name)
    local.check(manifest.models, adapters=bool(manifest.adapter_layouts))
    check_plan(folder.storage, manifest)
    with folder.sole_runner():
        return _finish(folder, manifest, local, progress=progress, console=console, started=started)


def _finish(folder: RunOut, manifest: RunManifest, local: LocalWorkers, *, progress: bool,
            console: Console | None, started: float) -> RunResult:
    """Produce what OUT's plan holds and its records lack, under the run's own ids."""
    settled = folder.settled()  # before the summary: it credits what records show and credits lack
    tracker = folder.progress.refresh()
    if len(settled) >= manifest.total:  # a finished run: nothing is started
        return RunResult(out=folder.url, run_id=manifest.run_id, total=manifest.total, done=tracker.done,
                         failed=tracker.failed, seconds=time.monotonic() - started, reenqueued=0,
                         already_done=tracker.done, already_failed=tracker.failed)
    uncancel(folder.storage)  # as `diffq resume` does: running it again means finishing it

    def publish_all(publisher) -> str:
        for message in folder.missing(settled):
            publisher.publish(message)
        return manifest.run_id

    return _serve(folder, local, queues=[shape.queue for shape in manifest.shapes], models=manifest.models,
                  adapter_layouts=manifest.adapter_layouts,
                  run_id=manifest.run_id, dtype=manifest.defaults.dtype, total=manifest.total, publish_all=publish_all,
                  progress=progress, console=console, started=started)


def _serve(folder: RunOut, local: LocalWorkers, *, queues: list[str], models: list[str], run_id: str,
           dtype: str, total: int, adapter_layouts: dict, publish_all, progress: bool, console: Console | None,
           started: float, schemes: list | None = None) -> RunResult:
    """Embedded broker, local workers and `publish_all(publisher)` (it returns the run
    id) in a thread; waits until the run folder holds `total` items done or failed."""
    already_done, already_failed = folder.progress.done, folder.progress.failed
    broker_dir = Path(tempfile.mkdtemp(prefix="diffq-broker-"))
    broker_url, transport_options = embedded_broker(broker_dir)
    specs = local.specs(broker_url, transport_options, queues, models, dtype, [RunScope.of(folder.url, run_id)],
                        adapter_layouts, schemes)
    output = _WorkerOutput(broker_dir / "workers.out")
    supervisor = Supervisor(specs, spawning=output.spawning)  # each child's stdout is `output`
    stop = threading.Event()
    publisher = BoundedPublisher(CeleryPublisher(broker_url, transport_options),
                                 broker_dir / "queue", max(16, 4 * len(specs)), stop)
    submission = _Submission(publish_all, publisher)
    # This transport loses a batch in flight when its worker dies (the table says
    # so): the runner re-enqueues from the run folder instead.
    lost = _LostBatches(folder, supervisor, submission) if transport_for(broker_url).loses_inflight_on_kill else None
    # The workers and their sink helpers inherit where to leave their trouble notes.
    troubles = folder.watch(broker_dir / "trouble")
    previous_notes_dir = os.environ.get(TROUBLE_DIR_ENV)
    os.environ[TROUBLE_DIR_ENV] = str(troubles.folder)
    bar = progress_bar(console or Console(stderr=True), enabled=progress)
    try:
        supervisor.start()
        submission.start()
        with bar:
            task = bar.add_task("run", total=total, completed=already_done, rate=0.0, failed=already_failed,
                                trouble="")
            while True:
                now = time.monotonic()
                look = folder.look(now, total)
                elapsed = now - started
                bar.update(task, completed=look.done, failed=look.failed,
                           rate=(look.done - already_done) / elapsed if elapsed else 0.0,
                           trouble=look.trouble or look.fetching or "")
                if not progress:
                    troubles.say(bar.console, look.trouble, now)
                output.forward()
                if look.finished(total):
                    break
                # `diffq cancel` from elsewhere: the workers drop what is queued.
                if submission.published() and folder.cancelled(now):
                    break
                submission.raise_error()
                supervisor.poll()
                if supervisor.all_fatal:
                    raise RunFailed("every worker failed to start; see the errors above")
                if lost is not None:
                    lost.check(now, look.moved)
                time.sleep(LOOP_S)
    finally:
        stop.set()
        supervisor.stop()
        submission.join(timeout=5)
        publisher.close()
        output.close()  # what the workers said last, but Celery's shutdown lines
        if previous_notes_dir is None:
            os.environ.pop(TROUBLE_DIR_ENV, None)
        else:
            os.environ[TROUBLE_DIR_ENV] = previous_notes_dir
        shutil.rmtree(broker_dir, ignore_errors=True)
    return RunResult(out=folder.url, run_id=submission.run_id, total=total, done=folder.progress.done,
                     failed=folder.progress.failed, seconds=time.monotonic() - started,
                     reenqueued=lost.reenqueued if lost else 0,
                     already_done=already_done, already_failed=already_failed)


LOOP_S = 0.2  # between two looks of the runner's loop at the run (progress, workers, cancel)


def progress_bar(console: Console, *, enabled: bool = True) -> Progress:
    """`diffq run`'s bar: done of total, images/s, failed, elapsed, and why storing fails
    when it has for a while (the task's `trouble` field, empty otherwise)."""
    # Drawn as often as the run's loop updates it (every LOOP_S), and only where it shows:
    # on a console that is not a terminal rich draws nothing until the end, and each tick
    # of its refresh thread rendered the whole bar for nobody.
    return Progress(TextColumn("[bold]diffq run"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:.1f} img/s · failed {task.fields[failed]}"),
                    TimeElapsedColumn(), TextColumn("{task.fields[trouble]}", style="bold yellow", markup=False),
                    console=console, disable=not enabled, transient=False,
                    auto_refresh=console.is_terminal, refresh_per_second=1 / LOOP_S)


# What Celery writes to a worker's stdout on its own at every stop (celery/apps/worker.py,
# `safe_say(..., sys.__stdout__)` in the shutdown handlers): not for `diffq run`'s user.
CELERY_CHATTER = re.compile(
    r"worker: (Warm|Cold) shutdown \(MainProcess\)"
    r"|worker: Hitting Ctrl\+C again will (initiate cold shutdown, )?terminate(,)? all running tasks!"
    r"|Waiting gracefully for cold shutdown to complete\.\.\.")


class _WorkerOutput:
    """The workers' stdout, in a file of the broker folder: each child is spawned with
    it as its fd 1 (`spawning`), and `forward` passes on every complete line that is
    not CELERY_CHATTER to the runner's stdout (under a bar, rich prints it above the
    bar). Their stderr stays the runner's: errors are never held back."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # Read through one open file, from where the last look ended (not opened and
        # sought on every look of the loop).
        self._reader = open(path, "rb")
        self._partial = b""

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """fd 1 is the file while a child is spawned (it inherits fd 1 as it is then).
        Whatever another thread of this process writes to its stdout meanwhile lands in
        the file too, and is passed on like the workers' lines."""
        with contextlib.suppress(ValueError, OSError):
            sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no stdout at all: nothing to keep clean
            yield
            return
        try:
            os.dup2(self._fd, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    def forward(self, final: bool = False) -> None:
        try:
            data = self._reader.read()
        except OSError:
            return
        if not data and not final:
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = b"" if final else lines.pop()
        text = "".join(f"{line}\n" for line in (raw.decode(errors="replace").rstrip("\r") for raw in lines)
                       if line.strip() and not CELERY_CHATTER.fullmatch(line.strip()))
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def close(self) -> None:
        self.forward(final=True)
        self._reader.close()
        os.close(self._fd)


class _Submission:
    """`publish_all(publisher)` in a thread; its run id, or its error for the main thread."""

    def __init__(self, publish_all, publisher: BoundedPublisher):
        self.publisher = publisher
        self.run_id = ""
        self._done = False
        self._error: BaseException | None = None

        def publish() -> None:
            try:
                self.run_id = publish_all(publisher)
                self._done = True
            except BaseException as exc:  # reported by the main thread
                self._error = exc

        self._thread = threading.Thread(target=publish, name="diffq-publish", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=timeout)

    def published(self) -> bool:
        """Everything submitted and nothing left in the runner's own queue."""
        return self._done and self.publisher.depth() == 0

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error


class _LostBatches:
    """A worker died with a batch in hand and this transport lost it. Once the queue
    is empty and the other workers have had time to finish theirs, re-enqueue what the
    run folder says is missing."""

    def __init__(self, folder: RunOut, supervisor: Supervisor, submission: _Submission):
        self.folder, self.supervisor, self.submission = folder, supervisor, submission
        self.reenqueued = 0
        self._deaths_seen = 0
        self._batch_time: float | None = None
        self._last_progress = time.monotonic()

    def check(self, now: float, moved: bool) -> None:
        if moved:
            self._last_progress = now
        if self.supervisor.deaths <= self._deaths_seen or not self.submission.published():
            return
        if self._batch_time is None:  # read once per death, not every poll
            self._batch_time = self.folder.longest_batch_s()
        if now - self._last_progress > max(5.0, 3 * self._batch_time):
            self._deaths_seen, self._batch_time = self.supervisor.deaths, None
            for message in self.folder.missing():
                # The batch's end on this broker (`lost with worker`): published again.
                end(Outcome.LOST_WITH_WORKER, Republished(lambda m=message: self.submission.publisher.publish(m)))
                self.reenqueued += len(message.items)
            self._last_progress = now


def schemes_of(options) -> list[str | None]:
    """The quantization schemes a run's batches name (None: full precision), each shape's
    under a profile: what its workers preload."""
    from diffq.core.speedups import parse

    specs = [spec for _, _, spec, _ in options.per_size] if options.per_size else [options.speedup]
    return sorted({getattr(parse(spec), "quant", None) for spec in specs}, key=lambda quant: quant or "")


def speedups_of(options) -> list[str]:
    """The specs a run's batches will carry (a profile's, one per shape)."""
    if options.per_size:
        return sorted({spec for _, _, spec, _ in options.per_size if spec})
    return [options.speedup] if options.speedup else []
