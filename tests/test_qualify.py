"""`diffq qualify` end to end on CPU, with the tiny pipeline and a stand-in Neuron backend.

Each run is the real command in a fresh interpreter (`python -m diffq qualify`), which
itself spawns the pinned measuring child: exit codes and output are what a person sees.
The stand-in `torch_neuronx` (tests/stand_ins) plays the vendor module the backend
table names (../shared/BACKENDS.md, Trainium "device" and "CPU fallback" rows:
`torch_neuronx.get_fallback_ops()`), and its "neuron" compile backend counts graphs.
"""

from __future__ import annotations

import importlib.util
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
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.app.qualify import Settings, Thresholds, _child_spec, checks, reduced
from diffq.core.records import DEGENERATE_CHECKS
from diffq.worker.device.backends import REFERENCE, RunConfig, get_backend
from diffq.worker.process.qualify import percentile

STAND_INS = Path(__file__).parent / "stand_ins"
SHAPE = "64x64"


def qualify(*args: str, env: dict | None = None) -> tuple[int, dict | None, str]:
    """Run the command; return its exit code, its --json object (if any) and all output."""
    proc = subprocess.run([sys.executable, "-m", "diffq", "qualify", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    output = proc.stdout + proc.stderr
    report = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, report, output


def stand_in_env(tmp_path: Path, **extra: str) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")]),
            "STANDIN_NEURON_GRAPHS": str(tmp_path / "graphs.txt"), "STANDIN_NEURON_ENV": str(tmp_path / "env.json"),
            **extra}


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A CPU float32 eager reference of two images, saved with its settings."""
    root = tmp_path_factory.mktemp("qualify")
    code, report, output = qualify("--model", tiny_model, "--shapes", SHAPE, "--batch-size", "2",
                                   "--save-reference", str(root / "ref"), "--json")
    assert code == 0, output
    return root / "ref", report


def test_save_reference_stores_images_and_settings(saved, tiny_model):
    ref, report = saved
    # The CPU float32 eager run is itself the default reference: nothing to compare.
    assert report["checks"]["parity"]["status"] == "skip" and report["passed"] is True
    assert report["checks"]["parity"]["detail"].endswith(f"({REFERENCE})")
    settings = json.loads((ref / "reference.json").read_text())["settings"]
    assert settings["shapes"] == [[64, 64]] and settings["batch_size"] == 2 and settings["seeds"] == [0, 1]
    assert len(settings["prompts"]) == 2 and settings["steps"] == 4
    for index in range(2):
        with Image.open(ref / "images" / SHAPE / f"{index}.png") as image:
            assert image.size == (64, 64)
    # The report the issue asks for, field by field.
    assert report["device"]["kind"] == "cpu" and report["compile"]["mode"] == "none"
    assert {"torch", "diffusers", "transformers"} <= set(report["versions"]) and report["versions"]["torch"]
    assert report["fallback_ops"] == []
    (shape,) = report["shapes"]
    assert shape["shape"] == SHAPE and shape["first_call_s"] > 0 and shape["steady_s"]["calls"] == 5
    assert 0 < shape["steady_s"]["median"] <= shape["steady_s"]["p90"]
    assert shape["images_per_s"] == pytest.approx(2 / shape["steady_s"]["median"], rel=1e-3)
    assert report["recompiles"]["steps_change"] == 0 and report["recompiles"]["revisit"] == 0
    assert report["memory"]["host_peak_rss_bytes"] > 0 and report["memory"]["device_peak_bytes"] is None
    # Every image went through the worker's checks: none degenerate.
    assert shape["degenerate"] == {"nonfinite": 0, "flat": 0} and report["degenerate"] == {SHAPE: shape["degenerate"]}
    assert report["checks"]["run"] == {"status": "pass", "detail": "1 shape(s) generated, no degenerate image"}


def test_cpu_against_saved_cpu_reference_passes(saved, tiny_model, tmp_path):
    ref, _ = saved
    code, report, output = qualify("--model", tiny_model, "--reference", str(ref), "--report", str(tmp_path / "r"),
                                   "--price-per-device-hour", "2.5", "--json")
    assert code == 0, output
    parity = report["parity"]
    assert parity["reference"] == str(ref) and parity["passed"] is True
    assert parity["psnr_db_min"] == 100.0 and parity["max_abs_diff"] == 0  # same environment: identical
    assert [s["shape"] for s in report["shapes"]] == [SHAPE]  # shapes, prompts and seeds came from the reference
    assert report["seeds"] == [0, 1] and report["batch_size"] == 2
    assert set(report["checks"]) == {"run", "fallback_ops", "recompiles", "parity"}
    assert all(c["status"] == "pass" for c in report["checks"].values()) and report["passed"] is True
    shape = report["shapes"][0]
    assert shape["cost_per_1000_images"] == pytest.approx(2.5 / shape["images_per_device_hour"] * 1000, rel=1e-3)
    page = (tmp_path / "r" / "index.html").read_text()
    # Self-contained: device, reference and difference image for each of the two items.
    assert page.count('src="data:image/png;base64,') == 6 and not re.findall(r'(?:src|href)="(?!data:)', page)
    assert "Compile vs steady state" in page and json.loads((tmp_path / "r" / "qualify.json").read_text())["passed"]


def test_inductor_against_eager_reference_passes(saved, tiny_model):
    ref, _ = saved
    code, report, output = qualify("--model", tiny_model, "--reference", str(ref), "--compile", "full", "--json")
    assert code == 0, output
    assert report["compile"]["mode"] == "full" and report["compile"]["backend"] == "inductor"
    assert report["parity"]["passed"] is True
    assert report["parity"]["psnr_db_min"] >= Thresholds().min_psnr
    assert report["shapes"][0]["first_call_graphs"] >= 1  # the first call compiled
    assert report["recompiles"]["steps_change"] == 0 and report["recompiles"]["steady"] == 0


def test_altered_reference_fails_without_traceback(saved, tiny_model, tmp_path):
    ref, _ = saved
    altered = tmp_path / "altered"
    shutil.copytree(ref, altered)
    path = altered / "images" / SHAPE / "1.png"
    pixels = np.asarray(Image.open(path).convert("RGB")).copy()
    pixels[:32] = 255 - pixels[:32]  # half the image inverted
    Image.fromarray(pixels).save(path)
    # Plain text on the terminal; the same object as --json in the report folder.
    code, _, output = qualify("--model", tiny_model, "--reference", str(altered), "--report", str(tmp_path / "r"))
    assert code == 1 and "Traceback" not in output
    assert "FAIL  parity" in output and "FAILED" in output.splitlines()
    report = json.loads((tmp_path / "r" / "qualify.json").read_text())
    assert report["parity"]["passed"] is False and report["passed"] is False
    assert report["checks"]["parity"]["status"] == "fail"
    images = report["parity"]["shapes"][0]["images"]
    assert images[0]["psnr_db"] == 100.0 and images[1]["psnr_db"] < Thresholds().min_psnr  # only the altered one


def test_neuron_stand_in_that_perturbs_outputs_fails_parity(saved, tiny_model, tmp_path):
    ref, _ = saved
    code, report, output = qualify("--model", tiny_model, "--device", "neuron", "--compile", "full",
                                   "--reference", str(ref), "--json",
                                   env=stand_in_env(tmp_path, STANDIN_NEURON_PERTURB="1"))
    assert code == 1 and "Traceback" not in output
    assert report["device"]["kind"] == "neuron" and report["compile"]["backend"] == "neuron"
    assert report["dtype"] == get_backend("neuron").default_dtype
    assert report["parity"]["passed"] is False and report["checks"]["parity"]["status"] == "fail"


def test_neuron_stand_in_fallback_ops_warnings_and_counted_recompiles(tiny_model, tmp_path):
    # Two shapes, each above --reference-max-pixels: both are compared at reduced shapes
    # against the default reference (this pipeline on CPU in float32).
    code, report, output = qualify("--model", tiny_model, "--device", "neuron", "--cores", "3", "--compile", "full",
                                   "--shapes", "64x64,48x80", "--reference-max-pixels", "3072", "--json",
                                   env=stand_in_env(tmp_path))
    assert code == 0, output
    # Pinned as `diffq worker` pins: the env the stand-in saw when the child imported it.
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen["NEURON_RT_VISIBLE_CORES"] == "3" and seen["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/tmp/neff_cache"
    # Qualified as a worker runs by default: a compiled graph failing on the device fails
    # (torch-neuronx neuron_dynamo_backend/backend.py, execution_wrapper), and none re-ran.
    assert seen["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"
    assert report["graph_fallback"] == {"env": "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "value": "1",
                                        "calls": 0, "per_shape": {}}
    assert report["checks"]["graph_fallback"]["status"] == "pass"
    assert report["device"]["slot"] == 3 and report["compile"]["cache_dir"] == "/tmp/neff_cache"
    assert report["fallback_ops"] == ["aten::_fft_r2c", "aten::linalg_eigh"]
    assert report["checks"]["fallback_ops"]["status"] == "warn"
    (warning,) = [w for w in report["warnings"] if "float64" in w["message"]]
    assert warning["count"] > 1  # raised on every call, reported once
    # Counted by the stand-in compile backend: one graph per measured shape, one per
    # reduced parity shape, none for a steps change or a revisit.
    graphs = (tmp_path / "graphs.txt").read_text().splitlines()
    rc = report["recompiles"]
    assert rc["new_shapes"] == {"64x64": 1, "48x80": 1}
    assert rc["steps_change"] == 0 and rc["revisit"] == 0 and rc["steady"] == 0
    assert [s["recompiles"] for s in report["shapes"]] == [{"steady": 0, "steps_change": 0, "revisit": 0}] * 2
    assert report["parity_shapes"] == ["48x48", "32x64"] and len(graphs) == 2 + 2
    assert [s["shape"] for s in report["parity"]["shapes"]] == ["48x48", "32x64"]
    assert report["parity"]["reference"] == "cpu" and report["parity"]["passed"] is True
    assert report["checks"]["recompiles"]["status"] == "pass" and report["passed"] is True


def test_neuron_stand_in_whose_graph_fails_on_the_device_fails(tiny_model, tmp_path):
    # The stand-in's compiled graph fails every call on the "device" and is handled as
    # torch-neuronx's execution_wrapper does: with the fallback disabled (qualify's, and a
    # worker's, default) the call raises instead of quietly re-running op by op.
    code, report, output = qualify("--model", tiny_model, "--device", "neuron", "--compile", "full",
                                   "--shapes", SHAPE, "--json",
                                   env=stand_in_env(tmp_path, STANDIN_NEURON_RUNTIME_FAIL="1"))
    assert code == 1 and "Traceback" not in output and report["passed"] is False
    assert report["checks"]["run"] == {"status": "fail",
                                       "detail": "RuntimeError: stand-in NEFF execution failed on the device"}
    assert json.loads((tmp_path / "env.json").read_text())["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"


def test_a_graph_that_re_ran_uncompiled_fails_qualification():
    # Should a release ignore the switch, the count still fails the check.
    report = {**_report(), "graph_fallback": {"env": "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "value": "1",
                                              "calls": 3, "per_shape": {"64x64.b1": 3}}}
    found = checks(report, Thresholds())["graph_fallback"]
    assert found == {"status": "fail", "detail": "3 compiled-graph call(s) failed on the device and re-ran "
                                                 "uncompiled, op by op (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1)"}
    assert "graph_fallback" not in checks(_report(), Thresholds())  # a backend without such a fallback


def test_missing_backend_package_fails_the_run_check(tiny_model, tmp_path):
    # No stand-in on the path: the child's `import torch_neuronx` (the table's extension) fails.
    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("a torch_neuronx is installed here")
    code, report, output = qualify("--model", tiny_model, "--device", "neuron", "--shapes", SHAPE, "--json")
    assert code == 1 and "Traceback" not in output
    assert report["checks"]["run"] == {"status": "fail", "detail": "ModuleNotFoundError: No module named 'torch_neuronx'"}
    assert report["passed"] is False and report["parity"]["passed"] is False


def test_a_nan_image_fails_the_run_check(tiny_model, tmp_path):
    # The second default prompt's output turns NaN in every call (worker/device/faults.py), as a
    # miscompiled graph or an overflowing VAE would make it: counted per shape, and fatal.
    code, report, output = qualify("--model", tiny_model, "--shapes", SHAPE, "--batch-size", "2", "--repeats", "1",
                                   "--report", str(tmp_path / "r"), "--json", env={"DIFFQ_FAULT_NAN": "lighthouse"})
    assert code == 1 and "Traceback" not in output and report["passed"] is False
    calls = 1 + 1 + 1 + 1  # first, the repeat, the steps change, the revisit
    assert report["shapes"][0]["degenerate"] == {"nonfinite": calls, "flat": 0}
    assert report["checks"]["run"] == {"status": "fail", "detail": f"1 shape(s) generated; {calls} image(s) with "
                                       f"{DEGENERATE_CHECKS['nonfinite']}: {calls} at {SHAPE}"}
    assert f"<td>{calls} nonfinite</td>" in (tmp_path / "r" / "index.html").read_text()  # its shape row


def test_a_flat_image_warns():
    report = {**_report(), "degenerate": {"64x64": {"nonfinite": 0, "flat": 2}}}
    assert checks(report, Thresholds())["run"]["status"] == "warn"
    report["degenerate"]["64x64"]["nonfinite"] = 1  # non-finite outranks flat
    assert checks(report, Thresholds())["run"]["status"] == "fail"


def _report(**recompiles) -> dict:
    return {"shapes": [{}], "fallback_ops": [], "compile": {"mode": "full", "backend": "inductor"},
            "recompiles": {"steps_change": 0, "revisit": 0, "steady": 0, "new_shapes": {"64x64": 1}, **recompiles},
            "parity": {"reference": "cpu", "psnr_db_min": 40.0, "max_abs_diff": 12, "passed": True}}


def test_verdict_recompiles_and_parity_margins():
    t = Thresholds()
    assert checks(_report(), t)["recompiles"]["status"] == "pass"
    assert checks(_report(steps_change=1), t)["recompiles"]["status"] == "fail"
    assert checks(_report(revisit=2), t)["recompiles"]["status"] == "fail"
    assert checks(_report(new_shapes={"64x64": 0}), t)["recompiles"]["status"] == "warn"
    near = _report()
    near["parity"]["psnr_db_min"] = t.min_psnr + t.warn_margin_db - 1
    assert checks(near, t)["parity"]["status"] == "warn"
    assert checks(_report(), t)["parity"]["status"] == "pass"


def test_reference_run_and_skip_read_the_tables_reference(tmp_path):
    # The reference child is planned from backends.REFERENCE, the same value the
    # "device run is its own reference" check compares against, so the two cannot drift.
    settings = Settings(model="m", prompts=["a"], seeds=[0], shapes=[(64, 64)], parity_shapes=[(32, 32)],
                        batch_size=1, steps=2, guidance_scale=1.0, max_sequence_length=8)
    spec = _child_spec(REFERENCE, slot=0, threads=2, compile_cache=None, settings=settings, measure=False,
                       extra=[], repeats=0, out_dir=tmp_path)
    child = spec.child
    assert RunConfig(device=child.device, dtype=spec.dtype, compile=child.compile, offload=child.offload) == REFERENCE
    assert child.dtype == spec.dtype and spec.shapes == [(32, 32)] and not spec.measure
    skipped = {**_report(), "parity": {"reference": "cpu", "skipped": True}}
    assert checks(skipped, Thresholds())["parity"] == {
        "status": "skip", "detail": "the device run is the reference configuration (cpu, float32, eager)"}


def test_reduced_shape_and_percentile():
    assert reduced((1024, 1024), 512 * 512) == (512, 512)
    assert reduced((768, 1344), 512 * 512) == (384, 672)
    assert reduced((512, 512), 512 * 512) == (512, 512)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 5.0 and percentile([3.0, 1.0, 2.0], 50) == 2.0


@pytest.mark.parametrize("args, message", [
    (["--shapes", "65x64"], "multiples of 16"),
    (["--shapes", "big"], "not HxW"),
    (["--compile", "defer-fuse"], "not a mode of cpu"),
    (["--offload", "model", "--compile", "full"], "--compile regional"),
    (["--reference", "/nonexistent"], "no reference.json"),
])
def test_bad_input_is_a_clear_error_before_any_child(tiny_model, args, message):
    result = CliRunner().invoke(app, ["qualify", "--model", tiny_model, *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and message in result.output and result.exception.__class__ is SystemExit


def test_options_contradicting_the_reference_are_refused(saved, tiny_model):
    ref, _ = saved
    result = CliRunner().invoke(app, ["qualify", "--model", tiny_model, "--reference", str(ref), "--shapes", "32x32"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "differs from the reference" in result.output


def test_command_options_are_the_issue_contract():
    result = CliRunner().invoke(app, ["qualify", "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0
    for option in ("--model", "--device", "--cores", "--chips", "--gpus", "--compile", "--dtype", "--offload",
                   "--shapes", "--batch-size", "--steps", "--prompts", "--reference", "--save-reference",
                   "--report", "--json", "--price-per-device-hour", "--speedups", "--profile", "--budget-psnr",
                   "--budget-ssim", "--max-candidates", "--max-batch-size", "--lora"):
        assert option in result.output


def test_prompt_file_rows_and_seeds(tmp_path):
    from diffq.app.qualify import QualifyError, read_prompt_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat", "seed": 7}\n{"prompt": "a dog"}\n')
    assert read_prompt_file(path, 3) == (["a cat", "a dog", "a cat"], [7, 1, 7])
    path.write_text('{"prompt": "a cat", "heigth": 64}\n')
    with pytest.raises(QualifyError, match=r"p.jsonl:1: field .heigth."):
        read_prompt_file(path, 1)


def test_backend_rows_for_memory_and_cache_stats():
    from diffq.worker.device.backends import BACKENDS, resolve

    # torch's device-generic allocator statistics (torch/accelerator/memory.py); the
    # CPU has no device allocator to ask.
    assert BACKENDS["cpu"].peak_memory is None
    for kind in ("cuda", "neuron", "tpu"):
        assert BACKENDS[kind].peak_memory == "torch.accelerator.max_memory_allocated"
    assert callable(resolve(BACKENDS["cuda"].peak_memory))
    # BACKENDS.md TPU "compile cache" row: "Stats: torch.tpu._get_cache_stats()".
    assert BACKENDS["tpu"].cache_stats == "torch.tpu._get_cache_stats"
    assert {kind for kind, b in BACKENDS.items() if b.cache_stats} == {"tpu"}
