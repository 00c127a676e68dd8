"""The transport table: what diffq needs to know about each kind of broker, as data.

One row per broker kind, beside the backend table (worker/device/backends.py). Every
place that used to branch on the broker URL (the Celery app, the publisher, the
queue report, compile-aware routing, the held acks, the embedded runner, the
lease keeper) looks its answer up here instead.

Facts pinned to kombu 5.7's sources (tests/test_transports.py cites them):
- Redis keeps a delivered message in the `unacked` hash and its delivery time in
  the `unacked_index` sorted set; a live consumer's sweep (`QoS.restore_visible`,
  under the `unacked_mutex`) puts back every entry older than the visibility
  timeout (kombu/transport/redis.py). Renewing a lease = moving the score forward.
  kombu records a delivery there only after its BRPOP returned, a second round trip:
  a message popped in between is lost for good, so workers fetch with a script that
  pops and records in one step (core/redis_consumer.py).
- SQS hides a received message for its visibility timeout; the holder extends it
  with `ChangeMessageVisibility` on the receipt handle (kombu/transport/SQS).
- RabbitMQ redelivers by itself when the consumer's connection goes, so nothing
  needs renewing; it closes a channel whose delivery stays unacked past
  `consumer_timeout` (see docs/RELIABILITY.md).
- The filesystem transport removes the message file on fetch: a task in flight
  when its worker is SIGKILLed is lost, so the embedded runner reconciles from the
  run folder (../shared/CELERY.md).
- Listing queues (a worker with no --queues finds them, `list_queues`): Redis has
  no queue objects, only lists, and an empty queue has no key, so a SCAN finds the
  queues that hold work; SQS lists queue URLs by name prefix (kombu maps '.' to '-'
  and prepends its `queue_name_prefix`, kombu/transport/SQS/__init__.py
  `entity_name`); AMQP has no listing at all, only RabbitMQ's management HTTP API
  (`GET /api/queues/<vhost>`) can, so that row needs its URL.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kombu import Exchange, Queue
from kombu.exceptions import OperationalError

from diffq.core.contract import QUEUE_PREFIX as PREFIX, queue_from_entity_name
from diffq.core.redis_consumer import redis_consumer_channel

# Where a worker puts messages it cannot take (not JSON, pickle, wrong schema, too
# big): one queue on every broker, shown by `diffq queues`, never consumed by workers.
DEAD_LETTERS = f"{PREFIX}dead"
# kombu's Redis priority sub-lists are '<queue>\x06\x16<priority>'.
PRIORITY_SEP = "\x06\x16"


def declared_depths(connection, queues: list[str]) -> dict[str, tuple[int, int]]:
    """queue -> (messages, broker-side consumers) by passive declare; missing -> (0, 0)."""
    result = {}
    channel = connection.channel()
    try:
        for name in queues:
            try:
                _, messages, consumers = channel.queue_declare(queue=name, passive=True)
            except Exception:
                # A queue nobody published to yet (Redis: no key; AMQP: 404, which
                # also closes the channel, so open a new one).
                _close_quietly(channel)
                channel = connection.channel()
                messages, consumers = 0, 0
            result[name] = (messages, consumers)
    finally:
        _close_quietly(channel)
    return result


def _close_quietly(channel) -> None:
    try:
        channel.close()
    except Exception:
        pass


def redis_list_depths(connection, prefix: str = PREFIX) -> dict[str, int]:
    """Every diffq queue on a Redis broker: one SCAN for lists plus one pipelined LLEN.

    Each queue is one list named exactly like it (priority_steps=[0]) and an empty
    queue has no key; any priority sub-list another producer made is folded in."""
    # A client of its own from the channel's pool: inside a worker the channel's
    # client holds the connection its event loop is blocked in BRPOP on.
    with connection.default_channel.conn_or_acquire() as client:
        return _redis_list_depths(client, prefix)


def _redis_list_depths(client, prefix: str) -> dict[str, int]:
    keys = sorted(k.decode() if isinstance(k, bytes) else k
                  for k in client.scan_iter(match=f"{prefix}*", count=1000, _type="list"))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    depths: Counter = Counter()
    for key, n in zip(keys, pipe.execute()):
        depths[key.split(PRIORITY_SEP, 1)[0]] += n
    return dict(depths)


def redis_listing_keys(prefix: str = PREFIX) -> tuple[str, str]:
    """The fleet's shared depth listing and its refresh lock: strings outside the
    prefix's lists (a listing SCANs for lists only; kombu's own keys start with '_')."""
    return f"_{prefix}depths", f"_{prefix}depths.lock"


def redis_shared_depths(connection, prefix: str = PREFIX, max_age: float = 1.0) -> dict[str, int]:
    """Every diffq queue's depth as the fleet last listed it, at most `max_age` s old:
    one GET, however many queues there are. The one reader per `max_age` that finds
    the listing stale and wins `SET NX PX` lists the broker (SCAN + pipelined LLEN)
    and stores it for everyone, so the fleet pays for a listing once per `max_age`,
    not once per worker. {} while another reader takes the very first one."""
    key, lock = redis_listing_keys(prefix)
    with connection.default_channel.conn_or_acquire() as client:
        stored = client.get(key)
        listing = json.loads(stored) if stored else None
        # Dated by its taker's clock: one from the future (a skewed clock) is stale too.
        fresh = listing is not None and 0 <= time.time() - listing["at"] < max_age
        if not fresh and client.set(lock, b"1", nx=True, px=max(1, int(max_age * 1000))):
            listing = {"at": time.time(), "depths": _redis_list_depths(client, prefix)}
            # Expires long after any reader would retake it: a stopped fleet leaves nothing.
            client.set(key, json.dumps(listing), ex=max(60, int(10 * max_age)))
    return dict(listing["depths"]) if listing else {}


def redis_queue_depths(connection, queues: list[str]) -> dict[str, int]:
    """The depth of each of `queues` on Redis: one pipelined LLEN (no key = empty)."""
    pipe = connection.default_channel.client.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(queue)
    return dict(zip(queues, pipe.execute()))


def passive_queue_depths(connection, queues: list[str]) -> dict[str, int]:
    return {queue: messages for queue, (messages, _) in declared_depths(connection, queues).items()}


# What a broker that does not answer raises through kombu (or its socket, before kombu wraps it).
UNREACHABLE = (OperationalError, OSError)


class CannotList(ValueError):
    """This broker cannot list its queues (as configured): name them with --queues."""


NEEDS_RABBITMQ_API = ("RabbitMQ cannot list queues over AMQP: pass --rabbitmq-api http://USER:PASS@HOST:15672 "
                      "(its management plugin) or name the queues with --queues")


def redis_list_queues(connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
    """The queues that hold work now (an empty Redis queue has no key)."""
    return sorted(redis_list_depths(connection, prefix))


def sqs_list_queues(connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
    """ListQueues by name prefix, mapped back to diffq's names (the caller keeps the
    ones that parse as shape queues: '-' for '.' is only undone where it was a dot)."""
    channel = connection.default_channel
    own = channel.queue_name_prefix
    wanted = channel.entity_name(own + prefix)
    names = []
    for page in channel.sqs().get_paginator("list_queues").paginate(QueueNamePrefix=wanted):
        for url in page.get("QueueUrls", []):
            names.append(url.rsplit("/", 1)[-1][len(own):])
    return sorted(_undo_sqs_names(names, prefix))


def _undo_sqs_names(names: list[str], prefix: str) -> list[str]:
    dashed = prefix.replace(".", "-")
    return [queue_from_entity_name(name) or (prefix + name[len(dashed):] if name.startswith(dashed) else name)
            for name in names]


def rabbitmq_list_queues(connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
    """RabbitMQ's management API (the plugin `rabbitmq_management`): the queues of the
    broker URL's vhost. Credentials: the API URL's, else the broker URL's."""
    if not api:
        raise CannotList(NEEDS_RABBITMQ_API)
    rows = rabbitmq_api_call(connection, api, "GET", "queues/{vhost}?columns=name")
    return sorted(row["name"] for row in rows if row["name"].startswith(prefix))


