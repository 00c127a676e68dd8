"""The process's line of batches: back-pressure, the sink's futures, the held ack.

`BatchLine` is the process's line of batches (a batch's life, step by step, is
worker/delivery/tasks.py). On receipt it settles the acks
whose stores finished; after generation it waits while `STORES_IN_FLIGHT` batches
are with the sink (back-pressure: never a growing pile of images behind a slow
store; two, so the sink starts the next batch as soon as it finishes one instead
of idling through the hand-off), hands the images to the sink and keeps the sink's
`credited` future; when the task returns, the ack is *held* until that future is
done, and the consumer's prefetch window widens by one meanwhile so the device
starts the next batch while this one uploads; then the routing step re-chooses
queues. A worker killed before the upload finishes never acked the batch: the
broker delivers it again (its lease lapses, core/transports.py).

Run-ahead (`paced`): while the device's calls are short (under DIFFQ_RUN_AHEAD_S),
the window holds one batch more, so the process's second task thread receives and
prepares the next batch while a call runs and the device never waits on the host's
per-batch work; a long call (a compile, a big model) narrows it back to one batch
in hand, which no other device could take meanwhile.

Every way a batch ends is an `Outcome` the task body reports once (`report`); what the
broker sees is `decide(outcome)` (worker/delivery/outcomes.py, the one table): ack now, hold
the ack until the sink's future is done, or requeue. They are carried out by the
broker door (worker/delivery/door.py `carry_out`) from the task threads, from an event-loop
timer, and at shutdown, through Celery's request, which hands each ack to the
consumer's loop where it has one (kombu channels are not thread-safe). The Celery
side of this (the request whose ack goes through here, the bootstep driving the
timers) is worker/delivery/celery_adapter.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.storage import Storage
from diffq.worker.observe import metrics
from diffq.worker.delivery.outcomes import Action, Outcome, decide
from diffq.worker.delivery.door import carry_out

log = logging.getLogger(__name__)

# Batches handed to the sink and not yet stored, at most (worker/sink/helper.py's
# shared-memory slots hold one more: the batch being handed on).
STORES_IN_FLIGHT = 2


class Delivery(Protocol):
    """What the line needs from a delivery whose ack it holds (the port of worker/delivery/door.py)."""

    id: str

    def ack_now(self) -> None: ...

    def requeue(self) -> None: ...

    def reject(self, requeue: bool = False) -> None: ...  # Celery's Request.reject: the broker dead-letters it


class Window(Protocol):
    """The consumer's prefetch window: one more delivery while an ack is held."""

    def widen(self) -> None: ...

    def narrow(self) -> None: ...


class BatchLine:
    def __init__(self, sink, router=None, run_ahead_s: float | None = None):
        self.sink = sink
        self.router = router  # worker/delivery/routing.py's Router, or None (round-robin)
        self.window: Window | None = None  # set once the consumer is up
        # Rung after an ack or a wider window: a consumer that polls (the embedded
        # broker) looks again at once instead of at its next poll.
        self.wake: Callable[[], None] = _nothing
        self.run_ahead_s = get_settings().run_ahead_s if run_ahead_s is None else run_ahead_s
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # one hand-off at a time: the back-pressure order
        # task id -> its outcome, and the sink future a held ack waits for
        self._reported: dict[str, tuple[Outcome, Future | None]] = {}
        self._held: list[tuple[Future, Delivery]] = []
        self._stores: collections.deque[Future] = collections.deque()  # the sink's, oldest first
        self._ahead = False  # the window holds one batch more (`paced`)
        self.running = 0  # batch tasks in progress (`batch_task`)
        self._closing = False  # the consumer has stopped (`close`)

    @contextlib.contextmanager
    def batch_task(self):
        """Around a batch task's body: `running` counts the task threads inside one."""
        with self._lock:
            self.running += 1
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1

    def attach(self, window: Window, wake: Callable[[], None] | None = None) -> None:
        """The consumer is up (again): its window starts at one batch per task thread;
        one batch in hand until a short call is seen."""
        with self._lock:
            self.window, self._ahead, self._closing = window, False, False
        window.narrow()
        if wake is not None:
            self.wake = wake

    def close(self) -> None:
        """The consumer has stopped: no timer settles held acks any more, so a batch
        task that ends from now on waits for its store and acks it itself."""
        self._closing = True

    def paced(self, call_s: float) -> None:
        """A call took `call_s` on the device: run ahead (a second batch in hand, its call
        prepared while this one runs) while calls are shorter than `run_ahead_s`."""
        ahead = call_s < self.run_ahead_s
        with self._lock:
            if self.window is None or ahead == self._ahead:
                return
            self._ahead = ahead
        if ahead:
            self.window.widen()
        else:
            self.window.narrow()
        self.wake()

    # -- the task body's side ------------------------------------------------------

    def received(self) -> None:
        """A batch arrives: ack what the sink finished meanwhile."""
        self.settle()

    def store(self, storage: Storage, message: BatchMessage, images: list, record: dict) -> Future:
        """Generation is done: back-pressure, hand to the sink, route. Returns the sink's
        `credited` future, which the batch's ack waits for (reported as `generated`)."""
        with self._store_lock:
            while self._stores and (self._stores[0].done() or len(self._stores) >= STORES_IN_FLIGHT):
                concurrent.futures.wait([self._stores.popleft()])
            self.settle()
            handed = self.sink.submit(storage, message, images, record)
            self._stores.append(handed.stored)
        handed.stored.add_done_callback(_observe_store)
        if self.router is not None:
            self.router.update_soon()  # before the next fetch, on the consumer's loop
        return handed.credited

    def credit_again(self, storage: Storage, message: BatchMessage) -> Future:
        """A redelivered batch already stored: credit it again; the ack waits for that
        (reported as `already stored`)."""
        with self._store_lock:
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
                self.wake()
            self.settle(wait=self._closing)
            return
        carry_out(action, delivery)
        self.wake()

    def settle(self, wait: bool = False) -> int:
        """Decide every held batch whose sink work is done (stored: ack; storing failed:
        requeue); with `wait`, every held batch. Returns how many settled."""
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
                    metrics.observe_upload_failure("store")
                    log.error("storing batch %s failed, handing it back: %r", delivery.id, future.exception())
                carry_out(decide(Outcome.STORED if future.exception() is None else Outcome.STORE_FAILED), delivery)
                if self.window is not None:
                    self.window.narrow()
                self.wake()
                settled += 1


def _nothing() -> None:
    pass


def _observe_store(future: Future) -> None:
    if future.exception() is None:
        metrics.observe_store(future.result().store_s, future.result().bytes)
