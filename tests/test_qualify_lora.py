"""`diffq qualify --lora A,B` (issue 50): on the device and compile mode asked, the
adapters' scaffold before the compile, then per adapter a hot-swapped batch and a
scale-only change, and back to none; each batch after the first must compile 0 graphs
and show its change in the images. Refused where the backend table has no `lora` row for
the device and compile mode; a bad adapter refused naming it, before any child starts.

End to end on the tiny FLUX.1 pipeline with `diffq tiny-lora` adapters of ranks 4
(q and v only) and 8, CPU Inductor, regional compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from diffq.app import qualify as q
from diffq.app.cli import app
from tests.test_lora import _safetensors, flux, loras  # noqa: F401  (fixtures: tiny FLUX.1, adapters of ranks 4, 8, 16)

SHAPE = "64x64"


def run(*args: str) -> tuple[int, dict | None, str]:
    proc = subprocess.run([sys.executable, "-m", "diffq", "qualify", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=900)
    report = json.loads(proc.stdout) if "--json" in args and proc.stdout.strip() else None
    return proc.returncode, report, proc.stdout + proc.stderr


def test_hot_swaps_compile_nothing_and_show_in_the_images(flux, loras, tmp_path):
    code, report, output = run("--model", flux, "--shapes", SHAPE, "--steps", "1", "--repeats", "1",
                               "--compile", "regional", "--lora", f"{loras[4]},{loras[8]}@0.8",
                               "--report", str(tmp_path / "r"), "--profile", str(tmp_path / "lora.json"), "--json")
    assert code == 0, output
    lora = report["lora"]
    assert [(s["change"], s["adapter"], s["scale"]) for s in lora["swaps"]] == [
        ("adapter", loras[4], 1.0), ("scale", loras[4], 0.5), ("adapter", loras[8], 0.8), ("scale", loras[8], 0.4),
        ("none", None, None)]
    # The scaffold went in before the compile: the measurement compiled the shape, and no
    # batch of the check compiled anything (its first, no adapter, found the shape served).
    assert report["shapes"][0]["first_call_graphs"] > 0 and lora["first_graphs"] == 0
    assert [s["graphs_compiled"] for s in lora["swaps"]] == [0] * 5 and lora["graphs_after_first"] == 0
    assert report["recompiles"]["steady"] == 0
    # Each change is seen in the pixels; back to none is the first batch's pixels again.
    assert all(s["vs_none"] > 0 and s["vs_previous"] > 0 for s in lora["swaps"][:4])
    assert lora["swaps"][4]["vs_none"] == 0 and lora["unseen"] == []
    assert all(s["swap_s"] > 0 for s in lora["swaps"])
    assert lora["swap_s"]["count"] == 2 and lora["scale_change_s"]["count"] == 2 and lora["none_s"]["count"] == 1
    assert lora["rank"] == 8 and lora["shape"] == SHAPE
    assert [(a["path"], a["scale"]) for a in lora["adapters"]] == [(loras[4], 1.0), (loras[8], 0.8)]
    assert all(a["revision"].startswith("sha256:") for a in lora["adapters"])  # pinned as submit pins them
    # The scaffold's zeros change no image: parity against a CPU reference that has none.
    assert report["parity"]["passed"]
    assert report["checks"]["lora"]["status"] == "pass" and report["passed"] is True
    assert "0 graphs compiled over 5 change(s)" in report["checks"]["lora"]["detail"]
    assert lora["lora_mode"] == "swap" and lora["refused"] is None and lora["change_check"]["showed"]
    assert lora["s_per_image_with"] > 0 and lora["s_per_image_without"] > 0
    text = q.render_text(report)
    assert f"lora {SHAPE} b1: --lora-mode swap, rank 8" in text and "PASS  lora:" in text
    page = (tmp_path / "r" / "index.html").read_text()
    assert "LoRA hot-swap" in page and loras[8] in page
    # --profile with --lora: the mode as measured, with the device and versions, for --lora-mode FILE.json.
    from diffq.core.profile import LoraProfile

    profile = LoraProfile.load(lora["profile"])
    assert (profile.model, profile.device, profile.compile) == (flux, "cpu", "regional") and "torch" in profile.versions
    [measured] = profile.measured
    assert (measured.mode, measured.ok, measured.s_per_image_with) == ("swap", True, lora["s_per_image_with"])
    from diffq.worker.device import lora_modes
    from diffq.worker.device.backends import get_backend

    here = {"generation": None, "models": [flux], "versions": lora_modes.installed_versions(get_backend("cpu"))}
    assert profile.versions == here["versions"] and profile.generation is None
    assert profile.lora_mode_for("cpu", "regional", **here)[0] == "swap"
    assert profile.lora_mode_for("cuda", "regional", **here) is None
    assert f"LoRA profile: {lora['profile']} (--lora-mode {lora['profile']}: auto through it)" in text


def test_a_recompile_or_an_unseen_swap_fails_the_check():
    def swap(change, graphs=0, vs_none=5, vs_previous=5):
        return {"change": change, "adapter": None if change == "none" else "a.safetensors",
                "scale": None if change == "none" else 1.0, "graphs_compiled": graphs, "swap_s": 0.01,
                "generate_s": 0.1, "vs_none": vs_none, "vs_previous": vs_previous}

    found = {"adapters": [{"path": "a.safetensors", "scale": 1.0, "revision": None}], "rank": 4, "targets": 2,
             "shape": SHAPE, "swaps": [swap("adapter"), swap("scale"), swap("none", vs_none=0)], "unseen": [],
             "recompiled": [], "refused": None, "swap_s": {"median": 0.01}, "scale_change_s": {"median": 0.01}}
    assert q.lora_check(found)["status"] == "pass"
    found["recompiled"] = ["scale a.safetensors 2"]
    check = q.lora_check(found)
    assert check["status"] == "fail" and "graphs compiled after the first batch: scale a.safetensors 2" in check["detail"]
    found["recompiled"] = []
    found["unseen"] = ["a.safetensors@1: the same pixels as without an adapter"]
    check = q.lora_check(found)
    assert check["status"] == "fail" and "not seen in the images: a.safetensors@1" in check["detail"]
    found["unseen"], found["refused"] = [], "--lora-mode swap: the change from none to a.safetensors@1 did not show"
    check = q.lora_check(found)
    assert check["status"] == "fail" and "change check: --lora-mode swap: the change" in check["detail"]


def test_which_batch_may_compile_is_the_modes():
    """Under swap and fuse no batch after the first may compile; under compile each new
    set may (a backend that bakes weights), but not going back to a set served before."""
    from diffq.core.adapters import AdapterLayout
    from diffq.worker.device.hotswap_check import ADAPTER, NONE, SCALE, HotswapCheck, Swap

    def swaps(*graphs):
        return [Swap(change=change, adapter=None if change == NONE else "a", scale=None if change == NONE else 1.0,
                     graphs_compiled=count, swap_s=0.01, generate_s=0.1, vs_none=0 if change == NONE else 5,
                     vs_previous=5) for change, count in zip((ADAPTER, SCALE, NONE), graphs)]

    layout = AdapterLayout(targets=("x",), rank=4)
    assert [s.change for s in HotswapCheck(layout, 0, mode="swap", swaps=swaps(2, 0, 0)).recompiled] == [ADAPTER]
    assert HotswapCheck(layout, 0, mode="compile", swaps=swaps(2, 2, 0)).ok
    assert [s.change for s in HotswapCheck(layout, 0, mode="compile", swaps=swaps(2, 2, 1)).recompiled] == [NONE]


def test_unseen_swaps_are_read_from_the_pixels():
    from diffq.worker.device.hotswap_check import BACK_TO_NONE_LEVELS, Swap

    def swap(change, scale, vs_none, vs_previous):
        return Swap(change=change, adapter="a" if scale is not None else None, scale=scale, graphs_compiled=0,
                    swap_s=0.01, generate_s=0.1, vs_none=vs_none, vs_previous=vs_previous)

    assert swap("adapter", 1.0, 0, 0).unseen == "a@1: the same pixels as without an adapter"
    assert swap("adapter", 0.0, 0, 3).unseen is None  # scale 0 is no adapter
    assert swap("scale", 0.5, 3, 0).unseen == "a@0.5: the same pixels as at its previous scale"
    assert swap("none", None, BACK_TO_NONE_LEVELS, 9).unseen is None
    assert "stale adapter" in swap("none", None, BACK_TO_NONE_LEVELS + 1, 9).unseen


def test_under_the_stand_in_swap_fails_its_change_check(flux, loras, monkeypatch, tmp_path):
    """Inductor's freezing (TORCHINDUCTOR_FREEZING=1, torch/_inductor/config.py) bakes the
    weights into the graphs, as Neuron and TPU do: a swap writes what the graphs never
    read. (compile under the stand-in: tests/test_lora_modes.py, host and run.)"""
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    args = ("--model", flux, "--shapes", SHAPE, "--steps", "1", "--repeats", "1", "--compile", "regional",
            "--lora", f"{loras[4]},{loras[8]}@0.8", "--json")
    code, report, output = run(*args, "--lora-mode", "swap", "--profile", str(tmp_path / "lora.json"))
    assert code == 1, output
    lora, check = report["lora"], report["checks"]["lora"]
    assert lora["lora_mode"] == "swap" and lora["swaps"] == [] and lora["change_check"]["moved"] == 0
    assert "--lora-mode swap: the change from none to" in lora["refused"] and "did not show" in lora["refused"]
    assert check["status"] == "fail" and check["detail"].count("change check: --lora-mode swap") == 1
    # The profile keeps the failure: `auto` through it never picks a mode that did not show.
    from diffq.core.profile import LoraProfile

    [measured] = LoraProfile.load(tmp_path / "lora.json").measured
    assert (measured.mode, measured.ok) == ("swap", False) and "did not show" in measured.refused
    assert LoraProfile.load(tmp_path / "lora.json").lora_mode_for("cpu", "regional", generation=None) is None


def test_a_device_row_without_a_lora_row_is_refused_before_any_child(flux, loras, monkeypatch):
    # The Neuron row faked without a `lora` row for --compile full (the real one has one).
    import dataclasses

    from diffq.worker.device import backends

    neuron = backends.BACKENDS["neuron"]
    monkeypatch.setitem(backends.BACKENDS, "neuron", dataclasses.replace(
        neuron, lora={mode: facts for mode, facts in neuron.lora.items() if mode != "full"}))
    result = CliRunner().invoke(app, ["qualify", "--model", flux, "--device", "neuron", "--compile", "full",
                                      "--lora", loras[8]], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert ("error: --lora refused: LoRA adapters on --device neuron --compile full: the backend table has no LoRA "
            "row") in result.output


@pytest.mark.parametrize("bad, why", [
    ("missing", "no such file"),
    ("corrupt", "corrupt header"),
    ("text_encoder", "text-encoder LoRA"),
    ("other_model", "another model"),
])
def test_a_bad_adapter_is_refused_naming_it(flux, loras, tmp_path, bad, why):
    path = str(tmp_path / f"{bad}.safetensors")
    if bad == "corrupt":
        _safetensors(tmp_path / f"{bad}.safetensors", {}, raw=b"{not json")
    elif bad == "text_encoder":
        _safetensors(tmp_path / f"{bad}.safetensors",
                     {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": [4, 16]})
    elif bad == "other_model":
        _safetensors(tmp_path / f"{bad}.safetensors",
                     {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": [4, 3072],
                      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": [3072, 4]})
    result = CliRunner().invoke(app, ["qualify", "--model", flux, "--lora", f"{loras[4]},{path}@0.5"],
                                env={"COLUMNS": "1000"})
    assert result.exit_code == 2, result.output
    assert f"error: --lora {path}@0.5: {path}: " in result.output and why in result.output
    assert result.exception.__class__ is SystemExit


def test_an_adapter_named_twice_and_none_at_all_are_refused(flux, loras):
    for given, message in ((f"{loras[4]},{loras[4]}@0.5", f"names {loras[4]} twice"), (",", "names no adapter")):
        result = CliRunner().invoke(app, ["qualify", "--model", flux, "--lora", given], env={"COLUMNS": "1000"})
        assert result.exit_code == 2 and message in result.output, result.output


def test_a_text_encoder_part_is_refused_unless_lora_text_encoder_drop(flux, tmp_path):
    """qualify takes --lora-text-encoder as run, submit and plan do (core/options.py):
    refused by default naming the option; with drop the file passes and the next adapter's
    fault is the one said (no device is started to find it)."""
    from tests.test_lora_files import KOHYA, TE, _kohya, _random

    te = {f"{TE}.lora_down.weight": torch.zeros(4, 32), f"{TE}.lora_up.weight": torch.zeros(32, 4)}
    path = _kohya(_random(flux, KOHYA, seed=5), tmp_path / "kohya-te.safetensors", extra=te)
    missing = str(tmp_path / "missing.safetensors")
    for given, says in (([], f"error: --lora {path}: {path}: has a text-encoder LoRA part"),
                        (["--lora-text-encoder", "drop"], f"error: --lora {missing}: {missing}: no such file")):
        result = CliRunner().invoke(app, ["qualify", "--model", flux, "--lora", f"{path},{missing}", *given],
                                    env={"COLUMNS": "1000"})
        assert result.exit_code == 2, result.output
        assert says in result.output, result.output
    assert "--lora-text-encoder drop" in CliRunner().invoke(
        app, ["qualify", "--model", flux, "--lora", path], env={"COLUMNS": "1000"}).output
    plan = q.plan_lora(q.get_backend("cpu"), "none", flux, [path], text_encoder="drop")
    assert [(ref.text_encoder, ref.file_layout) for ref in plan.refs] == [("drop", "kohya")]
