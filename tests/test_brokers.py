"""Brokers other than Redis: RabbitMQ (a private node, tests/servers.py, a private
vhost per test module) and Amazon SQS through moto's server over HTTP."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import pytest

from diffq.producer.submit import submit
from diffq.app.queues import queue_report
from tests.helpers import assert_run_complete, start_workers, wait_until

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"


@pytest.fixture(scope="module")
def amqp_url(rabbitmq_server):
    """amqp://guest:guest@127.0.0.1:PORT/<private vhost> on the private node, deleted afterwards with its queues."""
    url = rabbitmq_server.make_vhost()
    yield url
    rabbitmq_server.api("DELETE", "vhosts/" + url.rsplit("/", 1)[1])


def run_workers(broker_url: str, queues: list[str], model: str, out: str, total: int,
                timeout: float = 180.0, **spec_fields):
    """One real worker process until every item is done or failed; returns the status."""
    supervisor = start_workers(broker_url, queues, model, n=1, **spec_fields)
    try:
        return wait_until(out, supervisor, lambda s: s.done + s.failed >= total, timeout=timeout)
    finally:
        supervisor.stop(timeout=60)


@pytest.mark.slow
def test_rabbitmq_submit_depth_and_worker(amqp_url, tiny_model, tmp_path):
    out = str(tmp_path / "run")
    result = submit(EXAMPLES, out, model=tiny_model, broker_url=amqp_url, batch_size=4, steps=2)
    queues = sorted(result.queues)
    report = {q.queue: q for q in queue_report(amqp_url, queues, timeout=0.5)}
    assert {q: report[q].depth for q in queues} == result.queues
    st = run_workers(amqp_url, queues, tiny_model, out, result.total)
    assert (st.done, st.failed) == (result.total, 0)
    assert_run_complete(out, EXAMPLES, steps=2, model=tiny_model)
    assert all(q.depth == 0 for q in queue_report(amqp_url, queues, timeout=0))


@pytest.mark.slow
def test_sqs_submit_depth_and_worker(s3_server, tiny_model, tmp_path):
    """kombu's SQS transport against moto's server (the s3_server process serves SQS too)."""
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    broker_url = f"sqs://testing:testing@127.0.0.1:{s3_server.port}"
    # A per-test prefix keeps queues apart; a short wait keeps polling responsive.
    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-",
               "wait_time_seconds": 1, "polling_interval": 0.2}
    out = str(tmp_path / "run")
    result = submit(EXAMPLES, out, model=tiny_model, broker_url=broker_url, transport_options=options,
                    batch_size=4, steps=2)
    queues = sorted(result.queues)
    report = {q.queue: q for q in queue_report(broker_url, queues, timeout=0, transport_options=options)}
    assert {q: report[q].depth for q in queues} == result.queues
    st = run_workers(broker_url, queues, tiny_model, out, result.total, transport_options=options)
    assert (st.done, st.failed) == (result.total, 0)
    assert_run_complete(out, EXAMPLES, steps=2, model=tiny_model)


def test_embedded_broker_wait_ends_when_the_worker_stops(tmp_path, monkeypatch):
    """Celery's synloop waits in drain_events(timeout=2.0) and runs one more cycle
    after a warm shutdown is flagged; the embedded transport gives up the wait as
    soon as the flag is set (exit code 0 included), and still delivers messages."""
    from celery.worker import state
    from kombu import Exchange, Queue

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.embedded import EmbeddedTransport, embedded_broker

    url, options = embedded_broker(tmp_path / "broker")
    app = make_celery(url, options)
    with app.connection_for_read() as connection:
        assert isinstance(connection.transport, EmbeddedTransport)
        queue = Queue("diffq.test", Exchange("diffq.test"), routing_key="diffq.test")
        received = []
        with connection.Consumer([queue], callbacks=[lambda body, message: (received.append(body), message.ack())]):
            connection.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="diffq.test",
                                          declare=[queue], serializer="json")
            connection.drain_events(timeout=30)
            assert received == [{"n": 1}]
            monkeypatch.setattr(state, "should_stop", 0)
            with pytest.raises(socket.timeout):
                connection.drain_events(timeout=3600)  # returns in one polling interval



