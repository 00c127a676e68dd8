"""Dead letters: what a worker does with a message on a diffq queue that diffq did not write.

Not JSON, a content type other than JSON (pickle is refused unread), not a diffq
task, over the size cap (measured on receipt, before the body is parsed), a call
that is not one batch, or a batch that fails the schema: none of these can ever succeed, so none is
retried. Each is logged once (queue and reason) and ends in the broker's dead
letters, its way (core/transports.py `DeadLetterWay`, shown by `diffq queues`,
consumed by no worker): on RabbitMQ, once the worker has declared the policy,
rejected without requeue for the broker to route to `diffq.dead` (it adds the
queue and 'rejected' as `x-death`; diffq's reason is in the log only); elsewhere
(Redis, SQS, RabbitMQ without its management API) written as a JSON letter
carrying the reason and the start of the original body to `diffq.dead`, and
acknowledged. The worker goes on with the next message.

Celery's own handlers for the first four (celery/worker/consumer/consumer.py:
`on_decode_error`, `on_invalid_task`, `on_unknown_message`, `on_unknown_task`)
log a traceback and drop or reject the message; `DeadLetterStep` replaces them on
the consumer (its task handler looks them up when the event loop starts), declares
the broker's dead letters for the consumer's queues, and puts the receipt checks
(size, call shape) in front of the batch task's strategy. A Redis list item that
is not even a kombu envelope would end the worker inside kombu; the transport
table's `guard_deliveries` catches it first.
"""

from __future__ import annotations

import base64
import json
import logging
import time

from celery import bootsteps

from diffq.core.broker import TASK_NAME
from diffq.core.contract import MAX_MESSAGE_BYTES
from diffq.core.settings import get_settings
from diffq.core.signing import HEADER as SIGNATURE
from diffq.core.transports import DEAD_LETTERS, DEAD_QUEUE, transport_for
from diffq.worker.delivery import Outcome

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
    (what the transport's `DeadLetterWay.declare` answered); else diffq writes a letter."""

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
               headers: dict | None = None, *, letter: bool = False) -> Outcome:
        """A delivery the task refuses: the outcome to report for it. REFUSED (reject,
        the broker routes it) or DEAD_LETTER (the letter is written: ack). `letter`:
        written even where the broker would route a reject (the reason is the point)."""
        if self.by_broker and not letter:
            log.warning("dead letter from queue %s: %s (rejected to %s)", queue, reason, DEAD_LETTERS)
            return Outcome.REFUSED
        self.send(queue, reason, body, content_type, headers)
        return Outcome.DEAD_LETTER

    def reject(self, message, reason: str, *, queue: str | None = None, letter: bool = False) -> None:
        """Dead-letter a delivery the consumer cannot turn into a task. `letter`: write
        the letter with its reason even where the broker would route a reject (an
        admission refusal's reason is what its reader needs)."""
        queue = queue or (message.delivery_info or {}).get("routing_key") or "?"
        if letter:
            self.send(queue, reason, message.body, message.content_type, message.headers)
            message.ack()
        elif self.refuse(queue, reason, message.body, message.content_type, message.headers) is Outcome.REFUSED:
            message.reject(requeue=False)
        else:
            message.ack()


def dead_letters_of(app, worker: str) -> DeadLetters:
    """The consumer's DeadLetters (the broker's way, as declared when it started; kept
    on its app for the task body's refusals), else a letter writer."""
    return getattr(app, "diffq_dead_letters", None) or DeadLetters(app, worker)


def declare_dead_letters(app, queues: list[str], api: str | None) -> bool:
    """The broker's dead letters for `queues` (core/transports.py `DeadLetterWay`):
    True where it routes rejects itself. A broker that refuses (no policy rights,
    API down) leaves the worker writing letters, logged."""
    try:
        with app.connection_for_write() as connection:
            return transport_for(app.conf.broker_url).dead_letters.declare(connection, queues, api)
    except Exception as exc:
        log.warning("could not declare the broker's dead letters (%s); refused messages are written as letters",
                    exc)
        return False


