"""A `diffq run` killed part-way is finished without servers: `diffq run` again with the
same file and options, or `diffq resume OUT` with no broker. Every item exactly once,
under the run's own run id and seeds; nothing stored before the kill is written again."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffq.core import layout
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.producer.sources import derive_seed
from diffq.results.status import status
from tests.helpers import assert_run_complete, diffq

pytestmark = pytest.mark.slow

TOTAL, BATCH = 12, 2
HOLD = "held back"


def _args(prompts: Path, out: Path, model: str, steps: int = 2) -> list[str]:
    return ["run", str(prompts), "--model", model, "--out", str(out), "--batch-size", str(BATCH),
            "--steps", str(steps), "--no-progress"]


def _group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie (a zombie writes nothing)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _snapshot(out: Path) -> dict[Path, tuple[int, bytes]]:
    return {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in out.rglob("*") if path.is_file()}


def _interrupted_run(tmp_path: Path, model: str):
    """Start `diffq run`, SIGKILL its whole process group (runner, workers, sink helpers)
    once at least one batch is recorded. The last batch's prompts hold the worker for
    10 minutes (DIFFQ_FAULT_HOLD, this process only), so the run cannot finish first."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"item-{i:02d}", "prompt": f"prompt {i}" + (f" {HOLD}" if i >= TOTAL - BATCH else ""),
             "height": 64, "width": 64} for i in range(TOTAL)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()
    # TMPDIR: the killed runner's embedded broker folder is left behind; keep it in tmp_path.
    env = {**os.environ, "DIFFQ_FAULT_HOLD": f"{HOLD}:600", "TMPDIR": str(tmp_path / "tmp")}
    with open(tmp_path / "run.log", "wb") as log:
        # Two workers: the held batch may be delivered first (same-millisecond names sort
        # by their uuid), and a worker holding it takes nothing else (its calls are not
        # known to be short); the other one records the first batches.
        proc = subprocess.Popen([sys.executable, "-m", "diffq", *_args(prompts, out, model), "--workers", "2"],
                                env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "records").glob("*.jsonl")):
            assert proc.poll() is None, f"diffq run exited early:\n{(tmp_path / 'run.log').read_text()}"
            assert time.monotonic() < deadline, f"no batch recorded:\n{(tmp_path / 'run.log').read_text()}"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The workers and sinks are the runner's children: wait until the kill reached them all.
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid):
        assert time.monotonic() < deadline, "the killed run's processes are still running"
        time.sleep(0.05)
    done = {record.id: record for record in iter_records(open_storage(str(out)))}
    assert 0 < len(done) < TOTAL, "killed part-way"
    images = {out / record.file_name for record in done.values()}
    return prompts, out, done, {path: seen for path, seen in _snapshot(out).items() if path in images}


def _assert_finished(out: Path, prompts: Path, model: str, done_before: dict, images_before: dict) -> None:
    records = assert_run_complete(str(out), prompts, steps=2, model=model)  # each item recorded exactly once
    record_lines = sum(len(p.read_text().splitlines()) for p in (out / "records").glob("*.jsonl"))
    assert record_lines == TOTAL
    manifest = read_manifest(open_storage(str(out)))
    # The continued items have the seeds of the run that began (its run id's), not new ones.
    assert {r.run_id for r in records} == {manifest.run_id}
    assert all(r.seed == derive_seed(manifest.defaults.seed_base, r.id) for r in records)
    after = {r.id: r for r in records}
    assert all(after[item].batch_id == record.batch_id for item, record in done_before.items())
    # Stored before the kill: not generated again, not rewritten.
    assert {path: seen for path, seen in _snapshot(out).items() if path in images_before} == images_before
    st = status(str(out))
    assert (st.total, st.done, st.failed, st.pending) == (TOTAL, TOTAL, 0, 0)


