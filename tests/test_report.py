"""`diffq report`: figures from the records, text, HTML with embedded plots, contact sheet."""

from __future__ import annotations

import base64
import io
import re

import pytest
from PIL import Image

from diffq.results.report import build_report, render_text, report, to_json
from tests.test_export import make_run


def test_figures_from_records(tmp_path):
    # 5 batches of 8: w0 runs batches 0, 2, 4 (finished at +10, +11, +12 s), w1 runs
    # 1, 3 (+10.5, +11.5); each worker's first batch generates in 0.6 s, the rest 0.3 s.
    make_run(str(tmp_path / "run"), 40, failed_batches=1)
    r = build_report(str(tmp_path / "run"), price_per_device_hour=3.6)
    assert (r.total, r.done, r.failed) == (48, 40, 8)
    w0, w1 = r.workers
    assert (w0.worker, w0.images, w0.batches, w1.images) == ("w0@host", 24, 3, 16)
    assert w0.active_s == pytest.approx(12.0 - 9.4) and w1.active_s == pytest.approx(11.5 - 9.9)
    assert w0.compile_s == pytest.approx(0.3) and w1.compile_s == pytest.approx(0.3)
    assert w0.other_s == pytest.approx(2.6 - 1.2)
    assert r.device_hours == pytest.approx(4.2 / 3600)
    # price × device-hours / images × 1000
    assert r.cost_per_1000 == pytest.approx(3.6 * 4.2 / 3600 / 40 * 1000)
    assert r.wall_s == pytest.approx(2.6) and r.images_per_s == pytest.approx(40 / 2.6)
    assert [(s.label, s.done, s.total) for s in r.shapes] == [("32x32", 24, 32), ("32x48", 16, 16)]
    assert r.per_device()["cpu:1"]["images"] == 16
    assert sum(y * (x[1] - x[0]) for x, y in [(r.throughput()[0], v) for v in r.throughput()[1]]) == pytest.approx(40)
    assert r.errors == {"RuntimeError: out of memory": 1}
    assert len(r.sample) == 24 and len({s.id for s in r.sample}) == 24

    text = render_text(r)
    assert "40/48 done, 8 failed, 0 pending" in text
    assert f"{r.cost_per_1000:.4f} per 1,000 images at 3.6 per device-hour" in text
    assert "1 × RuntimeError: out of memory" in text
    assert to_json(r)["cost_per_1000"] == pytest.approx(r.cost_per_1000)
    assert build_report(str(tmp_path / "run")).cost_per_1000 is None


def test_html_page_embeds_plots_and_contact_sheet(tmp_path):
    make_run(str(tmp_path / "run"), 30)
    report(str(tmp_path / "run"), html_path=tmp_path / "r.html", contact_sheet_path=tmp_path / "sheet.png",
           price_per_device_hour=2.0, sample_size=10)
    page = (tmp_path / "r.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 4  # three plots and the contact sheet
    for data in images:
        Image.open(io.BytesIO(base64.b64decode(data))).verify()
    assert "per 1,000 images at 2 per device-hour" in page and "w1@host" in page and "32x48" in page
    sheet = Image.open(tmp_path / "sheet.png")
    assert sheet.size == (8 * 112, 2 * (112 + 14))
    assert base64.b64decode(images[-1]) == (tmp_path / "sheet.png").read_bytes()
