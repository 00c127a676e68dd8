"""The benchmark's simulated device (bench/standin.py) and its sweep (bench/device.py):
the stand-in waits without holding the GIL and hands back real-looking images; the
sweep drives a real `diffq run` and prints the documented JSON shape."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.device import configs, host_at, knee, main_parser, monotone, render, summarise
from bench.standin import StandInPipeline, image_pool, synth_image

ROOT = Path(__file__).resolve().parents[1]


def test_standin_waits_without_holding_the_gil():
    pipe = StandInPipeline()
    image_pool(64, 48)  # made once per process, outside the timed call
    span: dict[str, float] = {}
    result: dict = {}

    def call() -> None:
        span["start"] = time.perf_counter()
        result["images"] = pipe(prompt=["a device_s=0.2000", "b device_s=0.2000"], height=64, width=48).images
        span["end"] = time.perf_counter()

    thread = threading.Thread(target=call)
    ticks = []
    thread.start()
    while thread.is_alive():  # Python code in this thread while the call is in progress
        ticks.append(time.perf_counter())
        sum(range(200))
    thread.join()
    assert span["end"] - span["start"] >= 0.4  # 0.2 s per image, 2 images
    inside = [t for t in ticks if span["start"] + 0.05 < t < span["end"] - 0.05]
    assert inside, "no Python ran in another thread during the call: it held the GIL"
    assert pipe.cpu_s < 0.25 * pipe.busy_s, "the call used the CPU while waiting (spinning, not sleeping)"
    assert [(im.mode, im.size) for im in result["images"]] == [("RGB", (48, 64))] * 2


def test_standin_images_are_neither_noise_nor_flat():
    image = synth_image(1, 256, 256)
    raw = 256 * 256 * 3
    png = io.BytesIO()
    image.save(png, format="PNG", compress_level=1)
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(
        noise, format="PNG", compress_level=1)
    assert len(noise.getvalue()) > raw  # what noise does
    assert 0.15 * raw < len(png.getvalue()) < 0.8 * raw
    assert np.asarray(image).std() > 10


def test_knee_interpolates_where_busy_crosses_the_goal():
    assert knee([(0.4, 1.0), (0.1, 0.99), (0.05, 0.5)]) == 0.05 + 0.05 * (0.97 - 0.5) / (0.99 - 0.5)
    assert knee([(0.4, 1.0), (0.1, 0.99)]) is None
    assert knee([(0.4, 0.9), (0.1, 0.5)]) == 0.4


def test_a_dip_in_one_window_is_pooled_with_its_neighbours_not_read_as_the_knee():
    # 512² WebP, pass 1 of 2026-12-03: one window at 3 × the host limit read 0.966, every
    # window from there to the host limit 0.999; the points as measured put the knee there.
    measured = [(0.1, 0.9998), (0.08, 0.9658), (0.065, 0.9994), (0.05, 0.9997), (0.035, 0.9995),
                (0.02704, 0.9993), (0.02575, 0.9861), (0.025, 0.9575), (0.02318, 0.8659)]
    fitted = monotone(measured)
    assert [seconds for seconds, _ in fitted] == [seconds for seconds, _ in measured]
    assert all(slow >= fast for (_, slow), (_, fast) in zip(fitted, fitted[1:]))
    # The dip and the four faster points it broke the order with share their mean; the rest stand.
    pooled = (0.9658 + 0.9994 + 0.9997 + 0.9995 + 0.9993) / 5
    assert [round(f, 6) for _, f in fitted] == [0.9998] + [round(pooled, 6)] * 5 + [0.9861, 0.9575, 0.8659]
    assert knee(measured, fit=False) == pytest.approx(0.08 + 0.02 * (0.97 - 0.9658) / (0.9998 - 0.9658))
    assert knee(measured) == pytest.approx(0.025 + 0.00075 * (0.97 - 0.9575) / (0.9861 - 0.9575))
    # A curve already in order is its own fit.
    ordered = [(0.4, 1.0), (0.1, 0.99), (0.05, 0.5)]
    assert monotone(ordered) == ordered


def test_a_pass_is_set_against_its_bare_loop_where_it_read_the_knee():
    # The bare loop ran 0.10 s per image before the run and 0.12 after; the knee's grid
    # points were measured a quarter of the way through: 0.105 there, not the faster end.
    run = {"host_limit_before_after": [0.10, 0.12], "host_limit_at": [1000.0, 1400.0],
           "busy": [[0.2, 1.0], [0.13, 0.99], [0.11, 0.95], [0.09, 0.8]],
           "window_at": [[0.2, 1050.0], [0.13, 1100.0], [0.11, 1100.0], [0.09, 1300.0]],
           "gap_ms": [[0.2, 0.2], [0.13, 0.2], [0.11, 0.2], [0.09, 0.2]], "bytes_per_image": 1,
           "sink_store_s_per_image": 0.1, "host_cpu_s_per_image": 0.1,
           "run_cpu_s_per_image": [[0.2, 0.1], [0.09, 0.1]], "images": 8, "images_stored": 8}
    assert host_at(run, 900.0) == 0.10 and host_at(run, 1500.0) == 0.12
    row = summarise({"height": 64}, [run])
    (one,) = row["passes"]
    assert one["host_limit_s_per_image"] == 0.105 and one["knee_s_per_image"] == pytest.approx(0.12)
    assert one["knee_over_host"] == round(0.12 / 0.105, 3) and row["host_limit_s_per_image"] == 0.105
    old = {k: v for k, v in run.items() if k not in ("host_limit_at", "window_at")}  # before the time stamps
    assert summarise({"height": 64}, [old])["passes"][0]["host_limit_s_per_image"] == 0.10


def test_quick_keeps_the_rows_asked_for():
    assert configs(main_parser().parse_args(["--quick", "--sizes", "512", "--formats", "jpeg"])) == [
        ("local", 512, 8, "jpeg")]


def test_quick_is_every_format_at_1024_and_512_batch_8_local():
    assert configs(main_parser().parse_args(["--quick"])) == [
        ("local", size, 8, fmt) for size in (1024, 512) for fmt in ("png", "jpeg", "webp")]


def test_sweep_drives_a_real_run_and_prints_the_json_shape():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.device", "--json", "--sizes", "64", "--batches", "2", "--formats", "png",
         "--targets", "local", "--grid", "0.02,0.01"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads(proc.stdout)
    [sweep] = document["sweeps"]
    assert {"height", "width", "format", "batch", "host_limit_s_per_image", "knee_s_per_image",
            "busy"} <= set(sweep)
    assert (sweep["height"], sweep["width"], sweep["format"], sweep["batch"]) == (64, 64, "png", 2)
    assert [seconds for seconds, _ in sweep["busy"]] == [0.02, 0.01]
    assert all(0 < fraction <= 1 for _, fraction in sweep["busy"])
    assert sweep["host_limit_s_per_image"] > 0
    # Every prompt of the plan became an image of the run.
    assert sweep["images"] == sweep["images_stored"] > 0
    assert sweep["run_cpu_s_per_image"] > 0 and sweep["host_cpu_s_per_image"] > 0
    # The docs section has its row.
    # With a core beyond the sink's, the device loop and the sink run apart (bench.device.layout).
    assert sweep["layout"] == ("split" if len(os.sched_getaffinity(0)) > 1 else "shared")
    assert any(line.startswith(f"| 64² | png | 2 | local | {sweep['layout']} | 1 |")
               for line in render({"test": document}))


def test_standin_pt_output_is_an_accelerators_8_bit_batch_the_host_takes_without_a_copy():
    """output_type="pt" (what the worker asks for): B×3×H×W uint8, as scaled on the
    device; the host's to_arrays hands the sink views of that memory (as after a DMA)."""
    from diffq.worker.device.pipeline_host import to_arrays

    pipe = StandInPipeline()
    batch = pipe(prompt=[f"p{n} device_s=0.0" for n in range(10)], height=64, width=48, output_type="pt").images
    assert tuple(batch.shape) == (10, 3, 64, 48) and str(batch.dtype) == "torch.uint8"
    arrays = to_arrays(batch)
    pool = image_pool(64, 48)
    assert all(np.array_equal(arrays[n], np.asarray(pool[n % len(pool)])) for n in range(10))  # 10 > the pool: cycled
    assert all(np.shares_memory(arrays[n], batch.numpy()) for n in range(10))


