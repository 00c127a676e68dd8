"""`diffq qualify --speedups` (issue 40): per shape, every speed-up candidate the tables
offer on this device, measured for steady seconds per image and for fidelity against
full compute on the same prompts and seeds; a table, and a profile whose choice per
shape is the fastest candidate within the quality budget.

End to end on the tiny Flux pipeline (random weights: the figures show the mechanism,
not a model's quality loss), 64x64 and 28 steps (MagCache's flux preset is calibrated
for 28), one timed call per candidate to stay short; the planning, the child's
out-of-memory handling and SSIM on their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from diffq.app import qualify as q
from diffq.app.cli import app
from diffq.core.families import BY_NAME
from diffq.core.profile import SpeedupProfile
from diffq.worker.device.backends import get_backend

SHAPE = "64x64"
FAST = ("--shapes", SHAPE, "--steps", "28", "--repeats", "1")


def run(*args: str) -> tuple[int, dict | None, str, str]:
    proc = subprocess.run([sys.executable, "-m", "diffq", "qualify", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)
    report = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, report, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def flux(tiny_pipelines):
    return tiny_pipelines["flux"]


def _measured(shape: dict) -> list[dict]:
    return [c for c in shape["candidates"] if c["refused"] is None and c["skipped"] is None]


def test_speedups_write_the_table_and_a_profile_within_budget(flux, tmp_path):
    profile_path = tmp_path / "profile.json"
    code, report, _, stderr = run("--model", flux, *FAST, "--speedups", "--max-batch-size", "2",
                                  "--profile", str(profile_path), "--report", str(tmp_path / "r"), "--json")
    assert code == 0, stderr
    found = report["speedups"]
    # Said before the child started (on stderr: stdout is the JSON), with the compile count.
    assert stderr.startswith("speedups: 14 candidate(s) per shape to measure on 1 shape(s)")
    assert "compiles: 0 (--compile none on cpu compiles nothing)" in stderr and found["compiles"] == 0
    assert found["announced"] in stderr
    assert found["budget"] == {"min_psnr": q.BUDGET_PSNR, "min_ssim": q.BUDGET_SSIM}
    assert "not computed" in found["perceptual"] and "random weights" in found["note"]
    assert {i["speedup"] for i in found["not_offered"]} == {"firstblock", "sea", "faster", "textkv",
                                                            "quant:int8dq-tensor"}
    (shape,) = found["shapes"]
    measured = _measured(shape)
    # The default cap: full compute at batch sizes 1 and 2, every speed-up at 2, then at 1.
    assert len(measured) == q.MAX_CANDIDATES
    assert [(c["speedup"], c["batch_size"]) for c in measured if c["speedup"] is None] == [(None, 1), (None, 2)]
    assert sum(1 for c in measured if c["batch_size"] == 2) == 12
    skipped = [c for c in shape["candidates"] if c["skipped"]]
    assert len(skipped) == 10 and all(c["skipped"] == "over --max-candidates 14" for c in skipped)
    # The quantization rows beside the caches: the transformer's stored bytes (int8: at
    # most 0.3x full compute's float32), the float8 rows refused on CPU with the reason.
    full_bytes = next(c for c in measured if c["speedup"] is None)["transformer_weight_bytes"]
    quantized = {c["speedup"]: c for c in measured if c["speedup"] and c["speedup"].startswith("quant:")}
    assert set(quantized) == {"quant:int8wo", "quant:int8dq"} and full_bytes > 0
    assert all(c["transformer_weight_bytes"] <= 0.3 * full_bytes and c["psnr"] is not None and c["ssim"] is not None
               for c in quantized.values())
    refused = {c["speedup"]: c["refused"] for c in shape["candidates"] if c["refused"]}
    assert "no float8 arithmetic on CPU" in refused["quant:fp8wo"] and "float8 matmul" in refused["quant:fp8dq"]
    for c in measured:
        assert c["seconds_per_image"] > 0 and c["steady_s"]["calls"] == 1
        if c["speedup"] is None:
            assert c["psnr"] is None and c["within_budget"] and c["time_vs_full"] == 1.0
            continue
        # Per image, against full compute at the same batch size on the same prompts and seeds.
        assert len(c["images"]) == c["batch_size"] and c["psnr"] == min(i["psnr_db"] for i in c["images"])
        assert 0 < c["ssim"] <= 1 and c["within_budget"] == (c["psnr"] >= 35 and c["ssim"] >= 0.97)
    cached = [c for c in measured if c["speedup"] and not c["speedup"].startswith("attention:")]
    assert cached and all(c["psnr"] < q.PSNR_CAP for c in cached)  # each cache really skipped work
    assert any(c["speedup"].startswith("mag:mag_ratios=flux") for c in cached)  # the flux preset, on flux
    # The profile: per shape the fastest candidate within the budget, and every candidate.
    profile = SpeedupProfile.load(profile_path)
    assert found["profile"] == str(profile_path) and profile.model == flux and profile.steps == 28
    assert (profile.device, profile.compile) == ("cpu", "none")
    (choice,) = profile.shapes
    chosen = choice.chosen
    assert (choice.height, choice.width) == (64, 64) and chosen.within_budget
    assert chosen.speedup is None or (chosen.psnr >= profile.budget.min_psnr and chosen.ssim >= profile.budget.min_ssim)
    within = [c for c in choice.candidates if c.within_budget and c.refused is None and c.skipped is None]
    assert chosen.seconds_per_image == min(c.seconds_per_image for c in within)
    assert len(choice.candidates) == len(shape["candidates"])
    assert report["checks"]["speedups"]["status"] == "pass" and report["passed"]
    # The report: the table and, per measured speed-up, full compute and sped-up images side by side.
    page = (tmp_path / "r" / "index.html").read_text()
    assert "<h2>Speed-ups</h2>" in page and "random weights it shows the mechanism" in page
    assert page.count("<figcaption>full compute, batch size") == len(measured) - 2
    assert page.count('src="data:image/png;base64,') == 3 * (len(measured) - 2) + 3  # + the parity row


def test_a_strict_budget_refuses_every_cached_candidate_and_the_cap_holds(flux, tmp_path, monkeypatch):
    said = []
    run_child = q._run_child

    def child(name, spec, workdir, timeout):
        said.append(("child", name, len(spec.speedups)))
        return run_child(name, spec, workdir, timeout)

    monkeypatch.setattr(q, "_run_child", child)
    options = q.SpeedupOptions(budget_psnr=200.0, max_candidates=4, profile=tmp_path / "p.json")
    report = q.qualify(flux, shapes=[(64, 64)], steps=28, repeats=1, speedups=options,
                       announce=lambda line: said.append(("announce", line)))
    # The cost was said before the child started; the child got exactly the capped list.
    assert said[0][0] == "announce" and said[0][1].startswith("speedups: 4 candidate(s) per shape")
    assert "8 over --max-candidates 4" in said[0][1] and said[1] == ("child", "device", 4)
    (shape,) = report["speedups"]["shapes"]
    measured = _measured(shape)
    assert len(measured) == 4 and measured[0]["speedup"] is None
    assert shape["chosen"]["speedup"] is None and shape["chosen"]["batch_size"] == 1  # full compute
    for c in measured[1:]:  # shown, never chosen
        assert c["within_budget"] is False and c["verdict"] == "below budget" and c["psnr"] is not None
    assert sum(1 for c in shape["candidates"] if c["skipped"]) == 8
    profile = SpeedupProfile.load(tmp_path / "p.json")
    assert profile.budget.min_psnr == 200.0 and profile.shapes[0].chosen.speedup is None
    assert [c.within_budget for c in profile.shapes[0].candidates[:4]] == [True, False, False, False]
    text = q.render_text(report)
    assert "below budget" in text and "chosen" in text and "skipped: over --max-candidates 4" in text


# -- planning, from the tables --------------------------------------------------------


def _settings(shapes=((64, 64),), batch_size=1) -> q.Settings:
    return q.Settings(model="m", prompts=["a"] * batch_size, seeds=list(range(batch_size)), shapes=list(shapes),
                      parity_shapes=list(shapes), batch_size=batch_size, steps=28, guidance_scale=3.5,
                      max_sequence_length=32)


def test_eager_cpu_offers_each_cache_at_its_settings_and_the_attention_backends():
    specs, refused, not_offered = q.offered_speedups(get_backend("cpu"), "none", BY_NAME["flux"])
    assert specs[-3:] == ["attention:_native_math", "quant:int8wo", "quant:int8dq"]
    assert [r["speedup"] for r in refused] == ["quant:fp8wo", "quant:fp8dq"]
    assert sum(s.startswith("taylorseer:") for s in specs) == 4 and sum(s.startswith("mag:") for s in specs) == 2
    assert "mag:mag_ratios=flux,threshold=0.06" in specs
    assert sum(s.startswith("pyramidattentionbroadcast:") for s in specs) == 2
    assert "--unreproducible-speedup" in {i["speedup"]: i["reason"] for i in not_offered}["firstblock"]


def test_regional_compile_refuses_what_breaks_a_block_and_counts_compiles():
    backend, family = get_backend("cpu"), BY_NAME["flux"]
    specs, refused, _ = q.offered_speedups(backend, "regional", family)
    # Whole-block caches only (TaylorSeer lite, Mag); the rest are shown with the reason.
    assert specs == ["taylorseer:cache_interval=2,use_lite_mode=true", "taylorseer:cache_interval=3,use_lite_mode=true",
                     "mag:mag_ratios=flux,threshold=0.06", "mag:mag_ratios=flux,threshold=0.12",
                     "quant:int8wo", "quant:int8dq"]
    reasons = {r["speedup"]: r["reason"] for r in refused}
    assert "its hooks sit inside each block" in reasons["taylorseer:cache_interval=2"]
    assert "recompiles every block" in reasons["attention:_native_math"]
    plan = q.plan_speedups(backend, "regional", family, _settings([(64, 64), (48, 80)]),
                           q.SpeedupOptions(max_batch_size=4, max_candidates=30), repeats=2)
    assert plan["batch_sizes"] == [1, 2, 4]
    # 2 shapes x batch sizes 2 and 4 (batch size 1 is the measurement's own graph).
    assert plan["compiles"] == 4 and "compiles: 4 (2 shape(s) x new batch size(s) 2, 4" in plan["announce"]
    assert len(plan["measure"]) == 3 + 3 * 6 and plan["skipped"] == [] and "3 call(s) each" in plan["announce"]
    assert [c["index"] for c in plan["measure"]] == list(range(21))
    full = q.offered_speedups(backend, "full", family)
    # Quantized weights are traced like any others: every compile mode takes them.
    assert full[0] == ["quant:int8wo", "quant:int8dq"] and all("compiles the whole transformer" in r["reason"]
                                 for r in full[1] if r["speedup"].split(":")[0] not in ("attention", "quant"))


def test_families_without_the_preset_or_the_cache_context():
    backend = get_backend("cpu")
    specs, _, not_offered = q.offered_speedups(backend, "none", BY_NAME["flux2-klein"])
    assert not any(s.startswith("mag:") for s in specs)
    assert "presets (flux) are for those families, not flux2-klein" in {
        i["speedup"]: i["reason"] for i in not_offered}["mag"]
    specs, refused, _ = q.offered_speedups(backend, "none", BY_NAME["sd3"])
    assert specs == ["attention:_native_math", "quant:int8wo", "quant:int8dq"] and refused
    assert all("CacheMixin" in r["reason"] for r in refused if not r["speedup"].startswith("quant:"))


def test_the_cap_keeps_full_compute_at_every_batch_size_then_the_largest_batch():
    plan = q.plan_speedups(get_backend("cpu"), "none", BY_NAME["flux"], _settings(batch_size=2),
                           q.SpeedupOptions(max_candidates=5, max_batch_size=4), repeats=1)
    kept = [(c["speedup"] is None, c["batch_size"]) for c in plan["measure"]]
    assert kept == [(True, 1), (True, 2), (True, 4), (False, 4), (False, 4)]  # measured smallest batch first
    assert len(plan["prompts"]) == 4 == len(set(plan["seeds"])) and plan["prompts"][0] == "a"
    assert plan["compiles"] == 0 and q.batch_sizes(6) == [1, 2, 4, 6] and q.batch_sizes(1) == [1]


# -- the child: out of memory, failures -----------------------------------------------


def test_out_of_memory_stops_larger_batch_sizes_and_a_failure_is_the_candidates(tmp_path):
    import torch

    from diffq.worker.process.qualify import SpeedupCall, measure_speedups, speedup_image_path

    calls = [SpeedupCall(index=i, speedup=s, batch_size=b) for i, (s, b) in enumerate(
        [(None, 1), ("bad", 1), ("ok", 1), (None, 2), ("ok", 2), (None, 4), ("ok", 4)])]
    spec = SimpleNamespace(speedups=calls, steps=2, speedup_repeats=2, out_dir=str(tmp_path))
    seen = []

    def speedup_call(height, width, steps, batch_size, speedup, items):
        seen.append((batch_size, speedup))
        if batch_size == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if speedup == "bad":
            raise RuntimeError("No viable backend for scaled_dot_product_attention")
        images = [np.full((16, 16, 3), 7, dtype=np.uint8)] * batch_size
        return SimpleNamespace(images=images, generate_s=0.5 * batch_size, degenerate=[None] * batch_size,
                               record_extra={"transformer_weight_bytes": 100}), 0

    released = []
    session = SimpleNamespace(spec=spec, speedup_call=speedup_call, speedup_items=lambda n: list(range(n)),
                              backend=get_backend("cpu"), release=released.append)
    found = {e["index"]: e for e in measure_speedups(session, 16, 16)}
    assert released == [None]  # full compute's pipeline, once it ran out of memory
    assert found[1]["error"].startswith("RuntimeError: No viable backend") and "seconds_per_image" not in found[1]
    assert found[2]["seconds_per_image"] == 0.5 and found[2]["steady_s"]["calls"] == 2
    assert found[4]["seconds_per_image"] == 0.5 and found[3]["first_call_graphs"] == 0
    assert found[4]["transformer_weight_bytes"] == 100 and found[4]["device_peak_bytes"] is None  # CPU: none
    assert found[5]["out_of_memory"] == 4 and found[6]["out_of_memory"] == 4  # never tried
    assert (4, "ok") not in seen and seen.count((4, None)) == 1
    assert speedup_image_path(tmp_path, 16, 16, 4, 1).is_file()
    assert not speedup_image_path(tmp_path, 16, 16, 1, 0).exists()


def test_quant_schemes_are_probed_alone_where_full_compute_ran_out_of_memory(tmp_path):
    """Full compute out of memory at batch 4: the cache there is not tried (full compute's
    weights), but each quantization scheme is, alone, full compute's pipeline released
    first and each scheme's after its probe; a scheme out of memory itself is not tried
    at a larger batch. The table compares a fitting scheme's first items with full
    compute's at batch 2, the largest that fitted, and says so."""
    import torch

    from diffq.worker.process.qualify import SpeedupCall, measure_speedups

    planned = [(None, 2), (None, 4), ("taylorseer", 4), ("quant:int8wo", 4), ("quant:int8dq", 4),
               (None, 8), ("quant:int8wo", 8), ("quant:int8dq", 8)]
    calls = [SpeedupCall(index=i, speedup=s, batch_size=b) for i, (s, b) in enumerate(planned)]
    spec = SimpleNamespace(speedups=calls, steps=2, speedup_repeats=2, out_dir=str(tmp_path))
    held, seen, released = set(), [], []
    fits = {None: 2, "int8wo": 8, "int8dq": 2}  # the largest batch each pipeline's memory takes

    def speedup_call(height, width, steps, batch_size, speedup, items):
        seen.append((batch_size, speedup))
        scheme = speedup.removeprefix("quant:") if speedup and speedup.startswith("quant:") else None
        held.add(scheme)
        if batch_size > fits[scheme] or len(held) > 1 and batch_size > 2:  # two pipelines: never both past 2
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        images = [np.full((16, 16, 3), 7 + k, dtype=np.uint8) for k in range(batch_size)]
        return SimpleNamespace(images=images, generate_s=0.5 * batch_size, degenerate=[None] * batch_size,
                               record_extra={"transformer_weight_bytes": 30 if scheme else 100}), 0

    def release(quant):
        released.append(quant)
        held.discard(quant)

    session = SimpleNamespace(spec=spec, speedup_call=speedup_call, speedup_items=lambda n: list(range(n)),
                              backend=get_backend("cpu"), release=release)
    entries = measure_speedups(session, 16, 16)
    found = {e["index"]: e for e in entries}
    assert found[1]["out_of_memory"] == 4 and found[2]["out_of_memory"] == 4 and (4, "taylorseer") not in seen
    assert found[3]["alone"] and found[3]["seconds_per_image"] == 0.5 and found[3]["steady_s"]["calls"] == 2
    assert found[3]["transformer_weight_bytes"] == 30
    assert found[4]["out_of_memory"] == 4 and (8, "quant:int8dq") not in seen  # itself, at 4: not tried at 8
    assert found[5]["out_of_memory"] == 4 and (8, None) not in seen
    assert found[6]["seconds_per_image"] == 0.5 and found[7]["out_of_memory"] == 4
    assert released == [None, "int8wo", "int8dq", "int8wo"]

    plan = {"measure": [{"index": c.index, "speedup": c.speedup, "batch_size": c.batch_size} for c in calls],
            "batch_sizes": [2, 4, 8], "compiles": 0, "compiles_detail": "", "announce": "", "seeds": [1, 2],
            "not_offered": [], "refused": [], "skipped": [], "largest_batch_size": 8}
    table = q.speedup_results(plan, [{"shape": "16x16", "height": 16, "width": 16, "candidates": entries}], tmp_path,
                              q.SpeedupOptions())
    rows = {(c["speedup"], c["batch_size"]): c for c in table["shapes"][0]["candidates"]}
    wo = rows[("quant:int8wo", 4)]
    assert wo["reference_batch_size"] == 2 and wo["psnr"] == 100 and wo["ssim"] == 1.0 and len(wo["images"]) == 2
    assert wo["time_vs_full"] == 1.0 and wo["verdict"] in ("chosen", "within budget")
    assert rows[("quant:int8dq", 4)]["refused"] == "out of memory"
    assert rows[("quant:int8dq", 8)]["refused"] == "out of memory at batch size 4"
    assert rows[("taylorseer", 4)]["refused"] == "full compute ran out of memory at batch size 4"
    assert "against its batch 2" in q._speedup_status(wo)


