"""Worker metrics over real HTTP on loopback, and the JSON log formatter."""

from __future__ import annotations

import io
import json
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffq.worker.observe import logs
from diffq.worker.observe import metrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def port() -> int:
    return metrics.start_server(0, addr="127.0.0.1")


def test_metrics_served_over_http(port):
    queue = "diffq.tiny-abc123.64x64.b4.l64.nocfg.fp32"
    before = scrape(port)
    metrics.observe_batch(queue, items=3, generate_s=0.4)
    metrics.observe_batch(queue, items=4, generate_s=0.6)
    metrics.observe_store(0.05, 12_345)
    metrics.observe_compile("64x64.b4", 12.0)
    metrics.observe_compile("128x128.b4", 20.0)
    metrics.observe_recompile("64x64.b4", 2)
    metrics.observe_failure(queue, 2)
    after = scrape(port)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("diffq_images_total", queue=queue) == 7
    assert delta("diffq_batches_total", queue=queue) == 2
    assert delta("diffq_batch_seconds_count", queue=queue) == 2
    assert delta("diffq_batch_seconds_sum", queue=queue) == pytest.approx(1.0)
    assert delta("diffq_batch_seconds_bucket", queue=queue, le="0.5") == 1
    assert delta("diffq_upload_bytes_total") == 12_345
    assert delta("diffq_upload_seconds_count") == 1
    assert delta("diffq_compiles_total", shape="64x64.b4") == 1
    assert delta("diffq_compile_seconds_sum", shape="128x128.b4") == 20.0
    assert delta("diffq_recompiles_total", shape="64x64.b4") == 2
    assert delta("diffq_failures_total", queue=queue) == 2
    assert 0 < after[("diffq_device_busy_ratio", ())] <= 1
    assert ("process_resident_memory_bytes", ()) in after


def test_busy_ratio_window():
    window = metrics.BusyWindow(window=10.0)
    window.started -= 10.0  # as if the process had run for the whole window
    window.add(4.0)
    assert window.ratio() == pytest.approx(0.4, abs=0.01)


def test_json_log_lines():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("diffq.test.jsonlogs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.info(json.dumps({"event": "batch", "run": "r1", "queue": "q", "items": 4, "generate_s": 0.2}))
    log.warning("worker %s restarted", "w0", extra={"slot": 3})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 3
    batch, restart, failure = lines
    assert batch["event"] == "batch" and batch["items"] == 4 and batch["level"] == "INFO" and "msg" not in batch
    assert restart["msg"] == "worker w0 restarted" and restart["slot"] == 3
    assert "RuntimeError: boom" in failure["exc"]


def test_children_a_process_will_use_are_exported_at_zero_before_their_first_event(port):
    """A served queue's and its shape's children, the refusal reasons and the store
    stages are scraped at 0 before anything happens, so `rate`/`increase` see the
    first event and a ratio's denominator exists for a queue that only fails."""
    from diffq.worker.delivery.dead_letters import REASONS

    queue = "diffq.tiny-def456.32x48.b2.l64.nocfg.fp32"
    shape = "32x48.b2"
    before = scrape(port)
    assert ("diffq_images_total", (("queue", queue),)) not in before
    metrics.serving(queue, shape)
    metrics.refusals(REASONS)
    after = scrape(port)
    expected = {("diffq_images_total", (("queue", queue),)), ("diffq_batches_total", (("queue", queue),)),
                ("diffq_failures_total", (("queue", queue),)), ("diffq_redeliveries_total", (("queue", queue),)),
                ("diffq_batch_seconds_count", (("queue", queue),)),
                ("diffq_compiles_total", (("shape", shape),)), ("diffq_recompiles_total", (("shape", shape),)),
                ("diffq_graph_fallbacks_total", (("shape", shape),))}
    expected |= {("diffq_degenerate_images_total", (("kind", kind), ("queue", queue))) for kind in ("flat", "nonfinite")}
    assert {key: after.get(key) for key in expected} == dict.fromkeys(expected, 0.0)
    # Process-wide children (other tests in this process may have counted on them): exported.
    everywhere = {("diffq_upload_failures_total", (("stage", stage),)) for stage in ("try", "lookup", "store")}
    everywhere |= {("diffq_dead_letters_total", (("reason", reason),)) for reason in REASONS}
    assert everywhere <= set(after)
    assert {"malformed", "unsigned", "not_a_batch"} <= set(REASONS)
    metrics.observe_recompile(shape)
    assert scrape(port)[("diffq_recompiles_total", (("shape", shape),))] == 1.0  # 0 then 1: an increase of 1


def test_adapter_set_labels_are_capped_and_the_rest_count_as_other():
    """Per-set series carry the set's short digest, at most MAX_SET_LABELS per process;
    the next sets count under `other` (issue 64)."""
    labels = metrics._SetLabels(most=3)
    assert [labels(f"d{i}") for i in range(5)] == ["d0", "d1", "d2", metrics.OTHER_SET, metrics.OTHER_SET]
    assert labels("d1") == "d1"  # a known set keeps its label
    before = metrics.SET_FAILURES.labels("d0")._value.get()
    metrics.observe_failure("q-sets", 3, None)  # no adapters: no per-set series
    assert metrics.SET_FAILURES.labels("d0")._value.get() == before


def test_a_sets_images_and_failures_are_served_by_its_digest(port, monkeypatch):
    # The cap is the process's: another test in it (the soak's) may have filled it already.
    monkeypatch.setattr(metrics, "set_label", metrics._SetLabels())
    before = scrape(port)
    metrics.observe_batch("q-sets", 4, 0.2, "5e7d1a2b")
    metrics.observe_failure("q-sets", 2, "5e7d1a2b")
    after = scrape(port)
    key = (("adapter_set", "5e7d1a2b"),)
    assert after[("diffq_adapter_set_images_total", key)] - before.get(("diffq_adapter_set_images_total", key), 0) == 4
    assert after[("diffq_adapter_set_failures_total", key)] - before.get(("diffq_adapter_set_failures_total", key),
                                                                         0) == 2
