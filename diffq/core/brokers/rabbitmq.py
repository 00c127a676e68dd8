"""RabbitMQ: everything diffq does on an AMQP broker beyond kombu's public API (`RabbitMQBroker`).

RabbitMQ redelivers by itself when the consumer's connection goes, so nothing needs
renewing; it closes a channel whose delivery stays unacked past `consumer_timeout`
(docs/RELIABILITY.md), which the worker sets per consumer. AMQP cannot list queues:
only RabbitMQ's management HTTP API (`GET /api/queues/<vhost>`) can, so listing needs
its URL.

Dead letters: a policy (`dead-letter-exchange`) on every diffq queue routes a delivery
rejected without requeue to the `diffq.dead` exchange and queue; the broker adds an
`x-death` header (queue, reason 'rejected', time). A policy, not queue arguments: a
queue declared earlier without `x-dead-letter-exchange` would refuse a declare with
it (PRECONDITION_FAILED), and an older worker's plain declare would then refuse the
new queue; a policy applies to old and new queues alike and needs no argument on any
declare. Only the management API sets one, so without its URL the worker writes the
letter itself (as on Redis), into the same queue.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from diffq.core.brokers.base import (DEAD_LETTERS, DEAD_QUEUE, PEEKED_LETTERS, PREFIX, Broker, CannotList,
                                     DeadLetterReport, close_quietly, letter_fields)

NEEDS_RABBITMQ_API = ("RabbitMQ cannot list queues over AMQP: pass --rabbitmq-api http://USER:PASS@HOST:15672 "
                      "(its management plugin) or name the queues with --queues")
DEAD_LETTER_POLICY = "diffq-dead-letters"


class RabbitMQBroker(Broker):
    """AMQP: the connection is the lease; arrivals from the consumer tag; queues listed and
    the dead-letter policy set over the management API; the dead letters peeked and put
    back."""

    stamp_arrivals = None  # the broker names the consumer itself

    def options(self, settings) -> dict:
        return {}

    def consumer_arguments(self, settings) -> dict:
        # RabbitMQ >= 3.11.15 reads a per-consumer ack timeout (older servers ignore it
        # and need `consumer_timeout` in rabbitmq.conf: docs/RELIABILITY.md).
        return {"x-consumer-timeout": settings.max_hold_s * 1000}

    def arrival(self, message, consumer) -> str | None:
        """The broker names the consumer a delivery is for (basic.deliver's consumer tag,
        set by RabbitMQ, not by the publisher); kombu's Consumer maps each of its queues
        to its tag (kombu/messaging.py `Consumer._active_tags`)."""
        tag = (message.delivery_info or {}).get("consumer_tag")
        if tag is None or consumer is None:
            return None
        return next((queue for queue, known in consumer._active_tags.items() if known == tag), None)

    def list_queues(self, connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
        """RabbitMQ's management API (the plugin `rabbitmq_management`): the queues of the
        broker URL's vhost. Credentials: the API URL's, else the broker URL's."""
        if not api:
            raise CannotList(NEEDS_RABBITMQ_API)
        rows = api_call(connection, api, "GET", "queues/{vhost}?columns=name")
        return sorted(row["name"] for row in rows if row["name"].startswith(prefix))

    def declare_dead_letters(self, connection, queues: list[str], api: str | None = None) -> bool:
        """The dead-letter exchange and queue, and with the API URL the policy that routes
        rejects there. True: a delivery rejected without requeue is dead-lettered by RabbitMQ."""
        channel = connection.channel()
        try:
            DEAD_QUEUE(channel).declare()
        finally:
            close_quietly(channel)
        if not api:
            return False
        api_call(connection, api, "PUT", "policies/{vhost}/" + DEAD_LETTER_POLICY, rabbitmq_dead_letter_policy())
        return True

    def peek_dead_letters(self, connection, limit: int = PEEKED_LETTERS, *,
                          peeked: Callable) -> DeadLetterReport:
        """Passive declare for the count; the first `limit` fetched unacked, then each
        ended by `peeked(message)` (the worker's `peeked` end: requeued in place). `x-death`
        names their queue."""
        channel = connection.channel()
        try:
            try:
                _, count, _ = channel.queue_declare(queue=DEAD_LETTERS, passive=True)
            except Exception:
                return DeadLetterReport(0, [], "oldest first")  # never declared: none yet
            queue = DEAD_QUEUE(channel)
            letters, held = [], []
            try:
                for _ in range(min(limit, count)):
                    message = queue.get(no_ack=False)
                    if message is None:
                        break
                    held.append(message)  # held until all are read: a requeued one would come next
                    letters.append(_letter(message))
            finally:
                for message in held:
                    peeked(message)
            return DeadLetterReport(count, letters, "oldest first")
        finally:
            close_quietly(channel)


def _letter(message) -> dict:
    deaths = (message.headers or {}).get("x-death") or []
    death = deaths[0] if deaths else {}
    try:
        payload = json.loads(message.body)
    except (ValueError, TypeError):
        payload = None
    fields = letter_fields(payload, death.get("queue"), f"{death.get('reason', 'unknown')} (broker)")
    if fields["at"] is None and hasattr(death.get("time"), "timestamp"):
        fields["at"] = death["time"].timestamp()
    return fields


def rabbitmq_dead_letter_policy(prefix: str = PREFIX) -> dict:
    """The policy body: every diffq queue but the dead one dead-letters to `diffq.dead`
    (the dead letters' own rejects would otherwise loop back to it)."""
    dead = DEAD_LETTERS[len(prefix):] if DEAD_LETTERS.startswith(prefix) else DEAD_LETTERS
    return {"pattern": f"^{re.escape(prefix)}(?!{re.escape(dead)}$)", "apply-to": "queues", "priority": 0,
            "definition": {"dead-letter-exchange": DEAD_LETTERS, "dead-letter-routing-key": DEAD_LETTERS}}


def api_call(connection, api: str, method: str, path: str, body: dict | None = None):
    """One call to RabbitMQ's management HTTP API on the broker URL's vhost ('{vhost}'
    in `path`); the answer's JSON, or None for an empty one. CannotList when it does
    not answer."""
    parts = urllib.parse.urlsplit(api)
    user = urllib.parse.unquote(parts.username) if parts.username else connection.userid
    password = urllib.parse.unquote(parts.password) if parts.password else connection.password
    base = urllib.parse.urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""),
                                    parts.path.rstrip("/"), "", ""))
    vhost = urllib.parse.quote(connection.virtual_host or "/", safe="")
    request = urllib.request.Request(f"{base}/api/{path.format(vhost=vhost)}", method=method,
                                     data=None if body is None else json.dumps(body).encode(), headers={
        "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
        "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = response.read()
    except urllib.error.HTTPError as exc:  # it answered: wrong credentials, no such vhost, ...
        raise CannotList(f"RabbitMQ management API at {base} refused {method} /api/{path.format(vhost=vhost)} "
                         f"as {user}: HTTP {exc.code} {exc.reason}") from exc
    except OSError as exc:
        raise CannotList(f"RabbitMQ management API at {base} did not answer: {exc}") from exc
    return json.loads(answer) if answer.strip() else None
