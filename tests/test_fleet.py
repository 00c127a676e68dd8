"""The fleet path for real: submit to a private Redis, two spawned workers, outputs
on local disk, S3 (moto server over HTTP) and GCS (fake-gcs-server over HTTP)."""

import json
import pytest
from PIL import Image

from diffq.results.fetch import fetch
from diffq.results.status import status
from diffq.producer.submit import submit
from tests.helpers import assert_run_complete, expected_rows, start_workers, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def prompts_file(tmp_path):
    rows = [{"id": f"p{i:02d}", "prompt": f"a photo of thing {i}"} for i in range(10)]
    for i in (1, 4, 7):
        rows[i].update(height=64, width=64, seed=1000 + i)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("where", ["local", "s3", "gcs"])
def test_submit_two_workers_status_fetch(where, request, tmp_path, prompts_file, redis_server, tiny_model):
    out = {"local": lambda: str(tmp_path / "run"),
           "s3": lambda: request.getfixturevalue("s3_bucket"),
           "gcs": lambda: request.getfixturevalue("gcs_bucket")}[where]()
    result = submit(prompts_file, out, model=tiny_model, broker_url=redis_server, batch_size=4, steps=2)
    assert (result.total, result.shapes) == (10, 2)
    assert result.batches == 3  # 7 items at 128x128 -> 4 + 3 (padded on the worker); 3 at 64x64 -> 1
    st = status(out)
    assert (st.total, st.done, st.failed) == (10, 0, 0)

    supervisor = start_workers(redis_server, sorted(result.queues), tiny_model)
    try:
        st = wait_until(out, supervisor, lambda s: s.done + s.failed >= 10, timeout=240)
    finally:
        supervisor.stop(timeout=60)
    assert (st.done, st.failed, st.pending) == (10, 0, 0)
    records = assert_run_complete(out, prompts_file, steps=2, model=tiny_model)
    assert {r.worker.split("@")[0] for r in records} <= {"diffq-cpu0", "diffq-cpu1"}

    dest = tmp_path / "fetched"
    fetched = fetch(out, dest)
    assert (fetched.images, fetched.downloaded) == (10, 10)
    assert fetch(out, dest).downloaded == 0  # resumable: nothing left to fetch
    expected = expected_rows(prompts_file)
    metadata = [json.loads(line) for line in (dest / "metadata.jsonl").read_text().splitlines()]
    assert sorted(m["id"] for m in metadata) == sorted(expected)
    for m in metadata:
        with Image.open(dest / m["file_name"]) as image:
            assert image.size == (expected[m["id"]]["width"], expected[m["id"]]["height"])

    import datasets

    dataset = datasets.load_dataset("imagefolder", data_dir=str(dest), split="train")
    assert len(dataset) == 10
    by_id = {row["id"]: row for row in dataset}
    for item_id, want in expected.items():
        assert by_id[item_id]["prompt"] == want["prompt"]
        assert by_id[item_id]["image"].size == (want["width"], want["height"])
