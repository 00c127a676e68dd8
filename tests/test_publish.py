"""The fast publish path: messages built without pydantic or as_task_v2 per message,
pushed onto Redis lists without kombu's publish, and still exactly what Celery sends
and what a Celery worker accepts. Counts are exact: every item once."""

from __future__ import annotations

import base64
import json
import threading
from collections import Counter

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from kombu import Consumer

from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import TASK_NAME
from diffq.core.brokers.embedded import embedded_broker
from diffq.core.contract import BatchItem, BatchMessage
from diffq.producer.bucketing import RunOptions, bucket
from diffq.core.brokers.base import TaskMessages
from diffq.producer.messages import BatchEncoder, EncodedBatch, batch_id
from diffq.producer.publish import CeleryPublisher
from diffq.producer.sources import InputError, Prompt
from diffq.producer.submit import submit

SIZES = ((64, 64), (128, 64), (128, 128))
# Ids chosen to be volatile in the envelope: fresh per message on both paths.
VOLATILE_HEADERS = {"id", "root_id"}
VOLATILE_PROPERTIES = {"correlation_id", "delivery_tag"}


def prompts(n: int, steps: int = 4):
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        yield Prompt(i + 1, f"id-{i}", f"prompt {i} é ✓ \"q\"", h, w, None if i % 2 else i, steps,
                     1.0 if i % 5 else 3.5)


def encoded(n: int, run_id: str = "run1", out: str = "/tmp/out") -> list[EncodedBatch]:
    encoder = BatchEncoder(run_id, out)
    return [encoder.encode(batch) for batch in bucket(prompts(n), RunOptions(model="m", batch_size=4), "seed")]


def test_encoded_batches_equal_the_pydantic_messages():
    options = RunOptions(model="m", batch_size=4)
    encoder = BatchEncoder("run1", "/tmp/out")
    batches = list(bucket(prompts(50), options, "seed"))
    assert len(batches) > 10
    for batch in batches:
        fast = encoder.encode(batch)
        slow = BatchMessage(run_id="run1", out="/tmp/out", batch_id=batch_id(batch.shape, batch.index),
                            shape=batch.shape, params=batch.params,
                            items=[BatchItem(id=i.id, prompt=i.prompt, seed=i.seed) for i in batch.items])
        assert BatchMessage.from_json_payload(fast.json) == slow
        assert fast == EncodedBatch.of(slow)._replace(json=fast.json)


def test_a_bad_run_id_is_caught_before_anything_is_published():
    encoder = BatchEncoder("not a valid run id!", "/tmp/out")
    batch = next(iter(bucket(prompts(4), RunOptions(model="m", batch_size=4), "seed")))
    with pytest.raises(ValueError, match="run_id"):
        encoder.encode(batch)


def test_task_message_is_what_as_task_v2_builds():
    app = make_celery("redis://127.0.0.1:1/0")
    message = encoded(4)[0]
    task_id = "0123456789abcdef0123456789abcdef"
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, TASK_NAME, args=(), kwargs={"batch": json.loads(message.json)},
        argsrepr="", kwargsrepr=f"{message.run_id}/{message.batch_id}")
    template = TaskMessages(app)
    assert template.headers(message, task_id) == headers
    assert template.properties(task_id) == properties
    assert json.loads(template.body(message)) == json.loads(json.dumps(body))


def envelopes(client: redis.Redis, key: str) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


def test_redis_envelope_is_what_kombu_stores(make_redis_server):
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    message = encoded(4)[0]
    # kombu's own path, as diffq published before: as_task_v2 + Producer.publish.
    app = make_celery(server.url)
    headers, properties, body, _ = app.amqp.as_task_v2(
        "0123456789abcdef0123456789abcdef", TASK_NAME, args=(), kwargs={"batch": json.loads(message.json)},
        argsrepr="", kwargsrepr=f"{message.run_id}/{message.batch_id}")
    with app.connection_for_write() as connection:
        producer = connection.Producer(serializer="json")
        producer.publish(body, exchange="", routing_key=message.queue, headers=headers, serializer="json",
                         declare=[app.amqp.queues[message.queue]], **properties)
    publisher = CeleryPublisher(server.url)
    publisher.publish_encoded(message)
    publisher.close()

    kombu_made, ours = envelopes(client, message.queue)[::-1]  # LPUSH: newest first
    assert ours.keys() == kombu_made.keys()
    assert json.loads(base64.b64decode(ours["body"])) == json.loads(base64.b64decode(kombu_made["body"]))
    for field in ("content-encoding", "content-type"):
        assert ours[field] == kombu_made[field]
    assert ours["headers"].keys() == kombu_made["headers"].keys()
    for key, value in ours["headers"].items():
        assert key in VOLATILE_HEADERS or value == kombu_made["headers"][key], key
    assert ours["properties"].keys() == kombu_made["properties"].keys()
    for key, value in ours["properties"].items():
        assert key in VOLATILE_PROPERTIES or value == kombu_made["properties"][key], key
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
    assert ours["properties"]["delivery_tag"] != kombu_made["properties"]["delivery_tag"]
    # The queue is declared as kombu declares it (the binding kombu's routing reads).
    assert client.exists(f"_kombu.binding.{message.queue}")