def rabbitmq_api_call(connection, api: str, method: str, path: str, body: dict | None = None):
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


def guard_redis_deliveries(channel, on_bad: Callable[[str, bytes, str], None]) -> None:
    """Check each item the consumer's channel pops before kombu parses it.

    kombu's Redis channel reads a BRPOP reply and parses the item as its JSON
    envelope in one step (kombu/transport/redis.py `_brpop_read`); an item another
    client pushed that is not one raises out of the worker's event loop, which
    ends the worker and loses the item. A BRPOP response callback sees the reply
    first: a malformed item goes to `on_bad(queue, item, reason)` and the read
    returns nothing (kombu's `Empty`: the loop goes on)."""
    client = channel.client
    original = client.response_callbacks.get("BRPOP")

    def checked(response, **options):
        response = original(response, **options) if original else response
        if not response:
            return response
        key, item = response
        reason = _envelope_problem(item)
        if reason is None:
            return response
        queue = (key.decode() if isinstance(key, bytes) else key).split(PRIORITY_SEP, 1)[0]
        on_bad(queue, item, reason)
        return None

    client.set_response_callback("BRPOP", checked)


def _envelope_problem(item: bytes | str) -> str | None:
    """What keeps kombu from reading a Redis list item as a message, or None."""
    try:
        envelope = json.loads(item)
    except ValueError:
        return "not JSON (not a kombu message envelope)"
    if not isinstance(envelope, dict) or not isinstance(envelope.get("properties"), dict) \
            or "delivery_tag" not in envelope["properties"] or "body" not in envelope:
        return "JSON but not a kombu message envelope (body, properties.delivery_tag)"
    return None


# Where a worker finds the queue a delivery was taken from, as the transport saw it.
# On Redis, SQS and the filesystem the envelope's delivery_info is the publisher's
# to write, so its routing key is only what the sender claims.
ARRIVAL = "diffq_arrival"


