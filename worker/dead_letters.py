"""Dead letters: what a worker does with a message on a diffq queue that diffq did not write.

Not JSON, a content type other than JSON (pickle is refused unread), not a diffq
task, over the size cap (measured on receipt, before the body is parsed), a call
that is not one batch, or a batch that fails the schema: none of these can ever succeed, so none is
retried. Each is logged once (queue and reason), moved to the `diffq.dead` queue
(core/transports.py DEAD_LETTERS, shown by `diffq queues`, consumed by no worker)
as a JSON letter carrying the reason and the start of the original body, and
acknowledged; the worker goes on with the next message.

Celery's own handlers for the first four (celery/worker/consumer/consumer.py:
`on_decode_error`, `on_invalid_task`, `on_unknown_message`, `on_unknown_task`)
log a traceback and drop or reject the message; `DeadLetterStep` replaces them on
the consumer (its task handler looks them up when the event loop starts) and puts
the receipt checks (size, call shape) in front of the batch task's strategy. A
Redis list item that is not even a kombu envelope would end the worker inside
kombu; the transport table's `guard_deliveries` catches it first.
"""

from __future__ import annotations

import base64
import json
import logging
import time

from celery import bootsteps
from kombu import Exchange, Queue

from diffq.core.broker import TASK_NAME
from diffq.core.contract import MAX_MESSAGE_BYTES
from diffq.core.transports import DEAD_LETTERS, transport_for

log = logging.getLogger("diffq.worker")

# A letter keeps the start of the body: enough to find the sender, and the dead
# queue cannot become a way around the size cap.
KEPT_BODY_BYTES = 16 * 1024
DEAD_QUEUE = Queue(DEAD_LETTERS, Exchange(DEAD_LETTERS), routing_key=DEAD_LETTERS)


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
    def __init__(self, app, worker: str):
        self.app = app
        self.worker = worker

    def send(self, queue: str, reason: str, body, content_type: str | None = None,
             headers: dict | None = None) -> None:
        log.warning("dead letter from queue %s: %s (moved to %s)", queue, reason, DEAD_LETTERS)
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(letter(queue, reason, body, content_type, headers, self.worker),
                                 exchange=DEAD_QUEUE.exchange, routing_key=DEAD_LETTERS, declare=[DEAD_QUEUE],
                                 serializer="json", retry=True, retry_policy={"max_retries": 3})
        except Exception as exc:
            # Still acked by the caller: a message that can never succeed must not loop.
            log.error("could not store the dead letter from %s (%s); it is dropped", queue, exc)

    def reject(self, message, reason: str) -> None:
        """Dead-letter a delivery the consumer cannot turn into a task, and ack it."""
        queue = (message.delivery_info or {}).get("routing_key") or "?"
        self.send(queue, reason, message.body, message.content_type, message.headers)
        message.ack()


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
        dead = DeadLetters(consumer.app, self.worker)

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
        guard = transport_for(consumer.app.conf.broker_url).guard_deliveries
        if guard is not None and consumer.task_consumer is not None:
            guard(consumer.task_consumer.channel, lambda queue, item, reason: dead.send(queue, reason, item))
        strategy = consumer.strategies.get(TASK_NAME)
        if strategy is not None and not getattr(strategy, "checked_on_receipt", False):
            consumer.strategies[TASK_NAME] = checked_on_receipt(strategy, dead)


def checked_on_receipt(strategy, dead: DeadLetters):
    """The batch task's strategy behind two checks on receipt: the raw size, then the
    call's shape (no positional args, one `batch` object), which would otherwise fail
    inside Celery's tracer as a TypeError."""

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
        return strategy(message, *args, **kwargs)

    checked.checked_on_receipt = True
    return checked
