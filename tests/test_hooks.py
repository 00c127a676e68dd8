"""The hooks on a batch's life (worker/delivery/hooks.py), each on its own and in their order,
with the stub task, host and sink of tests/test_delivery.py: no broker, no servers.
The hooks ending batches through the whole task body: tests/test_delivery.py."""

from __future__ import annotations

import json

import pytest

from diffq.core import layout
from diffq.core.contract import BatchMessage
from diffq.core.settings import get_settings
from diffq.core.storage import open_storage
from diffq.worker.delivery import hooks
from diffq.worker.observe import metrics
from diffq.worker.delivery.outcomes import Outcome
from diffq.worker.device.faults import PoisonedPrompt
from diffq.worker.delivery.hooks import Batch, BatchHook, Cancel, Faults, Metrics, Retries, backoff_s, default_hooks
from diffq.worker.device.pipeline_host import FamilyUnsupported, Generated
from diffq.worker.delivery.spec import ChildSpec
from diffq.worker.delivery.runtime import Runtime
from diffq.worker.delivery.tasks import generate_batch
from tests.test_delivery import SHAPE, Retried, StubHost, StubSink, StubTask, batch


def runtime(host: StubHost | None = None) -> Runtime:
    return Runtime(spec=ChildSpec(name="w", broker_url="memory://", queues=[SHAPE.queue]),
                   host=host or StubHost(), sink=StubSink())


def a_batch(tmp_path, rt: Runtime | None = None, n: int = 2, retries: int = 0) -> Batch:
    message = BatchMessage.from_json_payload(batch(tmp_path, n))
    rt = rt or runtime()
    return Batch(StubTask(rt, retries=retries), message, rt.storage_for(message.out))


def test_the_default_hooks_and_their_order():
    # Cancel first: a cancelled run's batch meets no fault and counts in no metric.
    assert [type(hook) for hook in default_hooks()] == [Cancel, Faults, Metrics, Retries]


class Recorder(BatchHook):
    """Notes each call; ends the batch at `ends_at` when given."""

    def __init__(self, name: str, calls: list, ends_at: str | None = None):
        self.name, self.calls, self.ends_at = name, calls, ends_at

    def _step(self, step: str, batch: Batch):
        self.calls.append((step, self.name))
        return batch.end(Outcome.FAILED, failed=0) if step == self.ends_at else None

    def on_received(self, batch):
        return self._step("on_received", batch)

    def before_generate(self, batch):
        return self._step("before_generate", batch)

    def after_generate(self, batch, generated):
        assert isinstance(generated, Generated)
        return self._step("after_generate", batch)

    def on_error(self, batch, exc):
        return self._step("on_error", batch)


def run_with(tmp_path, host: StubHost, *recorders: Recorder):
    rt = runtime(host)
    rt.hooks = list(recorders)
    return rt, generate_batch(StubTask(rt), batch(tmp_path))


def test_each_step_calls_every_hook_in_order(tmp_path):
    calls: list = []
    rt, result = run_with(tmp_path, StubHost(), Recorder("a", calls), Recorder("b", calls))
    assert calls == [(step, name) for step in ("on_received", "before_generate", "after_generate")
                     for name in ("a", "b")]
    assert result["items"] == 2 and rt.line.reported("task-1") is Outcome.GENERATED


def test_a_failed_generation_goes_to_on_error_and_the_first_end_wins(tmp_path):
    calls: list = []
    rt, result = run_with(tmp_path, StubHost(fail=RuntimeError("boom")),
                          Recorder("a", calls), Recorder("b", calls, ends_at="on_error"), Recorder("c", calls))
    assert [c for c in calls if c[0] == "on_error"] == [("on_error", "a"), ("on_error", "b")]
    assert ("after_generate", "a") not in calls and result == {"batch_id": "b-1", "failed": 0}
    assert rt.line.reported("task-1") is Outcome.FAILED


def test_an_error_no_hook_ends_goes_to_celery(tmp_path):
    calls: list = []
    with pytest.raises(RuntimeError, match="boom"):
        run_with(tmp_path, StubHost(fail=RuntimeError("boom")), Recorder("a", calls))


@pytest.mark.parametrize("ends_at", ["on_received", "before_generate", "after_generate"])
def test_a_hook_ending_the_batch_stops_the_later_hooks_and_steps(tmp_path, ends_at):
    calls: list = []
    host = StubHost()
    rt, _ = run_with(tmp_path, host, Recorder("a", calls, ends_at=ends_at), Recorder("b", calls))
    assert calls[-1] == (ends_at, "a") and (ends_at, "b") not in calls
    assert host.calls == (1 if ends_at == "after_generate" else 0) and not rt.sink.submitted