def test_ssim_is_one_for_identical_images_and_falls_with_noise():
    rng = np.random.default_rng(0)
    a = np.zeros((64, 64, 3), dtype=np.uint8)
    a[:, 32:] = 200  # two flat halves: structure that noise destroys
    assert q.ssim(a, a) == pytest.approx(1.0)
    noisy = np.clip(a.astype(int) + rng.integers(-20, 20, a.shape), 0, 255).astype(np.uint8)
    value = q.ssim(a, noisy)
    assert 0 < value < 0.5 and value == pytest.approx(q.ssim(noisy, a))
    slight = np.clip(a.astype(int) + rng.integers(-1, 2, a.shape), 0, 255).astype(np.uint8)
    assert value < q.ssim(a, slight) < 1.0


# -- the command line -----------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--profile", "p.json"], "--profile tune(s) speed-ups: add --speedups"),
    (["--speedups", "--profile", "p.txt"], "name it FILE.json"),
    (["--speedups", "--budget-ssim", "1.5"], "--budget-ssim"),
])
def test_speedup_options_are_checked_before_anything_runs(tiny_model, args, message):
    result = CliRunner().invoke(app, ["qualify", "--model", tiny_model, *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and message in result.output


def test_speedup_options_are_on_the_command():
    result = CliRunner().invoke(app, ["qualify", "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    for option in ("--speedups", "--profile", "--budget-psnr", "--budget-ssim", "--max-candidates",
                   "--max-batch-size"):
        assert option in result.output