def test_embedded_consumer_looks_again_when_its_worker_rings(tmp_path):
    """A worker whose window was full waits between polls; when a task thread acks or
    widens the window (`wake_consumer`), the wait ends and Celery's loop applies the
    new window before it drains again."""
    import threading

    from kombu import Exchange, Queue

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.embedded import embedded_broker, wake_consumer

    url, options = embedded_broker(tmp_path / "broker")
    app = make_celery(url, options)
    with app.connection_for_read() as connection:
        queue = Queue("diffq.test", Exchange("diffq.test"), routing_key="diffq.test")
        with connection.Consumer([queue], callbacks=[lambda body, message: message.ack()]):
            waiting = threading.Event()
            threading.Timer(0.3, lambda: (waiting.wait(), wake_consumer())).start()
            waiting.set()
            started = time.monotonic()
            with pytest.raises(socket.timeout):
                connection.drain_events(timeout=120)  # nothing queued: only the bell ends it early
            assert time.monotonic() - started < 60


def test_a_ring_before_the_drain_begins_is_not_lost(tmp_path):
    """A task thread that widens the window just after Celery's loop applied it and
    before the next drain began: the drain must end at once for the loop to apply the
    new window (a ring cleared on entry cost a whole polling interval: 100 ms stalls
    of a fast device, bench.device)."""
    from kombu import Exchange, Queue

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.embedded import embedded_broker, wake_consumer

    url, options = embedded_broker(tmp_path / "broker")
    app = make_celery(url, options)
    with app.connection_for_read() as connection:
        queue = Queue("diffq.test", Exchange("diffq.test"), routing_key="diffq.test")
        with connection.Consumer([queue], callbacks=[lambda body, message: message.ack()]):
            wake_consumer()
            started = time.monotonic()
            with pytest.raises(socket.timeout):
                connection.drain_events(timeout=30)
            assert time.monotonic() - started < 10
            started = time.monotonic()
            with pytest.raises(socket.timeout):  # the ring was taken: the next drain polls on
                connection.drain_events(timeout=0.5)
            assert time.monotonic() - started >= 0.45


def _fresh_queue():
    """A queue and exchange of a name no other test declared: kombu keeps the filesystem
    transport's bindings process-wide, so a name bound before, in another folder, is
    not bound again in this one and its messages go nowhere."""
    from kombu import Exchange, Queue

    name = f"diffq.test-{uuid.uuid4().hex[:8]}"
    return Queue(name, Exchange(name), routing_key=name)


def _consume(connection, queue, count: int) -> list:
    """`count` message bodies from `queue`, in the order the channel delivered them."""
    received = []
    with connection.Consumer([queue], callbacks=[lambda body, message: (received.append(body), message.ack())]):
        while len(received) < count:
            connection.drain_events(timeout=30)
    return received


# kombu's clock as `_put` reads it, seconds per message index; None: the real clock.
CLOCKS = {"real clock": None, "one millisecond": lambda i: 1234.5678,
          "a digit more": lambda i: 9.998 if i < 150 else 10.001}  # 9998 ms, then 10001 ms


@pytest.mark.parametrize("clock", CLOCKS)
def test_embedded_broker_delivers_in_publish_order(tmp_path, monkeypatch, clock):
    """kombu's file names (<ms>_<uuid4>) shuffled the messages one publisher wrote
    within a millisecond; the sort as text put 10001 ms before 9998 ms."""
    from kombu.transport import filesystem

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.embedded import embedded_broker

    n = 300
    app = make_celery(*embedded_broker(tmp_path / "broker"))
    now = {"i": 0}
    if CLOCKS[clock] is not None:
        monkeypatch.setattr(filesystem, "monotonic", lambda: CLOCKS[clock](now["i"]))
    with app.connection_for_write() as connection:
        queue = _fresh_queue()
        producer = connection.Producer()
        for i in range(n):
            now["i"] = i
            producer.publish({"i": i}, exchange=queue.exchange, routing_key=queue.name, declare=[queue],
                             serializer="json")
        assert [body["i"] for body in _consume(connection, queue, n)] == list(range(n))
    assert not list((tmp_path / "broker" / "queue").glob("*.msg"))


def _publish_from_child(url: str, options: dict, queue, tag: str, n: int, start) -> None:
    from diffq.core.brokers.app import make_celery

    with make_celery(url, options).connection_for_write() as connection:
        producer = connection.Producer()
        start.wait(timeout=60)
        for i in range(n):
            producer.publish({"p": tag, "i": i}, exchange=queue.exchange, routing_key=queue.name, serializer="json")


