"""The door to the broker: the deliveries port, and `carry_out`, the one place an
`Action` (worker/delivery/outcomes.py `decide`) becomes a call on the broker.

The port is shaped like dramatiq's `Consumer` (dramatiq/broker.py: ack, nack,
requeue), in the names the batch line has always used:

    ack_now()          done: the broker forgets it                          (ACK)
    reject()           dead-lettered: rejected without requeue, the broker
                       routes it to its dead letters                        (REJECT)
    requeue()          back to its queue now, not counted as an attempt     (REQUEUE)
    let_lapse()        settled here only: the broker gives it back once
                       its lease runs out                                   (LET_LAPSE)

and, for everything a process holds at once, from a thread of its own with its
own connection (`AllHeld`, over worker/delivery/lease.py's keeper): renew and hand back.

One class per kind of delivery implements it: `BatchRequest`
(worker/delivery/celery_adapter.py, a delivery Celery made a task of: acks go through
Celery's request, on the consumer's loop), `Received` (a kombu message refused on
receipt, before it became a task), `Taken` (a Redis item that was no message: the
read removed it), `Detached` (a delivery whose connection is gone), `Overdue` (a
delivery held past its bound) and `AllHeld` (a drain's hand-back); `Delivered` is
the task's side of a delivery, as a batch's life sees it.

A delivery whose broker answers its ack, requeue or reject (`answer`: a future;
`BatchRequest`'s call runs later, on the consumer's loop) is heard out by `carry_out`:
one the broker could no longer be told about (core/brokers/base.py `ConnectionLost`:
Redis, its connection gone) is an end of its own, `connection lost`, decided like
every other. What a broker
kind does differently (renew, hand back, the consumer channel) is its broker object
(diffq/core/brokers/), which the transport table points at (diffq/core/transports.py).

Outside the broker classes only worker/delivery/celery_adapter.py imports celery or
kombu or reads their private attributes (tests/test_broker_door.py): here a
delivery is reached through kombu's and Celery's public methods only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from diffq.core.brokers.base import TASK_NAME, ConnectionLost, StillHeld
from diffq.worker.delivery.outcomes import Action, Outcome, decide

log = logging.getLogger("diffq.worker")


def carry_out(action: Action, delivery):
    """Do `action` to `delivery` (any implementation of the port); what its method
    returns (the hand-back's count). An ack, requeue or reject whose broker answers
    it (`answer`) is heard out: one the broker could no longer be told about ends
    `connection lost` (`_heard`)."""
    if action is Action.LET_LAPSE:
        return delivery.let_lapse()
    if action is Action.ACK_WHEN_STORED:
        raise ValueError(f"{action.value} is carried out by holding the ack, not at once")
    # A delivery whose broker answers nothing has no `answer` (the stubs, Received, ...).
    answer = getattr(delivery, "answer", None)
    answer = answer() if answer is not None else None
    if answer is not None:
        answer.add_done_callback(_heard)
    if action is Action.ACK:
        return delivery.ack_now()
    if action is Action.REQUEUE:
        return delivery.requeue()
    return delivery.reject(requeue=False)  # Celery's Request.reject: the broker dead-letters it


def _heard(answer: Future) -> None:
    """The broker's answer, where the call ran (the consumer's loop)."""
    if answer.cancelled() or answer.exception() is not None:
        return  # the call raised where it ran (Celery logs it): the delivery comes back with its lease
    lost = answer.result()
    if isinstance(lost, ConnectionLost):
        end(Outcome.CONNECTION_LOST, Detached(lost.tag, lost.settle))


def end(outcome: Outcome, delivery):
    """`carry_out(decide(outcome), delivery)`: how every end of a delivery outside the
    batch line's held acks reaches the broker."""
    return carry_out(decide(outcome), delivery)


class _Only:
    """A delivery of which only some ends make sense: the others are a bug, said loudly."""

    def ack_now(self):
        raise ValueError(f"{type(self).__name__}: cannot be acked")

    def requeue(self):
        raise ValueError(f"{type(self).__name__}: cannot be requeued")

    def reject(self, requeue: bool = False):
        raise ValueError(f"{type(self).__name__}: cannot be rejected")

    def let_lapse(self):
        raise ValueError(f"{type(self).__name__}: cannot be left to its lease")


class Received(_Only):
    """A kombu message the consumer refused before Celery made a task of it: settled
    now, never left to its lease."""

    def __init__(self, message):
        self.message = message

    def ack_now(self) -> None:
        self.message.ack()

    def requeue(self) -> None:
        self.message.reject(requeue=True)

    def reject(self, requeue: bool = False) -> None:
        self.message.reject(requeue=requeue)


