"""`diffq run`: the embedded default, end to end through real worker processes."""

import json

import pytest

from diffq.results.status import status
from tests.helpers import assert_run_complete, diffq

pytestmark = pytest.mark.slow


def test_run_mixed_shapes_with_two_workers(tmp_path, tiny_model):
    prompts = tmp_path / "mixed.jsonl"
    rows = [{"id": f"item-{i}", "prompt": f"prompt number {i}"} for i in range(11)]
    for i, row in enumerate(rows):
        if i % 3 == 1:
            row.update(height=64, width=64)
        if i % 3 == 2:
            row.update(height=64, width=128, seed=42 + i)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", tiny_model, "--out", str(out), "--workers", "2",
                 "--batch-size", "3", "--steps", "2", "--format", "jpeg", "--no-progress")
    assert "11/11 images, 0 failed" in proc.stdout
    records = assert_run_complete(str(out), prompts, steps=2, model=tiny_model)
    assert all(r.file_name.endswith(".jpg") for r in records)
    st = status(str(out))
    assert (st.total, st.done, st.failed) == (11, 11, 0)
    assert len(st.shapes) == 3 and all(s.done == s.total for s in st.shapes.values())


def test_run_flux1_family(tmp_path, tiny_pipelines):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"p {i}", "height": 64, "width": 64}) + "\n"
                               for i in range(3)))
    out = tmp_path / "out"
    diffq("run", str(prompts), "--model", tiny_pipelines["flux"], "--out", str(out), "--batch-size", "2",
          "--steps", "2", "--guidance-scale", "3.5", "--no-progress")
    assert_run_complete(str(out), prompts, steps=2, model=tiny_pipelines["flux"])


def test_bad_row_enqueues_nothing_and_names_the_line(tmp_path, tiny_model):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "bad", "height": 100}\n')
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", tiny_model, "--out", str(out), check=False)
    assert proc.returncode == 2
    assert f"{prompts}:2: field 'height': 100 is not a multiple of 16" in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_missing_model_fails_fast_with_a_clear_message(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n')
    proc = diffq("run", str(prompts), "--model", "black-forest-labs/FLUX.2-klein-4B", "--out", str(tmp_path / "o"),
                 check=False)
    assert proc.returncode == 2
    assert "not a local folder, not in the Hugging Face cache" in proc.stderr.replace("\n", " ")


def test_run_again_on_a_finished_run_changes_nothing_and_refuses_other_options_or_rows(tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "ok", "height": 64, "width": 64}\n')
    out = tmp_path / "out"
    args = ["run", str(prompts), "--model", tiny_model, "--out", str(out), "--steps", "1", "--no-progress"]
    diffq(*args)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    # The same file and options: the run is done, nothing is started or written.
    assert "1/1 images, 0 failed: nothing left to run" in diffq(*args).stdout
    # Other options (here the default --steps) or other rows would mix two runs in one OUT.
    proc = diffq("run", str(prompts), "--model", tiny_model, "--out", str(out), check=False)
    assert proc.returncode == 2 and "--steps: 1 in OUT's manifest, 4 now" in proc.stderr.replace("\n", "")
    prompts.write_text('{"id": "a", "prompt": "another", "height": 64, "width": 64}\n')
    proc = diffq(*args, check=False)
    assert proc.returncode == 2 and "the file changed since the run began" in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
    assert before == {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}

