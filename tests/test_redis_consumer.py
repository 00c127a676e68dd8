"""The worker's Redis fetch (diffq/core/brokers/redis.py `ConsumerChannel`) pops and records a message as
unacked in one step, against a private redis-server: a reply lost after the pop leaves
the message where a lapsed lease restores it, which kombu's BRPOP-then-append cannot
(kombu/transport/redis.py, kombu 5.7: `Channel._brpop_read`, `QoS.append`)."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
from kombu import Connection, Consumer, Queue

from diffq.core.brokers.redis import RedisBroker, RedisTransport
from diffq.core.transports import transport_for


def _queue() -> Queue:
    name = f"diffq.fetch-{uuid.uuid4().hex[:8]}"
    return Queue(name, routing_key=name)


def _drain(conn, timeout=0.2) -> None:
    try:
        conn.drain_events(timeout=timeout)
    except socket.timeout:
        pass


redis_consumer_channel = RedisBroker().consumer_channel


def test_the_redis_row_installs_the_redis_consumer_channel():
    assert type(transport_for("redis://h:6379/0").broker).consumer_channel is RedisBroker.consumer_channel
    assert transport_for("amqp://h//").broker.consumer_channel is None


def test_a_taken_message_is_recorded_unacked_by_the_same_step_and_acked_as_usual(redis_server):
    queue = _queue()
    got = []
    with Connection(redis_server, transport=RedisTransport) as conn:
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
        channel = conn.channel()
        consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)])
        channel.basic_qos(0, 1, False)
        fetch = redis_consumer_channel(channel)
        assert redis_consumer_channel(channel) is fetch  # once per channel
        with consumer:
            _drain(conn)
            assert [m.payload for m in got] == [{"n": 1}] and fetch.taken == 1
            tag = got[0].delivery_tag
            entry = json.loads(channel.client.hget(channel.unacked_key, tag))
            # kombu's own unacked entry: [payload, exchange, routing key]
            assert entry[0]["properties"]["delivery_tag"] == tag and entry[2] == queue.name
            assert channel.client.zscore(channel.unacked_index_key, tag) is not None
            assert channel.client.llen(queue.name) == 0
            got[0].ack()
            assert channel.client.hexists(channel.unacked_key, tag) is False
            assert channel.client.zscore(channel.unacked_index_key, tag) is None


def test_a_message_whose_reply_is_lost_comes_back_when_its_lease_lapses(redis_server):
    """The broker restart of tests/test_reliability.py in small: the pop happened, the
    worker never saw the message. Recorded in the same step, a sweep restores it."""
    queue = _queue()
    options = {"visibility_timeout": 1, "unacked_restore_throttle": 1}
    with Connection(redis_server, transport=RedisTransport, transport_options=options) as conn:
        conn.Producer().publish("lost reply", routing_key=queue.name, declare=[queue])
        channel = conn.channel()
        channel.basic_consume(queue.name, False, lambda message: None, consumer_tag="t")
        fetch = redis_consumer_channel(channel)
        taken = fetch.take()  # popped and recorded; the reply goes nowhere
        assert taken is not None and channel.client.llen(queue.name) == 0
        time.sleep(1.2)  # past the visibility timeout, nobody renewing
        channel.qos.restore_visible(num=10)
        back = channel.basic_get(queue.name, no_ack=True)
        assert back is not None and back.payload == "lost reply" and back.delivery_info["redelivered"]


def test_the_window_bounds_what_one_poll_start_takes(redis_server):
    queue = _queue()
    got = []
    with Connection(redis_server, transport=RedisTransport) as conn:
        producer = conn.Producer()
        for n in range(3):
            producer.publish({"n": n}, routing_key=queue.name, declare=[queue])
        channel = conn.channel()
        consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)])
        channel.basic_qos(0, 2, False)
        fetch = redis_consumer_channel(channel)
        with consumer:
            _drain(conn)
            assert [m.payload["n"] for m in got] == [0, 1]  # in order, two in hand
            assert not channel._in_poll  # nothing outstanding while the window is full
            assert channel.client.llen(queue.name) == 1 and fetch.taken == 2
            got[0].ack()
            _drain(conn)
            assert [m.payload["n"] for m in got] == [0, 1, 2]


def test_an_item_that_is_not_a_kombu_envelope_is_left_for_kombus_read(redis_server):
    queue = _queue()
    with Connection(redis_server, transport=RedisTransport) as conn:
        channel = conn.channel()
        channel.basic_consume(queue.name, False, lambda message: None, consumer_tag="t")
        channel.client.lpush(queue.name, b"not json")
        assert redis_consumer_channel(channel).take() is None
        assert channel.client.lrange(queue.name, 0, -1) == [b"not json"]
        assert channel.client.hlen(channel.unacked_key) == 0




def _held(conn, queue):
    got = []
    conn.Producer().publish("held", routing_key=queue.name, declare=[queue])
    channel = conn.default_channel  # the channel Celery's task consumer uses
    consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)])
    channel.basic_qos(0, 1, False)
    consumer.consume()
    return channel, got


def _collected(conn, channel) -> None:
    """The state Celery 5.7 leaves on a lost connection: `on_connection_error_after_connected`
    runs `connection.collect()`, which drops the transport's link to the connection
    (kombu/connection.py `_do_close_transport`) even when closing the channel failed on
    the dead socket; then `connection.close()` closes the channel again."""
    channel._disconnect_pools()  # the failed first close got this far
    conn._do_close_transport()


def test_kombu_alone_cannot_give_back_through_a_collected_connection(redis_server):
    """The vendor fact the detached settling answers: kombu's Redis QoS gives back what
    it holds through the channel's pool, rebuilt from the connection the transport no
    longer knows (kombu/transport/redis.py `_connparams`: `conninfo.hostname`); the
    AttributeError ended a worker on every Redis restart (tests/test_reliability.py)."""
    conn = Connection(redis_server)
    channel, got = _held(conn, _queue())
    _drain(conn)
    assert len(got) == 1
    _collected(conn, channel)
    with pytest.raises(AttributeError, match="hostname"):
        channel.close()


def test_a_channel_whose_connection_is_gone_leaves_its_deliveries_to_their_lease(redis_server):
    queue = _queue()
    conn = Connection(redis_server, transport=RedisTransport)
    channel, got = _held(conn, queue)
    installed = redis_consumer_channel(channel)
    _drain(conn)
    assert len(got) == 1 and installed.taken == 1
    tag = got[0].delivery_tag
    _collected(conn, channel)
    got[0].ack()  # a batch finishing after the loss: settled here, raises nothing
    channel.close()  # gives back nothing, raises nothing
    assert installed.left_held == 1 and not channel.qos._delivered
    with Connection(redis_server, transport=RedisTransport) as fresh:
        client = fresh.default_channel.client
        # Still held in the broker, where the lease sweep finds it once it lapses.
        assert client.hexists("unacked", tag) and client.zscore("unacked_index", tag) is not None
        assert client.llen(queue.name) == 0


def test_an_ack_after_the_channel_closed_and_gave_back_is_settled_here(redis_server):
    """A batch finishing after a reconnect whose close gave back what it held: the
    given-back copy is the broker's; the late ack must not end the worker."""
    queue = _queue()
    conn = Connection(redis_server, transport=RedisTransport)
    channel, got = _held(conn, queue)
    installed = redis_consumer_channel(channel)
    _drain(conn)
    conn.close()  # the broker was back in time: kombu gives the delivery back
    got[0].ack()
    assert installed.left_held == 1
    with Connection(redis_server, transport=RedisTransport) as fresh:
        assert fresh.default_channel.client.llen(queue.name) == 1


