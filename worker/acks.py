"""Deferred acknowledgement: overlap a batch's upload with the next batch, safely.

With plain `acks_late` a batch is acked when its task returns, so the task would
have to wait for its images to be encoded and stored before the device could start
the next batch (PNG encoding alone is ~1/6 of generation time for the tiny model).
Instead the task hands its images to the sink and returns; the ack is held back
until the sink has stored them, and the consumer's prefetch window is widened by
one for each held ack, so the next batch is fetched and generated meanwhile.
A worker killed before the upload finishes never acked that batch: the broker
delivers it again. Acks and rejects are only ever sent from the consumer's main
thread (kombu channels are not thread-safe): from the task body, from a hub timer
when the loop has one, and at shutdown.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from celery import bootsteps
from celery.worker.request import Request

log = logging.getLogger(__name__)

_lock = threading.Lock()
_expected: dict[str, Future] = {}  # task id -> its sink future, set by the task body
_held: list[tuple[Future, Request]] = []
_consumer = None


def expect(task_id: str, future: Future) -> None:
    """Called by the task before returning: ack this task only when `future` is done."""
    with _lock:
        _expected[task_id] = future


class DeferredAckRequest(Request):
    def acknowledge(self):
        with _lock:
            future = _expected.pop(self.id, None)
        if future is None or self.acknowledged:
            return super().acknowledge()
        with _lock:
            _held.append((future, self))
        if _consumer is not None:
            # Let the next batch in while this one's images are still being stored.
            _consumer.qos.increment_eventually()
        drain()


def _settle(future: Future, request: Request) -> None:
    if future.exception() is not None:
        log.error("storing batch %s failed, handing it back: %r", request.id, future.exception())
        request.reject(requeue=True)
    else:
        Request.acknowledge(request)
    if _consumer is not None:
        _consumer.qos.decrement_eventually()


def drain(wait: bool = False) -> int:
    """Ack (or requeue) every held batch whose sink work finished. Main thread only."""
    settled = 0
    while True:
        with _lock:
            ready = [(f, r) for f, r in _held if wait or f.done()]
            for pair in ready:
                _held.remove(pair)
        if not ready:
            return settled
        for future, request in ready:
            if wait:
                try:
                    future.result()
                except Exception:  # reported by _settle
                    pass
            _settle(future, request)
            settled += 1


def held() -> int:
    with _lock:
        return len(_held)


class DeferredAckStep(bootsteps.StartStopStep):
    """Consumer bootstep: a hub timer drains held acks while the worker is idle,
    and shutdown waits for the sink before the connection closes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer):
        global _consumer
        _consumer = consumer
        if consumer.hub is not None:
            self._timer = consumer.hub.call_repeatedly(0.05, drain)

    def stop(self, consumer):
        drain(wait=True)

    def shutdown(self, consumer):
        drain(wait=True)