class _StampingCallbacks(dict):
    """kombu's virtual transports hand each fetched message to the callback of the
    queue they took it from (kombu/transport/virtual/base.py `Transport._deliver`:
    `self._callbacks[queue](message)`; kombu/transport/SQS/__init__.py
    `_on_messages_ready`: `self.connection._callbacks.get(qname)`); each callback set
    here first writes that queue into the message's delivery_info."""

    def __init__(self, callbacks: dict):
        super().__init__()
        for queue, callback in callbacks.items():
            self[queue] = callback

    def __setitem__(self, queue, callback):
        def stamped(raw, _queue=queue, _callback=callback):
            properties = raw.get("properties") if isinstance(raw, dict) else None
            if isinstance(properties, dict):
                info = properties.get("delivery_info")
                if not isinstance(info, dict):
                    info = properties["delivery_info"] = {}
                info[ARRIVAL] = _queue
            return _callback(raw)

        super().__setitem__(queue, stamped)


def stamp_virtual_arrivals(consumer) -> None:
    """Make every delivery to this kombu Consumer's connection carry its queue (once)."""
    transport = consumer.channel.connection
    callbacks = getattr(transport, "_callbacks", None)
    if isinstance(callbacks, dict) and not isinstance(callbacks, _StampingCallbacks):
        transport._callbacks = _StampingCallbacks(callbacks)


def virtual_arrival(message, consumer) -> str | None:
    return (message.delivery_info or {}).get(ARRIVAL)


def amqp_arrival(message, consumer) -> str | None:
    """The broker names the consumer a delivery is for (basic.deliver's consumer tag,
    set by RabbitMQ, not by the publisher); kombu's Consumer maps each of its queues
    to its tag (kombu/messaging.py `Consumer._active_tags`)."""
    tag = (message.delivery_info or {}).get("consumer_tag")
    if tag is None or consumer is None:
        return None
    return next((queue for queue, known in consumer._active_tags.items() if known == tag), None)


def renew_redis(channel, messages: list) -> int:
    """Move each held delivery's `unacked_index` score to now (XX: never re-adds one
    that was acked or restored meanwhile). Returns how many entries were renewed."""
    now = time.time()
    tags = {message.delivery_tag: now for message in messages}
    if not tags:
        return 0
    # CH counts members whose score changed: the delivery time only moves forward.
    return channel.client.zadd(channel.unacked_index_key, tags, xx=True, ch=True)


def renew_sqs(channel, messages: list) -> int:
    """ChangeMessageVisibility on each held receipt handle: hidden for another timeout."""
    return _change_visibility(channel, messages, int(channel.visibility_timeout))


def _change_visibility(channel, messages: list, seconds: int) -> int:
    renewed = 0
    for message in messages:
        info = message.delivery_info
        sqs_message, queue_url = info.get("sqs_message"), info.get("sqs_queue")
        if not sqs_message or not queue_url:
            continue
        queue = channel.canonical_queue_name(info["routing_key"]) if info.get("routing_key") else None
        channel.sqs(queue=queue).change_message_visibility(
            QueueUrl=queue_url, ReceiptHandle=sqs_message["ReceiptHandle"],
            VisibilityTimeout=seconds)
        renewed += 1
    return renewed


def _visibility_options(settings) -> dict:
    return {"visibility_timeout": settings.visibility_timeout}


def _redis_options(settings) -> dict:
    return {
        "visibility_timeout": settings.visibility_timeout,
        # Keep every message in the base list: priority sub-lists would hide depth
        # from KEDA's redis-list scaler (its listName must equal the queue name).
        "priority_steps": [0],
        # Sweep for lapsed leases every 5 s, scanning on every sweep (kombu scans
        # only on every 10th by default): a dead holder's batch is back within a
        # lease + 5 s of its last renewal, once any worker's loop is idle.
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
        # A worker killed inside a sweep leaves kombu's sweep mutex set; it expires
        # after this (kombu's default is 300 s, during which nobody sweeps).
        "unacked_mutex_expire": 30,
    }


def _no_options(settings) -> dict:
    return {}


def hand_back_redis(channel, messages: list) -> int:
    """Put held deliveries back at the head of their queues now (kombu's own
    `restore_by_tag`, which also flags them redelivered): not a failed attempt."""
    for message in messages:
        channel.qos.restore_by_tag(message.delivery_tag, leftmost=True)
    return len(messages)


def hand_back_sqs(channel, messages: list) -> int:
    """Visibility 0: the held messages are receivable again at once."""
    return _change_visibility(channel, messages, 0)


def _amqp_consumer_arguments(settings) -> dict:
    # RabbitMQ >= 3.11.15 reads a per-consumer ack timeout (older servers ignore it
    # and need `consumer_timeout` in rabbitmq.conf: docs/RELIABILITY.md).
    return {"x-consumer-timeout": settings.max_hold_s * 1000}


