"""A worker writes only where its run lives, and takes only batches its producers sent
(worker/delivery/admission.py, core/signing.py): foreign batches pushed into a served queue on
Redis, RabbitMQ and SQS are dead-lettered with their reason and never generated, while
the real run completes exactly once; signatures, replays and key rotation."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import orjson
import pytest
from kombu import Connection

from diffq.app.queues import queue_report
from diffq.core.brokers.app import make_celery
from diffq.core.brokers.base import TASK_NAME
from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.signing import HEADER, Keys, canonical
from diffq.core.brokers.base import DEAD_LETTERS
from diffq.worker.delivery.admission import Admission, RunScope
from tests.test_dead_letters import task_body

SHAPE = ShapeKey(model="/models/m", height=64, width=64, batch_size=2, max_sequence_length=64, cfg=False)


def a_batch(out: str = "/runs/r1", run_id: str = "r1", shape: ShapeKey = SHAPE, **items) -> dict:
    return BatchMessage(run_id=run_id, out=out, batch_id="b-1", shape=shape,
                        params=BatchParams(num_inference_steps=1, guidance_scale=3.5),
                        items=[BatchItem(id="a", prompt="a cat — ünïcode\n", seed=2**62, **items)]
                        ).model_dump(mode="json")


# -- signatures ----------------------------------------------------------------------

def test_the_producers_bytes_are_the_canonical_form_a_worker_derives_again():
    from diffq.producer.bucketing import Batch
    from diffq.producer.messages import BatchEncoder, EncodedBatch

    batch = a_batch(metadata={"z": 1, "a": [0.1, 1e-07, 2.5e300], "é": "\u0000\t"})
    message = BatchMessage.model_validate(batch)
    encoded = BatchEncoder("r1", "/runs/r1").encode(Batch(message.shape, message.params, batch["items"], 0))
    for data in (encoded.json, EncodedBatch.of(message).json):
        # What the worker decodes (kombu's JSON) and signs again is exactly what was signed.
        from kombu.utils.json import loads

        assert canonical(loads(data.decode())) == data


def test_a_signature_binds_the_batch_its_queue_and_its_run():
    keys = Keys(b"k" * 32)
    batch = a_batch()
    signature = keys.sign_batch(SHAPE.queue, batch)
    assert keys.problem(SHAPE.queue, batch, signature) is None
    assert "unsigned" in keys.problem(SHAPE.queue, batch, None)
    assert "malformed" in keys.problem(SHAPE.queue, batch, "abc")
    assert "does not verify" in keys.problem("diffq.other-000000.64x64.b2.l64.nocfg.auto", batch, signature)
    for changed in ({**batch, "run_id": "r2"}, {**batch, "out": "/etc"},
                    {**batch, "items": [{**batch["items"][0], "prompt": "a dog"}]}):
        assert "does not verify" in keys.problem(SHAPE.queue, changed, signature)
    assert "does not hold" in keys.problem(SHAPE.queue, batch, Keys(b"w" * 32).sign_batch(SHAPE.queue, batch))


def test_rotation_accepts_the_previous_key_and_signs_with_the_current_one():
    old, new = b"old" * 11, b"new" * 11
    batch = a_batch()
    signed_before = Keys(old).sign_batch(SHAPE.queue, batch)
    rotated = Keys(new, previous=old)
    assert rotated.problem(SHAPE.queue, batch, signed_before) is None
    assert rotated.sign_batch(SHAPE.queue, batch).split(":")[1] == Keys(new).sign_batch(SHAPE.queue, batch).split(":")[1]
    assert "does not hold" in Keys(new).problem(SHAPE.queue, batch, signed_before)  # the old key dropped


def test_keys_come_from_the_settings_and_a_previous_key_alone_is_an_error(monkeypatch):
    from diffq.core.settings import Settings

    assert Keys.from_settings(Settings()) is None
    monkeypatch.setenv("DIFFQ_SIGNING_KEY", "current")
    monkeypatch.setenv("DIFFQ_SIGNING_KEY_PREVIOUS", "before")
    assert Keys.from_settings(Settings()) == Keys(b"current", b"before")
    assert "before" not in repr(Settings())  # secrets are not printed
    monkeypatch.delenv("DIFFQ_SIGNING_KEY")
    with pytest.raises(ValueError, match="without DIFFQ_SIGNING_KEY"):
        Keys.from_settings(Settings())


# -- admission -----------------------------------------------------------------------

def reason(admission: Admission, batch, queue=SHAPE.queue, signature=None) -> str | None:
    _, refusal = admission.check(batch, queue, signature)
    return refusal.reason if refusal else None


def test_a_run_scoped_worker_refuses_every_other_run_folder_and_run_id(tmp_path):
    out = tmp_path / "runs" / "r1"
    admission = Admission(runs=(RunScope.of(str(out), "r1"),))
    assert reason(admission, a_batch(str(out))) is None
    assert reason(admission, a_batch(str(tmp_path / "runs" / "r1" / ".." / "r1"))) is None  # the same folder
    for foreign in (str(tmp_path / "runs" / "r2"), "/etc", str(out / ".." / "escaped"), f"{out}-evil",
                    str(out / "sub"), "s3://another-bucket/runs/r1", "gs://bucket/r1"):
        assert "is not the run this worker serves" in reason(admission, a_batch(foreign)), foreign
    assert "run id 'r2' is not" in reason(admission, a_batch(str(out), run_id="r2"))


def test_without_a_run_the_prefixes_bound_where_a_worker_writes(tmp_path):
    admission = Admission(out_prefixes=(str(tmp_path / "runs"), "s3://bucket/runs"))
    for allowed in (str(tmp_path / "runs" / "r1"), "s3://bucket/runs/r1", "s3://bucket/runs"):
        assert reason(admission, a_batch(allowed)) is None, allowed
    for foreign in ("/etc", str(tmp_path / "runs" / ".." / "escaped"), str(tmp_path / "runs-evil" / "r1"),
                    "s3://another-bucket/runs/r1", "s3://bucket/runs-evil", "gs://bucket/runs/r1"):
        assert "outside this worker's allowed prefixes" in reason(admission, a_batch(foreign)), foreign


def test_any_out_wins_over_the_prefixes_setting(tmp_path):
    """`worker --any-out` passes no prefixes ([]): the setting no longer fills them in;
    a spec that says nothing (None) still takes DIFFQ_ALLOWED_OUT_PREFIXES."""
    from diffq.core.settings import Settings
    from diffq.worker.delivery.spec import ChildSpec

    settings = Settings(allowed_out_prefixes=[str(tmp_path / "runs")])
    spec = ChildSpec(name="w", device="cpu", broker_url="redis://127.0.0.1:1/0", queues=["q"], allowed_out_prefixes=[])
    assert Admission.of(spec, settings).out_prefixes == ()
    said = ChildSpec(name="w", device="cpu", broker_url="redis://127.0.0.1:1/0", queues=["q"])
    assert said.allowed_out_prefixes is None
    assert Admission.of(said, settings).out_prefixes == (str(tmp_path / "runs"),)


def test_a_batch_is_what_its_queue_says_and_names_a_model_the_worker_knows():
    admission = Admission(models=frozenset({"/models/m"}))
    assert reason(admission, a_batch()) is None
    for other in (SHAPE.model_copy(update={"height": 128}), SHAPE.model_copy(update={"dtype": "float32"}),
                  SHAPE.model_copy(update={"cfg": True})):
        assert "but arrived on" in reason(admission, a_batch(shape=other))
    evil = SHAPE.model_copy(update={"model": "/models/evil"})
    # Named on its own queue (a slug is a short hash: a forged one can collide), still refused.
    assert "was not told to load" in reason(admission, a_batch(shape=evil), queue=evil.queue)
    assert reason(Admission(), a_batch(shape=evil), queue=evil.queue) is None  # told nothing: warned at start
    assert Admission().warnings() and not Admission(
        runs=(RunScope(out="/r", run_id="r"),), models=frozenset({"m"}), keys=Keys(b"k"),
        adapters=("/loras",)).warnings()


def test_with_a_key_the_signature_is_checked_before_anything_else():
    keys = Keys(b"k" * 32)
    admission = Admission(keys=keys)
    batch = a_batch()
    assert reason(admission, batch, signature=keys.sign_batch(SHAPE.queue, batch)) is None
    assert "unsigned" in reason(admission, batch)
    assert "unsigned" in reason(admission, {"not": "a batch"})  # not even parsed
    assert "b-1: the queue it arrived on is unknown" in reason(admission, batch, queue=None, signature=keys.sign_batch(SHAPE.queue, batch))
    _, refusal = Admission().check({"not": "a batch"}, SHAPE.queue)
    assert refusal.malformed and "schema errors" in refusal.reason


# -- against real brokers --------------------------------------------------------------

def _celery_headers(task_id: str, signature: str | None = None) -> dict:
    headers = {"lang": "py", "task": TASK_NAME, "id": task_id, "root_id": task_id, "parent_id": None,
               "retries": 0, "eta": None, "expires": None, "group": None, "shadow": None,
               "timelimit": [None, None], "argsrepr": "", "kwargsrepr": "", "ignore_result": False}
    if signature:
        headers[HEADER] = signature
    return headers


def push(broker_url: str, queue: str, batches: list[tuple[dict, str | None]], transport_options=None) -> None:
    """Publish batch messages as any broker client could, straight onto `queue`."""
    app = make_celery(broker_url, transport_options)
    with app.connection_for_write() as connection:
        producer = connection.Producer()
        for batch, signature in batches:
            task_id = uuid.uuid4().hex
            producer.publish(task_body(batch), exchange="", routing_key=queue, content_type="application/json",
                             content_encoding="utf-8", headers=_celery_headers(task_id, signature),
                             declare=[app.amqp.queues[queue]])


def foreign_batches(real: dict, tmp_path: Path, out: str) -> dict[str, dict]:
    """Copies of a real batch aimed elsewhere, each with a batch id of its own."""
    def aimed(name: str, **changes) -> dict:
        return {**real, "batch_id": f"foreign-{name}", **changes}

    marker = f"diffq-test-{uuid.uuid4().hex[:8]}"
    return {
        "another OUT": aimed("other", out=str(tmp_path / "runs" / "other")),
        "/etc": aimed("etc", out=f"/etc/{marker}"),
        "a path with ..": aimed("dotdot", out=f"{out}/../escaped"),
        "another bucket": aimed("bucket", out="s3://another-bucket/runs/r1"),
        "another run id": aimed("runid", run_id="another-run"),
    }


def refused_batches(letters: list[dict]) -> dict[str, str]:
    """batch id -> reason, from the letters' reasons ("refused: batch ID: why")."""
    found = {}
    for letter in letters:
        match = re.match(r"refused: batch ([A-Za-z0-9_.-]+): (.*)", letter["reason"], re.S)
        assert match, letter
        found[match[1]] = match[2]
    return found


