"""No broken image stored as a good one: the worker's degenerate-image checks, the
--on-degenerate policy, exactly-once counts of a batch whose items part fail, and
what status, retry-failed, the report and the metrics say about them.

The checks on synthetic tensors; the policy through the task's own step on the real
sink (counts cross-checked against a full scan, tests/test_progress.py); the tiny
pipeline with the NaN and flat fault hooks (worker/device/faults.py) in-process; and end to
end through real worker processes (Redis) and `diffq run`.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from diffq.core import layout
from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.core.records import DEGENERATE_CHECKS, FLAT_MAX_LEVELS
from diffq.core.runfolder import iter_records, read_failures
from diffq.core.storage import open_storage
from diffq.producer.resume import retry_failed, scan, select_batches
from diffq.results.report import build_report, render_text, report, to_json
from diffq.results.status import status
from diffq.worker.observe import metrics
from diffq.worker.device.backends import BACKENDS
from diffq.worker.device.pipeline_host import Generated, PipelineHost, checked_arrays, to_arrays
from diffq.worker.sink.store import DEGENERATE_KEY, Sink
from diffq.worker.delivery.spec import DEGENERATE_POLICIES, ChildSpec
from diffq.worker.delivery.tasks import set_aside_degenerate
from tests.helpers import MEASURED, assert_run_complete, diffq, start_workers, wait_until
from tests.test_browser import browser, measure, screenshot  # noqa: F401 - `browser` is a fixture
from tests.test_progress import counts, make_plan, store
from tests.test_report import flagged_run

EVERY = frozenset(DEGENERATE_CHECKS)


# --- the checks ----------------------------------------------------------------------


def pipeline_output(layout_: str = "nchw") -> torch.Tensor:
    """Six images as the pipeline returns them (floats in [0, 1]): a real one, one NaN
    pixel, an infinite one, a flat colour, one within FLAT_MAX_LEVELS, one just past it."""
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    images[1, 0, 3, 4] = float("nan")
    images[2, 2, 0, 0] = float("inf")
    images[3] = torch.tensor([0.2, 0.5, 0.9]).view(3, 1, 1)  # flat, each channel its own level
    images[4:] = 128 / 255
    images[4, 1, 7, 7] = (128 + FLAT_MAX_LEVELS) / 255  # near-constant: still flat
    images[5, 1, 7, 7] = (128 + FLAT_MAX_LEVELS + 1) / 255  # one 8-bit level more: an image
    if layout_ == "channels_last":  # how diffusers' CPU output is laid out
        images = images.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return images


@pytest.mark.parametrize("layout_", ["nchw", "channels_last"])
def test_checks_find_non_finite_and_flat_images_and_change_no_pixel(layout_):
    images = pipeline_output(layout_)
    arrays, found = checked_arrays(images, EVERY)
    assert found == [None, "nonfinite", "nonfinite", "flat", "flat", None]
    plain = to_arrays(images)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, plain)) and arrays[0].shape == (16, 16, 3)
    # One check at a time; none at all finds nothing (--on-degenerate ignore).
    assert checked_arrays(images, frozenset({"nonfinite"}))[1] == [None, "nonfinite", "nonfinite", None, None, None]
    assert checked_arrays(images, frozenset({"flat"}))[1][3:] == ["flat", "flat", None]
    assert checked_arrays(images, frozenset(DEGENERATE_POLICIES["ignore"]))[1] == [None] * 6


def test_an_8_bit_output_is_checked_for_flatness_only():
    images = (pipeline_output()[[0, 3]].nan_to_num() * 255).round().to(torch.uint8)  # an accelerator's 8-bit batch
    assert checked_arrays(images, EVERY)[1] == [None, "flat"]


def test_the_tiny_pipeline_with_a_nan_and_a_flat_item(tiny_model, monkeypatch):
    monkeypatch.setenv("DIFFQ_FAULT_NAN", "broken")
    monkeypatch.setenv("DIFFQ_FAULT_FLAT", "plain")
    host = PipelineHost(backend=BACKENDS["cpu"], checks=frozenset(ChildSpec(
        name="w", broker_url="memory://", queues=[]).degenerate_policy))
    shape = ShapeKey(model=tiny_model, height=64, width=64, batch_size=4, max_sequence_length=16, cfg=False)
    items = [BatchItem(id=str(n), prompt=prompt, seed=n) for n, prompt in enumerate(["a fox", "a broken fox",
                                                                                     "a plain fox"])]
    generated = host.generate(shape, BatchParams(num_inference_steps=1, guidance_scale=1.0), items)
    assert generated.degenerate == [None, "nonfinite", "flat"]  # the padding item is not reported
    assert len(generated.images) == 3 and int(np.ptp(generated.images[2])) == 0
    assert int(np.ptp(generated.images[0])) > FLAT_MAX_LEVELS


# --- the policy and exactly-once counts ------------------------------------------------------


def task_with(policy: str):
    """What `set_aside_degenerate` reads of a task: the worker's spec and name."""
    spec = ChildSpec(name="w", broker_url="memory://", queues=[], on_degenerate=policy)
    return SimpleNamespace(runtime=SimpleNamespace(spec=spec, worker="w@test"))