# --- Dead letters: where a message no worker can take ends, the broker's own way --------
# RabbitMQ: a policy (`dead-letter-exchange`) on every diffq queue routes a delivery
# rejected without requeue to the `diffq.dead` exchange and queue; the broker adds an
# `x-death` header (queue, reason 'rejected', time). A policy, not queue arguments:
# a queue declared earlier without `x-dead-letter-exchange` would refuse a declare
# with it (PRECONDITION_FAILED), and an older worker's plain declare would then
# refuse the new queue; a policy applies to old and new queues alike and needs no
# argument on any declare. Only the management API sets one, so without its URL
# the worker writes the letter itself (as on Redis), into the same queue.
# SQS: a redrive policy on each shape queue moves a message received
# `maxReceiveCount` times to `diffq-dead`; a message diffq refuses goes there at
# once as a letter and is deleted (kombu's reject leaves a message of a queue with
# a redrive policy for SQS to redeliver, kombu/transport/SQS `basic_reject`: a
# message that can never succeed would go to workers that many times more).
# Redis has no mechanism: the worker's letter is the only way.

DEAD_LETTER_POLICY = "diffq-dead-letters"
DEAD_QUEUE = Queue(DEAD_LETTERS, Exchange(DEAD_LETTERS), routing_key=DEAD_LETTERS)
# Receives before SQS moves a batch to the dead letters: each lapsed lease, hand-back
# and requeue is one, so a batch whose host was lost a few times still runs.
SQS_MAX_RECEIVES = 20
PEEKED_LETTERS = 10  # letters `diffq queues` shows


@dataclass(frozen=True)
class DeadLetterReport:
    """The dead letters on a broker: how many, and some of them (queue, reason, at)."""

    count: int
    letters: list[dict]
    order: str  # which ones `letters` are, in words


def rabbitmq_dead_letter_policy(prefix: str = PREFIX) -> dict:
    """The policy body: every diffq queue but the dead one dead-letters to `diffq.dead`
    (the dead letters' own rejects would otherwise loop back to it)."""
    dead = DEAD_LETTERS[len(prefix):] if DEAD_LETTERS.startswith(prefix) else DEAD_LETTERS
    return {"pattern": f"^{re.escape(prefix)}(?!{re.escape(dead)}$)", "apply-to": "queues", "priority": 0,
            "definition": {"dead-letter-exchange": DEAD_LETTERS, "dead-letter-routing-key": DEAD_LETTERS}}


def declare_rabbitmq_dead_letters(connection, queues: list[str], api: str | None = None) -> bool:
    """The dead-letter exchange and queue, and with the API URL the policy that routes
    rejects there. True: a delivery rejected without requeue is dead-lettered by RabbitMQ."""
    channel = connection.channel()
    try:
        DEAD_QUEUE(channel).declare()
    finally:
        _close_quietly(channel)
    if not api:
        return False
    rabbitmq_api_call(connection, api, "PUT", "policies/{vhost}/" + DEAD_LETTER_POLICY,
                      rabbitmq_dead_letter_policy())
    return True


def declare_sqs_dead_letters(connection, queues: list[str], api: str | None = None) -> bool:
    """`diffq-dead`, and a redrive policy to it on each of `queues` that has none or
    diffq's with another count (a policy to another queue is the operator's: left as
    it is). False: diffq itself moves what it refuses."""
    channel = connection.default_channel
    dead_url = channel._new_queue(DEAD_LETTERS)
    client = channel.sqs(queue=channel.canonical_queue_name(DEAD_LETTERS))
    arn = client.get_queue_attributes(QueueUrl=dead_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    for queue in queues:
        if queue == DEAD_LETTERS:
            continue
        url = channel._new_queue(queue)
        found = client.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
        current = json.loads(found.get("Attributes", {}).get("RedrivePolicy") or "{}")
        if current.get("deadLetterTargetArn", arn) != arn or \
                str(current.get("maxReceiveCount")) == str(SQS_MAX_RECEIVES):
            continue
        client.set_queue_attributes(QueueUrl=url, Attributes={"RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": arn, "maxReceiveCount": str(SQS_MAX_RECEIVES)})})
    return False


def declare_no_dead_letters(connection, queues: list[str], api: str | None = None) -> bool:
    return False


def _letter_fields(payload, queue: str | None, reason: str) -> dict:
    """A worker's JSON letter (worker/delivery/dead_letters.py `letter`) as it is, else what the
    broker says about a message it moved itself."""
    if isinstance(payload, dict) and payload.get("v") == 1 and "reason" in payload:
        return {"queue": payload.get("queue"), "reason": payload.get("reason"), "at": payload.get("at")}
    return {"queue": queue, "reason": reason, "at": None}


