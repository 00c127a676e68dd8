"""`diffq run --lora-mode swap|fuse|compile` end to end on the tiny FLUX.1 pipeline,
`--compile regional`, rows over three adapter sets (one stacked) and none: every image
once, within 2 levels of swap's, every record and image naming its mode, the graphs
each mode compiles; `status --by-adapter` shows the mode. Then the stand-in for a backend
that bakes weights (Inductor's freezing, TORCHINDUCTOR_FREEZING=1 in the worker's
environment: torch/_inductor/config.py reads it; a pipeline call runs without grad): a swap
run fails its adapter batches with the change check's reason and writes none of their
images; a compile run's images match diffusers with the adapters fused the ordinary way."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from diffq.core.runfolder import iter_records, read_failures
from diffq.core.storage import open_storage
from tests.test_lora import flux, loras  # noqa: F401  (fixtures)
from tests.test_lora_modes import LEVELS, _fused_plain

SIDE, STEPS, BATCH = 64, 2, 2
# id -> (prompt index: "a tiny prompt K" at seed K, as tests/test_lora.py's items; the row's `lora`).
ROWS = {"base-0": (0, "none"), "base-1": (1, "none"),
        "r4-0": (0, "R4@0.8"), "r4-1": (1, "R4@0.8"),
        "r8-0": (0, "R8@0.5"), "r8-1": (1, "R8@0.5"),
        "stack-0": (0, ["R4@0.8", "R8@0.5"]), "stack-1": (1, ["R4@0.8", "R8@0.5"])}
SETS = {"base": (), "r4": ((4, 0.8),), "r8": ((8, 0.5),), "stack": ((4, 0.8), (8, 0.5))}


def _run(root: Path, flux, loras, mode: str, *, frozen: bool = False) -> tuple[Path, str]:
    from tests.helpers import diffq

    paths = {"R4": loras[4], "R8": loras[8]}

    def spelled(value):
        if isinstance(value, list):
            return [spelled(one) for one in value]
        name, at, scale = value.partition("@")
        return paths.get(name, name) + at + scale

    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": item_id, "prompt": f"a tiny prompt {k}", "seed": k,
                                           "lora": spelled(lora)}) + "\n" for item_id, (k, lora) in ROWS.items()))
    out = root / "out"
    with pytest.MonkeyPatch.context() as env:
        if frozen:
            env.setenv("TORCHINDUCTOR_FREEZING", "1")
        proc = diffq("run", str(prompts), "--model", flux, "--out", str(out), "--batch-size", str(BATCH),
                     "--steps", str(STEPS), "--max-sequence-length", "16", "--height", str(SIDE), "--width",
                     str(SIDE), "--compile", "regional", "--lora-mode", mode, "--no-progress", check=False)
    return out, proc.stdout + proc.stderr


def _images(out: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    storage = open_storage(str(out))
    return {record.id: np.asarray(Image.open(io.BytesIO(storage.get_bytes(record.file_name))).convert("RGB"))
            .astype(np.int16) for record in iter_records(storage)}


@pytest.fixture(scope="module")
def runs(flux, loras, tmp_path_factory):
    """One run per mode: mode -> its OUT."""
    found = {}
    for mode in ("swap", "fuse", "compile"):
        out, said = _run(tmp_path_factory.mktemp(f"run-{mode}"), flux, loras, mode)
        assert f"{len(ROWS)}/{len(ROWS)} images, 0 failed" in said, said
        found[mode] = out
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fuse", "compile"])
def test_every_image_once_within_two_levels_of_swaps(runs, mode):
    swapped, images = _images(runs["swap"]), _images(runs[mode])
    storage = open_storage(str(runs[mode]))
    assert sorted(record.id for record in iter_records(storage)) == sorted(ROWS)
    assert len(list(storage.list("images/"))) == len(ROWS)
    for item_id in ROWS:
        assert np.abs(images[item_id] - swapped[item_id]).max() <= LEVELS, item_id
    assert np.abs(images["stack-0"] - images["r4-0"]).max() > 10 * LEVELS  # the sets differ


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "fuse", "compile"])
def test_records_and_images_name_the_mode_and_graphs_stay_compiled(runs, mode):
    from PIL import Image

    storage = open_storage(str(runs[mode]))
    records = list(iter_records(storage))
    assert {record.lora_mode for record in records} == {mode}
    for record in records:
        embedded = Image.open(io.BytesIO(storage.get_bytes(record.file_name))).text
        assert embedded["lora_mode"] == mode
    batches = sorted({record.batch_id: record for record in records}.values(), key=lambda r: r.generate_started_at)
    assert len(batches) == len(SETS) and batches[0].graphs_compiled > 0
    # On CPU Inductor every mode reads the weights as graph inputs: nothing compiles after
    # the first batch (compile: "at most one compiling batch per set per worker life").
    assert [batch.graphs_compiled for batch in batches[1:]] == [0] * (len(batches) - 1)


@pytest.mark.slow
def test_status_by_adapter_shows_the_mode(runs):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["status", str(runs["fuse"]), "--by-adapter", "--json"])
    assert result.exit_code == 0, result.output
    groups = json.loads(result.output)["adapter_sets"]  # from the credits, which name the mode
    assert len(groups) == len(SETS) and {group["lora_mode"] for group in groups} == {"fuse"}
    table = CliRunner().invoke(app, ["status", str(runs["compile"]), "--by-adapter"], env={"COLUMNS": "300"})
    assert table.exit_code == 0 and "mode" in table.output and "compile" in table.output


# --- the stand-in: a backend that bakes weights -----------------------------------------


@pytest.mark.slow
def test_under_the_stand_in_a_swap_run_fails_its_adapter_batches_and_writes_none_of_their_images(
        flux, loras, tmp_path):
    out, said = _run(tmp_path, flux, loras, "swap", frozen=True)
    assert f"2/{len(ROWS)} images, 6 failed" in said, said
    storage = open_storage(str(out))
    assert sorted(record.id for record in iter_records(storage)) == ["base-0", "base-1"]
    assert len(list(storage.list("images/"))) == 2
    failures = list(read_failures(storage))
    assert sorted(item for failure in failures for item in failure.item_ids) == sorted(
        item for item in ROWS if not item.startswith("base"))
    assert all("did not show in the transformer's output" in failure.error or "serves no more LoRA adapters"
               in failure.error for failure in failures)
    assert any("LoraChangeUnseen" in failure.error for failure in failures)


@pytest.mark.slow
def test_under_the_stand_in_a_compile_run_matches_diffusers_fused_the_ordinary_way(flux, loras, tmp_path):
    out, said = _run(tmp_path, flux, loras, "compile", frozen=True)
    assert f"{len(ROWS)}/{len(ROWS)} images, 0 failed" in said, said
    images = _images(out)
    import torch

    with torch._inductor.config.patch(freezing=True):
        for name, stack in SETS.items():
            plain = _fused_plain(flux, tuple((loras[rank], scale) for rank, scale in stack))
            pair = np.stack([images[f"{name}-0"], images[f"{name}-1"]])
            assert np.abs(pair - plain).max() <= LEVELS, name
    torch._dynamo.reset()


# --- publishing grouped by set ----------------------------------------------------------

# 24 sets (two ranks, twelve scales each), three rows each, written round-robin: bucketed
# alone each set's batch fills after every other set's (s0 s1 … s23 s0 …); published
# grouped by set (producer/submit.py `grouped_by_set`). Batch size 1, so a worker serving
# n batches would change sets about n times in the file's order: more than the bound below.
MIXED_SETS, PER_SET, MIXED_WORKERS = 24, 3, 2


def set_changes(records) -> dict[str, tuple[int, int]]:
    """worker -> (set changes, sets served), from its records in the order it generated
    them (its first set counts as a change)."""
    per_worker: dict[str, list] = {}
    for record in sorted({record.batch_id: record for record in records}.values(),
                         key=lambda r: r.generate_started_at):
        per_worker.setdefault(record.worker, []).append(json.dumps(record.adapters))
    return {worker: (sum(1 for k, s in enumerate(sets) if k == 0 or sets[k - 1] != s), len(set(sets)))
            for worker, sets in per_worker.items()}


@pytest.mark.slow
def test_a_mixed_run_of_24_sets_under_fuse_changes_sets_about_once_per_set(flux, loras, tmp_path):
    from tests.helpers import diffq

    sets = [f"{loras[rank]}@{scale / 10:g}" for rank in (4, 8) for scale in range(1, 13)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"row-{k}", "prompt": f"a tiny prompt {k % 3}", "seed": k,
                                           "lora": sets[k % MIXED_SETS]}) + "\n"
                               for k in range(MIXED_SETS * PER_SET)))
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", flux, "--out", str(out), "--batch-size", "1", "--steps", "1",
                 "--max-sequence-length", "16", "--height", str(SIDE), "--width", str(SIDE),
                 "--workers", str(MIXED_WORKERS), "--lora-mode", "fuse", "--no-progress", check=False)
    total = MIXED_SETS * PER_SET
    assert f"{total}/{total} images, 0 failed" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    records = list(iter_records(open_storage(str(out))))
    assert len({json.dumps(record.adapters) for record in records}) == MIXED_SETS
    changes = set_changes(records)
    print("set changes per worker (changes, sets served):", changes)
    assert sum(1 for _ in records) == total and changes
    for worker, (changed, served) in changes.items():
        assert changed <= served + 1, (worker, changes)