def _dead_letters(broker_url: str, queue: str, transport_options=None) -> list[dict]:
    [info] = [i for i in queue_report(broker_url, [queue], timeout=0, transport_options=transport_options,
                                      letters=50) if i.queue == DEAD_LETTERS]
    return info.letters


def _serve_and_check(broker_url: str, tiny_model: str, tmp_path: Path, *, scoped: bool, prefixes: bool,
                     transport_options=None, **spec_fields) -> None:
    from diffq.core.storage import open_storage
    from diffq.producer.submit import read_plan, submit
    from diffq.results.status import status
    from tests.helpers import start_workers, wait_until

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"ok-{i}", "prompt": f"fine {i}"}) + "\n" for i in range(4)))
    out = str(tmp_path / "runs" / "r1")
    result = submit(prompts, out, model=tiny_model, broker_url=broker_url, transport_options=transport_options,
                    batch_size=2, steps=1, height=32, width=32)
    [queue] = result.queues
    real = next(read_plan(open_storage(out))).model_dump(mode="json")
    foreign = foreign_batches(real, tmp_path, out)
    push(broker_url, queue, [(batch, None) for batch in foreign.values()], transport_options)
    if transport_options:
        spec_fields["transport_options"] = transport_options
    if scoped:
        spec_fields["runs"] = [RunScope.of(out, result.run_id)]
    if prefixes:
        spec_fields["allowed_out_prefixes"] = [str(tmp_path / "runs")]
    supervisor = start_workers(broker_url, [queue], tiny_model, n=1, **spec_fields)
    try:
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=240)
        deadline = time.monotonic() + 60
        while len(letters := _dead_letters(broker_url, queue, transport_options)) < len(foreign):
            assert time.monotonic() < deadline, letters
            time.sleep(0.2)
        assert supervisor.deaths == 0
    finally:
        supervisor.stop(timeout=60)
    # The real run: exactly once, nothing else in its folder.
    assert (st.done, st.failed) == (4, 0) and status(out).done == 4
    records = sorted(p.name for p in (Path(out) / "records").iterdir())
    assert records == sorted(f"{b.batch_id}.jsonl" for b in read_plan(open_storage(out)))
    assert len(list((Path(out) / "images").iterdir())) == 4
    # None of the foreign ones generated or stored anything, anywhere.
    for batch in foreign.values():
        if "://" not in batch["out"]:
            path = Path(batch["out"]).resolve()
            assert path == Path(out) or not path.exists(), batch["out"]
    by_batch = refused_batches(letters)
    assert set(by_batch) == {batch["batch_id"] for batch in foreign.values()}, by_batch
    for why in by_batch.values():
        assert any(words in why for words in ("not the run this worker serves", "outside this worker's allowed",
                                              "holds no diffq run", "is not the id of the run")), why


