"""What happens to a delivery: one decision, from the batch's outcome.

Everything in a worker that ends a delivery reports an `Outcome`; `decide` turns it
into the one `Action` the broker sees, and the broker door (worker/delivery/door.py,
`carry_out`) is the one place an action becomes a call on the broker. The table
below is the whole policy; the batch line (worker/delivery/batches.py) carries it out for
the task's outcomes on the consumer's main thread, the receipt checks
(worker/delivery/dead_letters.py) for what never became a task, the drain
(worker/delivery/celery_adapter.py) for what is still held at its timeout, the lease keeper
(worker/delivery/lease.py) for a holder past its bound, the door itself for an ack or
reject the broker answers it could no longer pass on (its connection gone), the
consumer channel for what it holds when it closes, `diffq queues` for a
dead letter it read, and the embedded runner for a batch lost with its worker.

    outcome          action            why
    generated        ack when stored   the images, record and credit are stored first (held ack)
    already stored   ack when stored   a redelivered copy is credited again, then acked
    stored           ack               the sink finished what a held ack waited for
    store failed     requeue           nothing was lost: another delivery stores it
    cancelled        ack               `diffq cancel`: dropped unseen, nothing written
    failed           ack               its failure record is stored: the run goes on
    split            ack               its halves are published as batches of their own
    retry            ack               Celery has published the retry (with its countdown)
    dead letter      ack               refused (`refusal`): its letter is in diffq.dead, never retried
    refused          reject            refused (`refusal`): the broker dead-letters it (RabbitMQ's policy)
    malformed        ack               not even a message (a Redis item no kombu envelope): its letter is
                                       written, and the read that took it off the queue was its removal
    hand back        requeue           not a failed attempt: a tensor-parallel rank died, or Celery lost
                                       the task's worker (task_reject_on_worker_lost)
    engine rejected  reject            Celery's failure handler drops it without requeue (a `Reject`, or
                                       acks_on_failure off: neither is diffq's own)
    channel closed   requeue           still held when its consumer channel closes (Redis: what kombu
                                       restores at the close), not a failed attempt
    peeked           requeue           a dead letter `diffq queues` read (RabbitMQ: fetched unacked): back
                                       in its place once all are read
    lost with worker requeue           the embedded broker removed it at fetch and its worker died: the
                                       runner publishes it again from the run folder
    drained          requeue           SIGTERM's drain timeout passed with it in hand
    lease lapsed     let lapse         held past DIFFQ_MAX_HOLD_S: no longer renewed, the broker gives it
                                       back when its lease runs out (the outer bound on a hung holder)
    connection lost  let lapse         its channel is gone: settled here only, back once its lease lapses
                                       (redelivered, a stored batch is credited, not generated)
    unreported       ack               the task ended without saying (Celery's own acks_late)

A worker that dies carries nothing out: its deliveries' leases lapse (or its
connection closes), and the broker hands them to the next holder.
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
    MALFORMED = "malformed"
    HAND_BACK = "hand back"
    ENGINE_REJECTED = "engine rejected"
    CHANNEL_CLOSED = "channel closed"
    PEEKED = "peeked"
    LOST_WITH_WORKER = "lost with worker"
    DRAINED = "drained"
    LEASE_LAPSED = "lease lapsed"
    CONNECTION_LOST = "connection lost"
    UNREPORTED = "unreported"


class Action(str, Enum):
    ACK = "ack"
    ACK_WHEN_STORED = "ack when stored"  # hold the ack until the sink's future is done
    REQUEUE = "requeue"  # back to its queue now, not counted as an attempt
    REJECT = "reject"  # without requeue: to the broker's dead letters (core/brokers/)
    LET_LAPSE = "let lapse"  # settled here only; the broker gives it back when its lease runs out


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
    Outcome.MALFORMED: Action.ACK,
    Outcome.HAND_BACK: Action.REQUEUE,
    Outcome.ENGINE_REJECTED: Action.REJECT,
    Outcome.CHANNEL_CLOSED: Action.REQUEUE,
    Outcome.PEEKED: Action.REQUEUE,
    Outcome.LOST_WITH_WORKER: Action.REQUEUE,
    Outcome.DRAINED: Action.REQUEUE,
    Outcome.LEASE_LAPSED: Action.LET_LAPSE,
    Outcome.CONNECTION_LOST: Action.LET_LAPSE,
    Outcome.UNREPORTED: Action.ACK,
}


def decide(outcome: Outcome) -> Action:
    """The one place that says what a delivery's outcome does to it on the broker."""
    return DECISIONS[outcome]


class Refused(str, Enum):
    """Why a delivery is refused, never generated or retried: the receipt checks
    (worker/delivery/celery_adapter.py `checked_on_receipt`, Celery's handlers replaced by
    `DeadLetterStep`), admission (worker/delivery/admission.py) and the task body's."""

    UNDECODABLE = "body not decodable"  # Celery's on_decode_error
    INVALID_TASK = "invalid task"  # on_invalid_task: pickle, another content type
    NOT_A_TASK = "not a Celery task message"  # on_unknown_message
    UNKNOWN_TASK = "unknown task"  # on_unknown_task
    TOO_LARGE = "over the size cap"  # measured on receipt, before the body is parsed
    NOT_A_CALL = "not a batch call"  # not [[], {"batch": {...}}, embed]
    NOT_A_BATCH = "not a diffq batch"  # the schema (admission's `malformed`, or the task body's)
    # admission (worker/delivery/admission.py), in the order it checks:
    UNSIGNED = "signature does not verify"  # unsigned, altered, replayed, or its queue unknown
    WRONG_QUEUE = "not for the queue it arrived on"
    NOT_ITS_SCOPE = "run folder or run id not served"  # --run, DIFFQ_ALLOWED_OUT_PREFIXES
    UNKNOWN_MODEL = "model not served"  # --model, --models, DIFFQ_ALLOWED_MODELS
    UNKNOWN_ADAPTER = "adapter not allowed"  # DIFFQ_ALLOWED_ADAPTERS
    NOT_ITS_RUN = "not its run"  # the task body: no manifest of its run in its run folder
    OUT_NOT_ALLOWED = "run folder not allowed"  # the task body: Runtime.storage_for refused its run folder


# Refusals whose reason is what their reader needs (a trust decision): a letter is
# written even where the broker would route a rejected delivery itself (it keeps
# only the queue and 'rejected').
LETTERED = frozenset({Refused.UNSIGNED, Refused.WRONG_QUEUE, Refused.NOT_ITS_SCOPE, Refused.UNKNOWN_MODEL,
                      Refused.UNKNOWN_ADAPTER,
                      Refused.NOT_ITS_RUN, Refused.OUT_NOT_ALLOWED})


def refusal(why: Refused, by_broker: bool) -> Outcome:
    """The outcome of a refused delivery: REFUSED (rejected: the broker dead-letters it,
    where `by_broker`, as the broker's `declare_dead_letters` answered) or DEAD_LETTER (diffq
    writes the letter and acks)."""
    return Outcome.REFUSED if by_broker and why not in LETTERED else Outcome.DEAD_LETTER
