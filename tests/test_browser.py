"""Both HTML pages as a person sees them: opened in a real headless Chromium.

Each page is loaded twice: once for a screenshot (it renders, and not blank), once with
a script that runs after the page's load event and writes what it measured into the
DOM, which `--dump-dom` prints: every image decoded (`complete` and a natural width),
and no element of the contact sheet (or of the qualify page's image rows)
overlapping another or sticking out of its cell (getBoundingClientRect).

No browser: skipped on a developer's machine, a failure under CI=true (CI installs
chromium through scripts/test-services.sh).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffq.results.report import THUMB, report
from tests.test_report import lost_host_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WINDOW = (1280, 2400)
# Containers whose children must not overlap: the run report's contact sheet, the
# qualify page's device / reference / difference rows.
GROUPS = ".sheet, .row"
CHECK_JS = """
window.addEventListener('load', () => {
  const box = e => e.getBoundingClientRect();
  const slack = 0.5;  // sub-pixel rounding
  const meet = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > slack &&
                         Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > slack;
  const within = (a, b) => a.left >= b.left - slack && a.right <= b.right + slack &&
                           a.top >= b.top - slack && a.bottom <= b.bottom + slack;
  const name = e => e.tagName.toLowerCase() + (e.className ? '.' + e.className : '') +
                    (e.alt ? '[' + e.alt + ']' : '');
  const problems = [];
  let groups = 0, cells = 0;
  for (const group of document.querySelectorAll(GROUPS)) {
    groups++;
    const kids = [...group.children];
    cells += kids.length;
    kids.forEach((a, i) => kids.slice(i + 1).forEach(b => {
      if (meet(box(a), box(b))) problems.push(name(a) + ' overlaps ' + name(b));
    }));
    for (const kid of kids) {
      for (const part of kid.querySelectorAll('*'))
        if (!within(box(part), box(kid))) problems.push(name(part) + ' sticks out of ' + name(kid));
      const parts = [...kid.children];
      parts.forEach((a, i) => parts.slice(i + 1).forEach(b => {
        if (meet(box(a), box(b))) problems.push(name(a) + ' overlaps ' + name(b) + ' in ' + name(kid));
      }));
    }
  }
  const images = [...document.images].map(i => ({
    alt: i.alt, ok: i.complete && i.naturalWidth > 0, natural: [i.naturalWidth, i.naturalHeight],
    shown: [box(i).width, box(i).height], sheet: !!i.closest('.sheet')}));
  const out = document.createElement('pre');
  out.id = 'diffq-browser-check';
  out.textContent = JSON.stringify({images, problems, groups, cells,
    page_width: document.documentElement.scrollWidth, window_width: window.innerWidth,
    text: document.body.innerText});
  document.body.appendChild(out);
});
""".replace("GROUPS", json.dumps(GROUPS))


@pytest.fixture(scope="module")
def browser() -> str:
    found = os.environ.get("DIFFQ_BROWSER") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("no headless browser: scripts/test-services.sh installs chromium for CI")
    pytest.skip("no chromium installed (scripts/test-services.sh installs it)")


def _chromium(browser: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: tests run as root in CI, where Chromium's sandbox refuses to start;
    # the pages are local and self-contained. A fresh profile per call.
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                           *args], capture_output=True, text=True, timeout=180)


def measure(browser: str, page: Path, tmp_path: Path) -> dict:
    """What CHECK_JS found on `page` after it loaded."""
    checked = tmp_path / f"checked-{page.name}"
    checked.write_text(page.read_text().replace("</body>", f"<script>{CHECK_JS}</script></body>"))
    # The virtual time budget lets the load event (every data: image decoded) happen before the dump.
    proc = _chromium(browser, tmp_path, "--virtual-time-budget=20000", "--dump-dom", checked.as_uri())
    found = re.search(r'<pre id="diffq-browser-check">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"the check script wrote nothing (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def screenshot(browser: str, page: Path, tmp_path: Path) -> np.ndarray:
    shot = tmp_path / f"{page.stem}.png"
    proc = _chromium(browser, tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.is_file(), proc.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == WINDOW
        pixels = np.asarray(image.convert("RGB"))
    # Rendered: text, tables and images, not a blank or single-colour window.
    assert pixels.std() > 20 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200
    return pixels


def test_run_report_of_a_lost_host_in_a_browser(browser, tmp_path):
    lost_host_run(str(tmp_path / "run"))  # 200 items, three sizes up to 256x256, a host lost
    page = tmp_path / "report.html"
    report(str(tmp_path / "run"), html_path=page, price_per_device_hour=2.0, sample_size=60)
    screenshot(browser, page, tmp_path)
    seen = measure(browser, page, tmp_path)
    broken = [image["alt"] for image in seen["images"] if not image["ok"]]
    assert not broken, f"images that did not decode: {broken}"
    sheet = [image for image in seen["images"] if image["sheet"]]
    assert len(sheet) == 60 and len(seen["images"]) == 60 + 4  # the sample and four charts
    assert seen["groups"] == 1 and seen["cells"] == 60 and seen["problems"] == []
    for image in sheet:  # each scaled into its cell, its aspect kept
        (w, h), (shown_w, shown_h) = image["natural"], image["shown"]
        assert max(shown_w, shown_h) <= THUMB + 0.5 and shown_w / shown_h == pytest.approx(w / h, rel=0.02)
    assert {tuple(image["natural"]) for image in sheet} >= {(64, 64), (64, 128), (128, 128)}  # mixed sizes
    assert seen["page_width"] <= seen["window_width"]  # nothing pushes the page sideways
    text = seen["text"]
    assert "stopped early" in text and "2 lost batches (16 images) done again (2 redelivered)" in text
    assert "diffq-w0@host #2" in text


def test_qualify_report_in_a_browser(browser, tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffq", "qualify", "--model", tiny_model, "--shapes", "64x64",
                           "--batch-size", "2", "--repeats", "1", "--report", str(tmp_path / "q")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = tmp_path / "q" / "index.html"
    screenshot(browser, page, tmp_path)
    seen = measure(browser, page, tmp_path)
    assert len(seen["images"]) == 6 and all(image["ok"] for image in seen["images"])  # 2 items × 3 images
    assert seen["groups"] == 2 and seen["cells"] == 6 and seen["problems"] == []
    assert "diffq qualify cpu: passed" in seen["text"]


def test_the_reports_time_to_first_image_section_in_a_browser(browser, tmp_path):
    from diffq.core import layout
    from diffq.core.records import START_PHASES, WorkerStart
    from diffq.results.report import report

    run = str(tmp_path / "run")
    lost_host_run(run)
    from diffq.core.storage import open_storage

    storage = open_storage(run)
    for n, (worker, began, hit) in enumerate([("diffq-w0@host", 1.7e9, False), ("diffq-w1@host", 1.7e9, True),
                                              ("diffq-w0@host", 1.7e9 + 5, True)]):
        phases = dict(zip(START_PHASES, (4.0, 0.5, 0.0 if hit else 30.0, 12.0, 60.0, 2.0)))
        start = WorkerStart(worker=worker, pid=100 + n, device=f"cpu:{n % 2}", began_at=began,
                            first_image_at=began + sum(phases.values()), phases=phases,
                            time_to_first_image_s=sum(phases.values()),
                            fetches=[{"model": "s3://models/flux2", "revision": "sha256:ab", "hit": hit,
                                      "bytes": 0 if hit else 9_000_000_000, "seconds": phases["weights_fetch"],
                                      "mb_per_s": 0.0 if hit else 300.0}])
        storage.put_bytes(layout.start_key(worker, start.pid, began), start.model_dump_json().encode())
    page = tmp_path / "report.html"
    built = report(run, html_path=page)
    assert built.median_time_to_first_image_s == 78.5 and built.device_seconds_starting == 78.5 * 2 + 108.5
    screenshot(browser, page, tmp_path)
    seen = measure(browser, page, tmp_path)
    assert seen["page_width"] <= seen["window_width"]
    text = seen["text"]
    assert "Time to first image" in text
    assert "median time to first image 78.5 s over 3 worker lives; 265.5 device-seconds spent starting" in text
    assert "miss 9000.0 MB 30.0 s 300 MB/s" in text and text.count("hit 0.0 MB") == 2
