"""What happens to a delivery, decided in one place (worker/delivery/outcomes.py), tested without
a broker: a stub delivery, a stub sink and a stub task drive the real batch line and the
real task body through every outcome (stored, store failed, redelivered, cancelled,
retried, split, failed, dead-lettered, handed back), the hooks ending batches among them
(each hook on its own: tests/test_hooks.py)."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from diffq.core import layout
from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.records import CancelMarker
from diffq.core.storage import open_storage
from diffq.worker.delivery.batches import BatchLine
from diffq.worker.delivery.outcomes import DECISIONS, Action, Outcome, decide


class StubDelivery:
    def __init__(self, id: str = "task-1"):
        self.id = id
        self.calls: list[str] = []

    def ack_now(self) -> None:
        self.calls.append("ack")

    def requeue(self) -> None:
        self.calls.append("requeue")

    def reject(self, requeue: bool) -> None:
        self.calls.append("reject" if not requeue else "requeue")

    def let_lapse(self) -> None:
        self.calls.append("let lapse")


class StubWindow:
    def __init__(self):
        self.extra = 0

    def widen(self) -> None:
        self.extra += 1

    def narrow(self) -> None:
        self.extra -= 1


class StubSink:
    """Hands back futures the test completes, as the sink helper would."""

    def __init__(self):
        self.stored: list[Future] = []
        self.credited: list[Future] = []
        self.submitted: list[tuple] = []

    def submit(self, storage, message, images, record):
        handed = SimpleNamespace(stored=Future(), credited=Future())
        self.stored.append(handed.stored)
        self.credited.append(handed.credited)
        self.submitted.append((message.batch_id, len(images), record))
        return handed

    def credit(self, storage, message):
        future: Future = Future()
        self.credited.append(future)
        return future


def line_with_window() -> tuple[BatchLine, StubWindow]:
    line = BatchLine(StubSink())
    line.window = StubWindow()
    return line, line.window


def test_every_outcome_has_one_decision():
    assert set(DECISIONS) == set(Outcome)
    assert {decide(o) for o in Outcome} == set(Action)
    # Only a sink's future can hold an ack; only a failed store or a hand-back requeues,
    # and the broker-side ends that give a delivery back unharmed (issue 49: a closing
    # channel's restore, a peeked dead letter, a batch lost with its embedded worker).
    assert {o for o in Outcome if decide(o) is Action.ACK_WHEN_STORED} == {Outcome.GENERATED, Outcome.ALREADY_STORED}
    assert {o for o in Outcome if decide(o) is Action.REQUEUE} == {
        Outcome.STORE_FAILED, Outcome.HAND_BACK, Outcome.DRAINED,
        Outcome.CHANNEL_CLOSED, Outcome.PEEKED, Outcome.LOST_WITH_WORKER}


@pytest.mark.parametrize("outcome", [o for o in Outcome if decide(o) is not Action.ACK_WHEN_STORED])
def test_outcomes_without_sink_work_are_settled_at_once(outcome):
    line, window = line_with_window()
    delivery = StubDelivery()
    line.report(delivery.id, outcome)
    line.ack(delivery)
    assert delivery.calls == [decide(outcome).value]  # each stub call is named as its action
    assert window.extra == 0 and line.settle(wait=True) == 0


def test_an_unreported_delivery_is_acked_as_celery_would():
    line, _ = line_with_window()
    delivery = StubDelivery()
    line.ack(delivery)
    assert delivery.calls == ["ack"]


@pytest.mark.parametrize("stored_ok, expected", [(True, "ack"), (False, "requeue")])
def test_a_generated_batch_is_acked_only_once_stored(stored_ok, expected):
    line, window = line_with_window()
    future: Future = Future()
    delivery = StubDelivery()
    line.report(delivery.id, Outcome.GENERATED, future)
    assert line.expected(delivery.id) is future
    line.ack(delivery)
    # Held: nothing on the broker yet, and one more delivery may come in meanwhile.
    assert delivery.calls == [] and window.extra == 1
    assert line.settle() == 0 and delivery.calls == []
    if stored_ok:
        future.set_result(None)
    else:
        future.set_exception(OSError("store down"))
    assert line.settle() == 1
    assert delivery.calls == [expected] and window.extra == 0
    assert line.settle(wait=True) == 0  # settled once, never twice


def test_a_redelivered_stored_batch_is_credited_again_then_acked():
    line, _ = line_with_window()
    delivery = StubDelivery()
    line.report(delivery.id, Outcome.ALREADY_STORED, line.credit_again(storage=None, message=None))
    assert line.expected(delivery.id) is line.sink.credited[0]
    line.ack(delivery)
    assert delivery.calls == []
    line.sink.credited[0].set_result(None)
    assert line.settle() == 1 and delivery.calls == ["ack"]


def test_settle_waits_for_every_held_batch_at_shutdown():
    import threading

    line, window = line_with_window()
    deliveries = [StubDelivery(f"t{i}") for i in range(3)]
    futures = [Future() for _ in deliveries]
    for delivery, future in zip(deliveries, futures):
        line.report(delivery.id, Outcome.GENERATED, future)
        line.ack(delivery)
    assert window.extra == 3
    threading.Timer(0.05, lambda: [f.set_result(None) for f in futures]).start()
    assert line.settle(wait=True) == 3
    assert [d.calls for d in deliveries] == [["ack"]] * 3 and window.extra == 0


def test_a_held_outcome_needs_its_future_and_the_others_take_none():
    line, _ = line_with_window()
    with pytest.raises(ValueError, match="needs"):
        line.report("t", Outcome.GENERATED)
    with pytest.raises(ValueError, match="takes no"):
        line.report("t", Outcome.FAILED, Future())



def test_run_ahead_widens_the_window_by_one_while_calls_are_short():
    line = BatchLine(StubSink(), run_ahead_s=2.0)
    window = StubWindow()
    rings = []
    line.attach(window, wake=lambda: rings.append(1))
    assert window.extra == -1  # from Celery's two task threads down to one batch in hand
    line.paced(0.5)
    assert window.extra == 0 and len(rings) == 1  # a second batch comes in, and at once
    line.paced(0.4)
    assert window.extra == 0  # widened once, not per short call
    line.paced(30.0)  # a compile, or a big model: no batch waits behind it
    assert window.extra == -1
    line.attach(window)  # the consumer came up again: one batch in hand until a short call
    assert window.extra == -2
    never = BatchLine(StubSink(), run_ahead_s=0.0)
    never.attach(StubWindow())
    never.paced(0.001)
    assert never.window.extra == -1


def test_once_the_consumer_stopped_a_finishing_batch_acks_itself_when_stored():
    import threading

    line, window = line_with_window()
    line.close()  # no timer settles held acks any more
    future: Future = Future()
    delivery = StubDelivery()
    line.report(delivery.id, Outcome.GENERATED, future)
    threading.Timer(0.05, future.set_result, args=(None,)).start()
    line.ack(delivery)  # waits for the store instead of leaving the ack held
    assert delivery.calls == ["ack"] and window.extra == 0


def test_at_most_two_batches_are_with_the_sink_at_once(tmp_path):
    import threading

    from diffq.worker.delivery.batches import STORES_IN_FLIGHT

    line, _ = line_with_window()
    message = BatchMessage.model_validate(batch(tmp_path))
    for _ in range(STORES_IN_FLIGHT):
        line.store(None, message, [b"px"], {})
    third = threading.Thread(target=line.store, args=(None, message, [b"px"], {}))
    third.start()
    third.join(0.2)
    assert third.is_alive() and len(line.sink.submitted) == STORES_IN_FLIGHT  # waits for the oldest
    line.sink.stored[0].set_result(SimpleNamespace(store_s=0.1, bytes=2))
    third.join(10)
    assert not third.is_alive() and len(line.sink.submitted) == STORES_IN_FLIGHT + 1


# --- the task body, through a stub task: each path reports its outcome ------------------

SHAPE = ShapeKey(model="m", height=64, width=64, batch_size=2, max_sequence_length=8, cfg=False)


class StubHost:
    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.recompiles = 0
        self.calls = 0
        self.backend = SimpleNamespace(dtype_for=lambda dtype: "float32")

    def generate(self, shape, params, items):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        from diffq.worker.device.pipeline_host import Generated

        return Generated(images=[b"px"] * len(items), generate_s=0.01, compiled=False,
                         degenerate=[None] * len(items))


class Retried(Exception):
    """What Celery's task.retry raises (its Retry), here a stub's."""


class StubTask:
    name = "diffq.generate_batch"

    def __init__(self, runtime, *, retries: int = 0, redelivered: bool = False):
        self.runtime = runtime
        self.request = SimpleNamespace(id="task-1", retries=retries,
                                       delivery_info={"redelivered": redelivered, "routing_key": SHAPE.queue})
        self.sent: list[dict] = []
        self.letters: list[dict] = []
        task = self

        class Producer:
            def publish(self, body, **kwargs):
                task.letters.append(body)

        self.app = SimpleNamespace(
            send_task=lambda name, kwargs, **options: self.sent.append(kwargs["batch"]),
            producer_or_acquire=lambda: contextlib.nullcontext(Producer()))

    def retry(self, exc, countdown, **options):
        self.retried = {"exc": exc, "countdown": countdown, **options}
        return Retried(countdown)


@pytest.fixture
def make_runtime(tmp_path):
    from diffq.worker.process.spec import ChildSpec
    from diffq.worker.process.runtime import Runtime

    def make(host: StubHost) -> Runtime:
        spec = ChildSpec(name="w", broker_url="memory://", queues=[SHAPE.queue])
        return Runtime(spec=spec, host=host, sink=StubSink())

    return make


def batch(tmp_path, n: int = 2) -> dict:
    # A worker writes only into a run folder whose manifest names the batch's run.
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "manifest.json").write_text('{"run_id": "r"}')
    return BatchMessage(run_id="r", out=str(tmp_path / "run"), batch_id="b-1", shape=SHAPE,
                        params=BatchParams(num_inference_steps=1, guidance_scale=1.0),
                        items=[BatchItem(id=f"i{k}", prompt="p", seed=k) for k in range(n)]).model_dump(mode="json")


def run_task(task, payload):
    from diffq.worker.delivery.tasks import generate_batch

    return generate_batch(task, payload)


def test_generated_batches_go_to_the_sink_and_hold_their_ack(tmp_path, make_runtime):
    rt = make_runtime(StubHost())
    task = StubTask(rt)
    assert run_task(task, batch(tmp_path)) == {"batch_id": "b-1", "items": 2}
    assert rt.line.reported("task-1") is Outcome.GENERATED
    assert rt.sink.submitted[0][:2] == ("b-1", 2) and rt.sink.submitted[0][2].dtype == "float32"


def test_not_a_batch_is_dead_lettered(tmp_path, make_runtime):
    rt = make_runtime(StubHost())
    task = StubTask(rt)
    result = run_task(task, {"not": "a batch"})
    assert "dead_letter" in result and rt.line.reported("task-1") is Outcome.DEAD_LETTER
    assert [letter["queue"] for letter in task.letters] == [SHAPE.queue] and rt.host.calls == 0


def test_a_cancelled_runs_batch_is_dropped_unseen(tmp_path, make_runtime):
    rt = make_runtime(StubHost())
    payload = batch(tmp_path)
    marker = CancelMarker(cancelled_at=0.0, by="u@h")  # as `diffq cancel` writes it
    open_storage(payload["out"]).put_bytes(layout.CANCEL, marker.model_dump_json().encode())
    assert run_task(StubTask(rt), payload)["cancelled"] == 2
    assert rt.line.reported("task-1") is Outcome.CANCELLED and rt.host.calls == 0 and not rt.sink.submitted


def test_a_redelivered_batch_already_stored_is_not_generated_again(tmp_path, make_runtime):
    rt = make_runtime(StubHost())
    payload = batch(tmp_path)
    open_storage(payload["out"]).put_bytes(layout.record_key("b-1"), b"")
    assert run_task(StubTask(rt, redelivered=True), payload)["skipped"]
    assert rt.line.reported("task-1") is Outcome.ALREADY_STORED and rt.host.calls == 0


def test_a_failing_batch_retries_then_splits_then_fails_alone(tmp_path, make_runtime):
    from diffq.core.settings import get_settings

    retries = get_settings().task_max_retries
    rt = make_runtime(StubHost(fail=RuntimeError("boom")))
    with pytest.raises(Retried):
        run_task(StubTask(rt, retries=0), batch(tmp_path))
    assert rt.line.reported("task-1") is Outcome.RETRY

    task = StubTask(rt, retries=retries)  # out of retries: halved, each half a batch of its own
    assert run_task(task, batch(tmp_path))["split"] == ["b-1.s0", "b-1.s1"]
    assert rt.line.reported("task-1") is Outcome.SPLIT
    assert [[i["id"] for i in half["items"]] for half in task.sent] == [["i0"], ["i1"]]

    alone = StubTask(rt, retries=retries)
    assert run_task(alone, batch(tmp_path, n=1))["failed"] == 1
    assert rt.line.reported("task-1") is Outcome.FAILED
    failure = json.loads(open_storage(str(tmp_path / "run")).get_bytes(layout.failure_key("b-1")))
    assert failure["item_ids"] == ["i0"] and "boom" in failure["error"] and failure["attempts"] == retries + 1


def test_a_broken_tensor_parallel_group_hands_the_batch_back(tmp_path, make_runtime, monkeypatch):
    from celery.worker import state as worker_state

    from diffq.worker.device.tensor_parallel import EXIT_GROUP_BROKEN, GroupBroken

    monkeypatch.setattr(worker_state, "should_stop", None)
    rt = make_runtime(StubHost(fail=GroupBroken("rank 1 died")))
    result = run_task(StubTask(rt), batch(tmp_path))
    assert result["handed_back"] == "rank 1 died" and rt.line.reported("task-1") is Outcome.HAND_BACK
    assert worker_state.should_stop == EXIT_GROUP_BROKEN
    delivery = StubDelivery()
    rt.line.ack(delivery)
    assert delivery.calls == ["requeue"]


# --- the hooks ending batches, through the real task body ----------------------------------


def test_a_fault_injected_batch_retries_then_splits(tmp_path, make_runtime, monkeypatch):
    from diffq.core.settings import get_settings

    monkeypatch.setenv("DIFFQ_FAULT_POISON", "p")  # every prompt of `batch` is "p"
    rt = make_runtime(StubHost())
    task = StubTask(rt)
    with pytest.raises(Retried):
        run_task(task, batch(tmp_path))
    # Reported before Celery's retry was asked for; a counted attempt (Celery's own limit).
    assert rt.line.reported("task-1") is Outcome.RETRY and "max_retries" not in task.retried
    assert "PoisonedPrompt" in type(task.retried["exc"]).__name__ and rt.host.calls == 0
    out_of_retries = StubTask(rt, retries=get_settings().task_max_retries)
    assert run_task(out_of_retries, batch(tmp_path))["split"] == ["b-1.s0", "b-1.s1"]
    assert rt.line.reported("task-1") is Outcome.SPLIT and rt.host.calls == 0


def test_a_permanent_error_fails_at_once_and_refused_items_are_split_off(tmp_path, make_runtime):
    from diffq.worker.device.pipeline_host import FamilyUnsupported

    rt = make_runtime(StubHost(fail=FamilyUnsupported("no such family")))
    assert run_task(StubTask(rt), batch(tmp_path))["failed"] == 2  # first attempt, no retry
    assert rt.line.reported("task-1") is Outcome.FAILED

    refused = RuntimeError("family refuses i1")
    refused.item_ids = ["i1"]
    rt = make_runtime(StubHost(fail=refused))
    task = StubTask(rt, retries=99)
    assert run_task(task, batch(tmp_path))["split"] == ["b-1.s0", "b-1.s1"]
    assert [[i["id"] for i in half["items"]] for half in task.sent] == [["i0"], ["i1"]]


class Flaky:
    """A run folder whose reads of `key` (or every write) raise, as a store that is down."""

    def __init__(self, storage, key: str | None):
        self.storage, self.key = storage, key

    def exists(self, key):
        if key == self.key:
            raise OSError("store down")
        return self.storage.exists(key)

    def get_bytes(self, key):
        if key == self.key:
            raise OSError("store down")
        return self.storage.get_bytes(key)

    def put_bytes(self, key, data, **options):
        raise OSError("store down")

    @property
    def url(self):
        return self.storage.url


@pytest.mark.parametrize("where", ["run manifest", "cancel marker", "redelivery lookup", "failure record"])
def test_storage_trouble_retries_without_using_an_attempt(tmp_path, make_runtime, where):
    from diffq.core.settings import get_settings

    rt = make_runtime(StubHost(fail=RuntimeError("boom") if where == "failure record" else None))
    payload = batch(tmp_path, n=1)
    key = {"run manifest": layout.MANIFEST, "cancel marker": layout.CANCEL,
           "redelivery lookup": layout.record_key("b-1")}.get(where)
    rt.storages[payload["out"]] = Flaky(rt.storage_for(payload["out"]), key)
    task = StubTask(rt, retries=get_settings().task_max_retries, redelivered=True)
    with pytest.raises(Retried):
        run_task(task, payload)
    assert rt.line.reported("task-1") is Outcome.RETRY
    assert task.retried["max_retries"] is None and isinstance(task.retried["exc"], OSError)
    assert rt.host.calls == (1 if where == "failure record" else 0) and not rt.sink.submitted


def test_a_hook_that_ends_a_batch_stops_its_life_there(tmp_path, make_runtime):
    from diffq.worker.delivery.hooks import BatchHook

    class Skip(BatchHook):
        def before_generate(self, batch):
            return batch.end(Outcome.CANCELLED, cancelled=len(batch.message.items))

    rt = make_runtime(StubHost())
    rt.hooks = [Skip()]
    assert run_task(StubTask(rt), batch(tmp_path)) == {"batch_id": "b-1", "cancelled": 2}
    assert rt.line.reported("task-1") is Outcome.CANCELLED and rt.host.calls == 0 and not rt.sink.submitted
    delivery = StubDelivery()
    rt.line.ack(delivery)
    assert delivery.calls == ["ack"]
