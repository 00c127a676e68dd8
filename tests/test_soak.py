"""bench/soak.py's smoke run (issue 64): the worker's host side over many batches and
adapter sets (past the metrics' label cap), every batch stored and credited, RSS sampled."""

from __future__ import annotations

import math

import pytest

from bench import soak


def test_growth_is_the_slope_after_warm_up():
    # Warm-up jumps (batches 0-250) are left out; then 2 MB per 1,000 batches.
    samples = [(0, 100.0), (100, 180.0), (200, 190.0)] + [(b, 200.0 + 0.002 * (b - 300)) for b in range(300, 1001, 100)]
    assert soak.growth_per_1000(samples) == pytest.approx(2.0)
    assert soak.growth_per_1000([(0, 1.0)]) == 0.0


def test_a_quick_soak_stores_every_batch_and_caps_the_set_labels(tmp_path):
    from diffq.worker.observe import metrics

    def labelled() -> set[str]:
        return {sample.labels["adapter_set"] for family in metrics.SET_IMAGES.collect() for sample in family.samples
                if sample.name.endswith("_total")}

    # The registry is the process's: other tests in it may have labelled sets already.
    before = labelled()
    result = soak.soak(str(tmp_path / "run"), batches=120, sets=metrics.MAX_SET_LABELS + 4, sample_every=20,
                       refresh_every=30)
    assert result["done"] == 120 * 2 and result["done_per_set"] == metrics.MAX_SET_LABELS + 4
    assert result["rss_peak_mb"] >= result["rss_start_mb"] > 0 and math.isfinite(result["growth_mb_per_1000_batches"])
    after = labelled()
    assert metrics.OTHER_SET in after and len(after - {metrics.OTHER_SET}) <= metrics.MAX_SET_LABELS + len(before)
    assert len(after - before - {metrics.OTHER_SET}) <= metrics.MAX_SET_LABELS


def test_the_backlog_service_lets_go_of_runs_that_left(tmp_path):
    """Runs come and go over scrapes (an abandoned one's folder deleted): the collector
    holds only the runs still listed."""
    result = soak.backlog_soak(str(tmp_path), scrapes=80, every_s=300.0, sample_every=10)
    # A run an hour (12 scrapes of 5 min), each listed 3 hours (36 scrapes): 7 started, 4
    # left (3 finished, the 4th abandoned and its folder deleted), 3 held.
    assert result["runs"] == 7 and result["runs_held"] == 3, result
