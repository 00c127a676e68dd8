"""Patience for a model fetch: what a dropped connection, a timeout, a 5xx, S3's
SlowDown or GCS's 429 costs is a wait, not the worker. Each stream that fails waits
(exponential backoff with full jitter: google-api-core's exponential_sleep_generator)
and continues from its last byte, for as long as the store has moved no byte for less
than DIFFQ_MODEL_FETCH_PATIENCE_S; every wait is logged with what it waits for:

    fetching weights: 0.34 of 1.07 GB, retrying S3 (connection refused) for 0:20

What cannot heal (403, 404, a changed object, a checksum mismatch) is raised at once.
The same line, updated as bytes arrive, is left for `diffq run`'s progress bar in
DIFFQ_TROUBLE_DIR (a `fetch-<pid>.txt` note, removed when the fetch ends).

Why our own loop, not the libraries' retries: botocore's retry modes count attempts
and share one quota per client (~35 retries across threads in an outage), and
google-api-core's Retry counts its deadline from the first call, not from the last
byte received; neither resumes a stream from where it stopped. The libraries still
do the quick retries inside one call (botocore standard mode, 3 attempts here).
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
from pathlib import Path

from google.api_core.retry import exponential_sleep_generator

from diffq.core.progress import FETCH_NOTE, TROUBLE_DIR_ENV

log = logging.getLogger("diffq.worker")

BACKOFF_FIRST_S = 0.5
BACKOFF_MOST_S = 15.0  # a stream tries again at least this often while it waits (docs/fleet.md)
NOTE_EVERY_S = 1.0


class FetchGaveUp(Exception):
    """The store moved no byte for longer than the patience."""


def backoff():
    return exponential_sleep_generator(BACKOFF_FIRST_S, BACKOFF_MOST_S, 2.0)


def transient(exc: BaseException) -> str | None:
    """Why `exc` may heal ("connection dropped", "503 SlowDown", ...), or None when it
    cannot (403, 404, 412, a local disk error, anything unknown)."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from google.api_core import exceptions as google
    from google.auth.exceptions import TransportError
    from requests import exceptions as requests
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = exc.response.get("Error", {}).get("Code", "")
        slow = code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                        "ServiceUnavailable")
        said = f"{status} {code}" if code and code != str(status) else str(status)  # a HEAD's has no body
        return said if slow or status in (408, 429) or status >= 500 else None
    if isinstance(exc, google.GoogleAPICallError):
        code = exc.code or 0
        return f"{int(code)} {type(exc).__name__}" if code in (408, 429) or code >= 500 else None
    if isinstance(exc, (BotoConnectionError, HTTPClientError, Urllib3Error, requests.ConnectionError,
                        requests.Timeout, requests.ChunkedEncodingError, TransportError, http.client.HTTPException,
                        ConnectionError, TimeoutError)):
        text = f"{type(exc).__name__} {exc}".lower()
        if "refused" in text or "could not connect" in text:
            return "connection refused"
        if "timeout" in text or "timed out" in text:
            return "timed out"
        return "connection dropped"
    return None


def from_store(exc: BaseException) -> bool:
    """Whether the store answered `exc` (a refusal to name with the file); anything else
    that cannot heal — a local disk full, a bug — is raised as it is, so the batch is
    retried rather than failed for good."""
    from botocore.exceptions import ClientError
    from google.api_core.exceptions import GoogleAPICallError

    return isinstance(exc, (ClientError, GoogleAPICallError))


class Patience:
    """One fetch's bytes and its outage: shared by every stream of the fetch."""

    def __init__(self, store: str, url: str, patience_s: float, total: int, done: int = 0):
        self.store, self.url, self.patience_s = store, url, patience_s
        self.total, self.done = total, done
        self.transferred = 0  # bytes received from the store now, resent ones included
        self.since: float | None = None  # the first failure since a byte last arrived
        self.reason = ""
        self._lock = threading.Lock()
        self._noted = 0.0
        folder = os.environ.get(TROUBLE_DIR_ENV)
        self.note_path = Path(folder) / FETCH_NOTE.format(pid=os.getpid()) if folder else None

    def moved(self, n: int, *, counted: bool = True) -> None:
        """`n` bytes arrived (`counted`: towards the file's completion)."""
        with self._lock:
            self.transferred += n
            if counted:
                self.done += n
            if self.since is not None:
                log.warning("fetching weights: the %s link is back after %s", self.store, _clock(self.waited()))
                self.since = None
        if self.note_path and time.monotonic() - self._noted >= NOTE_EVERY_S:
            self._note()

    def waited(self) -> float:
        return time.monotonic() - self.since if self.since is not None else 0.0

    def line(self) -> str:
        said = f"fetching weights: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB"
        if self.since is not None:
            said += f", retrying {self.store} ({self.reason}) for {_clock(self.waited())}"
        return said

    def wait(self, exc: BaseException, name: str, sleeps) -> None:
        """After `exc` in the stream of file `name`: sleep the next backoff, or raise
        `exc` when it cannot heal, FetchGaveUp when patience ran out."""
        reason = transient(exc)
        if reason is None:
            raise exc
        with self._lock:
            if self.since is None:
                self.since, self.reason = time.monotonic(), reason
            waited = self.waited()
        if waited >= self.patience_s:
            raise FetchGaveUp(f"model {self.url}: file {name}: no byte from {self.store} for {_clock(waited)} "
                              f"({reason}: {exc}); gave up after DIFFQ_MODEL_FETCH_PATIENCE_S="
                              f"{self.patience_s:g}") from exc
        delay = min(next(sleeps), self.patience_s - waited)
        log.warning("%s; %s tries again in %.1f s", self.line(), name, delay)
        self._note()
        time.sleep(delay)

    def _note(self) -> None:
        self._noted = time.monotonic()
        if self.note_path is None:
            return
        try:
            tmp = self.note_path.with_name(self.note_path.name + ".tmp")
            tmp.write_text(self.line())
            os.replace(tmp, self.note_path)
        except OSError:
            pass

    def close(self) -> None:
        if self.note_path is not None:
            self.note_path.unlink(missing_ok=True)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"
