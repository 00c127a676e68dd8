"""OUT as the embedded runner holds it: the run folder's storage, opened once, and
everything `diffq run` / `resume` read from it while they produce the run.

`RunOut` is made once per call from the URL the user typed; the runner passes that
object, never the storage, to its own parts. It owns the one-runner lock of a local
OUT, the manifest of a run already there, the progress summary (done and failed),
why storing fails (`TroubleView`: the workers' notes in the broker's folder, OUT's own
notes, a look at a local OUT's disk), the cancel marker and, after a lost batch, what
the run folder says is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from diffq.core import layout
from diffq.core.contract import BatchMessage
from diffq.core.progress import (ProgressSummary, fetch_notes, local_troubles, observed_trouble,
                                 recorded_troubles, trouble_message)
from diffq.core.records import RunManifest
from diffq.core.runfolder import iter_records, read_cancel, read_manifest
from diffq.core.storage import Storage, open_storage
from diffq.producer.resume import missing_batches, scan


class RunFailed(RuntimeError):
    pass


class RunBusy(RunFailed):
    pass


@dataclass(frozen=True)
class Look:
    """What one look at OUT found, for the bar and the runner's loop."""

    done: int
    failed: int
    moved: bool  # more items done or failed than at the look before
    trouble: str | None  # why storing fails, once it has for over a minute
    fetching: str | None  # a local worker's model fetch, while it runs

    def finished(self, total: int) -> bool:
        return self.done + self.failed >= total


class RunOut:
    """OUT, opened once: see the module's docstring."""

    def __init__(self, url: str | os.PathLike[str]):
        self.storage: Storage = open_storage(url)
        self.url = self.storage.url
        self.progress = ProgressSummary(self.storage)
        self.troubles: TroubleView | None = None
        self._next_cancel_check = 0.0

    @contextlib.contextmanager
    def sole_runner(self) -> Iterator[None]:
        """One embedded runner at a time on a local OUT: a second one continuing the run
        would produce what the first has in hand again, under other batch ids. The lock
        (flock on the folder) goes with its process, `kill -9` included. An object store
        has no such lock: there, finishing a run that is still running is the user's call."""
        path = self.storage.local_path(layout.MANIFEST)
        if path is None:
            yield
            return
        folder = path.parent
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)  # not inherited by the workers (PEP 446)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunBusy(f"another diffq run or resume is producing {self.url} now: "
                              "wait for it to end, or stop it first") from None
            yield
        finally:
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):  # left only if nothing was written
                    folder.rmdir()

    def manifest(self) -> RunManifest | None:
        """The manifest of the run OUT already holds, or None for a new OUT."""
        return read_manifest(self.storage) if self.storage.exists(layout.MANIFEST) else None

    def read_manifest(self) -> RunManifest:
        """The run OUT holds (`NotARun` where it holds none)."""
        return read_manifest(self.storage)

    def watch(self, notes: Path) -> TroubleView:
        """Why storing fails, from here on: `notes` is the local folder the workers leave theirs in."""
        self.troubles = TroubleView(self.storage, notes)
        return self.troubles

    def look(self, now: float, total: int) -> Look:
        """The progress summary refreshed and, where `watch` named the workers' notes, why storing fails."""
        before = self.progress.done + self.progress.failed
        done, failed = self.progress.refresh().done, self.progress.failed
        trouble = fetching = None
        if self.troubles is not None:
            trouble = self.troubles.look(now, pending=total - done - failed)
            fetching = self.troubles.fetching
        return Look(done=done, failed=failed, moved=done + failed != before, trouble=trouble, fetching=fetching)

    def cancelled(self, now: float) -> bool:
        """`diffq cancel` from elsewhere: the marker, read at most every CANCEL_CHECK_S."""
        if now < self._next_cancel_check:
            return False
        self._next_cancel_check = now + layout.CANCEL_CHECK_S
        return read_cancel(self.storage) is not None

    def longest_batch_s(self, default: float = 5.0) -> float:
        """The longest pipeline call the records show (`default` without records)."""
        return max((record.generate_s for record in iter_records(self.storage)), default=default)

    def settled(self) -> set[str]:
        """The batches recorded or failed; `scan` also credits a batch recorded but never
        credited (killed in between), which would otherwise stay pending."""
        return scan(self.storage).settled

    def missing(self, settled: set[str] | None = None) -> Iterator[BatchMessage]:
        """The plan's batches not `settled` (by default: as OUT says now), to publish again."""
        return missing_batches(self.storage, self.settled() if settled is None else settled)


class TroubleView:
    """Why storing fails, for the bar: the notes the workers' sinks leave in `folder`
    (the broker's, on a local disk), OUT's own trouble notes, and a look at a local
    OUT's disk (diffq/core/progress.py). Looked at every LOOK_S, OUT's notes (a
    listing) every NOTES_S; None until storing has failed for longer than a minute."""

    LOOK_S = 2.0
    NOTES_S = 10.0
    SAY_AGAIN_S = 300.0  # without a bar: the message again this often while it lasts

    def __init__(self, storage: Storage, folder: Path):
        self.storage, self.folder = storage, folder
        folder.mkdir(parents=True, exist_ok=True)
        self._next_look = self._next_notes = 0.0
        self._in_out: list = []
        self._message: str | None = None
        self.fetching: str | None = None  # a local worker's model fetch, while it runs
        self._said: tuple[str, float] | None = None  # (reason, when) last said without a bar

    def look(self, now: float, pending: int) -> str | None:
        if now >= self._next_look:
            self._next_look = now + self.LOOK_S
            if now >= self._next_notes:
                self._next_notes = now + self.NOTES_S
                self._in_out = recorded_troubles(self.storage) if pending > 0 else []
            troubles = [*local_troubles(self.folder), *self._in_out, observed_trouble(self.storage, pending)]
            self._message = trouble_message(troubles) if pending > 0 else None
            # A worker still fetching its model is starting, not failed: the bar shows its
            # line (the workers' own log says each wait without a bar).
            self.fetching = next(iter(fetch_notes(self.folder)), None)
        return self._message

    def say(self, console: Console, message: str | None, now: float) -> None:
        """Without a bar: say it once, and again every SAY_AGAIN_S or when the reason changes."""
        if message is None:
            self._said = None
            return
        reason = message.partition(" — ")[0]
        if self._said is None or self._said[0] != reason or now - self._said[1] >= self.SAY_AGAIN_S:
            self._said = (reason, now)
            console.print(f"diffq run: {message}", markup=False, highlight=False)
