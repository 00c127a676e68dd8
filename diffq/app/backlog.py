"""The per-model backlog: queued batches over every shape queue of a model, served
over HTTP for KEDA's `metrics-api` scaler, and the feeder of windowed runs.

A run submitted with a window (producer/feed.py) has only that window in the broker:
a broker-side trigger alone would never grow a pool past it. The service therefore
runs the fleet's feeder too (given the feeds folder, `--feeds` / DIFFQ_FEEDS) and adds
each queue's batches still in OUT to the broker's depth, for pools per model and per
shape (`?queue=Q`, Neuron and TPU) alike. The feeder lives here rather than in the
workers or a service of its own: it is one small torch-free pod that already reads the
broker, there is one of it (a second one would do no harm: producer/feed.py), and the
number KEDA reads is the one the feeder holds, with nothing between them to disagree.

KEDA's broker scalers watch queues by name (a Redis list, an SQS queue, a RabbitMQ
queue), and a pool whose workers discover their queues (`diffq worker --models M`)
gets new queues whenever a run brings a new shape. Triggers named at render time
would leave such a pool at zero replicas for that shape forever. This service lists
the broker's diffq queues the way discovery does (the transport table's listing and
depths) and sums them per model, so one trigger per pool covers every shape, present
and future, on every broker diffq supports. It reads only depths: it never consumes,
and KEDA's own per-queue triggers stay beside it.

When the broker cannot be read, the service answers the last listing it did read,
with its age (`age_s`) and the error. KEDA's metrics-api scaler takes any answer but
a 200 as an error (kedacore/keda pkg/scalers/metrics_api_scaler.go
`getMetricValueFromURL`: "api returned %d") and keeps no value of its own: the trigger
is then missing from that poll (the HPA scales up on the other triggers but skips a
scale-down), and a ScaledObject `fallback` would pin the pool at its fallback replicas
whatever the other triggers say, so none is rendered. Only before any good listing
does the service answer 503.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from diffq.core.contract import model_slug, queue_slug, without_layout

PORT = 9500
# KEDA polls each ScaledObject every 15 s; many pools share one listing.
REFRESH_S = 5.0


def model_backlogs(broker_url: str, rabbitmq_api: str | None = None,
                   unpublished: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """model slug -> {queue: depth + unpublished} for every shape queue the broker lists
    or the feeder still holds batches of (`unpublished`: queue -> batches in OUT)."""
    from diffq.app.queues import queue_report

    by_model: dict[str, dict[str, int]] = {}
    for info in queue_report(broker_url, timeout=0, rabbitmq_api=rabbitmq_api, unpublished=unpublished):
        slug = queue_slug(info.queue)
        if slug is not None:
            by_model.setdefault(slug, {})[info.queue] = info.depth + info.unpublished
    return by_model


class NoListing(RuntimeError):
    """The broker has not been read once yet: nothing to answer (a 503)."""


class Backlog:
    """The latest listing, refreshed at most every `refresh_s` (one broker listing for
    every pool's poll); when a refresh fails, the last good listing and its age."""

    def __init__(self, list_backlogs, refresh_s: float = REFRESH_S, clock=time.monotonic, runs=None):
        self._list = list_backlogs
        self._runs = runs  # the feeder's runs: each one's batches in the broker and in OUT
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tried = float("-inf")  # the last listing attempt
        self._good: float | None = None  # when the last good listing was read
        self._error: str | None = None  # why the last attempt failed, None if it did not
        self._value: dict[str, dict[str, int]] = {}

    def current(self) -> tuple[dict[str, dict[str, int]], float, str | None]:
        """(listing, its age in seconds, the error of the latest attempt or None).
        Raises NoListing while no listing has ever been read."""
        with self._lock:
            now = self._clock()
            if now - self._tried >= self.refresh_s:
                self._tried = now
                try:
                    self._value, self._good, self._error = self._list(), now, None
                except Exception as exc:  # the broker is away: keep the last good listing
                    self._error = f"{type(exc).__name__}: {exc}"
            if self._good is None:
                raise NoListing(self._error or "no listing yet")
            return self._value, now - self._good, self._error

    def answer(self, model: str | None, queue: str | None = None) -> dict:
        """The JSON a `GET /backlog[?model=M|?queue=Q]` answers: `backlog` is what KEDA
        reads (queued + not yet published), `age_s` how old the listing is (more than
        `refresh_s` only while the broker cannot be read: `error` says why)."""
        backlogs, age, error = self.current()
        fresh = {"age_s": round(age, 1)} | ({"error": error} if error else {})
        if queue is not None:  # a per-shape pool's (Neuron, TPU): its own queue and its LoRA runs' of that shape
            mine = {q: n for q, n in backlogs.get(queue_slug(queue) or "", {}).items() if without_layout(q) == queue}
            return {"queue": queue, "backlog": sum(mine.values()), "queues": mine, **fresh}
        if model is None:
            totals = Counter({slug: sum(queues.values()) for slug, queues in backlogs.items()})
            runs = {"runs": self._runs()} if self._runs is not None else {}
            return {"backlog": sum(totals.values()), "models": dict(totals), **runs, **fresh}
        # A model reference or its slug (what the rendered trigger URL carries).
        slug = model if model in backlogs else model_slug(model)
        queues = backlogs.get(slug, {})
        return {"model": slug, "backlog": sum(queues.values()), "queues": queues, **fresh}


def serve(backlog: Backlog, host: str = "0.0.0.0", port: int = PORT, metrics=None) -> ThreadingHTTPServer:
    """An HTTP server answering /backlog and /healthz, and /metrics given a
    prometheus-client registry (diffq/app/run_metrics.py); the caller runs serve_forever()."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/healthz":
                return self._send(200, {"ok": True})
            if url.path == "/metrics" and metrics is not None:
                from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

                return self._send_bytes(200, generate_latest(metrics), CONTENT_TYPE_LATEST)
            if url.path != "/backlog":
                return self._send(404, {"error": f"no {url.path}: try /backlog?model=M"})
            query = urllib.parse.parse_qs(url.query)
            model, queue = query.get("model", [None])[0], query.get("queue", [None])[0]
            try:
                return self._send(200, backlog.answer(model, queue))
            except NoListing as exc:  # never read the broker: KEDA logs the trigger's error
                return self._send(503, {"error": f"no listing yet: {exc}"})

        def _send(self, code: int, body: dict) -> None:
            self._send_bytes(code, json.dumps(body).encode(), "application/json")

        def _send_bytes(self, code: int, data: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # KEDA polls often: no access log
            pass

    return ThreadingHTTPServer((host, port), Handler)