# -- through kombu's extension points, not patched objects (issue 62) ---------------------------


def _shadowing(obj) -> set[str]:
    """Instance attributes that hide a method (or other callable) of the object's class:
    what replacing a method on a live object leaves behind."""
    return {name for name in vars(obj) if callable(getattr(type(obj), name, None))}


def test_the_workers_redis_channel_is_set_up_without_patching_a_kombu_or_redis_object(redis_server):
    """The consumer channel as the worker sets it up (make_celery's connection, the fetch,
    the settling and the guard): no kombu or redis-py object carries an instance attribute
    over its class's method, and redis-py's BRPOP reply callback is its own."""
    from redis import Redis

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.redis import KOMBU_TRANSPORTS

    queue = _queue()
    broker = RedisBroker()
    got = []
    with make_celery(redis_server).connection_for_read() as conn:
        # Celery's broker_transport: the class by its path; the URL's host, port and db kept.
        assert conn.transport_cls == KOMBU_TRANSPORTS["redis"] and isinstance(conn.transport, RedisTransport)
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
        channel = conn.channel()
        consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)])
        channel.basic_qos(0, 1, False)
        served = broker.consumer_channel(channel, closed=lambda held: held.restore())
        broker.guard_deliveries(channel, lambda queue, item, reason: None)
        with consumer:
            _drain(conn)
            assert [m.payload for m in got] == [{"n": 1}] and served.taken == 1
            assert broker.answer(got[0]) is not None
            objects = {"connection": conn, "transport": conn.transport, "poller": conn.transport.cycle,
                       "channel": channel, "qos": channel.qos, "client": channel.client, "pool": channel.pool,
                       "async pool": channel.async_pool, "message": got[0]}
            assert {name: _shadowing(obj) for name, obj in objects.items() if _shadowing(obj)} == {}
            assert channel.client.response_callbacks["BRPOP"] is Redis().response_callbacks["BRPOP"]
            got[0].ack()
    from kombu.transport import TRANSPORT_ALIASES
    assert not set(KOMBU_TRANSPORTS.values()) & set(TRANSPORT_ALIASES.values())  # no alias added


