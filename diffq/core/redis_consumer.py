"""The worker's Redis consumer channel: what kombu's own lacks, installed on it.

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
in `unacked`, which the lease sweep restores (core/transports.py, `renew_redis`).

2. A channel that outlives its connection. On a lost connection Celery's consumer
collects the connection, which drops the transport's link to it, and then closes it
(celery/worker/consumer/consumer.py, `on_connection_error_after_connected`, Celery
5.7); the channel's close gives back what it holds (`QoS.restore_unacked`), which
needs that link: an AttributeError no handler expects ended the worker, and a batch
finishing after the reconnect acks through the same dead channel. Here a channel
whose connection is gone settles locally: what it held stays in `unacked` and comes
back once its lease lapses (redelivered, a stored batch is credited, not generated).
The worker decides that end (`connection lost`, worker/delivery/outcomes.py) and carries it
out through its broker door (worker/delivery/door.py `lost_connection`, passed as `lost`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

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


log = logging.getLogger(__name__)


class ConsumerChannel:
    """Installed on one consumer channel (kombu's Redis `Channel`) by the worker."""

    def __init__(self, channel, lost: Callable[[str, Callable[[], None]], None] | None = None):
        self.channel = channel
        # (delivery tag, settle here) for a delivery the broker can no longer be told about.
        self.lost = lost or _settle
        self.recorded: set[str] = set()  # delivery tags the script recorded as unacked
        self._script = None
        qos = channel.qos
        self._kombu = {name: getattr(qos, name) for name in ("append", "ack", "reject", "restore_unacked")}
        self._kombu_start = channel._brpop_start
        self.taken = 0  # messages taken by the script (tests, bench)
        self.left_held = 0  # deliveries left to their lease once the connection was gone

    def install(self) -> ConsumerChannel:
        # kombu's poller calls `_brpop_start` on every poll start while the channel can
        # consume and no BRPOP is outstanding (MultiChannelPoller._register_BRPOP).
        self.channel._brpop_start = self.start
        qos = self.channel.qos
        qos.append, qos.ack, qos.reject, qos.restore_unacked = \
            self.append, self.ack, self.reject, self.restore_unacked
        return self

    def start(self, timeout=1):
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

    def ack(self, delivery_tag):
        if not self.detached:
            return self._kombu["ack"](delivery_tag)
        self._leave(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if not self.detached:
            return self._kombu["reject"](delivery_tag, requeue=requeue)
        self._leave(delivery_tag)

    def restore_unacked(self, client=None):
        if client is not None or not self.detached:
            return self._kombu["restore_unacked"](client)
        qos = self.channel.qos
        for tag in list(qos._delivered):
            self._leave(tag)
        qos._delivered.clear()

    def _leave(self, delivery_tag) -> None:
        self.lost(delivery_tag, lambda: self._settle_here(delivery_tag))

    def _settle_here(self, delivery_tag) -> None:
        self.channel.qos._quick_ack(delivery_tag)  # settled here; still in the broker's `unacked`
        self.left_held += 1


def _settle(delivery_tag, settle: Callable[[], None]) -> None:
    settle()
    log.warning("the broker connection is gone: delivery %s is settled by the broker (given back "
                "at the close, or back once its lease lapses)", delivery_tag)


def redis_consumer_channel(channel, lost: Callable[[str, Callable[[], None]], None] | None = None) -> ConsumerChannel:
    """Install the atomic fetch and the detached settling on a consumer channel (once);
    `lost(tag, settle)`: the worker's end for a delivery whose connection is gone."""
    installed = channel.__dict__.get("diffq_consumer")
    if installed is None:
        installed = channel.diffq_consumer = ConsumerChannel(channel, lost).install()
    return installed