def _envelope_payload(envelope: dict):
    """The body of a kombu virtual-transport envelope, parsed (None if not JSON)."""
    body = envelope.get("body")
    try:
        if (envelope.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return json.loads(body)
    except (ValueError, TypeError):
        return None


def _envelope_queue(envelope: dict) -> str | None:
    return ((envelope.get("properties") or {}).get("delivery_info") or {}).get("routing_key")


def peek_redis_dead_letters(connection, limit: int = PEEKED_LETTERS) -> DeadLetterReport:
    """LLEN and the list's head: kombu LPUSHes, so the head holds the newest."""
    with connection.default_channel.conn_or_acquire() as client:
        count = client.llen(DEAD_LETTERS)
        items = client.lrange(DEAD_LETTERS, 0, limit - 1) if limit > 0 else []
    letters = []
    for item in items:
        try:
            envelope = json.loads(item)
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict):
            letters.append({"queue": None, "reason": "not a kombu message", "at": None})
            continue
        letters.append(_letter_fields(_envelope_payload(envelope), _envelope_queue(envelope), "unknown"))
    return DeadLetterReport(count, letters, "newest first")


def peek_rabbitmq_dead_letters(connection, limit: int = PEEKED_LETTERS) -> DeadLetterReport:
    """Passive declare for the count; the first `limit` fetched unacked and left to the
    channel's close, which requeues them in place. `x-death` names their queue."""
    channel = connection.channel()
    try:
        try:
            _, count, _ = channel.queue_declare(queue=DEAD_LETTERS, passive=True)
        except Exception:
            return DeadLetterReport(0, [], "oldest first")  # never declared: none yet
        queue = DEAD_QUEUE(channel)
        letters = []
        for _ in range(min(limit, count)):
            message = queue.get(no_ack=False)
            if message is None:
                break
            deaths = (message.headers or {}).get("x-death") or []
            death = deaths[0] if deaths else {}
            try:
                payload = json.loads(message.body)
            except (ValueError, TypeError):
                payload = None
            fields = _letter_fields(payload, death.get("queue"), f"{death.get('reason', 'unknown')} (broker)")
            if fields["at"] is None and hasattr(death.get("time"), "timestamp"):
                fields["at"] = death["time"].timestamp()
            letters.append(fields)
        return DeadLetterReport(count, letters, "oldest first")
    finally:
        _close_quietly(channel)


def peek_sqs_dead_letters(connection, limit: int = PEEKED_LETTERS) -> DeadLetterReport:
    """ApproximateNumberOfMessages, and up to 10 received with visibility 0 (left in
    place; SQS picks which). A batch the redrive policy moved is a kombu envelope."""
    channel = connection.default_channel
    url = channel._new_queue(DEAD_LETTERS)
    client = channel.sqs(queue=channel.canonical_queue_name(DEAD_LETTERS))
    attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    count = int(attributes["Attributes"]["ApproximateNumberOfMessages"])
    messages = []
    if limit > 0 and count:
        messages = client.receive_message(QueueUrl=url, MaxNumberOfMessages=min(limit, 10), VisibilityTimeout=0,
                                          WaitTimeSeconds=0, AttributeNames=["All"]).get("Messages", [])
    letters = []
    for message in messages:
        body = message.get("Body", "")
        try:
            envelope = json.loads(body)
        except ValueError:
            try:
                envelope = json.loads(base64.b64decode(body))
            except (ValueError, TypeError):
                envelope = None
        received = message.get("Attributes", {}).get("ApproximateReceiveCount", "?")
        if not isinstance(envelope, dict):
            letters.append({"queue": None, "reason": "not a kombu message", "at": None})
            continue
        letters.append(_letter_fields(_envelope_payload(envelope), _envelope_queue(envelope),
                                      f"moved by the redrive policy (received {received} times)"))
    return DeadLetterReport(count, letters, "a sample (SQS keeps no order)")


@dataclass(frozen=True)
class DeadLetterWay:
    """How this broker keeps the messages no worker can take."""

    place: str  # in words, for the docs and `diffq queues`
    # (connection, queues, api URL) -> True where the broker now dead-letters a
    # delivery rejected without requeue itself; False: the worker writes a letter
    # to DEAD_LETTERS and acks. Idempotent; run by `diffq submit` and worker start.
    declare: Callable = declare_no_dead_letters
    # (connection, limit) -> DeadLetterReport; None: only the queue's depth is shown.
    peek: Callable | None = None


HAND_DEAD_LETTERS = DeadLetterWay("the diffq.dead queue: the worker's JSON letters")
REDIS_DEAD_LETTERS = DeadLetterWay("the diffq.dead list: the worker's JSON letters (Redis has no mechanism)",
                                   peek=peek_redis_dead_letters)
RABBITMQ_DEAD_LETTERS = DeadLetterWay(
    f"policy {DEAD_LETTER_POLICY}: rejects routed to exchange and queue diffq.dead (needs --rabbitmq-api; "
    "without it the worker's JSON letters, same queue)",
    declare=declare_rabbitmq_dead_letters, peek=peek_rabbitmq_dead_letters)
SQS_DEAD_LETTERS = DeadLetterWay(
    f"queue diffq-dead: redrive policy target (maxReceiveCount {SQS_MAX_RECEIVES}) and the worker's JSON letters",
    declare=declare_sqs_dead_letters, peek=peek_sqs_dead_letters)


