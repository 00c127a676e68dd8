"""`diffq report`: figures from the records, text, HTML with embedded plots, contact sheet,
and what happened in a run that lost a host (worker lives, lost batches, retries)."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from diffq.core import layout
from diffq.core.contract import ShapeKey
from diffq.core.progress import ProgressLog
from diffq.core.records import FailureRecord, ImageRecord, RunManifest, ShapeSummary, jsonl, parse_record
from diffq.core.storage import open_storage
from diffq.results.report import build_report, render_html, render_text, report, to_json
from tests.test_export import make_run, run_defaults

# Three sizes, the largest four times the side of the smallest: the contact sheet must
# fit each into its cell.
LOST_SHAPES = [ShapeKey(model="tiny", height=h, width=w, batch_size=8, max_sequence_length=64, cfg=False,
                        dtype="float32") for h, w in ((64, 64), (128, 64), (256, 256))]
GENERATE_S, FIRST_S, STORE_S, HAND_OVER_S = 0.5, 0.9, 0.05, 0.02
LEASE_S = 60.0


def test_figures_from_records(tmp_path):
    # 5 batches of 8: w0 runs batches 0, 2, 4 (finished at +10, +11, +12 s), w1 runs
    # 1, 3 (+10.5, +11.5); each worker's first batch generates in 0.6 s, the rest 0.3 s,
    # each call ending 0.05 s before its batch is stored.
    make_run(str(tmp_path / "run"), 40, failed_batches=1)
    r = build_report(str(tmp_path / "run"), price_per_device_hour=3.6)
    assert (r.total, r.done, r.failed) == (48, 40, 8)
    w0, w1 = r.workers
    assert (w0.worker, w0.images, w0.batches, w1.images) == ("w0@host", 24, 3, 16)
    assert (w0.writer, w0.lives, w0.label) == ("w0", 1, "w0@host")  # one progress writer: one life
    assert w0.active_s == pytest.approx(12.0 - 9.35) and w1.active_s == pytest.approx(11.5 - 9.85)
    assert w0.compile_s == pytest.approx(0.3) and w1.compile_s == pytest.approx(0.3)
    assert w0.other_s == pytest.approx(2.65 - 1.2) and w0.waited_s == 0
    assert r.device_hours == pytest.approx(4.3 / 3600)
    # price × device-hours / images × 1000
    assert r.cost_per_1000 == pytest.approx(3.6 * 4.3 / 3600 / 40 * 1000)
    assert r.wall_s == pytest.approx(2.65) and r.images_per_s == pytest.approx(40 / 2.65)
    assert [(s.label, s.done, s.total) for s in r.shapes] == [("32x32", 24, 32), ("32x48", 16, 16)]
    assert r.per_device()["cpu:1"]["images"] == 16
    assert sum(y * (x[1] - x[0]) for x, y in [(r.throughput()[0], v) for v in r.throughput()[1]]) == pytest.approx(40)
    assert r.errors == {"RuntimeError: out of memory": 1}
    assert len(r.sample) == 24 and len({s.id for s in r.sample}) == 24
    assert not r.stopped and not r.lost and not r.waits and r.planned is None

    text = render_text(r)
    assert "40/48 done, 8 failed, 0 pending" in text
    assert f"{r.cost_per_1000:.4f} per 1,000 images at 3.6 per device-hour" in text
    assert "1 × RuntimeError: out of memory" in text
    assert "No process stopped early" not in text  # a failure record is a retry to report
    assert "1 failure record (3 attempts in all)" in text
    assert to_json(r)["cost_per_1000"] == pytest.approx(r.cost_per_1000)
    assert build_report(str(tmp_path / "run")).cost_per_1000 is None


def test_rates_from_records_are_what_qualify_reports(tmp_path):
    make_run(str(tmp_path / "run"), 40)
    rates = to_json(build_report(str(tmp_path / "run")))["rates"]
    # Per shape: steady = the median later call of a life, first call = steady + the
    # median first-call excess (0.6 - 0.3).
    assert [(r["height"], r["width"], r["batch_size"], r["steps"], r["device_kind"]) for r in rates] == [
        (32, 32, 8, 2, "cpu"), (32, 48, 8, 2, "cpu")]
    # 32x32 is w0's batches 0, 2 and 4; 32x48 is w1's 1 and 3.
    assert [r["steady_s"]["calls"] for r in rates] == [2, 1]
    for rate in rates:
        assert rate["steady_s"]["median"] == pytest.approx(0.3) and rate["first_call_s"] == pytest.approx(0.6)
        assert rate["images_per_s"] == pytest.approx(8 / 0.3) and rate["dtype"] == "auto"


def test_html_page_embeds_plots_and_contact_sheet(tmp_path):
    make_run(str(tmp_path / "run"), 30)
    report(str(tmp_path / "run"), html_path=tmp_path / "r.html", contact_sheet_path=tmp_path / "sheet.png",
           price_per_device_hour=2.0, sample_size=10)
    page = (tmp_path / "r.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 4 + 10  # four plots, then the contact sheet's ten cells
    for data in images:
        Image.open(io.BytesIO(base64.b64decode(data))).verify()
    assert page.count("<figure ") == 10 and 'class="sheet"' in page
    assert "per 1,000 images at 2 per device-hour" in page and "w1@host" in page and "32x48" in page
    sheet = Image.open(tmp_path / "sheet.png")
    assert sheet.size == (8 * 112 + 7 * 8, 2 * (112 + 14) + 8)  # two rows of eight cells, 8 px apart


# --- a 200-item run that lost a host ---------------------------------------------------


def _png(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


class _Life:
    """One worker process as the sink leaves it: records, images, its progress writer."""

    def __init__(self, storage, worker: str, writer: str | None, device: str, start: float):
        self.storage, self.worker, self.device, self.clock = storage, worker, device, start
        self.log = ProgressLog(storage, writer=writer) if writer else None
        self.compiled: set[str] = set()
        self.images: dict[tuple, bytes] = {}

    def batch(self, batch_id: str, shape: ShapeKey, ids: list[str], *, at: float | None = None) -> None:
        start = max(self.clock, at or 0.0)
        generate = GENERATE_S if shape.queue in self.compiled else FIRST_S  # a life's first call compiles
        self.compiled.add(shape.queue)
        ended = start + generate
        records = []
        for n, item in enumerate(ids):
            key = layout.image_key(item, "png")
            size = (shape.height, shape.width, n % 3)
            self.storage.put_bytes(key, self.images.get(size) or self.images.setdefault(size, _png(n, *size[:2])))
            records.append(ImageRecord(
                file_name=key, id=item, prompt=f"prompt {item}", seed=n, height=shape.height, width=shape.width,
                steps=4, guidance_scale=1.0, model="tiny", run_id="lost", batch_id=batch_id, queue=shape.queue,
                device=self.device, worker=self.worker, generate_s=generate, generate_started_at=start,
                generate_ended_at=ended, store_s=STORE_S, finished_at=ended + STORE_S))
        self.storage.put_bytes(layout.record_key(batch_id), jsonl(records))
        if self.log:
            self.log.add(batch_id, shape.queue, ids)
            self.log.flush()
        self.clock = ended + HAND_OVER_S


def lost_host_run(url: str, *, second_host_at: float = 5.0, writers: bool = True) -> dict:
    """200 items in 25 batches of 8 over three sizes, two hosts of two workers with the same
    names (one hostname): host A does batches 0-9 and dies holding 10 and 11; host B, up
    from `second_host_at`, does 12-24 (24 fails: its first half is done as b000024.s0,
    the second fails after 3 attempts) and, a lease after the loss, 10 and 11.
    Returns the times the test checks against."""
    storage = open_storage(url)
    t0 = 1.7e9
    ids = [f"item-{i:03d}" for i in range(200)]
    batch = {b: (f"b{b:06d}", LOST_SHAPES[b % 3], ids[8 * b:8 * b + 8]) for b in range(25)}
    items = {s.queue: sum(len(batch[b][2]) for b in batch if batch[b][1] == s) for s in LOST_SHAPES}
    storage.put_bytes(layout.MANIFEST, RunManifest(
        run_id="lost", created_at=t0 - 1, source="p.jsonl", out=url, total=200, batches=25, plan_parts=1,
        defaults=run_defaults(LOST_SHAPES[0]), diffq_version="0",
        shapes=[ShapeSummary(shape=s, queue=s.queue, items=items[s.queue], batches=-(-items[s.queue] // 8))
                for s in LOST_SHAPES]).model_dump_json().encode())

    def life(name, pid, slot, start):
        return _Life(storage, f"diffq-w{slot}@host", f"host-{pid}-{pid:x}" if writers else None, f"cpu:{slot}",
                     t0 + start)

    host_a = [life("a", 101, 0, 0.0), life("a", 102, 1, 0.0)]
    for b in range(10):
        host_a[b % 2].batch(*batch[b])
    lost_at = max(worker.clock - HAND_OVER_S + STORE_S for worker in host_a)  # its last stored batch
    host_b = [life("b", 201, 0, second_host_at), life("b", 202, 1, second_host_at)]
    for b in range(12, 24):
        host_b[b % 2].batch(*batch[b])
    batch_id, shape, half = batch[24][0], batch[24][1], batch[24][2]
    host_b[0].batch(f"{batch_id}.s0", shape, half[:4])
    storage.put_bytes(layout.failure_key(f"{batch_id}.s1"), FailureRecord(
        run_id="lost", batch_id=f"{batch_id}.s1", item_ids=half[4:], error="RuntimeError: boom", attempts=3,
        worker=host_b[1].worker, failed_at=host_b[1].clock).model_dump_json().encode())
    idle_from = [worker.clock - HAND_OVER_S for worker in host_b]
    back = lost_at + LEASE_S  # the broker gives the held batches back once their lease runs out
    host_b[0].batch(*batch[10], at=back)
    host_b[1].batch(*batch[11], at=back)
    return {"t0": t0, "lost_at": lost_at, "back": back, "idle_from": idle_from}


def test_a_lost_host_is_told_as_it_happened(tmp_path):
    facts = lost_host_run(str(tmp_path / "run"))
    r = build_report(str(tmp_path / "run"))
    assert (r.total, r.done, r.failed) == (200, 196, 4)
    # Two hosts, one hostname: four processes, not two merged rows.
    assert [(w.label, w.process, w.batches) for w in r.workers] == [
        ("diffq-w0@host #1", "host pid 101", 5), ("diffq-w0@host #2", "host pid 201", 8),
        ("diffq-w1@host #1", "host pid 102", 5), ("diffq-w1@host #2", "host pid 202", 7)]
    a0, b0, a1, b1 = r.workers
    assert a0.stopped_early and a1.stopped_early and not b0.stopped_early and not b1.stopped_early
    # The lost batches: given back a lease after the loss, each waited that long.
    lost = {b.batch_id: b for b in r.lost}
    assert set(lost) == {"b000010", "b000011"} and {b.kind for b in lost.values()} == {"redelivered"}
    assert all(b.lost_wait_s == pytest.approx(LEASE_S, abs=1e-3) for b in lost.values())
    assert r.workers[lost["b000010"].life].label == "diffq-w0@host #2"
    # Host B's lives waited for them, and that wait is not "storing / idle".
    assert b0.waited_s == pytest.approx(facts["back"] - facts["idle_from"][0], abs=1e-3)
    assert b1.waited_s == pytest.approx(facts["back"] - facts["idle_from"][1], abs=1e-3)
    # What is left: the hand-overs between its other calls and storing its last batch.
    assert b0.other_s == pytest.approx((b0.batches - 2) * HAND_OVER_S + STORE_S, abs=1e-3)
    assert r.retries == {"halved": 1, "retried_failures": 0, "failure_records": 1, "failed_attempts": 3}
    text = render_text(r)
    assert "diffq-w0@host #1 (host pid 101) stopped early" in text
    assert "2 lost batches (16 images) done again (2 redelivered) after waiting 60.0 s." in text
    assert "Retries: 1 batch halved after an error, 0 retried failures, 1 failure record (3 attempts in all)" in text
    assert "lost b000011 (redelivered, 8 images): waited 60.0 s, done by diffq-w1@host #2" in text
    data = to_json(r)
    assert [entry["batch_id"] for entry in data["lost"]] == ["b000010", "b000011"]
    assert sum(w["stopped_early"] for w in data["workers"]) == 2


def test_lives_without_progress_writers_are_split_by_overlapping_calls(tmp_path):
    # No progress segments (a reconciled run): host B starts while host A still works,
    # and one process never makes two calls at once.
    lost_host_run(str(tmp_path / "run"), second_host_at=1.0, writers=False)
    r = build_report(str(tmp_path / "run"))
    assert [(w.label, w.process, w.batches) for w in r.workers] == [
        ("diffq-w0@host #1", "by timing", 5), ("diffq-w0@host #2", "by timing", 8),
        ("diffq-w1@host #1", "by timing", 5), ("diffq-w1@host #2", "by timing", 7)]
    assert {b.batch_id for b in r.lost} == {"b000010", "b000011"}


def test_a_run_lost_nothing_says_so(tmp_path):
    make_run(str(tmp_path / "run"), 40)
    story = build_report(str(tmp_path / "run")).story()
    assert story[-1].startswith("No process stopped early, no batch waited 5.0 s or more, no retries")


def flagged_run(url: str, flagged: list[int]) -> list[str]:
    """make_run's 40 items, the `flagged` ones stored flagged flat (as `--on-degenerate flag` leaves them)."""
    ids = make_run(url, 40)
    storage = open_storage(url)
    marked = {ids[i] for i in flagged}
    for key in list(storage.list(layout.RECORDS_PREFIX)):
        records = [r.model_copy(update={"degenerate": "flat"}) if r.id in marked else r
                   for r in parse_record(storage.get_bytes(key))]
        storage.put_bytes(key, jsonl(records))
    return sorted(marked)


