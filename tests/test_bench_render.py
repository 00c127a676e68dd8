"""`make bench` writes docs/BENCHMARKS.md whole (bench/__main__.py `render`): from the
figures it keeps (docs/benchmarks.json, docs/scale_*.json) it must give back every
section the page has, the hand-run scale and degenerate-image parts included, and
every scale goal in the goals table. Nothing is measured here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import producer
from bench.__main__ import main, render
from bench.scale import goals as scale_goals

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def headings(text: str) -> list[str]:
    fenced = False
    found = []
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line)
    return found


def rendered() -> str:
    return render(json.loads((DOCS / "benchmarks.json").read_text()))


def test_the_renderer_gives_every_section_the_page_has_in_its_order():
    text = rendered()
    page = headings((DOCS / "BENCHMARKS.md").read_text())
    assert "## Scale" in page and "## What the degenerate-image checks cost" in page
    assert headings(text) == page


def test_every_scale_goal_is_a_row_of_the_goals_table():
    goals_table = rendered().partition("\n## Goals\n")[2].partition("\n## ")[0]
    checks = scale_goals()
    assert {goal for goal, _, _ in checks} >= {
        "export: the union of N shards' output is byte-identical to a single export's",
        "status: exact counts unchanged (redeliveries, splits, failures)"}
    for goal, met, figure in checks:
        assert f"| {goal} | {'yes' if met else '**no**'} | {figure} |" in goals_table


def test_render_only_rewrites_the_page_from_the_kept_figures(tmp_path, monkeypatch):
    import bench.__main__ as entry

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.json").write_text((DOCS / "benchmarks.json").read_text())
    monkeypatch.setattr(entry, "ROOT", tmp_path)
    main(["--render"])
    assert (docs / "BENCHMARKS.md").read_text() == rendered()
    assert sorted(p.name for p in docs.iterdir()) == ["BENCHMARKS.md", "benchmarks.json"]  # no plots redrawn


def test_the_producer_part_judges_the_largest_size():
    def row(case, rows, wall, cpu, rss):
        return {"case": case, "format": "jsonl", "rows": rows, "wall_s": wall, "cpu_s": cpu,
                "peak_rss_mb": rss, "rows_per_s": round(rows / wall), "rows_per_cpu_s": round(rows / cpu),
                "load": "1.0–1.0", "command": f"python -m bench.producer --scale {rows}"}

    rows = [row("plan", 10_000_000, 100.0, 90.0, 120.0), row("plan", 100_000_000, 1600.0, 1500.0, 480.0),
            row("submit (discard)", 100_000_000, 2500.0, 2000.0, 520.0)]
    lines = producer.scale_section(rows)
    assert lines[0] == "### Producer at 100M rows"
    assert "| plan | jsonl | 100,000,000 | 1600.0 | 1500.0 | 62,500 | 66,667 | 480.0 | – | 1.0–1.0 (0) |" in "\n".join(lines)
    (speed, speed_met, speed_figure), (memory, memory_met, memory_figure), _ = producer.scale_goals(rows)
    assert "100,000,000 rows" in speed and not speed_met  # submit: 40,000 rows/s
    assert speed_figure == "plan: 62,500 (66,667 per CPU s), submit (discard): 40,000 (50,000 per CPU s)"
    assert not memory_met and memory_figure == "plan: 480.0 MB, submit (discard): 520.0 MB"
    assert producer.scale_section([]) == []


def test_a_section_run_again_drops_the_notes_written_beside_its_old_figures(tmp_path, monkeypatch):
    import bench.__main__ as entry
    import bench.device

    kept = json.loads((DOCS / "benchmarks.json").read_text())
    assert {"device", "handoff"} <= set(kept["notes"])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.json").write_text(json.dumps(kept))
    monkeypatch.setattr(entry, "ROOT", tmp_path)
    monkeypatch.setattr(entry, "run_section", lambda name, quick: kept[name])  # the same figures, "measured" again
    monkeypatch.setattr(entry, "plot", lambda *args: None)
    monkeypatch.setattr(bench.device, "plot", lambda *args: None)
    main(["--only", "handoff"])
    saved = json.loads((docs / "benchmarks.json").read_text())
    assert "handoff" not in saved["notes"] and saved["notes"]["device"] == kept["notes"]["device"]
    page = (docs / "BENCHMARKS.md").read_text()
    assert kept["notes"]["device"].strip() in page and kept["notes"]["handoff"].strip() not in page
    assert "### Handing pixels to the sink helper" in page  # the figures stay


def test_the_device_feed_goals_judge_the_helper_rows_at_every_size_and_format():
    from bench.__main__ import device_feed_goals

    def row(size, fmt, knee, sink="process"):
        return {"height": size, "format": fmt, "batch": 8, "target": "local", "layout": "split", "sink": sink,
                "knee_s_per_image": knee, "host_limit_s_per_image": 0.010, "repeats": [{"load_average": 1.5}]}

    rows = [row(size, fmt, 0.0105) for size in (1024, 512) for fmt in ("png", "jpeg", "webp")]
    slow_socket = row(1024, "jpeg", 0.050, sink="process (socket pixels)")
    results = {"device": {"one_core": {"sweeps": rows}, "socket_pixels": {"sweeps": [slow_socket]}}}
    (goal, met, figure), breakdown, hand, warm, gpu = device_feed_goals(results)
    assert met and figure.startswith("1024² png: 1.05,") and figure.endswith("load average 1.5–1.5 on 2 cores")
    assert (breakdown[1], hand[1], warm[1], gpu[1]) == (False, False, "pending", "not measurable here")
    # Steady means every pass: the best of three within 1.10 × is not enough.
    rows[0].update(passes=[{"knee_over_host": ratio} for ratio in (1.05, 1.17, 0.98)],
                   goal={"every_pass_within_10pct": False})
    (_, met, figure), *_ = device_feed_goals(results)
    assert not met and figure.startswith("1024² png: 1.05 (per pass 1.05, 1.17, 0.98),")
    rows[0].update(passes=[{"knee_over_host": ratio} for ratio in (1.05, 1.07, 0.98)],
                   goal={"every_pass_within_10pct": True})
    assert device_feed_goals(results)[0][1]
    rows[-1]["knee_s_per_image"] = 0.012
    assert not device_feed_goals(results)[0][1]
    del rows[-1]
    (_, met, figure), *_ = device_feed_goals(results)
    assert not met and figure.endswith("512² webp: not measured; load average 1.5–1.5 on 2 cores")
