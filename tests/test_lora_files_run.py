"""One whole `diffq run --compile regional` (slow: a worker process and one compile) over
LoRA files as people have them, row by row: kohya, kohya under ComfyUI's
`diffusion_model.`, XLabs, a raw PEFT save, a kohya file whose text-encoder part the row
drops, the same adapters in diffusers' layout as diffusers' own `FluxPipeline.lora_state_dict`
converts them, a stack of two, none, and adapters with per-module alphas and ranks and
with use_rslora. Each converted file gives the pixels of its diffusers-layout twin, the
hot-swaps compile nothing after the worker's first batch, every record names the layout
the file came in and the text-encoder part dropped, and the scalings diffq writes give
the pixels of diffusers' ordinary load_lora_weights compiled the same way."""

from __future__ import annotations

import json

import pytest

import numpy as np

from tests.test_lora import BATCH, STEPS, _plain, flux, loras, tolerance  # noqa: F401  (fixtures)
from tests.test_lora_files import SAME, VISIBLE, _apart, files  # noqa: F401  (the files, built in the test)
from tests.test_lora_run import _images


def _rows(files, loras) -> dict[str, object]:
    return {"none": "none", "kohya": files["kohya"], "kohya_diffusers": files["kohya by diffusers"],
            "comfyui": files["comfyui"], "xlabs": files["xlabs"], "xlabs_diffusers": files["xlabs by diffusers"],
            "peft": files["peft"], "diffusers": loras[8],
            "kohya_te": {"path": files["kohya+te"], "text_encoder": "drop"},
            "stack": [files["kohya"], f"{files['xlabs']}@0.5"], "alphas": files["alphas"], "rslora": files["rslora"]}


@pytest.fixture(scope="module")
def files_run(flux, loras, files, tmp_path_factory):
    from tests.helpers import diffq

    root = tmp_path_factory.mktemp("lora-files-run")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{name}-{k}", "prompt": f"a tiny prompt {k}", "seed": k,
                                           "lora": spec}) + "\n"
                               for name, spec in _rows(files, loras).items() for k in range(BATCH)))
    out = root / "out"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DIFFQ_MODEL_CACHE", str(root / "model-cache"))
        proc = diffq("run", str(prompts), "--model", flux, "--out", str(out), "--batch-size", str(BATCH),
                     "--steps", str(STEPS), "--max-sequence-length", "16", "--height", "64", "--width", "64",
                     "--compile", "regional", "--no-progress")
    return out, proc


def test_every_layout_runs_with_the_pixels_of_diffusers_conversion(files_run, files, loras):
    out, proc = files_run
    count = len(_rows(files, loras)) * BATCH
    assert f"{count}/{count} images, 0 failed" in proc.stdout, proc.stdout + proc.stderr
    assert "Already found a `peft_config`" not in proc.stdout + proc.stderr  # peft's warning on a second slot
    images = _images(out)
    by_row = {name: [images[f"{name}-{k}"] for k in range(BATCH)] for name in _rows(files, loras)}
    for name, twin in [("kohya", "kohya_diffusers"), ("comfyui", "kohya_diffusers"), ("kohya_te", "kohya_diffusers"),
                       ("xlabs", "xlabs_diffusers"), ("peft", "diffusers")]:
        for got, want, none in zip(by_row[name], by_row[twin], by_row["none"]):
            assert _apart(got, want) <= SAME, name
            assert _apart(got, none) > VISIBLE, name


def test_hot_swaps_over_converted_files_compile_nothing_after_the_first_batch(files_run):
    from diffq.results.report import build_report

    out, _ = files_run
    graphs = build_report(str(out)).by_adapter.graphs
    assert graphs and all(g.compiled > 0 and g.steady == 0 for g in graphs.values()), graphs


def test_records_name_the_layout_and_the_dropped_text_encoder_part(files_run, files, loras):
    from diffq.core.runfolder import iter_records
    from diffq.core.storage import open_storage

    out, _ = files_run
    adapters = {record.id.rpartition("-")[0]: record.adapters for record in iter_records(open_storage(str(out)))}
    assert adapters["none"] is None
    assert [a.get("file_layout") for a in adapters["kohya"]] == ["kohya"]
    assert [a.get("file_layout") for a in adapters["comfyui"]] == ["comfyui"]
    assert [(a["file_layout"], a["text_encoder"]) for a in adapters["kohya_te"]] == [("kohya", "drop")]
    assert [(a["file_layout"], a["scale"]) for a in adapters["stack"]] == [("kohya", 1.0), ("xlabs", 0.5)]
    assert "file_layout" not in adapters["diffusers"][0] and "text_encoder" not in adapters["diffusers"][0]


@pytest.mark.slow
def test_alphas_rslora_and_mixed_ranks_match_load_lora_weights_compiled_the_same_way(files_run, files, flux,
                                                                                       tolerance):
    """Per-module alphas and ranks (alpha_pattern, rank_pattern) and use_rslora: the run's
    images within what compiling alone changes of diffusers' own load_lora_weights, its
    blocks compiled as the worker compiles them. (A kohya conversion's mixed ranks: its
    images are its diffusers twin's above, and that twin's are load_lora_weights' in
    test_lora_files.py, eager; a third compiled plain pipeline would add a minute here.)"""
    out, _ = files_run
    images = _images(out)
    for name in ("alphas", "rslora"):
        got = np.stack([images[f"{name}-{k}"] for k in range(BATCH)])
        assert np.abs(got - _plain(flux, True, files[name])).max() <= tolerance, name
        assert np.abs(got - np.stack([images[f"none-{k}"] for k in range(BATCH)])).max() > VISIBLE, name