def drain(broker_url: str, queues: list[str], expected: int,
          transport_options: dict | None = None) -> list[tuple[dict, dict]]:
    """`expected` messages from `queues`, decoded by kombu as a Celery worker decodes them."""
    app = make_celery(broker_url, transport_options)
    received: list[tuple[dict, dict]] = []

    def on_message(body, message):
        received.append((message.headers, body))
        message.ack()

    with app.connection_for_read() as connection:
        consumer = Consumer(connection, [app.amqp.queues[q] for q in queues], callbacks=[on_message],
                            accept=["json"])
        with consumer:
            while len(received) < expected:
                connection.drain_events(timeout=30)  # a deadline, not a pause: all are queued
    return received


def check_received(received: list[tuple[dict, dict]], sent: list[EncodedBatch]) -> None:
    assert len(received) == len(sent)
    assert len({headers["id"] for headers, _ in received}) == len(sent)
    items: Counter = Counter()
    for headers, (args, kwargs, embed) in received:
        assert headers["task"] == TASK_NAME and args == [] and embed["chain"] is None
        message = BatchMessage.from_json_payload(kwargs["batch"])
        assert headers["kwargsrepr"] == f"{message.run_id}/{message.batch_id}"
        items.update(item.id for item in message.items)
    assert items == Counter(item["id"] for m in sent for item in json.loads(m.json)["items"])
    assert set(items.values()) == {1}


@pytest.mark.parametrize("transport_options", [None, {"global_keyprefix": "pfx:"}])
def test_redis_messages_are_consumed_exactly_once(make_redis_server, transport_options):
    server = make_redis_server()
    sent = encoded(3001)
    publisher = CeleryPublisher(server.url, transport_options, batch_size=100)  # many pipeline flushes
    for message in sent:
        publisher.publish_encoded(message)
    publisher.close()
    client = redis.Redis.from_url(server.url)
    prefix = (transport_options or {}).get("global_keyprefix", "")
    queues = sorted({m.queue for m in sent})
    assert sum(client.llen(prefix + q) for q in queues) == len(sent)
    check_received(drain(server.url, queues, len(sent), transport_options), sent)
    assert sum(client.llen(prefix + q) for q in queues) == 0


def test_filesystem_broker_publishes_through_kombu(tmp_path):
    broker_url, options = embedded_broker(tmp_path / "broker")
    sent = encoded(40)
    publisher = CeleryPublisher(broker_url, options)
    for message in sent:
        publisher.publish_encoded(message)
    publisher.close()
    check_received(drain(broker_url, sorted({m.queue for m in sent}), len(sent), options), sent)
    assert not list((tmp_path / "broker" / "queue").glob("*.msg"))


def test_a_celery_worker_runs_every_pushed_task(make_redis_server):
    server = make_redis_server()
    app = make_celery(server.url)
    sent = encoded(100)
    done: list[str] = []
    all_done = threading.Event()

    @app.task(name=TASK_NAME, bind=True)
    def generate_batch(task, batch: dict) -> None:
        done.append(BatchMessage.from_json_payload(batch).batch_id)
        if len(done) == len(sent):
            all_done.set()

    app.conf.task_queues = None
    queues = sorted({m.queue for m in sent})
    publisher = CeleryPublisher(server.url)
    for message in sent:
        publisher.publish_encoded(message)
    publisher.close()
    with start_worker(app, pool="solo", perform_ping_check=False, queues=queues, loglevel="WARNING",
                      shutdown_timeout=30):
        assert all_done.wait(timeout=60), f"{len(done)} of {len(sent)} tasks ran"
    assert Counter(done) == Counter(m.batch_id for m in sent)


def test_bad_last_row_leaves_redis_and_out_empty(make_redis_server, tmp_path):
    server = make_redis_server()
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(9000))
                    + '{"prompt": "bad", "height": 7}\n')
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"p.jsonl:9001: field 'height'"):
        submit(path, str(out), model="m", broker_url=server.url)
    assert redis.Redis.from_url(server.url).dbsize() == 0 and not out.exists()


def test_submit_enqueues_every_prompt_once_and_plan_matches(make_redis_server, tmp_path):
    from diffq.producer.submit import read_plan
    from diffq.core.storage import open_storage

    server = make_redis_server()
    path = tmp_path / "p.jsonl"
    rows = [{"id": f"x{i}", "prompt": f"p{i}", "height": SIZES[i % 3][0], "width": SIZES[i % 3][1]}
            for i in range(4999)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = submit(path, str(tmp_path / "out"), model="m", broker_url=server.url, batch_size=3)
    assert result.total == 4999 and result.batches == sum(result.queues.values())
    plan = list(read_plan(open_storage(str(tmp_path / "out"))))
    assert len(plan) == result.batches  # several plan parts of 2000 batches
    sent = [EncodedBatch.of(message) for message in plan]
    check_received(drain(server.url, sorted(result.queues), len(sent)), sent)
    assert sum(redis.Redis.from_url(server.url).llen(q) for q in result.queues) == 0
    assert {item.id for m in plan for item in m.items} == {row["id"] for row in rows}


def test_an_oversized_batch_is_refused_before_anything_is_written(make_redis_server, tmp_path):
    server = make_redis_server()
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * 16_000}) + "\n" for _ in range(40)))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="over the 262,144-byte limit"):
        submit(path, str(out), model="m", broker_url=server.url, batch_size=32)
    assert redis.Redis.from_url(server.url).dbsize() == 0 and not out.exists()


def test_shape_queues_carry_nothing_the_raw_push_would_skip():
    # kombu's Redis `_put` adds PEXPIRE for x-expires queues; the raw LPUSH does not.
    queue = make_celery("redis://127.0.0.1:1/0").amqp.queues[encoded(1)[0].queue]
    assert queue.expires is None and queue.message_ttl is None and not queue.queue_arguments