def test_the_patching_checks_can_fail(redis_server):
    """What the old broker did (a QoS method, `_brpop_start` and the BRPOP reply callback
    replaced on kombu's live objects) is what the check above finds."""
    from redis import Redis

    with Connection(redis_server) as conn:
        channel = conn.channel()
        channel.qos.ack = lambda tag: None
        channel._brpop_start = lambda timeout=None: None
        channel.client.set_response_callback("BRPOP", lambda response, **options: response)
        assert _shadowing(channel.qos) == {"ack"} and _shadowing(channel) == {"_brpop_start"}
        assert channel.client.response_callbacks["BRPOP"] is not Redis().response_callbacks["BRPOP"]


def test_the_broker_module_assigns_attributes_only_on_its_own_objects():
    """Over the module's source: every attribute it assigns is one of `self`'s (its own
    classes' instances), and it calls no setattr or redis-py response-callback setter."""
    import ast
    import inspect

    import diffq.core.brokers.redis as module

    def foreign_writes(source: str) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(source)):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                                and target.value.id == "self"):
                    found.append(f"line {target.lineno}: {ast.unparse(target)} =")
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in ("setattr", "set_response_callback"):
                    found.append(f"line {node.lineno}: {name}(…)")
        return found

    assert foreign_writes(inspect.getsource(module)) == []
    assert foreign_writes("def install(qos, f):\n    qos.ack = f\n")
    assert foreign_writes("def install(channel, f):\n    channel.qos.ack, channel.x = f, 1\n")
    assert foreign_writes("def install(client, f):\n    client.set_response_callback('BRPOP', f)\n")


def test_a_bare_rediss_url_keeps_kombus_tls_default(make_redis_server):
    """kombu gives a rediss:// URL without ssl options TLS without certificate checks
    only when the scheme names its transport (kombu/connection.py `_init_params`); handed
    diffq's class, the rediss channel keeps that default (and a URL's own options win)."""
    from diffq.core.brokers.app import make_celery

    server = make_redis_server(tls=True)
    bare = server.url.split("?", 1)[0]
    for url in (bare, server.url):
        with make_celery(url).connection_for_write() as conn:
            assert conn.default_channel.client.ping()
