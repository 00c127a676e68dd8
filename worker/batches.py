"""The process's line of batches: back-pressure, the sink's futures, the held ack.

`BatchLine` is the process's line of batches (a batch's life, step by step, is
worker/tasks.py). On receipt it settles the acks
whose stores finished; after generation it waits for the previous batch's store
(back-pressure: one batch stored while the next generates, never a growing pile
of images behind a slow store), hands the images to the sink and keeps the sink's
`credited` future; when the task returns, the ack is *held* until that future is
done, and the consumer's prefetch window widens by one meanwhile so the device
starts the next batch while this one uploads; then the routing step re-chooses
queues. A worker killed before the upload finishes never acked the batch: the
broker delivers it again (its lease lapses, core/transports.py).

Every way a batch ends is an `Outcome` the task body reports once (`report`); what the
broker sees is `decide(outcome)` (worker/delivery.py, the one table): ack now, hold
the ack until the sink's future is done, or requeue. Acks and requeues run only on
the consumer's main thread (kombu channels are not thread-safe): from the task
body, from an event-loop timer, and at shutdown. The Celery side of this (the
request whose ack goes through here, the bootstep driving the timers) is
worker/celery_adapter.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures import Future
from typing import Protocol

from diffq.core.contract import BatchMessage
from diffq.core.storage import Storage
from diffq.worker import metrics
from diffq.worker.delivery import Action, Outcome, decide

log = logging.getLogger(__name__)


class Delivery(Protocol):
    """What the line needs from a delivery whose ack it holds."""

    id: str

    def ack_now(self) -> None: ...

    def requeue(self) -> None: ...

    def reject(self, requeue: bool = False) -> None: ...  # Celery's Request.reject: the broker dead-letters it


class Window(Protocol):
    """The consumer's prefetch window: one more delivery while an ack is held."""

    def widen(self) -> None: ...

    def narrow(self) -> None: ...


class BatchLine:
    def __init__(self, sink, router=None):
        self.sink = sink
        self.router = router  # worker/routing.py's Router, or None (round-robin)
        self.window: Window | None = None  # set once the consumer is up
        self._lock = threading.Lock()
        # task id -> its outcome, and the sink future a held ack waits for
        self._reported: dict[str, tuple[Outcome, Future | None]] = {}
        self._held: list[tuple[Future, Delivery]] = []
        self._last_store: Future | None = None

    # -- the task body's side ------------------------------------------------------

    def received(self) -> None:
        """A batch arrives: ack what the sink finished meanwhile."""
        self.settle()

    def store(self, storage: Storage, message: BatchMessage, images: list, record: dict) -> Future:
        """Generation is done: back-pressure, hand to the sink, route. Returns the sink's
        `credited` future, which the batch's ack waits for (reported as `generated`)."""
        if self._last_store is not None:
            concurrent.futures.wait([self._last_store])
        self.settle()
        handed = self.sink.submit(storage, message, images, record)
        self._last_store = handed.stored
        handed.stored.add_done_callback(_observe_store)
        if self.router is not None:
            self.router.update()  # before the next fetch
        return handed.credited

    def credit_again(self, storage: Storage, message: BatchMessage) -> Future:
        """A redelivered batch already stored: credit it again; the ack waits for that
        (reported as `already stored`)."""
        return self.sink.credit(storage, message)

    def report(self, task_id: str, outcome: Outcome, future: Future | None = None) -> None:
        """How this delivery's batch ended; `future`: what a held ack waits for."""
        if (decide(outcome) is Action.ACK_WHEN_STORED) != (future is not None):
            raise ValueError(f"outcome {outcome.value!r} {'needs' if future is None else 'takes no'} sink future")
        with self._lock:
            self._reported[task_id] = (outcome, future)

    def reported(self, task_id: str) -> Outcome | None:
        with self._lock:
            entry = self._reported.get(task_id)
        return entry[0] if entry else None

    def expected(self, task_id: str) -> Future | None:
        """The sink future the delivery's ack will wait for, if any."""
        with self._lock:
            entry = self._reported.get(task_id)
        return entry[1] if entry else None

    # -- the consumer's side -------------------------------------------------------

    def ack(self, delivery: Delivery) -> None:
        """The task returned: carry out the decision for what it reported."""
        with self._lock:
            outcome, future = self._reported.pop(delivery.id, (Outcome.UNREPORTED, None))
        action = decide(outcome)
        if action is Action.ACK_WHEN_STORED:
            with self._lock:
                self._held.append((future, delivery))
            if self.window is not None:
                self.window.widen()
            self.settle()
            return
        _apply(action, delivery)

    def settle(self, wait: bool = False) -> int:
        """Decide every held batch whose sink work is done (stored: ack; storing failed:
        requeue); with `wait`, every held batch. Main thread only. Returns how many settled."""
        settled = 0
        while True:
            with self._lock:
                ready = [pair for pair in self._held if wait or pair[0].done()]
                for pair in ready:
                    self._held.remove(pair)
            if not ready:
                return settled
            for future, delivery in ready:
                concurrent.futures.wait([future])
                if future.exception() is not None:
                    log.error("storing batch %s failed, handing it back: %r", delivery.id, future.exception())
                _apply(decide(Outcome.STORED if future.exception() is None else Outcome.STORE_FAILED), delivery)
                if self.window is not None:
                    self.window.narrow()
                settled += 1


def _apply(action: Action, delivery: Delivery) -> None:
    if action is Action.ACK:
        delivery.ack_now()
    elif action is Action.REQUEUE:
        delivery.requeue()
    elif action is Action.REJECT:
        delivery.reject(requeue=False)  # Celery's Request.reject: the broker dead-letters it
    else:
        raise ValueError(f"{action.value} is carried out by holding the ack, not at once")


def _observe_store(future: Future) -> None:
    if future.exception() is None:
        metrics.observe_store(future.result().store_s, future.result().bytes)
