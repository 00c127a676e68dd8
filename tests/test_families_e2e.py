"""Every pipeline family end to end through real workers (`diffq run`), with per-item
negative prompts, metadata and models, provenance inside the files, and the new
fields through fetch and every export format, read back with the real readers
(PIL, datasets, webdataset)."""

import io
import json

import pytest
from PIL import Image

from diffq import __version__
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.results.status import status
from tests.helpers import assert_run_complete, diffq, start_workers, wait_until

pytestmark = pytest.mark.slow

SIZE = 64


def write_rows(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"height": SIZE, "width": SIZE, **row}) + "\n" for row in rows))
    return path


def run(tmp_path, rows, model, *options):
    prompts = write_rows(tmp_path, rows)
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", model, "--out", str(out), "--batch-size", "2", "--steps", "2",
                 "--no-progress", *options)
    assert f"{len(rows)}/{len(rows)} images, 0 failed" in proc.stdout
    return prompts, out


def embedded_text(data: bytes) -> dict:
    """The provenance a reader sees: PNG text chunks, or JPEG/WebP EXIF UserComment."""
    image = Image.open(io.BytesIO(data))
    image.load()
    if image.format == "PNG":
        return dict(image.text)
    comment = image.getexif().get_ifd(0x8769).get(0x9286)
    if comment is None:
        return {}
    assert comment[:8] == b"ASCII\0\0\0"
    return json.loads(comment[8:])


def test_sd3_with_negative_prompts_metadata_and_png_provenance(tmp_path, tiny_pipelines):
    model = tiny_pipelines["sd3"]
    rows = [{"id": "neg", "prompt": "a red fox", "negative_prompt": "blurry, dark ünïcode ✓", "seed": 11,
             "metadata": {"source": "unit", "score": 0.5, "tags": ["a", "b"]}},
            {"id": "plain", "prompt": "a red fox", "seed": 11, "metadata": {"source": "unit", "score": 1.0,
                                                                          "tags": []}},
            {"id": "third", "prompt": "a blue whale", "metadata": {"source": "other", "score": 2.0, "tags": ["c"]}}]
    prompts, out = run(tmp_path, rows, model, "--guidance-scale", "5")
    records = {r.id: r.model_dump() for r in assert_run_complete(str(out), prompts, steps=2, model=model)}
    assert records["neg"]["negative_prompt"] == "blurry, dark ünïcode ✓"
    assert records["plain"]["negative_prompt"] is None and records["plain"]["metadata"] == rows[1]["metadata"]
    assert records["neg"]["metadata"] == rows[0]["metadata"]  # unchanged
    # CFG on: SD3's queue carries the cfg bit.
    assert all(r["queue"].endswith(".cfg.auto") and r["dtype"] == "float32" for r in records.values())
    storage = open_storage(str(out))
    neg, plain = (storage.get_bytes(records[i]["file_name"]) for i in ("neg", "plain"))
    # Same seed and prompt; the negative prompt alone changes the pixels.
    assert Image.open(io.BytesIO(neg)).tobytes() != Image.open(io.BytesIO(plain)).tobytes()
    text = embedded_text(neg)
    assert text == {"prompt": "a red fox", "negative_prompt": "blurry, dark ünïcode ✓", "seed": "11",
                    "steps": "2", "guidance_scale": "5", "size": f"{SIZE}x{SIZE}", "model": model,
                    "diffq_version": __version__}
    assert "negative_prompt" not in embedded_text(plain)

    # fetch: metadata.jsonl loads with datasets, metadata as a struct column.
    import datasets

    dest = tmp_path / "fetched"
    diffq("fetch", str(out), str(dest), "--no-progress")
    ds = datasets.load_dataset("imagefolder", data_dir=str(dest), split="train")
    assert isinstance(ds.features["metadata"], dict)  # a struct of its keys
    assert set(ds.features["metadata"]) == {"source", "score", "tags"}
    by_id = {row["id"]: row for row in ds}
    assert by_id["neg"]["metadata"] == rows[0]["metadata"]
    assert by_id["neg"]["negative_prompt"] == "blurry, dark ünïcode ✓" and by_id["plain"]["negative_prompt"] is None
    assert by_id["third"]["image"].size == (SIZE, SIZE)

    # webdataset: the sample's .json carries them.
    import webdataset as wds

    diffq("export", str(out), str(tmp_path / "wds"), "--format", "webdataset")
    samples = {s["json"]["id"]: s for s in wds.WebDataset(str(tmp_path / "wds" / "shard-000000.tar"),
                                                         shardshuffle=False).decode("pil")}
    assert samples["neg"]["json"]["metadata"] == rows[0]["metadata"]
    assert samples["neg"]["json"]["negative_prompt"] == "blurry, dark ünïcode ✓"

    # parquet: a negative_prompt column and the metadata object as JSON text.
    diffq("export", str(out), str(tmp_path / "pq"), "--format", "parquet")
    table = datasets.load_dataset("parquet", data_files=str(tmp_path / "pq" / "*.parquet"), split="train")
    by_id = {row["id"]: row for row in table}
    assert json.loads(by_id["neg"]["metadata"]) == rows[0]["metadata"]
    assert by_id["neg"]["negative_prompt"] == "blurry, dark ünïcode ✓" and by_id["plain"]["negative_prompt"] is None
    assert by_id["neg"]["image"].size == (SIZE, SIZE)