def _is_batch_call(call) -> bool:
    """Celery protocol 2's body: [args, kwargs, embed] (celery/app/amqp.py as_task_v2)."""
    return (isinstance(call, (list, tuple)) and len(call) == 3 and call[0] == [] and isinstance(call[1], dict)
            and set(call[1]) == {"batch"} and isinstance(call[1]["batch"], dict))


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class DeadLetterStep(bootsteps.StartStopStep):
    """Consumer bootstep: Celery's handlers for undeliverable messages, replaced."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    worker = "diffq"  # bound per app

    def start(self, consumer):
        queues = [queue.name for queue in (consumer.task_consumer.queues if consumer.task_consumer else [])]
        dead = DeadLetters(consumer.app, self.worker, declare_dead_letters(consumer.app, queues, _api(consumer.app)))
        consumer.app.diffq_dead_letters = dead

        def on_decode_error(message, exc):
            dead.reject(message, f"body not decodable as {message.content_type}: {_reason(exc)}")

        def on_invalid_task(body, message, exc):
            dead.reject(message, f"refused ({message.content_type}): {_reason(exc)}")

        def on_unknown_message(body, message):
            dead.reject(message, "not a Celery task message")

        def on_unknown_task(body, message, exc):
            dead.reject(message, f"unknown task {(message.headers or {}).get('task')!r}")

        consumer.on_decode_error = on_decode_error
        consumer.on_invalid_task = on_invalid_task
        consumer.on_unknown_message = on_unknown_message
        consumer.on_unknown_task = on_unknown_task
        if consumer.task_consumer is not None:
            consumer.task_consumer.on_decode_error = on_decode_error
        transport = transport_for(consumer.app.conf.broker_url)
        if transport.guard_deliveries is not None and consumer.task_consumer is not None:
            transport.guard_deliveries(consumer.task_consumer.channel,
                                       lambda queue, item, reason: dead.send(queue, reason, item))
        if transport.stamp_arrivals is not None and consumer.task_consumer is not None:
            transport.stamp_arrivals(consumer.task_consumer)
        runtime = getattr(consumer.app.tasks.get(TASK_NAME), "runtime", None)
        strategy = consumer.strategies.get(TASK_NAME)
        if strategy is not None and not getattr(strategy, "checked_on_receipt", False):
            consumer.strategies[TASK_NAME] = checked_on_receipt(
                strategy, dead, getattr(runtime, "admission", None),
                lambda message: transport.arrival(message, consumer.task_consumer))


def _api(app) -> str | None:
    """The worker's RabbitMQ management API URL (its spec's, else DIFFQ_RABBITMQ_API)."""
    task = app.tasks.get(TASK_NAME)
    spec = getattr(getattr(task, "runtime", None), "spec", None)
    return getattr(spec, "rabbitmq_api", None) or get_settings().rabbitmq_api


def checked_on_receipt(strategy, dead: DeadLetters, admission=None, arrival=None):
    """The batch task's strategy behind the checks on receipt: the raw size, the call's
    shape (no positional args, one `batch` object, which would otherwise fail inside
    Celery's tracer as a TypeError), then the worker's admission (worker/admission.py:
    signature, schema, queue, run, model) of the batch on the queue it arrived on."""

    def checked(message, *args, **kwargs):
        size = len(message.body or b"")
        if size > MAX_MESSAGE_BYTES:
            return dead.reject(message, f"message of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            call = message.decode()
        except Exception:
            return strategy(message, *args, **kwargs)  # Celery's own handlers say why
        if not _is_batch_call(call):
            return dead.reject(message, "not a diffq batch call (expected no args and one 'batch' object)")
        if admission is not None:
            queue = arrival(message) if arrival is not None else None
            _, refusal = admission.check(call[1]["batch"], queue, (message.headers or {}).get(SIGNATURE))
            if refusal is not None:
                return dead.reject(message, refusal.reason if refusal.malformed else f"refused: {refusal.reason}",
                                   queue=queue, letter=not refusal.malformed)
        return strategy(message, *args, **kwargs)

    checked.checked_on_receipt = True
    return checked