def generated_for(message, degenerate: list) -> Generated:
    rng = np.random.default_rng(len(message.items))
    images = [rng.integers(0, 256, (message.shape.height, message.shape.width, 3), dtype=np.uint8)
              for _ in message.items]
    return Generated(images=images, generate_s=0.1, compiled=False, degenerate=degenerate)


def store_checked(sink: Sink, storage, message, degenerate: list, policy: str = "flag"):
    """The task body from generation on: the policy's step, then the sink (images, record, credit)."""
    generated = generated_for(message, degenerate)
    stored, images, flagged = set_aside_degenerate(task_with(policy), storage, message, generated, attempts=1)
    if stored is not None:
        sink.submit(storage, stored, images, {**MEASURED, **({DEGENERATE_KEY: flagged} if flagged else {})}
                    ).credited.result()
    return stored, flagged


def sample_value(name: str, labels: dict) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_nan_item_fails_alone_and_counts_stay_exact_through_retry_failed(tmp_path):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    storage = open_storage(out)
    sink = Sink()
    total = sum(len(m.items) for m in plan)
    message = plan[0]  # four items: 32-0 .. 32-3
    queue = message.shape.queue
    before = {kind: sample_value("diffq_degenerate_images_total", {"queue": queue, "kind": kind})
              for kind in DEGENERATE_CHECKS}
    stored, flagged = store_checked(sink, storage, message, [None, "nonfinite", "flat", None])
    for other in plan[1:]:
        store(sink, other)

    # The NaN item failed with its check; the rest of its batch is stored, the flat one flagged.
    assert [item.id for item in stored.items] == ["32-0", "32-2", "32-3"] and flagged == {"32-2": "flat"}
    (failure,) = read_failures(storage)
    assert failure.item_ids == ["32-1"] and failure.degenerate == {"32-1": "nonfinite"} and failure.attempts == 1
    assert failure.error == f"DegenerateImage: {DEGENERATE_CHECKS['nonfinite']}"
    assert failure.batch_id != stored.batch_id and all(b.startswith(f"{message.batch_id}.d")
                                                       for b in (failure.batch_id, stored.batch_id))
    assert not storage.exists(layout.image_key("32-1", "png"))
    records = {record.id: record for record in iter_records(storage)}
    assert "32-1" not in records and len(records) == total - 1
    assert {i: r.degenerate for i, r in records.items() if r.degenerate} == {"32-2": "flat"}
    assert counts(out)[:2] == (total - 1, 1)  # status == a full scan: done + failed == items
    assert {kind: sample_value("diffq_degenerate_images_total", {"queue": queue, "kind": kind}) - before[kind]
            for kind in DEGENERATE_CHECKS} == {"nonfinite": 1, "flat": 1}

    # A redelivered copy that comes out the same writes nothing new and counts the same.
    store_checked(Sink(), storage, message, [None, "nonfinite", "flat", None])
    assert len(list(read_failures(storage))) == 1 and counts(out)[:2] == (total - 1, 1)

    # The pipeline is fixed: retry-failed selects exactly the failed item, once.
    found = scan(storage)
    (retried,) = select_batches(storage, (found.failed - found.done).__contains__, "f")
    assert [item.id for item in retried.items] == ["32-1"]
    store_checked(sink, storage, retried, [None])
    assert counts(out)[:2] == (total, 0)
    # A late copy of the whole batch that came out whole changes nothing either.
    store(Sink(), message)
    assert counts(out)[:2] == (total, 0)


