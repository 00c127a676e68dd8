"""What happens to a delivery: one decision, from the batch's outcome.

Everything in a worker that ends a batch's life reports an `Outcome`; `decide` turns
it into the one `Action` the broker sees. The table below is the whole policy; the
batch line (worker/batches.py) carries it out on the consumer's main thread, and
the drain (worker/celery_adapter.py) for what is still held at its timeout.

    outcome          action            why
    generated        ack when stored   the images, record and credit are stored first (held ack)
    already stored   ack when stored   a redelivered copy is credited again, then acked
    stored           ack               the sink finished what a held ack waited for
    store failed     requeue           nothing was lost: another delivery stores it
    cancelled        ack               `diffq cancel`: dropped unseen, nothing written
    failed           ack               its failure record is stored: the run goes on
    split            ack               its halves are published as batches of their own
    retry            ack               Celery has published the retry (with its countdown)
    dead letter      ack               not a diffq batch: its letter is in diffq.dead, never retried
    refused          reject            not a diffq batch: the broker dead-letters it (RabbitMQ's policy)
    hand back        requeue           not a failed attempt (a tensor-parallel rank died)
    drained          requeue           SIGTERM's drain timeout passed with it in hand
    unreported       ack               the task ended without saying (Celery's own acks_late)
"""

from __future__ import annotations

from enum import Enum


class Outcome(str, Enum):
    GENERATED = "generated"
    ALREADY_STORED = "already stored"
    STORED = "stored"
    STORE_FAILED = "store failed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    SPLIT = "split"
    RETRY = "retry"
    DEAD_LETTER = "dead letter"
    REFUSED = "refused"
    HAND_BACK = "hand back"
    DRAINED = "drained"
    UNREPORTED = "unreported"


class Action(str, Enum):
    ACK = "ack"
    ACK_WHEN_STORED = "ack when stored"  # hold the ack until the sink's future is done
    REQUEUE = "requeue"  # back to its queue now, not counted as an attempt
    REJECT = "reject"  # without requeue: to the broker's dead letters (core/transports.py)


DECISIONS: dict[Outcome, Action] = {
    Outcome.GENERATED: Action.ACK_WHEN_STORED,
    Outcome.ALREADY_STORED: Action.ACK_WHEN_STORED,
    Outcome.STORED: Action.ACK,
    Outcome.STORE_FAILED: Action.REQUEUE,
    Outcome.CANCELLED: Action.ACK,
    Outcome.FAILED: Action.ACK,
    Outcome.SPLIT: Action.ACK,
    Outcome.RETRY: Action.ACK,
    Outcome.DEAD_LETTER: Action.ACK,
    Outcome.REFUSED: Action.REJECT,
    Outcome.HAND_BACK: Action.REQUEUE,
    Outcome.DRAINED: Action.REQUEUE,
    Outcome.UNREPORTED: Action.ACK,
}


def decide(outcome: Outcome) -> Action:
    """The one place that says what a delivery's outcome does to it on the broker."""
    return DECISIONS[outcome]