def test_run_again_with_the_same_args_finishes_the_run(tmp_path, tiny_model):
    prompts, out, done, images = _interrupted_run(tmp_path, tiny_model)
    proc = diffq(*_args(prompts, out, tiny_model))
    assert f"{TOTAL}/{TOTAL} images, 0 failed" in proc.stdout
    assert f"continued: {len(done)} were done before" in proc.stdout
    _assert_finished(out, prompts, tiny_model, done, images)
    # Finished: the same command again starts nothing and changes nothing.
    before = _snapshot(out)
    proc = diffq(*_args(prompts, out, tiny_model))
    assert f"{TOTAL}/{TOTAL} images, 0 failed: nothing left to run" in proc.stdout
    assert _snapshot(out) == before


def test_resume_without_a_broker_finishes_the_run(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("DIFFQ_BROKER_URL", raising=False)
    prompts, out, done, images = _interrupted_run(tmp_path, tiny_model)
    proc = diffq("resume", str(out), "--no-progress")
    assert f"{TOTAL}/{TOTAL} images, 0 failed" in proc.stdout
    _assert_finished(out, prompts, tiny_model, done, images)


def test_run_again_with_other_steps_is_refused_and_changes_nothing(tmp_path, tiny_model):
    prompts, out, _, _ = _interrupted_run(tmp_path, tiny_model)
    before = _snapshot(out)
    proc = diffq(*_args(prompts, out, tiny_model, steps=3), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--steps: 2 in OUT's manifest, 3 now" in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
    assert _snapshot(out) == before


def test_a_plan_part_a_killed_submit_never_wrote_is_restored_by_run_not_guessed_by_resume(tmp_path, tiny_model):
    """A submit writes the manifest, then each plan part before publishing its batches:
    killed between parts, OUT lacks batches only the prompt file knows."""
    from diffq.app.runner import resume
    from diffq.producer.resume import PlanIncomplete, continuation
    from diffq.core.options import GenerationOptions
    from diffq.producer.submit import make_options, submit, validate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"p {i}"}) + "\n" for i in range(5)))
    out = str(tmp_path / "out")
    submit(prompts, out, model=tiny_model, publisher=_Discard(), batch_size=2)
    storage = open_storage(out)
    part = layout.plan_key(0)
    written = storage.get_bytes(part)
    storage.delete(part)
    with pytest.raises(PlanIncomplete, match="holds 0 of its run's 1 plan parts"):
        resume(out)
    options, defaults = make_options(model=tiny_model, options=GenerationOptions.of(batch_size=2))
    assert continuation(storage, read_manifest(storage), prompts=prompts, plan=validate(prompts, options, defaults),
                        options=options, defaults=defaults) == 1
    assert storage.get_bytes(part) == written  # the same batches, ids and seeds


class _Discard:
    def publish_encoded(self, encoded) -> None:
        pass


def test_a_second_runner_on_an_out_being_produced_is_refused(tmp_path, tiny_model):
    """Continuing a run another runner still produces would make its batches twice."""
    from diffq.app.run_out import RunOut

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "ok", "height": 64, "width": 64}\n')
    out = tmp_path / "out"
    with RunOut(str(out)).sole_runner():  # as a live `diffq run` holds it
        proc = diffq(*_args(prompts, out, tiny_model), check=False)
        assert proc.returncode == 2 and "another diffq run or resume is producing" in proc.stderr
    assert not out.exists()  # the lock left nothing behind


def test_resume_with_a_broker_refuses_local_worker_options(tmp_path):
    """With a broker, resume only re-enqueues: a --workers there would be silently unused."""
    proc = diffq("resume", str(tmp_path / "out"), "--broker", "redis://127.0.0.1:9/0", "--workers", "2",
                 "--threads", "2", check=False)
    assert proc.returncode == 2
    assert "--workers, --threads: options of local workers" in proc.stderr.replace("\n", "")


def test_resume_without_a_broker_refuses_the_feeders_options(tmp_path, monkeypatch):
    """Without a broker, resume feeds its own local workers: a --window or --feeds there would
    be silently unused."""
    monkeypatch.delenv("DIFFQ_BROKER_URL", raising=False)
    proc = diffq("resume", str(tmp_path / "out"), "--window", "8", "--feeds", str(tmp_path / "feeds"), check=False)
    assert proc.returncode == 2
    assert "--window, --feeds: options of a resume with a broker" in proc.stderr.replace("\n", "")
    assert not (tmp_path / "out").exists() and not (tmp_path / "feeds").exists()