def test_cancel_drops_a_marked_runs_batch_looking_once_per_interval(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(hooks.time, "monotonic", lambda: now[0])
    hook = Cancel()
    b = a_batch(tmp_path)
    assert hook.on_received(b) is None
    open_storage(b.message.out).put_bytes(layout.CANCEL, b"{}")
    assert hook.on_received(b) is None  # the marker's last look is still fresh
    now[0] += layout.CANCEL_CHECK_S
    end = hook.on_received(b)
    assert end.outcome is Outcome.CANCELLED and end.result == {"batch_id": "b-1", "cancelled": 2}
    assert end.future is None and end.then is None


def test_faults_inert_unless_set_then_poison_raises_before_generation(tmp_path, monkeypatch):
    b = a_batch(tmp_path)
    monkeypatch.delenv("DIFFQ_FAULT_POISON", raising=False)
    monkeypatch.delenv("DIFFQ_FAULT_HOLD", raising=False)
    assert Faults().before_generate(b) is None
    monkeypatch.setenv("DIFFQ_FAULT_POISON", "no such prompt")
    assert Faults().before_generate(b) is None
    monkeypatch.setenv("DIFFQ_FAULT_POISON", "p")
    with pytest.raises(PoisonedPrompt):
        Faults().before_generate(b)


def sample(name: str, labels: dict) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_observe_a_generated_batch_its_compile_recompiles_and_fallbacks(tmp_path):
    host = StubHost()
    b = a_batch(tmp_path, runtime(host))
    names = {"diffq_batches_total": {"queue": SHAPE.queue}, "diffq_images_total": {"queue": SHAPE.queue},
             "diffq_compiles_total": {"shape": SHAPE.label}, "diffq_recompiles_total": {"shape": SHAPE.label},
             "diffq_graph_fallbacks_total": {"shape": SHAPE.label}}
    before = {name: sample(name, labels) for name, labels in names.items()}
    hook = Metrics()
    assert hook.before_generate(b) is None
    # The call compiled two graphs of a shape already served (the call's own count:
    # the other batch task may be calling meanwhile).
    generated = Generated(images=[b"px"] * 2, generate_s=0.5, compiled=True, graph_fallbacks=3, recompiled=2)
    assert hook.after_generate(b, generated) is None
    assert {name: sample(name, labels) - before[name] for name, labels in names.items()} == {
        "diffq_batches_total": 1, "diffq_images_total": 2, "diffq_compiles_total": 1,
        "diffq_recompiles_total": 2, "diffq_graph_fallbacks_total": 3}


def test_retries_retry_with_backoff_then_split_then_record_a_failure(tmp_path):
    limit = get_settings().task_max_retries
    first = a_batch(tmp_path, retries=0)
    end = Retries().on_error(first, RuntimeError("boom"))
    assert end.outcome is Outcome.RETRY and end.result is None
    assert isinstance(end.then(), Retried) and first.task.retried["countdown"] == backoff_s(0)

    last = a_batch(tmp_path, retries=limit)
    end = Retries().on_error(last, RuntimeError("boom"))
    assert end.outcome is Outcome.SPLIT and end.result["split"] == ["b-1.s0", "b-1.s1"]
    assert [len(half["items"]) for half in last.task.sent] == [1, 1]

    alone = a_batch(tmp_path, n=1, retries=limit)
    end = Retries().on_error(alone, RuntimeError("boom"))
    assert end.outcome is Outcome.FAILED and end.result == {"batch_id": "b-1", "failed": 1}
    record = json.loads(alone.storage.get_bytes(layout.failure_key("b-1")))
    assert record["attempts"] == limit + 1 and record["error"] == "RuntimeError: boom"


def test_retries_fail_a_permanent_error_at_once(tmp_path):
    b = a_batch(tmp_path, retries=0)
    end = Retries().on_error(b, FamilyUnsupported("no such family"))
    assert end.outcome is Outcome.FAILED and not b.task.sent
    assert b.storage.exists(layout.failure_key("b-1"))


def test_backoff_doubles_and_is_capped():
    base = get_settings().retry_backoff_s
    assert [backoff_s(n) for n in range(3)] == [min(hooks.MAX_BACKOFF_S, base * 2**n) for n in range(3)]
    assert backoff_s(100) == hooks.MAX_BACKOFF_S
