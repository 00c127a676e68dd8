"""Assertions on a finished run folder: what every end-to-end test checks."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

from diffq.core.records import ImageRecord
from diffq.core.runfolder import iter_records
from diffq.core.storage import open_storage


# What the task measures and hands the sink with a batch (worker/delivery/tasks.py), for
# tests that drive the sink directly.
MEASURED = {"device": "cpu:0", "worker": "w@test", "generate_s": 0.1, "generate_started_at": 1.7e9,
            "generate_ended_at": 1.7e9 + 0.1}


def expected_rows(prompts_path: Path, height: int = 128, width: int = 128) -> dict[str, dict]:
    rows = {}
    for line in prompts_path.read_text().splitlines():
        row = json.loads(line)
        rows[row["id"]] = {"prompt": row["prompt"], "height": row.get("height", height),
                           "width": row.get("width", width), "seed": row.get("seed")}
    return rows


def assert_run_complete(out: str, prompts_path: Path, steps: int, model: str) -> list[ImageRecord]:
    """Every item exactly once; every image decodes at its size; metadata matches the input."""
    storage = open_storage(out)
    expected = expected_rows(prompts_path)
    record_lines = [json.loads(line)
                    for key in storage.list("records/")
                    for line in storage.get_bytes(key).decode().splitlines() if line]
    ids = [r["id"] for r in record_lines]
    assert sorted(ids) == sorted(expected), "each item recorded exactly once"
    records = list(iter_records(storage))
    for record in records:
        want = expected[record.id]
        assert record.prompt == want["prompt"]
        assert (record.height, record.width) == (want["height"], want["width"])
        if want["seed"] is not None:
            assert record.seed == want["seed"]
        assert record.steps == steps and record.model == model
        image = Image.open(io.BytesIO(storage.get_bytes(record.file_name)))
        image.load()
        assert image.size == (want["width"], want["height"])
    images = [k for k in storage.list("images/")]
    assert len(images) == len(expected)
    return records


def start_workers(broker: str, queues: list[str], model: str, n: int = 2, **spec_fields):
    """n real worker processes (spawned, pinned, solo pool) on `queues`."""
    from diffq.worker.process.supervisor import Supervisor, plan_children

    spec_fields.setdefault("loglevel", "ERROR")
    supervisor = Supervisor(plan_children(device="cpu", devices=list(range(n)), broker_url=broker,
                                          queues=queues, models=[model], **spec_fields))
    supervisor.start()
    return supervisor


def wait_until(out: str, supervisor, predicate, timeout: float = 300.0):
    """Poll the run folder until `predicate(status)` holds; restarts dead workers meanwhile."""
    import time

    from diffq.results.status import status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(out)
        if predicate(st):
            return st
        supervisor.poll()
        assert not supervisor.all_fatal, "workers could not start"
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s: {status(out)}")


def diffq(*args, check=True):
    """Run the `diffq` CLI in a fresh interpreter, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "diffq", *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"diffq {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def patched(obj, **attributes):
    """A copy of `obj` with `attributes` set on it: a broker object (diffq/core/brokers/)
    with one of its methods replaced or switched off (None)."""
    import copy

    clone = copy.copy(obj)
    for name, value in attributes.items():
        setattr(clone, name, value)
    return clone