def test_flagged_images_are_listed_with_a_contact_sheet(tmp_path, monkeypatch):
    from diffq.results import report as report_module

    out = str(tmp_path / "run")
    marked = flagged_run(out, [3, 17, 30, 31])
    monkeypatch.setattr(report_module, "FLAGGED_SHOWN", 3)  # all counted, the first three listed
    r = build_report(out)
    assert r.flagged_kinds == {"flat": 4} and [f.id for f in r.flagged] == marked[:3]
    assert (r.done, r.failed) == (40, 0)  # a flagged image is stored: done
    text = render_text(r)
    assert "4 images stored flagged as degenerate (4 flat): see Flagged images." in text
    assert "flagged images (4 flat): stored, a check found them degenerate" in text
    assert all(item in text for item in marked[:3]) and marked[3] not in text and "… and 1 more" in text
    assert to_json(r)["flagged"] == {"kinds": {"flat": 4}, "items": marked[:3]}
    report(out, html_path=tmp_path / "r.html", sample_size=5)
    page = (tmp_path / "r.html").read_text()
    start = page.index("<h2>Flagged images</h2>")
    flagged_part = page[start:page.index("<h2>", start + 1)]
    assert "4 flat: stored, a check found them degenerate; 3 of them shown." in flagged_part
    assert flagged_part.count("<figure ") == 3 and page.count("<figure ") == 5 + 3
    for data in re.findall(r'src="data:image/png;base64,([^"]+)"', flagged_part):
        Image.open(io.BytesIO(base64.b64decode(data))).verify()


def test_a_run_without_flagged_images_says_none(tmp_path):
    make_run(str(tmp_path / "run"), 16)
    r = build_report(str(tmp_path / "run"))
    assert not r.flagged and "flagged images" not in render_text(r)
    assert "<h2>Flagged images</h2><p>none</p>" in render_html(r)