def test_policy_fail_fails_flat_images_too_and_a_batch_of_nothing_but_broken_images(tmp_path):
    out = str(tmp_path / "run")
    plan = make_plan(out)
    storage = open_storage(out)
    sink = Sink()
    stored, flagged = store_checked(sink, storage, plan[0], [None, "nonfinite", "flat", None], policy="fail")
    assert [item.id for item in stored.items] == ["32-0", "32-3"] and flagged == {}
    (failure,) = read_failures(storage)
    assert failure.degenerate == {"32-1": "nonfinite", "32-2": "flat"}
    assert failure.error == f"DegenerateImage: {DEGENERATE_CHECKS['nonfinite']}; {DEGENERATE_CHECKS['flat']}"
    # Every item broken: nothing to store, the failure record is the batch's own.
    assert store_checked(sink, storage, plan[1], ["nonfinite"] * len(plan[1].items)) == (None, {})
    assert {f.batch_id for f in read_failures(storage)} == {failure.batch_id, plan[1].batch_id}
    assert counts(out)[:2] == (2, 2 + len(plan[1].items))


def test_ignore_runs_no_check_and_flag_leaves_a_clean_batch_as_it_was(tmp_path):
    assert DEGENERATE_POLICIES["ignore"] == {}  # the host gets no check to run: no cost, nothing found
    out = str(tmp_path / "run")
    message = make_plan(out)[0]
    generated = generated_for(message, [None] * len(message.items))
    assert set_aside_degenerate(task_with("flag"), open_storage(out), message, generated, 1) == (
        message, generated.images, {})
    with pytest.raises(ValueError, match="--on-degenerate nope: choose fail, flag, ignore"):
        ChildSpec(name="w", broker_url="memory://", queues=[], on_degenerate="nope")


