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


class _Workers:
    """Stands in for the run's stop event: each wait of the publisher is a look's worth of
    the workers' consumption (`per_look` messages taken from the queue folder)."""

    def __init__(self, queue_dir, per_look):
        self.queue_dir, self.per_look, self.looks, self.deepest = queue_dir, per_look, 0, 0

    def wait(self, timeout):
        self.looks += 1
        for name in sorted(p.name for p in self.queue_dir.iterdir())[: self.per_look]:
            (self.queue_dir / name).unlink()
        return False


class _Files:
    def __init__(self, queue_dir, workers):
        self.queue_dir, self.workers, self.count = queue_dir, workers, 0

    def publish(self, message):
        self.count += 1
        (self.queue_dir / f"{self.count:06d}.diffq.msg").write_text("m")
        self.workers.deepest = max(self.workers.deepest, sum(1 for _ in self.queue_dir.iterdir()))


@pytest.mark.parametrize("per_look, grows", [(10_000, True), (1, False)], ids=["fast device", "slow device"])
def test_the_embedded_backlog_grows_to_what_the_workers_drain_between_two_looks(tmp_path, monkeypatch,
                                                                                per_look, grows):
    from diffq.app.runner import BoundedPublisher

    monkeypatch.setattr(BoundedPublisher, "MOST_BACKLOG", 128)
    workers = _Workers(tmp_path, per_look)
    publisher = BoundedPublisher(_Files(tmp_path, workers), tmp_path, 16, workers)
    for n in range(400):
        publisher.publish({"n": n})
    if grows:  # found drained at every look: waves of 16, 32, 64, then 128, the ceiling
        assert publisher.max_backlog == 128 and workers.deepest == 128
    else:  # never found drained: the first bound holds
        assert publisher.max_backlog == 16 and workers.deepest == 16
