"""`status --by-adapter` from the progress summary (issue 64): a run submitted with three
adapter sets (real adapter checks on the tiny FLUX.1 pipeline), its batches stored and
credited by the real sink or failed by the worker's own failure writer, one set failing
every batch: done / failed / pending per set, text and --json, without reading a record.
A run whose manifest predates `adapter_sets` says so and falls back to the records."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from diffq.app.cli import app
from diffq.core import adapters as A
from diffq.core import layout
from diffq.core.progress import ProgressLog, ProgressSummary
from diffq.core.storage import open_storage
from diffq.producer.submit import submit
from diffq.worker.delivery.failures import write_failure
from diffq.worker.sink.store import Sink
from tests.helpers import MEASURED
from tests.test_lora import flux, loras  # noqa: F401  (fixtures)
from tests.test_lora_run import ARGS, Recording, _jsonl


@pytest.fixture(scope="module")
def run(flux, loras, tmp_path_factory):  # noqa: F811
    """12 rows per set (6 batches of 2) over r4, r8 and r16; every r16 batch fails, two of
    r8's are not done yet (pending), the rest stored and credited."""
    tmp = tmp_path_factory.mktemp("sets")
    rows = [{"id": f"{rank}-{k}", "prompt": f"p {k}", "lora": loras[rank]} for rank in (4, 8, 16) for k in range(12)]
    recording, out = Recording(), str(tmp / "out")
    submit(_jsonl(tmp / "prompts.jsonl", rows), out, model=flux, publisher=recording, window=None, **ARGS)
    storage, sink = open_storage(out), Sink(threads=2)
    digests = {}
    try:
        by_rank = {}
        for message in recording.published:
            rank = int(message.items[0].id.split("-")[0])
            digests[rank] = A.set_digest(message.params.adapters)
            by_rank.setdefault(rank, []).append(message)
        for rank, messages in by_rank.items():
            for n, message in enumerate(messages):
                if rank == 16:
                    write_failure(storage, message, "RuntimeError: this adapter breaks the call", 3, "w-0")
                elif not (rank == 8 and n >= 4):
                    images = [np.zeros((ARGS["height"], ARGS["width"], 3), np.uint8) for _ in message.items]
                    handed = sink.submit(storage, message, images, {**MEASURED, "lora_mode": "swap"})
                    handed.stored.result(timeout=60)
                    handed.credited.result(timeout=60)
    finally:
        sink.close()
    return out, digests, loras


def test_status_by_adapter_counts_done_failed_and_pending_per_set_from_the_summary(run, monkeypatch):
    out, digests, loras = run
    # Not one record is read: the view is the summary's (a records read would fail here).
    monkeypatch.setattr("diffq.results.status.read_records", lambda *a, **k: pytest.fail("records read"))
    result = CliRunner().invoke(app, ["status", out, "--by-adapter", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {row["set"]: row for row in data["adapter_sets"]}
    assert set(rows) == set(digests.values())
    assert {rank: (rows[d]["items"], rows[d]["done"], rows[d]["failed"], rows[d]["pending"])
            for rank, d in digests.items()} == {4: (12, 12, 0, 0), 8: (12, 8, 0, 4), 16: (12, 0, 12, 0)}
    assert rows[digests[4]]["lora_mode"] == "swap" and rows[digests[16]]["lora_mode"] == "-"
    assert rows[digests[16]]["adapters"][0]["path"] == loras[16]
    assert (data["done"], data["failed"], data["pending"]) == (20, 12, 4)
    text = CliRunner().invoke(app, ["status", out, "--by-adapter"], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    line = next(line for line in text.output.splitlines() if line.startswith(digests[16]))
    # Paths shortened to what tells them apart: the file names, not the folder they share.
    assert line.split() == [digests[16], "r16@1", "-", "12", "0", "12", "0"], line


def test_a_redelivered_credit_and_a_failure_retried_into_done_count_once(run, tmp_path):
    out, digests, _ = run
    storage = open_storage(out)
    before = ProgressSummary(storage).refresh()
    again = ProgressLog(storage, writer="again")
    log_keys = [key for key in storage.list(layout.PROGRESS_PREFIX)]
    assert log_keys
    # A second writer crediting a batch already credited (a redelivery): the same counts.
    from diffq.core.progress import parse_segment
    batch_id, queue, items, _ = next(parse_segment(storage.get_bytes(log_keys[0])))
    again.add(batch_id, queue, [f"x{n}" for n in range(items)], adapter_set=digests[4], mode="swap")
    again.flush()
    after = ProgressSummary(storage).refresh()
    assert after.done_per_set == before.done_per_set and after.failed_per_set == before.failed_per_set
    storage.delete(layout.progress_key("again", 0))


def test_a_run_without_adapter_sets_in_its_manifest_says_so(tmp_path):
    from tests.test_lora_sources import _adapter_run

    url = str(tmp_path / "old")
    _adapter_run(url)  # a hand-made run folder whose manifest predates adapter_sets
    result = CliRunner().invoke(app, ["status", url, "--by-adapter", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert "adapter_sets" not in data and "lists no adapter sets" in data["adapter_note"]
    assert sum(group["images"] for group in data["by_adapter"]["adapters"]) == 64
