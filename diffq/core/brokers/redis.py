"""Redis: everything diffq does on a Redis broker beyond kombu's public API (`RedisBroker`).

Facts pinned to kombu 5.7's sources (tests/test_transports.py cites them): Redis
keeps a delivered message in the `unacked` hash and its delivery time in the
`unacked_index` sorted set; a live consumer's sweep (`QoS.restore_visible`, under
the `unacked_mutex`) puts back every entry older than the visibility timeout
(kombu/transport/redis.py). Renewing a lease = moving the score forward. Each queue
is one list of its exact name (priority_steps [0]); an empty queue has no key.

kombu is extended here through its extension points, never by replacing a method or
attribute on an object diffq did not create: kombu's Redis `Transport`, `Channel` and
`QoS` are subclassed (`RedisTransport`, `RedissTransport`, `RedisSentinelTransport`;
`RedisChannel`, `RedisQoS`) and handed to Celery as its `broker_transport`, a
"module:Class" path per scheme (`KOMBU_TRANSPORTS`, read by make_celery): the URL keeps
its scheme, and kombu's process-wide `TRANSPORT_ALIASES` stay as they are. What the
worker's consumer channel adds (`ConsumerChannel`, switched on by `RedisChannel.serve`):


1. A fetch that cannot lose a message: pop and record it in one step.

kombu's Redis channel takes a message with BRPOP and records it as unacked
(`unacked` hash, `unacked_index` score: what a lapsed lease restores) in a second
round trip (kombu/transport/redis.py, kombu 5.7: `Channel._brpop_read`, then
`QoS.append`). Between the two the message lives only in the BRPOP reply: a broker
restart or a dropped connection there loses it for good, and no lease can bring it
back. A Redis restart during a run showed exactly that in its append-only file: an
RPOP of one batch's message and no HSET for it (tests/test_reliability.py).

Here the consumer's channel, while it has room for another message, first takes one
with a script that pops it and records it as unacked at once (a script's writes are
applied, and reach the append-only file, together). Only when every queue it serves
is empty does it wait on kombu's own BRPOP, so the two-step path is left to a message
that arrives while the worker waits. A lost reply after the script leaves the message
in `unacked`, which the lease sweep restores (`RedisBroker.renew` below).

2. A channel that outlives its connection. On a lost connection Celery's consumer
collects the connection, which drops the transport's link to it, and then closes it
(celery/worker/consumer/consumer.py, `on_connection_error_after_connected`, Celery
5.7); the channel's close gives back what it holds (`QoS.restore_unacked`), which
needs that link: an AttributeError no handler expects ended the worker, and a batch
finishing after the reconnect acks through the same dead channel. Here a channel
whose connection is gone settles locally: what it held stays in `unacked` and comes
back once its lease lapses (redelivered, a stored batch is credited, not generated).
The channel does not decide that end: an ack or reject it can no longer pass on is
answered `ConnectionLost` (`answer`: a future per delivery, resolved where Celery runs
the ack, on the consumer's loop), and the worker's door decides (`connection lost`,
worker/delivery/outcomes.py) and carries it out (worker/delivery/door.py `carry_out`).
An ack no one asked the answer of (kombu's own use, a bare channel) is settled here.

3. A close that gives back through the worker's table. kombu's close restores every
delivery the channel still holds (`QoS.restore_unacked`); here each one is reported
to the worker's `closed` hook: `StillHeld` (`channel closed`: a requeue, carried out by
kombu's own `restore_by_tag`, as kombu's close would), or `ConnectionLost` where the
connection is already gone.

4. A reply check. A BRPOP reply that is no kombu envelope goes to the worker's
`on_bad` before kombu parses it (`RedisChannel.guard`), through a subclass of the
channel's own redis-py client class (`_get_client`), not a replaced reply callback.

kombu's private names that remain, each for a reason kombu offers no public way to meet
(checked against kombu 5.7; the `kombu<5.8` pin keeps them there):
- `Channel._brpop_start`, overridden: kombu's poller calls it on every poll start
  (MultiChannelPoller._register_BRPOP); the only place a fetch can run before the BRPOP.
- `Channel._get_client`, overridden: where kombu picks its client class (the reply check).
- `Channel._connparams`, overridden (`RedissChannel`): kombu's TLS default for rediss://.
- `Channel._queue_cycle` (`consume`, `rotate`) and `Channel._q_for_pri`: the queues and
  list names kombu's own BRPOP would use, in its round-robin order (the script pops the
  same lists in the same order; the publisher names lists by `_q_for_pri` too).
- `Transport._deliver`: hands a taken message to its consumer as `_brpop_read` does.
- `Transport._callbacks`: wrapped once in `_Arrivals.__init__`, on diffq's own transport
  (each delivery stamped with its queue: base.py `StampingCallbacks`).
- `QoS._delivered` (what a closing channel holds, kombu's own `restore_unacked` loop) and
  `QoS._quick_ack` (forget a delivery here without telling a broker that is gone).
- `virtual.QoS.append`, past kombu's Redis QoS: its bookkeeping without the Redis write
  the take script already made.

How the fetch waits: it does not wait inside the script (Redis runs a blocking pop
inside a script without blocking). The script only looks: it pops and records one
message if a served queue holds one, and returns nothing otherwise; then, with every
queue empty, the channel sends kombu's own BRPOP (with its timeout, 1 s by default), and
the event loop waits on that socket like any other kombu Redis consumer.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import ssl
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import orjson
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from diffq.core.brokers.base import (DEAD_LETTERS, PEEKED_LETTERS, PREFIX, Broker, ConnectionLost, DeadLetterReport,
                                     StampingCallbacks, StillHeld, dashed, envelope_payload, envelope_queue,
                                     letter_fields, new_task_id)

log = logging.getLogger(__name__)

# kombu's Redis priority sub-lists are '<queue>\x06\x16<priority>'.
PRIORITY_SEP = "\x06\x16"


# -- the fetch and the consumer channel ------------------------------------------------------


# KEYS: the unacked hash, the unacked index, then the queues' lists in the order to
# try. ARGV[1]: the delivery time (kombu scores with the client's clock too). The
# unacked entry is kombu's own: [payload, exchange, routing_key] (QoS.append), with
# the payload's bytes as they were published. An item that is not a kombu envelope
# is left where it is for kombu's read (and diffq's guard_deliveries) to take.
TAKE_SCRIPT = """
for i = 3, #KEYS do
  local item = redis.call('LINDEX', KEYS[i], -1)
  if item then
    local ok, message = pcall(cjson.decode, item)
    if not ok or type(message) ~= 'table' or type(message['properties']) ~= 'table'
        or message['body'] == nil then
      return false
    end
    local properties = message['properties']
    local info = properties['delivery_info']
    local tag = properties['delivery_tag']
    if type(info) ~= 'table' or type(tag) ~= 'string' then
      return false
    end
    redis.call('RPOP', KEYS[i])
    redis.call('ZADD', KEYS[2], ARGV[1], tag)
    redis.call('HSET', KEYS[1], tag,
      '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ',' .. cjson.encode(info['routing_key']) .. ']')
    return {KEYS[i], item}
  end
