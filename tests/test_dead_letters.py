"""Messages on a diffq queue that diffq did not write: hand-made kombu envelopes
pushed with redis-py's LPUSH onto a queue a real worker consumes. Each is refused
once, without a retry, moved to `diffq.dead` with its queue and reason, and the
worker goes on (then finishes a real run on the same queue).

The envelope is kombu's Redis message format (kombu/transport/virtual/base.py
`Channel.prepare_message`, body base64 per `body_encoding`) carrying Celery's
protocol 2 headers (celery/app/amqp.py `as_task_v2`)."""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid

import pytest
import redis

from diffq.app.queues import queue_report
from diffq.core.storage import open_storage
from diffq.core.contract import MAX_MESSAGE_BYTES, MAX_PROMPT_CHARS, BatchMessage
from diffq.core.brokers.base import DEAD_LETTERS
from diffq.producer.submit import submit
from tests.helpers import start_workers, wait_until

TASK = "diffq.generate_batch"


def envelope(queue: str, body: bytes, content_type: str = "application/json", task: str | None = TASK) -> str:
    task_id = uuid.uuid4().hex
    headers = {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "parent_id": None, "retries": 0,
               "eta": None, "expires": None, "group": None, "shadow": None, "timelimit": [None, None],
               "argsrepr": "", "kwargsrepr": "", "ignore_result": False} if task else {}
    return json.dumps({
        "body": base64.b64encode(body).decode(), "content-encoding": "utf-8", "content-type": content_type,
        "headers": headers,
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2, "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "body_encoding": "base64",
                       "delivery_tag": str(uuid.uuid4())}})


def task_body(batch: dict) -> bytes:
    return json.dumps([[], {"batch": batch}, {"callbacks": None, "errbacks": None, "chain": None,
                                               "chord": None}]).encode()


def big_but_valid_batch(queue_shape: dict) -> dict:
    """Schema-valid, over the size cap: only the size check refuses it."""
    items = [{"id": f"big-{i}", "prompt": "x" * MAX_PROMPT_CHARS, "seed": i} for i in range(20)]
    return {"run_id": "other", "out": "/nowhere", "batch_id": "big", "shape": {**queue_shape, "batch_size": 20},
            "params": {"num_inference_steps": 1, "guidance_scale": 1.0}, "items": items}


def bad_messages(queue: str, shape: dict) -> dict[str, tuple[str, str]]:
    """name -> (raw list item, a word the reason must contain)."""
    return {
        "not an envelope": ("this is not json", "not JSON"),
        "json, not an envelope": ("[1, 2]", "envelope"),
        "body not json": (envelope(queue, b"\x80{not json"), "not decodable"),
        "pickle": (envelope(queue, b"\x80\x04K\x01.", content_type="application/x-python-serialize"), "pickle"),
        "wrong schema": (envelope(queue, task_body({"foo": 1})), "schema"),
        "wrong call": (envelope(queue, json.dumps([[1, 2], {}, {}]).encode()), "not a diffq batch call"),
        "over the cap": (envelope(queue, task_body(big_but_valid_batch(shape))), "exceeds"),
        "not a task": (envelope(queue, b'{"hello": 1}', task=None), "not a Celery task"),
        "other task": (envelope(queue, task_body({}), task="someone.else"), "unknown task"),
    }


@pytest.mark.slow
def test_bad_messages_are_dead_lettered_once_and_the_worker_goes_on(make_redis_server, tiny_model, tmp_path):
    server = make_redis_server()
    client = redis.Redis.from_url(server.url)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"ok-{i}", "prompt": f"fine {i}"}) + "\n" for i in range(6)))
    # The run's queue exists before the worker starts; its batches come after the bad ones.
    out = str(tmp_path / "run")
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=2, steps=1, height=32,
                    width=32)
    [queue] = result.queues
    good = client.lrange(queue, 0, -1)
    client.delete(queue)
    _, kwargs, _ = json.loads(base64.b64decode(json.loads(good[0])["body"]))
    shape = kwargs["batch"]["shape"]
    bad = bad_messages(queue, shape)
    for item, _ in bad.values():
        client.lpush(queue, item)
    supervisor = start_workers(server.url, [queue], tiny_model, n=1)
    try:
        deadline = time.monotonic() + 180
        while client.llen(DEAD_LETTERS) < len(bad):
            assert time.monotonic() < deadline, f"{client.llen(DEAD_LETTERS)} dead letters"
            supervisor.poll()
            time.sleep(0.2)
        for item in good:  # real batches after the bad ones, on the same queue
            client.lpush(queue, item)
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=180)
        assert (st.done, st.failed) == (6, 0)
        assert supervisor.deaths == 0, "a bad message ended the worker"
    finally:
        supervisor.stop(timeout=60)
    letters = [json.loads(base64.b64decode(json.loads(raw)["body"])) for raw in client.lrange(DEAD_LETTERS, 0, -1)]
    assert len(letters) == len(bad)  # once each: no retry loop, no second letter
    assert all(letter["queue"] == queue for letter in letters)
    reasons = [letter["reason"] for letter in letters]
    for name, (_, word) in bad.items():
        assert sum(word in reason for reason in reasons) >= 1, (name, reasons)
    big = next(letter for letter in letters if "exceeds" in letter["reason"])
    assert big["body_bytes"] > MAX_MESSAGE_BYTES and big["truncated"] and len(big["body"]) < MAX_MESSAGE_BYTES
    assert client.llen(queue) == 0 and client.hlen("unacked") == 0
    assert not list(open_storage(out).list("failures/"))
    report = {info.queue: info.depth for info in queue_report(server.url, timeout=0)}
    assert report[DEAD_LETTERS] == len(bad)


def test_a_dead_letter_is_logged_once_with_queue_and_reason(make_redis_server, caplog):
    from diffq.core.brokers.app import make_celery
    from diffq.worker.delivery.dead_letters import DeadLetters

    server = make_redis_server()
    dead = DeadLetters(make_celery(server.url), "w@h")
    with caplog.at_level(logging.WARNING, logger="diffq.worker"):
        dead.send("diffq.q", "not JSON", b"\xff\xfe")
    [record] = [r for r in caplog.records if r.name == "diffq.worker"]
    assert "diffq.q" in record.getMessage() and "not JSON" in record.getMessage()
    [raw] = redis.Redis.from_url(server.url).lrange(DEAD_LETTERS, 0, -1)
    letter = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert letter["body_encoding"] == "base64" and base64.b64decode(letter["body"]) == b"\xff\xfe"


def test_a_parsed_payload_is_held_to_the_size_cap():
    """A dict payload (the broker client already parsed it) used to skip the check."""
    batch = big_but_valid_batch({"model": "m", "height": 32, "width": 32, "batch_size": 20,
                                 "max_sequence_length": 64, "cfg": False, "dtype": "float32"})
    with pytest.raises(ValueError, match="exceeds"):
        BatchMessage.from_json_payload(batch)
    batch["items"] = batch["items"][:2]
    assert len(BatchMessage.from_json_payload(batch).items) == 2