# --- KEDA: how a fleet scales on this broker's queues ---------------------------------
# Scaler types, metadata and TriggerAuthentication parameters as KEDA's scalers parse
# them (the `keda:"name=…, order=…"` field tags), read at KEDA_SOURCE: pkg/scalers/
# redis_scaler.go (redisMetadata, redisConnectionInfo), rabbitmq_scaler.go
# (rabbitMQMetadata), aws_sqs_queue_scaler.go, metrics_api_scaler.go; the trigger
# types from pkg/scaling/scalers_builder.go. tests/data/keda/ keeps those structs and
# tests/test_keda_scalers.py checks every rendered name against them. Every value is a
# string, as the CRD requires.
KEDA_SOURCE = "kedacore/keda@8b4f083ca8c8c2baf8477e322bd4d16ac4dfa09a"
# Schemes whose broker speaks TLS. KEDA's redis scalers dial in plain text unless
# `enableTLS` says otherwise (redis_scaler.go SetEnableTLS, defaultEnableTLS false):
# a rediss:// pool left without it never scales from zero. AMQP: amqp091-go turns
# TLS on for an amqps:// host by itself (rabbitmq/amqp091-go connection.go DialConfig).
KEDA_TLS_SCHEMES = frozenset({"rediss", "amqps"})
# The scheme of the `host` KEDA dials for a RabbitMQ broker: amqp091-go's ParseURI
# takes amqp:// and amqps:// only (uri.go errURIScheme), and rabbitmq_scaler.go's
# Validate maps only those to the AMQP protocol; kombu's pyamqp:// is plain AMQP.
KEDA_AMQP_SCHEMES = {"amqp": "amqp", "pyamqp": "amqp", "amqps": "amqps"}


@dataclass(frozen=True)
class KedaFacts:
    """What a rendered trigger needs besides the queue: the fleet's own settings and
    what its broker URL and transport options say (`keda_facts`)."""

    per_replica: int  # queued batches per replica before KEDA adds one
    redis_db: int = 0
    aws_region: str = "us-east-1"  # kombu's SQS default region too
    tls: bool = False  # the broker speaks TLS
    sentinel_master: str | None = None  # kombu's `master_name` transport option
    # The AMQP URL KEDA dials: the scheme KEDA parses, host, port and vhost, no
    # credentials (those come from the Secret through the TriggerAuthentication).
    amqp_host: str | None = None


def sqs_entity_name(queue: str) -> str:
    """The SQS queue kombu creates for `queue` ('.' -> '-', other punctuation but
    '-' and '_' -> '_'; kombu/transport/SQS/__init__.py `entity_name`)."""
    import string

    table = {ord(c): "_" for c in string.punctuation if c not in "-_."}
    table[ord(".")] = "-"
    return queue.translate(table)


def _redis_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # The Celery queue is one Redis list of exactly this name (priority_steps [0]).
    metadata = {"listName": queue, "listLength": str(facts.per_replica), "activationListLength": "0",
                "databaseIndex": str(facts.redis_db)}
    if facts.tls:
        metadata["enableTLS"] = "true"
    return metadata


def _redis_sentinel_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # `address` (the TriggerAuthentication's) lists the sentinels; they name the master.
    if not facts.sentinel_master:
        raise ValueError("a sentinel:// broker needs kombu's master_name transport option "
                         "(the master the sentinels name): pass --broker-option master_name=NAME")
    return {**_redis_trigger(queue, facts), "sentinelMaster": facts.sentinel_master}


def _sqs_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # Visible + in flight (scaleOnInFlight): a pool does not scale in under its batches.
    return {"queueURL": sqs_entity_name(queue), "queueLength": str(facts.per_replica),
            "activationQueueLength": "0", "awsRegion": facts.aws_region, "scaleOnInFlight": "true"}


def _rabbitmq_trigger(queue: str, facts: KedaFacts) -> dict[str, str]:
    # AMQP protocol: the ready messages of the queue (a passive declare), like LLEN.
    if not facts.amqp_host:
        raise ValueError("an AMQP fleet's --broker names its host (amqp://HOST:5672/VHOST): KEDA dials it")
    return {"protocol": "amqp", "host": facts.amqp_host, "queueName": queue, "mode": "QueueLength",
            "value": str(facts.per_replica), "activationValue": "0"}


@dataclass(frozen=True)
class KedaScaler:
    """KEDA's scaler for one queue of this broker and the credentials it reads."""

    type: str  # the trigger type (pkg/scaling/scalers_builder.go)
    metadata: Callable[[str, KedaFacts], dict[str, str]]
    # TriggerAuthentication secretTargetRef: (scaler parameter, key of the broker Secret).
    auth: tuple[tuple[str, str], ...]
    source: str = ""  # the scaler's file under KEDA_SOURCE


