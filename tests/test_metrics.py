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


def test_a_long_lived_worker_lets_idle_sets_go_and_labels_later_ones(port):
    """A worker serves run after run (issue 64): a set idle past SET_LABEL_IDLE_S gives
    its label and its series up for a later set; a set still in use is never dropped;
    never more than the cap at once; a set that comes back starts again at 0."""
    now = [0.0]
    labels = metrics._SetLabels(clock=lambda: now[0])
    idle, most = metrics.SET_LABEL_IDLE_S, metrics.MAX_SET_LABELS

    def ours() -> set[str]:  # the per-set series exported in both counters, of this test's digests
        images, failures = ({s.labels["adapter_set"] for family in counter.collect() for s in family.samples
                             if s.name.endswith("_total") and s.labels["adapter_set"].startswith("L")}
                            for counter in (metrics.SET_IMAGES, metrics.SET_FAILURES))
        assert images == failures
        assert len(images) <= most
        return images

    # Run 1: a set used throughout ("Lkeep") and 31 more fill the cap; the 33rd counts as other.
    first = [f"Lr1-{i}" for i in range(most - 1)]
    assert [labels(d) for d in ["Lkeep", *first]] == ["Lkeep", *first]
    assert labels("Lr1-late") == metrics.OTHER_SET
    metrics.SET_IMAGES.labels(labels(first[0])).inc(5)
    assert ours() == {"Lkeep", *first}
    # Run 1 ends; only Lkeep stays in use, through its last-used time staying recent.
    now[0] += idle / 2
    assert labels("Lkeep") == "Lkeep"
    now[0] += idle / 2 + 1
    # Run 2's sets, one after another, each for ten minutes: each gets its own label.
    second = [f"Lr2-{i}" for i in range(3 * most)]
    for digest in second:
        assert labels(digest) == digest and labels("Lkeep") == "Lkeep"
        assert digest in ours() and "Lkeep" in ours()
        now[0] += 600
    # The idle sets of run 1 are gone from both counters; the recent ones of run 2 held.
    held = ours()
    assert not held & set(first) and "Lkeep" in held
    assert set(second[-int(idle // 600):]) <= held and second[0] not in held
    # A set of run 1 comes back: its own label again, its series from 0 (a counter reset).
    assert labels(first[0]) == first[0]
    assert metrics.SET_IMAGES.labels(first[0])._value.get() == 0
    assert first[0] in scrape_sets(port)


def test_a_set_label_is_held_past_what_its_alert_reads():
    """A label let go while DiffqAdapterSetFailing still looked back over its window would
    hide a failing set; the idle time is twice the default window + wait, at least an hour."""
    from diffq.app.monitoring import Thresholds

    defaults = Thresholds()
    assert metrics.SET_LABEL_IDLE_S >= max(3600, 2 * 60 * (defaults.failure_window_minutes
                                                           + defaults.failure_for_minutes))


def scrape_sets(port: int) -> set[str]:
    return {dict(labels)["adapter_set"] for name, labels in scrape(port) if name == "diffq_adapter_set_images_total"}


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
