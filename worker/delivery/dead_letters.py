"""Dead letters: what a worker does with a message on a diffq queue that diffq did not write.

Not JSON, a content type other than JSON (pickle is refused unread), not a diffq
task, over the size cap (measured on receipt, before the body is parsed), a call
that is not one batch, or a batch that fails the schema: none of these can ever succeed, so none is
retried. Each is logged once (queue and reason) and ends in the broker's dead
letters, its way (the broker object's `declare_dead_letters`, core/brokers/; shown by `diffq queues`,
consumed by no worker): on RabbitMQ, once the worker has declared the policy,
rejected without requeue for the broker to route to `diffq.dead` (it adds the
queue and 'rejected' as `x-death`; diffq's reason is in the log only); elsewhere
(Redis, SQS, RabbitMQ without its management API) written as a JSON letter
carrying the reason and the start of the original body to `diffq.dead`, and
acknowledged. The worker goes on with the next message.

Which of the two a refusal gets is `refusal` (worker/delivery/outcomes.py: each reason a
`Refused` row), and what the broker sees is `decide` of that outcome, carried out
through the broker door (worker/delivery/door.py). The Celery side (`DeadLetterStep`, which
replaces Celery's own handlers for undecodable, invalid and unknown messages, and
the receipt checks in front of the batch task's strategy) is
worker/delivery/celery_adapter.py. A Redis list item that is not even a kombu envelope
would end the worker inside kombu; the broker object's `guard_deliveries` catches
it first, and it ends as `malformed`.
"""

from __future__ import annotations

import base64
import json
import logging
import time

from diffq.core.brokers.base import DEAD_LETTERS, DEAD_QUEUE
from diffq.core.transports import transport_for
from diffq.worker.delivery.outcomes import Outcome, Refused, refusal
from diffq.worker.delivery.door import Received, Taken, end
from diffq.worker.observe import metrics

log = logging.getLogger("diffq.worker")

# A letter keeps the start of the body: enough to find the sender, and the dead
# queue cannot become a way around the size cap.
KEPT_BODY_BYTES = 16 * 1024


def letter(queue: str, reason: str, body, content_type: str | None, headers: dict | None, worker: str) -> dict:
    raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    kept = raw[:KEPT_BODY_BYTES]
    try:
        text, encoding = kept.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(kept).decode(), "base64"
    headers = headers if isinstance(headers, dict) else {}
    return {"v": 1, "queue": queue, "reason": reason, "worker": worker, "at": time.time(),
            "content_type": content_type, "task": headers.get("task"), "id": headers.get("id"),
            "body": text, "body_encoding": encoding, "body_bytes": len(raw), "truncated": len(raw) > len(kept)}


class DeadLetters:
    """`by_broker`: the broker dead-letters a delivery rejected without requeue itself
    (what the broker's `declare_dead_letters` answered); else diffq writes a letter."""

    def __init__(self, app, worker: str, by_broker: bool = False):
        self.app = app
        self.worker = worker
        self.by_broker = by_broker

    def send(self, queue: str, reason: str, body, content_type: str | None = None,
             headers: dict | None = None) -> None:
        """Write the letter to DEAD_LETTERS (the caller acks the delivery)."""
        log.warning("dead letter from queue %s: %s (moved to %s)", queue, reason, DEAD_LETTERS)
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(letter(queue, reason, body, content_type, headers, self.worker),
                                 exchange=DEAD_QUEUE.exchange, routing_key=DEAD_LETTERS, declare=[DEAD_QUEUE],
                                 serializer="json", retry=True, retry_policy={"max_retries": 3})
        except Exception as exc:
            # Still acked by the caller: a message that can never succeed must not loop.
            log.error("could not store the dead letter from %s (%s); it is dropped", queue, exc)

    def refuse(self, queue: str, reason: str, body, content_type: str | None = None,
               headers: dict | None = None, *, why: Refused = Refused.NOT_A_BATCH) -> Outcome:
        """A delivery refused for `why`: the outcome to report for it (`refusal`).
        REFUSED: the broker routes it once rejected; DEAD_LETTER: its letter is
        written here (then acked)."""
        outcome = refusal(why, self.by_broker)
        metrics.observe_dead_letter(reason_label(why))
        if outcome is Outcome.REFUSED:
            log.warning("dead letter from queue %s: %s (rejected to %s)", queue, reason, DEAD_LETTERS)
        else:
            self.send(queue, reason, body, content_type, headers)
        return outcome

    def reject(self, message, reason: str, *, why: Refused = Refused.NOT_A_BATCH, queue: str | None = None) -> None:
        """Dead-letter a kombu message the consumer refuses before it becomes a task."""
        queue = queue or (message.delivery_info or {}).get("routing_key") or "?"
        end(self.refuse(queue, reason, message.body, message.content_type, message.headers, why=why),
            Received(message))

    def malformed(self, queue: str, item, reason: str) -> None:
        """A broker item that is no message at all: its letter, and the `malformed` end."""
        metrics.observe_dead_letter(MALFORMED)
        self.send(queue, reason, item)
        end(Outcome.MALFORMED, Taken())


MALFORMED = "malformed"  # a broker item that is no message at all


def reason_label(why: Refused) -> str:
    """A refusal's `reason` label on diffq_dead_letters_total."""
    return why.name.lower()


# Every reason a worker process may dead-letter for: exported at 0 from its start.
REASONS = tuple(reason_label(why) for why in Refused) + (MALFORMED,)


def dead_letters_of(app, worker: str) -> DeadLetters:
    """The consumer's DeadLetters (the broker's way, as declared when it started; kept
    on its app for the task body's refusals), else a letter writer."""
    return getattr(app, "diffq_dead_letters", None) or DeadLetters(app, worker)


def declare_dead_letters(app, queues: list[str], api: str | None) -> bool:
    """The broker's dead letters for `queues` (the broker's `declare_dead_letters`, diffq/core/brokers/):
    True where it routes rejects itself. A broker that refuses (no policy rights,
    API down) leaves the worker writing letters, logged."""
    try:
        with app.connection_for_write() as connection:
            return transport_for(app.conf.broker_url).broker.declare_dead_letters(connection, queues, api)
    except Exception as exc:
        log.warning("could not declare the broker's dead letters (%s); refused messages are written as letters",
                    exc)
        return False