_REDIS_AUTH = (("address", "redis-address"), ("password", "redis-password"))
REDIS_SCALER = KedaScaler("redis", _redis_trigger, auth=_REDIS_AUTH, source="pkg/scalers/redis_scaler.go")
# `address` here is the sentinels' host:port list (comma-separated); `password` the
# master's, as kombu sends it (no sentinelPassword: kombu's sentinel_kwargs carry none).
REDIS_SENTINEL_SCALER = KedaScaler("redis-sentinel", _redis_sentinel_trigger, auth=_REDIS_AUTH,
                                   source="pkg/scalers/redis_scaler.go")
SQS_SCALER = KedaScaler("aws-sqs-queue", _sqs_trigger,
                        auth=(("awsAccessKeyID", "aws-access-key-id"), ("awsSecretAccessKey", "aws-secret-access-key")),
                        source="pkg/scalers/aws_sqs_queue_scaler.go")
# `host` is rendered (KedaFacts.amqp_host); KEDA puts these credentials into it.
RABBITMQ_SCALER = KedaScaler("rabbitmq", _rabbitmq_trigger,
                             auth=(("username", "rabbitmq-username"), ("password", "rabbitmq-password")),
                             source="pkg/scalers/rabbitmq_scaler.go")


def _scheme(broker_url: str) -> str:
    return broker_url.split("://", 1)[0].split("+", 1)[0].lower()


def keda_scaler(broker_url: str) -> KedaScaler | None:
    """KEDA's scaler for this broker URL's scheme; None: no fleet runs on it."""
    keda = transport_for(broker_url).keda
    return dict(keda).get(_scheme(broker_url)) if keda else None


def keda_facts(broker_url: str, transport_options: dict | None = None, *, per_replica: int, redis_db: int = 0,
               aws_region: str = "us-east-1") -> KedaFacts:
    """The facts a trigger reads from the broker: TLS (a TLS scheme, or kombu's `ssl`
    option), the sentinels' master (kombu's `master_name`), the AMQP host KEDA dials."""
    from urllib.parse import quote, unquote, urlsplit

    options = transport_options or {}
    scheme = _scheme(broker_url)
    tls = scheme in KEDA_TLS_SCHEMES or bool(options.get("ssl"))
    amqp_host = None
    if scheme in KEDA_AMQP_SCHEMES:
        url = urlsplit(broker_url)
        if url.hostname:
            host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
            port = f":{url.port}" if url.port else ""
            # kombu's vhost: the path after its first '/', '/' where there is none.
            vhost = unquote(url.path[1:]) or "/"
            amqp_host = f"{'amqps' if tls else KEDA_AMQP_SCHEMES[scheme]}://{host}{port}/{quote(vhost, safe='')}"
    return KedaFacts(per_replica=per_replica, redis_db=redis_db, aws_region=aws_region, tls=tls,
                     sentinel_master=options.get("master_name"), amqp_host=amqp_host)


@dataclass(frozen=True)
class Transport:
    name: str
    schemes: tuple[str, ...]
    # Celery drives the consumer from an event loop (hub): timers run while idle
    # (held-ack settling, routing, Redis's restore sweep), and the consumer can
    # switch queues at run time. Without one (synloop) there are no timers.
    event_loop: bool
    # A task in flight when its worker is SIGKILLed never comes back by itself.
    loses_inflight_on_kill: bool
    # How the batch a worker holds stays its own while it works, and returns when
    # the holder dies: a renew(channel, messages) call every lease period, or None
    # where the broker needs nothing (AMQP: the connection is the lease; embedded:
    # the runner reconciles from the run folder).
    renew: Callable | None
    # Give held deliveries back now (drain past its timeout, parent gone):
    # hand_back(channel, messages), or None where closing the connection does it
    # (AMQP) or nothing can (embedded).
    hand_back: Callable | None = None
    # The producer's fast path (producer/publish.py's PUBLISHERS).
    publisher: str = "kombu-batch"
    # Every queue under a prefix and its depth in one call, list_depths(connection,
    # prefix), or None: names come from the caller and the workers, and each depth
    # is a passive declare.
    list_depths: Callable | None = None
    # The depth of each of the given queues (0 for one with no messages yet): what
    # compile-aware routing reads every second where there is no shared listing.
    queue_depths: Callable = field(default=passive_queue_depths)
    # Every queue's depth from one listing the whole fleet shares, at most max_age
    # old: shared_depths(connection, prefix, max_age) -> {queue: depth}. What routing
    # and discovery read every second, at a cost per worker that does not grow with
    # the queues; None: each worker reads queue_depths itself and lists list_queues.
    shared_depths: Callable | None = None
    broker_options: Callable = field(default=_visibility_options)
    # Arguments of the worker's basic.consume (settings -> dict).
    consumer_arguments: Callable = field(default=lambda settings: {})
    # A kombu Transport class replacing the scheme's own ("module:Class").
    kombu_transport: str | None = None
    # Every diffq queue on the broker, (connection, prefix, api URL) -> names, for
    # workers started without --queues; None: the queues must be named.
    list_queues: Callable | None = None
    # Why list_queues needs an API URL, where it does (refused before anything starts).
    list_needs_api: str | None = None
    discovery: str = "none: name the queues (--queues or --run)"  # the same, in words
    # (channel, on_bad) -> None: check raw deliveries the transport would choke on.
    guard_deliveries: Callable | None = None
    # (channel, lost) -> None: what the worker's consumer channel needs beyond the
    # transport's own (Redis: a fetch that pops and records in one step; settling
    # after a lost connection, through `lost(tag, settle)`: core/redis_consumer.py).
    consumer_channel: Callable | None = None
    # Celery's monitoring channels: task events (Flower, `celery events`: three
    # publishes per batch) and remote control (`celery inspect`, `diffq queues`' live
    # consumers: its pidbox queue is polled every cycle), both on the worker's main
    # thread between two device calls. Off where no monitor can attach (the embedded
    # run's folder, the in-process memory broker); DIFFQ_TASK_EVENTS overrides events.
    monitored: bool = True
    # KEDA's scaler per URL scheme of this broker; None: no fleet runs on it (embedded, memory).
    keda: tuple[tuple[str, KedaScaler], ...] | None = None
    # Env a worker pod (and the backlog service) reads from the broker Secret, besides
    # DIFFQ_BROKER_URL: (variable, Secret key). AMQP lists queues only over its HTTP API.
    secret_env: tuple[tuple[str, str], ...] = ()
    # Where refused messages end and how (see DeadLetterWay above).
    dead_letters: DeadLetterWay = HAND_DEAD_LETTERS
    # The queue a delivery arrived on, as the broker or transport saw it (message,
    # kombu Consumer) -> name; and what the consumer needs installed for it to know.
    arrival: Callable = virtual_arrival
    stamp_arrivals: Callable | None = stamp_virtual_arrivals