class Taken(_Only):
    """A Redis list item that is no kombu envelope (core/brokers/redis.py
    `guard_deliveries`): the read popped it and nothing recorded it as unacked,
    so the pop was its ack; it cannot be put back for a reader that chokes on it."""

    def ack_now(self) -> None:
        pass


class Detached(_Only):
    """A delivery whose broker connection is gone (core/brokers/redis.py): `settle`
    forgets it here; the broker still holds it as unacked and gives it back when its
    lease lapses."""

    def __init__(self, tag: str, settle: Callable[[], None]):
        self.tag, self.settle = tag, settle

    def let_lapse(self) -> None:
        self.settle()
        log.warning("the broker connection is gone: delivery %s is settled by the broker (given back "
                    "at the close, or back once its lease lapses)", self.tag)


class Closing(_Only):
    """A delivery still held when its consumer channel closes: `restore` puts it back
    on its queue (core/brokers/redis.py: kombu's `restore_by_tag`, as kombu's own close
    would)."""

    def __init__(self, tag: str, restore: Callable[[], None]):
        self.tag, self.restore = tag, restore

    def requeue(self) -> None:
        self.restore()


def channel_closed(held: StillHeld | ConnectionLost) -> None:
    """The consumer channel's hook for a delivery it still holds as it closes: back on
    its queue, or, its connection already gone, left to its lease."""
    if isinstance(held, ConnectionLost):
        end(Outcome.CONNECTION_LOST, Detached(held.tag, held.settle))
    else:
        end(Outcome.CHANNEL_CLOSED, Closing(held.tag, held.restore))


def peeked(message) -> None:
    """A dead letter `diffq queues` fetched to read (core/brokers/rabbitmq.py)."""
    end(Outcome.PEEKED, Received(message))


class Republished(_Only):
    """A batch the embedded broker lost with its worker (its file left the queue at
    fetch): `publish` sends it again from the run folder (diffq/app/runner.py)."""

    def __init__(self, publish: Callable[[], None]):
        self.publish = publish

    def requeue(self) -> None:
        self.publish()


class Overdue(_Only):
    """A delivery held past DIFFQ_MAX_HOLD_S: `stop` takes it off the lease keeper's
    renewals."""

    def __init__(self, tag: str, held_s: float, stop: Callable[[str], None]):
        self.tag, self.held_s, self.stop = tag, held_s, stop

    def let_lapse(self) -> None:
        self.stop(self.tag)
        log.warning("delivery %s held for %.0f s, past DIFFQ_MAX_HOLD_S: no longer renewed; the broker gives "
                    "it back once its lease lapses", self.tag, self.held_s)


class AllHeld(_Only):
    """Everything a process holds, given back at once through the transport's
    hand-back (worker/delivery/lease.py), from the thread that asks: a drain past its timeout."""

    def __init__(self, lease):
        self.lease = lease

    def requeue(self) -> int:
        return self.lease.hand_back() if self.lease is not None else 0


class Delivered:
    """A delivery Celery made a task of, as a batch's life sees it (worker/delivery/tasks.py,
    worker/delivery/hooks.py): which one it is, how often it was tried, and the two ways its
    work goes on elsewhere (Celery's retry; a batch of its own, published). What the
    broker sees of the delivery itself is the batch line's (`BatchRequest`)."""

    def __init__(self, task):
        self.task = task  # the bound Celery task (a stub in tests)

    @property
    def id(self) -> str:
        return self.task.request.id

    @property
    def retries(self) -> int:
        return self.task.request.retries

    @property
    def redelivered(self) -> bool:
        """Delivered before (the broker says so) or retried: it may already be stored."""
        return bool((self.task.request.delivery_info or {}).get("redelivered") or self.task.request.retries)

    @property
    def returned(self) -> bool:
        """Delivered before by the broker, not a retry: a holder lost it (its lease
        lapsed, its connection closed) or handed it back."""
        return bool((self.task.request.delivery_info or {}).get("redelivered")) and not self.task.request.retries

    @property
    def routing_key(self) -> str | None:
        """The queue its envelope names (the sender's word, not where it arrived)."""
        return (self.task.request.delivery_info or {}).get("routing_key")

    @property
    def app(self):
        return self.task.app

    def retry(self, exc: Exception, countdown: float, **options) -> BaseException:
        """Celery's retry (its message published with the countdown): what to raise."""
        return self.task.retry(exc=exc, countdown=countdown, **options)

    def publish(self, queue: str, batch: dict, **options) -> None:
        """A batch of its own on `queue` (a split's half)."""
        self.task.app.send_task(TASK_NAME, kwargs={"batch": batch}, queue=queue, routing_key=queue, **options)
