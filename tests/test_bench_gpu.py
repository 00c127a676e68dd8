"""bench/gpu.py, the one prepared run on a lent accelerator, dry-run here on the CPU
with `--tiny`: every part (a)-(d) writes its figures into gpu.json and the chart,
and a deadline stops it cleanly with what is left listed as cut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def gpu_bench(out: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu", "--tiny", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_tiny_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "gpu"
    # (e) apart, below: three qualify processes would take the CPU minutes.
    proc = gpu_bench(out, "--items", "2", "--deadline", "540", "--parts", "a,b,c,d",
                     timeout=580)  # a deadline: the test below
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    figures = result["figures"]
    assert result["cut"] == [] and not any("error" in figures[step] for step in figures), figures
    assert result["device"]["torch_device"] == "cpu" and result["versions"]["diffusers"]

    # (a): both batch sizes, each a whole diffq run and a bare loop over the same items.
    best = figures["a"]["probe"]["best_batch_size"]
    assert best in (1, 2)
    for batch in sorted({1, best}):
        a = figures["a"][f"batch {batch}"]
        assert a["items"] == 2 * batch
        assert a["diffq_images_per_s"] == pytest.approx(a["items"] / a["diffq_process_s"], rel=1e-3)
        assert a["bare_process_s"] > a["bare_load_s"] > 0
        assert a["diffq_start"]["time_to_first_image_s"] > 0
    # (b): regional only on the CPU; the second process started from the first's cache.
    b = figures["b"]
    assert set(b) == {"regional"}
    assert b["regional"]["warm_first_call_s"] < b["regional"]["cold_first_call_s"]
    # (c): full compute, then every speed-up offered on the CPU, each measured.
    rows = figures["c"]["speedups"]["rows"]
    assert rows[0]["speedup"] == "none (full compute)" and rows[0]["same_in_other_composition"]
    measured = {row["speedup"] for row in rows[1:] if "s_per_image" in row}
    assert {"attention:_native_math", "mag:mag_ratios=flux,threshold=0.06"} <= measured
    native = next(row for row in rows if row["speedup"] == "attention:_native_math")
    assert native["psnr_min"] > 40 and 0.99 < native["ssim_min"] <= 1
    # (d): qualify chose from its own candidates, and the run took the profile's choice.
    d = figures["d"]
    chosen = d["qualify"]["chosen"][0]
    assert d["qualify"]["checks"]["parity"] == "pass"  # against (c)'s full compute, on the same device
    run = d["run with the profile"]
    assert run["images"] == 2 * max(2, best) and run["speedups"] == [str(chosen["speedup"])]
    assert run["batch_sizes"] == [chosen["batch_size"]]

    with Image.open(out / "gpu.png") as chart:
        assert chart.format == "PNG" and chart.size[0] > 600


def test_the_deadline_cuts_cleanly(tmp_path):
    out = tmp_path / "gpu"
    proc = gpu_bench(out, "--deadline", "4", timeout=120)  # mid-build or mid-(a): a process is stopped
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    steps = ["build", "a", "b", "c", "d", "e"]
    stopped = result["cut"][0].split(":")[0]
    assert stopped in ("build", "a") and "stopped at the deadline" in result["cut"][0]
    assert result["cut"][1:] == steps[steps.index(stopped) + 1:]
    assert result["wall_s"] < 30  # stopped, not waited for
    assert (out / "gpu.png").is_file()


@pytest.mark.slow
def test_the_lora_part_qualifies_a_mode_with_adapters_written_for_the_built_model(tmp_path):
    """(e) on the tiny pipeline, one mode (each is the same `diffq qualify --lora`
    process): two adapters of ranks 8 and 16 written without loading the transformer's
    weights, each change seen in the images, no graph after the first batch; its table."""
    from bench import gpu

    out = tmp_path / "gpu"
    proc = gpu_bench(out, "--parts", "e", "--lora-modes", "swap", "--deadline", "300", timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    e = result["figures"]["e"]
    assert result["cut"] == [] and "error" not in e, e
    assert e["adapters"]["ranks"] == [8, 16] and set(e) == {"adapters", "swap"}
    swap = e["swap"]
    assert swap["exit"] == 0 and swap["check"]["status"] == "pass" and swap["rank"] == 16
    assert swap["graphs_after_first"] == 0 and swap["unseen"] == [] and swap["refused"] is None
    assert [c["change"] for c in swap["changes"]] == ["adapter", "scale", "adapter", "scale", "none"]
    assert all(c["vs_none"] > 0 for c in swap["changes"][:-1]) and swap["changes"][-1]["vs_none"] == 0
    assert swap["s_per_image_with"] > 0 and swap["s_per_image_without"] > 0
    (row,) = [line for line in gpu.render(result) if line.startswith("| swap |")]
    assert row.startswith("| swap | pass | 0 |")


@pytest.mark.slow
def test_a_second_call_loads_the_kept_model_and_carries_the_first_calls_figures_on(tmp_path):
    env_tmp = tmp_path / "tmp"  # where --keep-model keeps the pipeline (the temp dir)
    env_tmp.mkdir()
    first, second = tmp_path / "first", tmp_path / "second"
    for out, parts in ((first, "a"), (second, "c")):
        proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--tiny", "--out", str(out), "--parts", parts,
                               "--items", "1", "--keep-model"], cwd=ROOT, capture_output=True, text=True,
                              timeout=400, env={**os.environ, "TMPDIR": str(env_tmp)})
        assert proc.returncode == 0, proc.stderr[-3000:]
    before = json.loads((first / "gpu.json").read_text())
    after = json.loads((second / "gpu.json").read_text())
    assert "reused" not in before["figures"]["build"]
    assert after["figures"]["build"]["reused"] == str(env_tmp / "diffq-bench-gpu-tiny-flux")
    assert after["figures"]["a"] == before["figures"]["a"]  # carried on, not measured again
    assert after["earlier"]["parts"] == ["a"] and after["cut"] == []
    best = before["figures"]["a"]["probe"]["best_batch_size"]
    assert after["figures"]["c"]["speedups"]["batch_size"] == max(2, best)


# -- what the device machine is carried --------------------------------------------------


def test_every_runtime_dependency_the_gpu_run_needs_is_carried_or_on_the_image(monkeypatch):
    """diffq's dependency closure (for the device's CPython 3.12) less the device image's
    packages and LEFT_BEHIND is within CARRIED: torchao (quant:SCHEME, a core dependency,
    not on the image) among the wheels; a wheel dropped from the list is named."""
    from bench import gpu

    assert gpu.uncarried() == []
    assert "torchao" in gpu.CARRIED and "torchao" not in gpu.DEVICE_IMAGE
    monkeypatch.setattr(gpu, "CARRIED", tuple(n for n in gpu.CARRIED if n not in ("torchao", "kombu")))
    assert gpu.uncarried() == ["kombu", "torchao"]
    monkeypatch.setattr(gpu, "LEFT_BEHIND", {})
    assert {"boto3", "google-cloud-storage", "grafana-foundation-sdk"} <= set(gpu.uncarried())


BLOCKED_IMPORT = """
import importlib, sys
# None in sys.modules: an import raises ModuleNotFoundError and importlib.util.find_spec
# answers None, as where the package is not installed.
for module in sys.argv[1].split(","):
    sys.modules[module] = None
for name in sys.argv[2:]:
    importlib.import_module(name)
from diffq.worker.device.quantize import torchao_config
torchao_config("int8wo")
print("ok")
"""


def test_the_gpu_runs_modules_import_without_what_is_left_behind():
    """The modules the GPU run loads (the CLI, run, worker, qualify's child, the pipeline
    host and the quantizer's torchao configs) import with LEFT_BEHIND's modules refused,
    as on the device, where they are absent."""
    modules = ["bench.gpu", "diffq.app.cli", "diffq.app.runner", "diffq.app.qualify", "diffq.worker.process.qualify",
               "diffq.worker.process.child", "diffq.worker.delivery.celery_adapter",
               "diffq.worker.device.pipeline_host"]
    from bench.gpu import LEFT_BEHIND

    blocked = ",".join(module for module, _ in LEFT_BEHIND.values())
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, blocked, *modules], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, blocked, "diffq.core.storage.s3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert "ModuleNotFoundError: import of boto3 halted" in proc.stderr  # the check above can fail