TRANSPORTS = (
    Transport("redis", ("redis", "rediss", "sentinel"), event_loop=True, loses_inflight_on_kill=False,
              renew=renew_redis, hand_back=hand_back_redis, publisher="redis-lists",
              list_depths=redis_list_depths, queue_depths=redis_queue_depths, shared_depths=redis_shared_depths,
              broker_options=_redis_options,
              list_queues=redis_list_queues, discovery="SCAN for diffq.* lists (queues holding work)",
              guard_deliveries=guard_redis_deliveries, consumer_channel=redis_consumer_channel,
              dead_letters=REDIS_DEAD_LETTERS,
              keda=(("redis", REDIS_SCALER), ("rediss", REDIS_SCALER), ("sentinel", REDIS_SENTINEL_SCALER))),
    # The connection is the lease: the broker redelivers when it closes.
    Transport("amqp", ("amqp", "amqps", "pyamqp"), event_loop=True, loses_inflight_on_kill=False,
              renew=None, broker_options=_no_options, consumer_arguments=_amqp_consumer_arguments,
              list_queues=rabbitmq_list_queues, list_needs_api=NEEDS_RABBITMQ_API,
              discovery="management API only (--rabbitmq-api URL); AMQP itself cannot list queues",
              keda=(("amqp", RABBITMQ_SCALER), ("amqps", RABBITMQ_SCALER), ("pyamqp", RABBITMQ_SCALER)),
              secret_env=(("DIFFQ_RABBITMQ_API", "rabbitmq-api"),),
              dead_letters=RABBITMQ_DEAD_LETTERS, arrival=amqp_arrival, stamp_arrivals=None),
    Transport("sqs", ("sqs",), event_loop=True, loses_inflight_on_kill=False,
              renew=renew_sqs, hand_back=hand_back_sqs,
              list_queues=sqs_list_queues, discovery="ListQueues by name prefix", keda=(("sqs", SQS_SCALER),),
              secret_env=(("AWS_ACCESS_KEY_ID", "aws-access-key-id"), ("AWS_SECRET_ACCESS_KEY", "aws-secret-access-key")),
              dead_letters=SQS_DEAD_LETTERS),
    # No lease: the embedded runner re-enqueues from the run folder.
    Transport("embedded", ("filesystem",), event_loop=False, loses_inflight_on_kill=True,
              renew=None, broker_options=_no_options, kombu_transport="diffq.core.broker:EmbeddedTransport",
              monitored=False),
    # kombu's in-process transport: only for plans and tests that start nothing.
    Transport("memory", ("memory",), event_loop=False, loses_inflight_on_kill=True,
              renew=None, broker_options=_no_options, monitored=False),
)
_BY_SCHEME = {scheme: row for row in TRANSPORTS for scheme in row.schemes}


class UnknownTransport(ValueError):
    pass


def transport_for(broker_url: str) -> Transport:
    scheme = _scheme(broker_url)
    try:
        return _BY_SCHEME[scheme]
    except KeyError:
        raise UnknownTransport(f"broker URL scheme '{scheme}://' is not one diffq supports "
                               f"({', '.join(sorted(_BY_SCHEME))})") from None