end
return false
"""



# The QoS methods `RedisQoS` overrides: the consumer channel's when it has one.
QOS_METHODS = ("append", "ack", "reject", "restore_unacked")


class ConsumerChannel:
    """The worker's fetch and settling on one consumer channel (`RedisChannel.serve`).

    `kombu`: kombu's own QoS methods (append, ack, reject, restore_unacked) and the
    channel's own `start` (`_brpop_start`), which the subclasses below override and
    reach here through `super()`; without it, the ones the channel's QoS carries (a
    stand-in channel in tests)."""

    def __init__(self, channel, closed: Callable[[StillHeld | ConnectionLost], None] | None = None,
                 kombu: dict[str, Callable] | None = None):
        self.channel = channel
        # Each delivery still held when the channel closes; None: kombu's own restore.
        self.closed = closed
        # delivery tag -> what its ack or reject met, for whoever asked (`answer`)
        self._answers: dict[str, Future] = {}
        self.recorded: set[str] = set()  # delivery tags the script recorded as unacked
        self._script = None
        if kombu is None:
            qos = channel.qos
            kombu = {name: getattr(qos, name) for name in QOS_METHODS}
            kombu["start"] = channel._brpop_start
        self._kombu = kombu
        self._kombu_start = kombu["start"]
        self.taken = 0  # messages taken by the script (tests, bench)
        self.left_held = 0  # deliveries left to their lease once the connection was gone

    def start(self, timeout=None):
        qos = self.channel.qos
        # Up to the window (one with no window: kombu's own pace), then kombu's BRPOP
        # where there is still room: every queue empty, or no window to fill.
        for _ in range(qos.prefetch_count or 1):
            if not qos.can_consume():
                return  # the window is full: the poll start after an ack looks again
            taken = self.take()
            if taken is None:
                break
            queue, payload = taken
            self.channel.connection._deliver(payload, queue)
        if qos.can_consume():
            return self._kombu_start(timeout)

    def take(self) -> tuple[str, dict] | None:
        """Pop the next message and record it as unacked, in one step; None when no
        queue holds one (or the next one is for kombu's own read)."""
        channel = self.channel
        if channel.global_keyprefix:
            return None  # kombu prefixes keys inside its client: its own path
        queues = channel._queue_cycle.consume(len(channel.active_queues))
        if not queues:
            return None
        keys = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps for queue in queues]
        with channel.conn_or_acquire() as client:
            if self._script is None:
                self._script = client.register_script(TAKE_SCRIPT)
            answer = self._script(keys=[channel.unacked_key, channel.unacked_index_key, *keys],
                                  args=[time.time()], client=client)
        if not answer:
            return None
        key, item = answer
        queue = bytes_to_str(key).rsplit(channel.sep, 1)[0]
        channel._queue_cycle.rotate(queue)
        payload = loads(bytes_to_str(item))
        self.recorded.add(payload["properties"]["delivery_tag"])
        self.taken += 1
        return queue, payload

    def append(self, message, delivery_tag):
        """kombu's QoS.append, less the write the script already made."""
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            virtual.QoS.append(self.channel.qos, message, delivery_tag)
        else:
            self._kombu["append"](message, delivery_tag)

    # -- after the connection is gone --------------------------------------------------

    @property
    def detached(self) -> bool:
        """The transport no longer knows its connection (Celery collected it), or the
        channel is closed (what it held was given back or left to its lease)."""
        transport = self.channel.connection
        return transport is None or transport.client is None

    def answer(self, delivery_tag) -> Future:
        """What the next ack or reject of this delivery meets, once it runs (Celery runs
        it later, on the consumer's loop): None when the broker was told, a
        `ConnectionLost` when it no longer can be."""
        return self._answers.setdefault(delivery_tag, Future())

    def ack(self, delivery_tag):
        if not self.detached:
            return self._told(delivery_tag, self._kombu["ack"], delivery_tag)
        self._lost(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if not self.detached:
            return self._told(delivery_tag, self._kombu["reject"], delivery_tag, requeue=requeue)
        self._lost(delivery_tag)

    def restore_unacked(self, client=None):
        if client is not None or not self.detached:
            if self.closed is None:
                return self._kombu["restore_unacked"](client)
            # kombu's own (kombu/transport/redis.py QoS.restore_unacked), one tag at a
            # time through the worker's end for it (`channel closed`).
            qos = self.channel.qos
            with self.channel.conn_or_acquire(client) as client:
                for tag in list(qos._delivered):
                    self.closed(StillHeld(tag, lambda tag=tag, client=client: qos.restore_by_tag(tag, client=client)))
            qos._delivered.clear()
            return None
        qos = self.channel.qos
        for tag in list(qos._delivered):
            lost = self._connection_lost(tag)
            (self.closed or _settle)(lost)
        qos._delivered.clear()

    def _told(self, delivery_tag, call: Callable, *args, **kwargs):
        answer = self._answers.pop(delivery_tag, None)
        try:
            result = call(*args, **kwargs)
        except BaseException as exc:  # Celery logs it; the delivery comes back with its lease
            if answer is not None:
                answer.set_exception(exc)
            raise
        if answer is not None:
            answer.set_result(None)
        return result

    def _lost(self, delivery_tag) -> None:
        lost = self._connection_lost(delivery_tag)
        answer = self._answers.pop(delivery_tag, None)
        if answer is None:
            _settle(lost)
        else:
            answer.set_result(lost)

    def _connection_lost(self, delivery_tag) -> ConnectionLost:
        return ConnectionLost(delivery_tag, lambda: self._settle_here(delivery_tag))

    def _settle_here(self, delivery_tag) -> None:
        self.channel.qos._quick_ack(delivery_tag)  # settled here; still in the broker's `unacked`
        self.left_held += 1


def _settle(lost: ConnectionLost) -> None:
    """Where no worker asked: settled here, left to the lease."""
    lost.settle()
    log.warning("the broker connection is gone: delivery %s is settled by the broker (given back "
                "at the close, or back once its lease lapses)", lost.tag)


# -- kombu's Redis transport, subclassed -------------------------------------------------------


class RedisQoS(kombu_redis.QoS):
    """kombu's Redis QoS; on a consumer channel the worker serves (`RedisChannel.serve`),
    its append, ack, reject and restore go through the `ConsumerChannel`, which reaches
    kombu's own through `super()`."""

    def append(self, message, delivery_tag):
        served = self.channel.diffq
        if served is None:
            return super().append(message, delivery_tag)
        return served.append(message, delivery_tag)

    def ack(self, delivery_tag):
        served = self.channel.diffq
        if served is None:
            return super().ack(delivery_tag)
        return served.ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        served = self.channel.diffq
        if served is None:
            return super().reject(delivery_tag, requeue=requeue)
        return served.reject(delivery_tag, requeue=requeue)

    def restore_unacked(self, client=None):
        served = self.channel.diffq
        if served is None:
            return super().restore_unacked(client)
        return served.restore_unacked(client)


class _CheckedReplies:
    """redis-py's client, each BRPOP reply handed to `checked` (its channel's
    `_checked_reply`) after redis-py's own parsing and before kombu reads it."""

    def __init__(self, *args, checked: Callable | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._checked = checked

    def parse_response(self, connection, command_name, **options):
        response = super().parse_response(connection, command_name, **options)
        if command_name == "BRPOP" and response and self._checked is not None:
            return self._checked(response)
        return response


@functools.cache
def _checked_client(base: type) -> type:
    # kombu's client class: redis.Redis, or its PrefixedStrictRedis under a global key prefix.
    return type(f"Checked{base.__name__}", (_CheckedReplies, base), {})


class _ServedChannel:
    """What diffq's Redis channels add to kombu's (`RedisChannel`, `RedisSentinelChannel`)."""

    QoS = RedisQoS
    # The worker's fetch and settling (`serve`); None: kombu's own (a producer's channel).
    diffq: ConsumerChannel | None = None
    # on_bad(queue, item, reason) for a popped item that is no kombu envelope (`guard`).
    on_bad: Callable[[str, bytes, str], None] | None = None

    def serve(self, closed: Callable | None = None) -> ConsumerChannel:
        """The atomic fetch and the detached settling, on this channel from now on (once)."""
        if self.diffq is None:
            qos = self.qos
            kombu = {name: getattr(super(RedisQoS, qos), name) for name in QOS_METHODS}
            kombu["start"] = super()._brpop_start
            self.diffq = ConsumerChannel(self, closed, kombu)
        return self.diffq

    def guard(self, on_bad: Callable[[str, bytes, str], None]) -> None:
        self.on_bad = on_bad

    def _brpop_start(self, timeout=None):
        # kombu's poller calls it on every poll start while the channel can consume and
        # no BRPOP is outstanding (kombu/transport/redis.py MultiChannelPoller._register_BRPOP).
        if self.diffq is None:
            return super()._brpop_start(timeout)
        return self.diffq.start(timeout)

    def _get_client(self):
        # kombu builds every client of this channel from it (`_create_client`).
        base = super()._get_client()
        if isinstance(base, functools.partial):
            return functools.partial(_checked_client(base.func), *base.args, checked=self._checked_reply,
                                     **base.keywords)
        return functools.partial(_checked_client(base), checked=self._checked_reply)

    def _checked_reply(self, response):
        """kombu's Redis channel parses a BRPOP reply as its JSON envelope in one step
        (kombu/transport/redis.py `_brpop_read`); an item another client pushed that is
        not one raises out of the worker's event loop, which ends the worker and loses
        the item. Here a malformed item goes to `on_bad(queue, item, reason)` and the
        read gets nothing (kombu's `Empty`: the loop goes on)."""
        if self.on_bad is None:
            return response
        key, item = response
        reason = _envelope_problem(item)
        if reason is None:
            return response
        queue = (key.decode() if isinstance(key, bytes) else key).split(PRIORITY_SEP, 1)[0]
        self.on_bad(queue, item, reason)
        return None


class RedisChannel(_ServedChannel, kombu_redis.Channel):
    pass


class RedissChannel(RedisChannel):
    """A rediss:// broker: kombu sets TLS without certificate checks for a bare rediss://
    URL only when the scheme names its transport (kombu/connection.py `_init_params`);
    handed a class, it does not, so the class keeps that default."""

    connection_class = kombu_redis.Channel.connection_class_ssl

    def _connparams(self, asynchronous=False):
        params = super()._connparams(asynchronous)
        if not self.connection.client.ssl:
            params.setdefault("ssl_cert_reqs", ssl.CERT_NONE)
        return params


class RedisSentinelChannel(_ServedChannel, kombu_redis.SentinelChannel):
    pass


class _Arrivals:
    """Each delivery stamped with the queue it was taken from (base.py `StampingCallbacks`),
    by the transport's own callback table."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self._callbacks = StampingCallbacks(self._callbacks)


class RedisTransport(_Arrivals, kombu_redis.Transport):
    Channel = RedisChannel


class RedissTransport(_Arrivals, kombu_redis.Transport):
    Channel = RedissChannel


class RedisSentinelTransport(_Arrivals, kombu_redis.SentinelTransport):
    Channel = RedisSentinelChannel


# Handed to kombu as a class by Celery's `broker_transport` (make_celery), per scheme;
# the URL keeps its scheme. Not through kombu's TRANSPORT_ALIASES: that is process-wide.
KOMBU_TRANSPORTS = {"redis": f"{__name__}:RedisTransport", "rediss": f"{__name__}:RedissTransport",
                    "sentinel": f"{__name__}:RedisSentinelTransport"}


# -- publishing ------------------------------------------------------------------------------


class RedisLists:
    """LPUSH of kombu Redis transport envelopes in a non-transactional pipeline.

    One LPUSH per list per flush, with every message buffered for it: the same
    order on the list as one LPUSH each, without redis-py's cost per command.
    kombu's `_put` would also PEXPIRE a queue declared with `x-expires`; diffq's
    shape queues are declared without it.
    """

    def __init__(self, producer, batch_size: int):
        channel: kombu_redis.Channel = producer.channel
        self._channel = channel
        self._batch_size = batch_size
        self._stack = contextlib.ExitStack()
        # kombu's own client: its pool, TLS, password and global key prefix.
        client = self._stack.enter_context(channel.conn_or_acquire())
        self._pipeline = self._stack.enter_context(client.pipeline(transaction=False))
        self._buffered = 0
        self._pending: dict[str, list[bytes]] = {}  # list name -> envelopes, oldest first
        self._lists: dict[str, str] = {}

    def _list(self, queue: str) -> str:
        # Priority 0 lands in the base list with diffq's priority_steps=[0]; asking
        # the channel keeps it right under any other steps a deployment sets.
        name = self._lists.get(queue)
        if name is None:
            name = self._lists[queue] = self._channel._q_for_pri(queue, 0)
        return name

    def put(self, queue: str, body: bytes, headers: dict, properties: dict) -> None:
        # The envelope kombu's virtual Channel stores: prepare_message, then
        # _inplace_augment_message (base64 body, delivery tag, delivery info).
        properties.update(
            delivery_mode=2,  # persistent, as the default exchange publishes
            delivery_info={"exchange": "", "routing_key": queue},
            priority=0,
            body_encoding="base64",
            delivery_tag=dashed(new_task_id()),
        )
        envelope = orjson.dumps({"body": base64.b64encode(body).decode("ascii"),
                                 "content-encoding": "utf-8", "content-type": "application/json",
                                 "headers": headers, "properties": properties})
        name = self._list(queue)
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = []
        pending.append(envelope)
        self._buffered += 1
        if self._buffered >= self._batch_size:
            self.flush()

    def flush(self) -> None:
        if self._buffered:
            for name, envelopes in self._pending.items():
                self._pipeline.lpush(name, *envelopes)
            self._pending.clear()
            self._buffered = 0
            self._pipeline.execute()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._stack.close()


# -- depths and listing ----------------------------------------------------------------------


def list_depths_with(client, prefix: str) -> dict[str, int]:
    keys = sorted(k.decode() if isinstance(k, bytes) else k
                  for k in client.scan_iter(match=f"{prefix}*", count=1000, _type="list"))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    depths: Counter = Counter()
    for key, n in zip(keys, pipe.execute()):
        depths[key.split(PRIORITY_SEP, 1)[0]] += n
    return dict(depths)


def listing_keys(prefix: str = PREFIX) -> tuple[str, str]:
    """The fleet's shared depth listing and its refresh lock: strings outside the
    prefix's lists (a listing SCANs for lists only; kombu's own keys start with '_')."""
    return f"_{prefix}depths", f"_{prefix}depths.lock"


def shared_listing(connection, prefix: str = PREFIX, max_age: float = 1.0) -> dict[str, int]:
    """Every diffq queue's depth as the fleet last listed it, at most `max_age` s old:
    one GET, however many queues there are. The one reader per `max_age` that finds
    the listing stale and wins `SET NX PX` lists the broker (SCAN + pipelined LLEN)
    and stores it for everyone, so the fleet pays for a listing once per `max_age`,
    not once per worker. {} while another reader takes the very first one."""
    key, lock = listing_keys(prefix)
    with connection.default_channel.conn_or_acquire() as client:
        stored = client.get(key)
        listing = json.loads(stored) if stored else None
        # Dated by its taker's clock: one from the future (a skewed clock) is stale too.
        fresh = listing is not None and 0 <= time.time() - listing["at"] < max_age
        if not fresh and client.set(lock, b"1", nx=True, px=max(1, int(max_age * 1000))):
            listing = {"at": time.time(), "depths": list_depths_with(client, prefix)}
            # Expires long after any reader would retake it: a stopped fleet leaves nothing.
            client.set(key, json.dumps(listing), ex=max(60, int(10 * max_age)))
    return dict(listing["depths"]) if listing else {}



# -- a malformed item ------------------------------------------------------------------------


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



def _served(channel, what: str) -> bool:
    """The channel is one of diffq's (make_celery hands kombu `KOMBU_TRANSPORTS`). kombu's
    own (a `;` failover list switches back to it: kombu/connection.py `switch`) keeps
    kombu's own behaviour, and the log says so."""
    if isinstance(channel, _ServedChannel):
        return True
    log.warning("the Redis consumer channel is kombu's own %s, not diffq's: %s are off on it",
                type(channel).__name__, what)
    return False


class RedisBroker(Broker):
    """Redis: leases by the `unacked_index` score, a pipelined LPUSH publisher, one SCAN
    for every queue's depth (shared by the fleet), an atomic fetch on the consumer channel,
    a guard for items that are no kombu envelope, the dead letters' list read by LLEN."""

    publisher = RedisLists
    kombu_transport = KOMBU_TRANSPORTS["redis"]

    def kombu_transport_for(self, broker_url: str) -> str | None:
        return KOMBU_TRANSPORTS.get(broker_url.split("://", 1)[0].lower(), self.kombu_transport)

    def options(self, settings) -> dict:
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

    def renew(self, channel, messages: list) -> int:
        """Move each held delivery's `unacked_index` score to now (XX: never re-adds one
        that was acked or restored meanwhile). Returns how many entries were renewed."""
        now = time.time()
        tags = {message.delivery_tag: now for message in messages}
        if not tags:
            return 0
        # CH counts members whose score changed: the delivery time only moves forward.
        return channel.client.zadd(channel.unacked_index_key, tags, xx=True, ch=True)

    def hand_back(self, channel, messages: list) -> int:
        """Put held deliveries back at the head of their queues now (kombu's own
        `restore_by_tag`, which also flags them redelivered): not a failed attempt."""
        for message in messages:
            channel.qos.restore_by_tag(message.delivery_tag, leftmost=True)
        return len(messages)

    def list_depths(self, connection, prefix: str = PREFIX) -> dict[str, int]:
        """Every diffq queue on a Redis broker: one SCAN for lists plus one pipelined LLEN.

        Each queue is one list named exactly like it (priority_steps=[0]) and an empty
        queue has no key; any priority sub-list another producer made is folded in."""
        # A client of its own from the channel's pool: inside a worker the channel's
        # client holds the connection its event loop is blocked in BRPOP on.
        with connection.default_channel.conn_or_acquire() as client:
            return list_depths_with(client, prefix)

    def queue_depths(self, connection, queues: list[str]) -> dict[str, int]:
        """The depth of each of `queues` on Redis: one pipelined LLEN (no key = empty)."""
        pipe = connection.default_channel.client.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return dict(zip(queues, pipe.execute()))

    def shared_depths(self, connection, prefix: str = PREFIX, max_age: float = 1.0) -> dict[str, int]:
        return shared_listing(connection, prefix, max_age)

    def list_queues(self, connection, prefix: str = PREFIX, api: str | None = None) -> list[str]:
        """The queues that hold work now (an empty Redis queue has no key)."""
        return sorted(self.list_depths(connection, prefix))

    def guard_deliveries(self, channel, on_bad: Callable[[str, bytes, str], None]) -> None:
        """Check each item the consumer's channel pops before kombu parses it: a malformed
        one goes to `on_bad(queue, item, reason)` (`_ServedChannel._checked_reply`)."""
        if _served(channel, "the guard for items that are no kombu envelope"):
            channel.guard(on_bad)

    def consumer_channel(self, channel, closed: Callable | None = None) -> ConsumerChannel | None:
        """The atomic fetch and the detached settling on a consumer channel (once);
        `closed(StillHeld | ConnectionLost)`: the worker's end for each delivery still held
        when the channel closes."""
        if _served(channel, "the atomic fetch and the detached settling"):
            return channel.serve(closed)
        return None

    def answer(self, message) -> Future | None:
        """What this delivery's next ack or reject meets (`ConsumerChannel.answer`); None
        on a channel without diffq's consumer fixes."""
        served = getattr(message.channel, "diffq", None)
        return served.answer(message.delivery_tag) if isinstance(served, ConsumerChannel) else None

    def peek_dead_letters(self, connection, limit: int = PEEKED_LETTERS, peeked: Callable | None = None) -> DeadLetterReport:
        """LLEN and the list's head: kombu LPUSHes, so the head holds the newest (read
        without taking: nothing to end)."""
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
            letters.append(letter_fields(envelope_payload(envelope), envelope_queue(envelope), "unknown"))
        return DeadLetterReport(count, letters, "newest first")