def test_the_policy_reaches_every_worker_of_run_resume_and_worker(tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app
    from diffq.app.options import DEFAULT_ON_DEGENERATE, DegeneratePolicy, LocalWorkers, build_devices
    from diffq.app.runner import LocalWorkers as Embedded
    from diffq.app.choices import CompileMode, Device

    local = LocalWorkers(devices=build_devices(Device("cpu"), 2), compile=CompileMode("none"), compile_cache=None,
                         offload=None, warmup=None, threads=1, allow_fallback=False,
                         on_degenerate=DegeneratePolicy("fail"))
    assert local.given() == ["--workers", "--on-degenerate"]
    specs = Embedded(**local.kwargs()).specs("memory://", {}, ["q"], ["m"], "auto")
    assert [spec.on_degenerate for spec in specs] == ["fail", "fail"]
    assert DEFAULT_ON_DEGENERATE.value == "flag" == ChildSpec(name="w", broker_url="memory://", queues=[]).on_degenerate
    result = CliRunner().invoke(app, ["worker", "--plan", "--queues", "q", "--broker", "memory://",
                                      "--on-degenerate", "ignore"])
    assert result.exit_code == 0, result.output
    assert [child["on_degenerate"] for child in json.loads(result.stdout)] == ["ignore"]


# --- end to end ----------------------------------------------------------------------


def write_prompts(path, n: int, marked: dict[int, str]):
    rows = [{"id": f"i{i:04d}", "prompt": f"{marked.get(i, '')} prompt {i}".strip(), "height": 64, "width": 64}
            for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def serve_until(out: str, broker: str, queues: list[str], model: str, predicate):
    """One real worker process on `queues` until the run's status satisfies `predicate`."""
    supervisor = start_workers(broker, queues, model, n=1)
    try:
        return wait_until(out, supervisor, predicate, timeout=180)
    finally:
        supervisor.stop(timeout=60)


@pytest.mark.slow
def test_workers_fail_a_nan_item_store_a_flat_one_flagged_and_retry_failed_redoes_the_nan_one(
        tmp_path, redis_server, tiny_model, monkeypatch):
    monkeypatch.setenv("DIFFQ_FAULT_NAN", "BROKEN")
    monkeypatch.setenv("DIFFQ_FAULT_FLAT", "PLAIN")
    prompts = write_prompts(tmp_path / "p.jsonl", 8, {2: "BROKEN", 5: "PLAIN"})
    out = str(tmp_path / "run")
    from diffq.producer.submit import submit

    queues = list(submit(prompts, out, model=tiny_model, broker_url=redis_server, batch_size=4, steps=1).queues)
    st = serve_until(out, redis_server, queues, tiny_model, lambda s: s.done + s.failed >= 8)
    assert (st.total, st.done, st.failed) == (8, 7, 1)
    storage = open_storage(out)
    (failure,) = read_failures(storage)
    assert failure.item_ids == ["i0002"] and failure.degenerate == {"i0002": "nonfinite"}
    records = {record.id: record for record in iter_records(storage)}
    assert sorted(records) == [f"i{i:04d}" for i in range(8) if i != 2]
    assert {i: r.degenerate for i, r in records.items() if r.degenerate} == {"i0005": "flat"}
    flat = Image.open(io.BytesIO(storage.get_bytes(records["i0005"].file_name)))
    assert int(np.ptp(np.asarray(flat))) == 0  # stored as it came: one colour

    # The report lists the flagged item, with its contact sheet, in text and HTML.
    built = build_report(out)
    assert [r.id for r in built.flagged] == ["i0005"] and to_json(built)["flagged"] == {
        "kinds": {"flat": 1}, "items": ["i0005"]}
    text = render_text(built)
    assert "flagged images (1 flat)" in text and "i0005" in text and "1 image stored flagged as degenerate" in text
    assert f"1 × DegenerateImage: {DEGENERATE_CHECKS['nonfinite']}" in text
    page = tmp_path / "report.html"
    report(out, html_path=page, sample_size=4)
    flagged_part = page.read_text().partition("<h2>Flagged images</h2>")[2]
    assert "1 flat: stored" in flagged_part and flagged_part.index("i0005") < flagged_part.index("<figure ")

    # The pipeline is fixed: retry-failed re-enqueues the NaN item alone, once.
    monkeypatch.delenv("DIFFQ_FAULT_NAN")
    requeued = retry_failed(out, redis_server)
    assert (requeued.items, requeued.batches) == (1, 1)
    assert (serve_until(out, redis_server, queues, tiny_model, lambda s: s.done >= 8).failed) == 0
    assert_run_complete(out, prompts, steps=1, model=tiny_model)


def test_the_flagged_sheet_in_a_browser(browser, tmp_path):  # noqa: F811 - the fixture
    out = str(tmp_path / "run")
    marked = flagged_run(out, [3, 17, 30])
    page = tmp_path / "report.html"
    report(out, html_path=page, sample_size=6)
    screenshot(browser, page, tmp_path)
    seen = measure(browser, page, tmp_path)
    assert all(image["ok"] for image in seen["images"]) and seen["problems"] == []
    assert seen["groups"] == 2 and seen["cells"] == 6 + 3  # the sample's sheet, the flagged images' sheet
    assert "Flagged images" in seen["text"] and all(item in seen["text"] for item in marked)


@pytest.mark.slow
def test_run_on_degenerate_fail_fails_the_flat_item(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("DIFFQ_FAULT_FLAT", "PLAIN")
    prompts = write_prompts(tmp_path / "p.jsonl", 3, {1: "PLAIN"})
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", tiny_model, "--out", str(out), "--batch-size", "3",
                 "--steps", "1", "--on-degenerate", "fail", "--no-progress", check=False)
    assert proc.returncode == 1 and "2/3 images, 1 failed" in proc.stdout
    st = status(str(out))
    assert (st.done, st.failed) == (2, 1)
    (failure,) = read_failures(open_storage(str(out)))
    assert failure.degenerate == {"i0001": "flat"}