@pytest.mark.slow
@pytest.mark.parametrize("scoped,prefixes", [(True, False), (False, True), (True, True)],
                         ids=["run", "prefixes", "run+prefixes"])
def test_redis_worker_never_generates_a_foreign_batch(make_redis_server, tiny_model, tmp_path, scoped, prefixes):
    _serve_and_check(make_redis_server().url, tiny_model, tmp_path, scoped=scoped, prefixes=prefixes)


@pytest.mark.slow
@pytest.mark.parametrize("scoped,prefixes", [(True, False), (False, True)], ids=["run", "prefixes"])
def test_rabbitmq_worker_never_generates_a_foreign_batch(rabbitmq_server, rabbitmq_vhost, tiny_model, tmp_path,
                                                         scoped, prefixes):
    _serve_and_check(rabbitmq_vhost, tiny_model, tmp_path, scoped=scoped, prefixes=prefixes,
                     rabbitmq_api=rabbitmq_server.api_url)


@pytest.fixture
def sqs(s3_server):
    pytest.importorskip("pycurl", reason="kombu's SQS transport needs pycurl (pip install 'kombu[sqs]')")
    options = {"region": "us-east-1", "queue_name_prefix": f"t{uuid.uuid4().hex[:8]}-",
               "wait_time_seconds": 1, "polling_interval": 0.2}
    return f"sqs://testing:testing@127.0.0.1:{s3_server.port}", options