def test_sink_threads_setting_reaches_the_helper(monkeypatch):
    from diffq.worker.sink.store import Sink
    from diffq.worker.sink.helper import SinkProcess, make_sink

    monkeypatch.setenv("DIFFQ_SINK_THREADS", "8")
    sink = make_sink()
    try:
        sink.start()
        assert isinstance(sink, SinkProcess)
        argv = open(f"/proc/{sink._helper.process.pid}/cmdline").read().split("\0")[:-1]
        assert argv[-2] == "8"  # the helper's arguments: socket fd, threads, retry seconds
    finally:
        sink.close()
    monkeypatch.setenv("DIFFQ_SINK", "thread")
    threaded = make_sink()
    assert isinstance(threaded, Sink) and threaded._pool._max_workers == 8
    threaded.close()


def test_phases_cut_each_gap_into_the_segments_between_stamps():
    """bench.phases: every second between one call's end and the next call's start
    falls into exactly one segment, named by the stamps either side of it."""
    from bench.phases import breakdown, gaps

    stamps = []
    for n in range(4):
        base = 10.0 * n
        stamps += [(base, "device>"), (base + 1.0, "device<"), (base + 1.5, "task<"), (base + 1.75, "read message>"),
                   (base + 2.0, "read message<")]
    stamps.append((40.0, "device>"))
    per_gap = gaps(stamps)
    assert len(per_gap) == 3 and [name for name, _ in per_gap[0]] == [
        "device< → task<", "task< → read message>", "read message> → read message<", "read message< → device>"]
    assert all(sum(seconds for _, seconds in segments) == 9.0 for segments in per_gap)
    result = breakdown(per_gap, skip=1)
    assert result["gaps"] == 2 and result["gap_ms_median"] == 9000.0
    assert {row["segment"]: row["ms"] for row in result["segments"]}["read message< → device>"] == 8000.0