def test_two_publisher_processes_deliver_every_message_once_each_in_its_order(tmp_path, monkeypatch):
    """Two forked publishers (as the runner's publisher and a worker's republish) at
    once, into one queue: both count on from the same publish count and, here, read
    the same millisecond, so their names differ only by the uuid; every message comes
    once, each publisher's in the order it wrote them."""
    import multiprocessing

    from kombu.transport import filesystem

    from diffq.core.brokers.app import make_celery
    from diffq.core.brokers.embedded import embedded_broker

    n = 200
    url, options = embedded_broker(tmp_path / "broker")
    monkeypatch.setattr(filesystem, "monotonic", lambda: 1234.5678)
    queue = _fresh_queue()
    with make_celery(url, options).connection_for_write() as connection:
        queue(connection.default_channel).declare()
    fork = multiprocessing.get_context("fork")
    start = fork.Event()
    children = [fork.Process(target=_publish_from_child, args=(url, options, queue, tag, n, start)) for tag in "ab"]
    for child in children:
        child.start()
    start.set()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0]
    with make_celery(url, options).connection_for_write() as connection:
        received = _consume(connection, queue, 2 * n)
    assert sorted((body["p"], body["i"]) for body in received) == [(p, i) for p in "ab" for i in range(n)]
    for tag in "ab":
        assert [body["i"] for body in received if body["p"] == tag] == list(range(n))
    assert not list((tmp_path / "broker" / "queue").glob("*.msg"))


def test_an_embedded_message_is_not_taken_while_it_is_written(tmp_path, monkeypatch):
    """kombu wrote a message file under its final name: a consumer looking meanwhile
    took it and read it half written. A look while the message is being written takes
    nothing; the message then comes whole."""
    from queue import Empty

    from kombu.transport import filesystem

    from diffq.core.brokers import embedded
    from diffq.core.brokers.app import make_celery

    app = make_celery(*embedded.embedded_broker(tmp_path / "broker"))
    queue = _fresh_queue()
    looks = []
    with app.connection_for_write() as publisher, app.connection_for_write() as consumer:
        queue(consumer.default_channel).declare()

        class LookingFile:
            """A file being written whose every write first lets the consumer look."""

            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def __getattr__(self, name):
                return getattr(self.f, name)

            def write(self, data):
                try:
                    looks.append(consumer.default_channel._get(queue.name))
                except Empty:
                    looks.append(None)
                return self.f.write(data)

        def open_looking(path, mode="r", *args, **kwargs):
            f = open(path, mode, *args, **kwargs)
            return LookingFile(f) if "w" in mode else f

        for module in (embedded, filesystem):  # whichever writes the message
            monkeypatch.setattr(module, "open", open_looking, raising=False)
        publisher.Producer().publish({"whole": True}, exchange=queue.exchange, routing_key=queue.name,
                                     serializer="json")
        monkeypatch.undo()
        assert looks == [None]
        assert _consume(consumer, queue, 1) == [{"whole": True}]
    assert not list((tmp_path / "broker" / "queue").iterdir())


@pytest.mark.slow
def test_rabbitmq_consumer_carries_the_ack_timeout(rabbitmq_server, amqp_url, tiny_model, tmp_path):
    """RabbitMQ closes a channel whose delivery stays unacked past `consumer_timeout`
    (30 min by default): a long first compile would hit it. The worker consumes with
    `x-consumer-timeout` = DIFFQ_MAX_HOLD_S (read per consumer by RabbitMQ >= 3.11.15;
    older servers need the server setting, docs/RELIABILITY.md)."""
    from diffq.core.settings import Settings

    out = str(tmp_path / "run")
    result = submit(EXAMPLES, out, model=tiny_model, broker_url=amqp_url, batch_size=4, steps=2)
    queue = sorted(result.queues)[0]
    vhost = amqp_url.rsplit("/", 1)[1]
    supervisor = start_workers(amqp_url, [queue], tiny_model, n=1)

    def consumer_arguments() -> str:
        listed = rabbitmq_server.rabbitmqctl("list_consumers", "-p", vhost, "queue_name", "arguments")
        return "\n".join(line for line in listed.splitlines() if line.startswith(queue))

    try:
        deadline = time.monotonic() + 120
        while not consumer_arguments() and time.monotonic() < deadline:
            supervisor.poll()
            time.sleep(0.5)
        listed = consumer_arguments()
    finally:
        supervisor.stop(timeout=60)
    assert "x-consumer-timeout" in listed and str(Settings().max_hold_s * 1000) in listed, listed