def test_flux2_with_webp_provenance(tmp_path, tiny_pipelines):
    model = tiny_pipelines["flux2"]
    rows = [{"id": str(i), "prompt": f"prompt ✓ {i}"} for i in range(3)]
    prompts, out = run(tmp_path, rows, model, "--format", "webp", "--guidance-scale", "4")
    records = [r.model_dump() for r in assert_run_complete(str(out), prompts, steps=2, model=model)]
    # Guidance-distilled: no CFG bit, one queue.
    assert {r["queue"] for r in records} == {records[0]["queue"]} and records[0]["queue"].endswith(".nocfg.auto")
    record = next(r for r in records if r["id"] == "1")
    text = embedded_text(open_storage(str(out)).get_bytes(record["file_name"]))
    assert text["prompt"] == "prompt ✓ 1" and text["seed"] == str(record["seed"])
    assert text["guidance_scale"] == "4" and text["model"] == model and "negative_prompt" not in text


def test_flux_with_jpeg_provenance(tmp_path, tiny_pipelines):
    model = tiny_pipelines["flux"]
    rows = [{"id": str(i), "prompt": f"p {i}"} for i in range(3)]
    prompts, out = run(tmp_path, rows, model, "--format", "jpeg", "--guidance-scale", "3.5")
    records = [r.model_dump() for r in assert_run_complete(str(out), prompts, steps=2, model=model)]
    text = embedded_text(open_storage(str(out)).get_bytes(records[0]["file_name"]))
    assert text["prompt"] == records[0]["prompt"] and text["steps"] == "2" and text["guidance_scale"] == "3.5"
    assert text["diffq_version"] == __version__ and text["size"] == f"{SIZE}x{SIZE}"


def test_flux2_klein_without_embedded_metadata(tmp_path, tiny_pipelines):
    model = tiny_pipelines["flux2-klein"]
    rows = [{"id": str(i), "prompt": f"p {i}", "guidance_scale": 1.0 + 3 * (i % 2)} for i in range(3)]
    prompts, out = run(tmp_path, rows, model, "--no-embed-metadata")
    records = [r.model_dump() for r in assert_run_complete(str(out), prompts, steps=2, model=model)]
    # Klein's CFG is a second pass over the same shapes: one queue for both guidance values.
    assert len({r["queue"] for r in records}) == 1
    assert sorted(r["guidance_scale"] for r in records) == [1.0, 1.0, 4.0]
    assert embedded_text(open_storage(str(out)).get_bytes(records[0]["file_name"])) == {}


def test_rows_of_one_file_name_different_models(tmp_path, tiny_pipelines):
    klein, sd3 = tiny_pipelines["flux2-klein"], tiny_pipelines["sd3"]
    rows = [{"id": f"k{i}", "prompt": f"k {i}"} for i in range(3)]
    rows += [{"id": f"s{i}", "prompt": f"s {i}", "model": sd3, "guidance_scale": 5.0, "negative_prompt": "dark"}
             for i in range(2)]
    _, out = run(tmp_path, rows, klein, "--workers", "2")
    storage = open_storage(str(out))
    manifest = read_manifest(storage)
    assert manifest.models == sorted([klein, sd3])
    records = {r.id: r.model_dump() for r in iter_records(storage)}
    assert sorted(records) == sorted(row["id"] for row in rows)
    for row in rows:
        record = records[row["id"]]
        assert record["model"] == row.get("model", klein)
        assert record["queue"] in {s.queue for s in manifest.shapes if s.shape.model == record["model"]}
        assert embedded_text(storage.get_bytes(record["file_name"]))["model"] == record["model"]
    assert status(str(out)).done == len(rows)


def test_worker_fails_only_the_items_the_family_refuses(tmp_path, tiny_pipelines, redis_server):
    """A model the producer cannot read (here: a folder mounted only where workers run)
    is checked by the worker: the refused item fails with a clear record, the rest of
    its batch is produced."""
    import shutil

    from diffq.producer.submit import submit

    model = tmp_path / "models" / "klein"
    rows = [{"id": "ok1", "prompt": "a"}, {"id": "bad", "prompt": "b", "negative_prompt": "blurry"},
            {"id": "ok2", "prompt": "c"}]
    prompts = write_rows(tmp_path, rows)
    out = str(tmp_path / "out")
    # Submitted while the folder does not exist: the family is unknown at submit.
    result = submit(prompts, out, model=str(model), broker_url=redis_server, batch_size=3, steps=2)
    assert result.batches == 1
    shutil.copytree(tiny_pipelines["flux2-klein"], model)
    supervisor = start_workers(redis_server, list(result.queues), str(model), n=1)
    try:
        st = wait_until(out, supervisor, lambda st: st.done + st.failed == 3)
    finally:
        supervisor.stop()
    assert (st.done, st.failed) == (2, 1)
    storage = open_storage(out)
    assert sorted(r.id for r in iter_records(storage)) == ["ok1", "ok2"]
    failures = [json.loads(storage.get_bytes(key)) for key in storage.list("failures/")]
    assert [f["item_ids"] for f in failures] == [["bad"]]
    assert failures[0]["error"] == ("FamilyUnsupported: item bad: field 'negative_prompt': "
                                    "Flux2KleinPipeline (flux2-klein) takes no negative prompt")
    assert failures[0]["attempts"] == 1  # refused at once, no retries