@pytest.mark.slow
@pytest.mark.parametrize("scoped,prefixes", [(True, False), (False, True)], ids=["run", "prefixes"])
def test_sqs_worker_never_generates_a_foreign_batch(sqs, tiny_model, tmp_path, scoped, prefixes):
    broker_url, options = sqs
    _serve_and_check(broker_url, tiny_model, tmp_path, scoped=scoped, prefixes=prefixes, transport_options=options)


@pytest.mark.slow
def test_signed_fleet_refuses_unsigned_and_wrongly_signed_batches_across_a_rotation(make_redis_server, tiny_model,
                                                                                    tmp_path, monkeypatch):
    """The producer signs with the old key; the workers rotated to a new one and keep the
    old as previous. An unsigned copy of a real batch, one signed with a stranger's key
    and a signed batch replayed into another shape's queue are dead-lettered; a poisoned
    item's retries and splits, re-published by the worker, are signed again and taken."""
    from diffq.core.storage import open_storage
    from diffq.producer.submit import read_plan, submit
    from tests.helpers import start_workers, wait_until

    server = make_redis_server()
    old, new = "old-key-" + uuid.uuid4().hex, "new-key-" + uuid.uuid4().hex
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": f"ok-{i}", "prompt": f"fine {i}"} for i in range(5)] + [{"id": "bad", "prompt": "POISON here"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = str(tmp_path / "run")
    monkeypatch.setenv("DIFFQ_SIGNING_KEY", old)
    result = submit(prompts, out, model=tiny_model, broker_url=server.url, batch_size=2, steps=1,
                    height=32, width=32)
    [queue] = result.queues
    real = next(read_plan(open_storage(out))).model_dump(mode="json")
    other = ShapeKey.model_validate({**real["shape"], "height": 64}).queue
    replayed = {**real, "batch_id": "replayed"}
    push(server.url, queue, [({**real, "batch_id": "unsigned"}, None),
                             ({**real, "batch_id": "stranger"}, Keys(b"stranger").sign_batch(queue, {
                                 **real, "batch_id": "stranger"}))])
    # Signed for its own queue, published into another served one.
    push(server.url, other, [(replayed, Keys(old.encode()).sign_batch(queue, replayed))])
    monkeypatch.setenv("DIFFQ_SIGNING_KEY", new)
    monkeypatch.setenv("DIFFQ_SIGNING_KEY_PREVIOUS", old)
    monkeypatch.setenv("DIFFQ_FAULT_POISON", "POISON")
    monkeypatch.setenv("DIFFQ_RETRY_BACKOFF_S", "0.05")  # test speed only: the retries still happen
    supervisor = start_workers(server.url, [queue, other], tiny_model, n=1, runs=[RunScope.of(out, result.run_id)])
    try:
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= result.total, timeout=240)
        deadline = time.monotonic() + 60
        while len(letters := _dead_letters(server.url, queue)) < 3:
            assert time.monotonic() < deadline, letters
            time.sleep(0.2)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed) == (5, 1)
    reasons = refused_batches(letters)
    assert set(reasons) == {"unsigned", "stranger", "replayed"}, reasons
    assert "unsigned" in reasons["unsigned"] and "does not hold" in reasons["stranger"]
    assert "does not verify" in reasons["replayed"]
    records = {p.name for p in (Path(out) / "records").iterdir()}
    assert not {name for name in records if name.split(".")[0] in {"unsigned", "stranger", "replayed"}}
