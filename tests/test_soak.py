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


# -- the whole worker (--whole): a real `diffq run`, each process by role ---------------------


def test_each_process_of_a_run_is_named_by_its_role():
    python = "/usr/bin/python3"
    assert soak.role_of([python, "-m", "diffq", "run", "p.jsonl"], is_root=True) == soak.RUNNER
    assert soak.role_of([python, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
                                       "pipe_handle=7)", "--multiprocessing-fork"], is_root=False) == soak.WORKER
    assert soak.role_of([python, "-m", "diffq.worker.sink.helper", "3"], is_root=False) == soak.SINK_HELPER
    assert soak.role_of([python, "-c", "from multiprocessing.resource_tracker import main;main(4)"],
                        is_root=False) == soak.TRACKER
    assert soak.role_of(["/usr/bin/nvidia-smi"], is_root=False) == "other: nvidia-smi"


def test_a_live_tree_is_sampled_by_role(tmp_path):
    """A process that spawns a child as the supervisor does (multiprocessing's spawn, which
    starts the resource tracker too): each found under the root, each with its RSS."""
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    script = ("import multiprocessing as mp, pathlib, time\n"
              "def child(path):\n    pathlib.Path(path).touch(); time.sleep(60)\n"
              "if __name__ == '__main__':\n"
              f"    p = mp.get_context('spawn').Process(target=child, args=({str(ready)!r},)); p.start(); p.join()\n")
    (tmp_path / "tree.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "tree.py")])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the spawned child never started"
            time.sleep(0.05)
        roles = soak.sample_tree(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert set(roles) == {soak.RUNNER, soak.WORKER, soak.TRACKER}, roles
    assert roles[soak.RUNNER]["pids"] == [proc.pid] and len(roles[soak.WORKER]["pids"]) == 1
    assert all(role["rss_mb"] > 1 for role in roles.values())


def test_each_role_reports_its_start_peak_and_growth_after_warm_up():
    # The sink helper appears at the first batch and is restarted once (another pid);
    # the worker grows 3 MB per 1,000 batches after warm-up (its load before it left out).
    samples = [(b, {soak.RUNNER: {"rss_mb": 100.0, "pids": [1]},
                    soak.WORKER: {"rss_mb": (50.0 if b < 250 else 400.0 + 0.003 * b), "pids": [2],
                                  "device_mb": 900.0},
                    **({soak.SINK_HELPER: {"rss_mb": 30.0, "pids": [3 if b < 500 else 4]}} if b else {})})
               for b in range(0, 1001, 50)]
    report = soak.roles_report(samples)
    assert report[soak.RUNNER] == {"rss_start_mb": 100.0, "rss_peak_mb": 100.0,
                                   "rss_growth_mb_per_1000_batches": 0.0, "pids": [1]}
    worker = report[soak.WORKER]
    assert worker["rss_start_mb"] == 50.0 and worker["rss_peak_mb"] == 403.0
    assert worker["rss_growth_mb_per_1000_batches"] == pytest.approx(3.0)
    assert worker["device_peak_mb"] == 900.0 and worker["device_growth_mb_per_1000_batches"] == pytest.approx(0.0)
    assert report[soak.SINK_HELPER]["pids"] == [3, 4] and "device_peak_mb" not in report[soak.SINK_HELPER]
