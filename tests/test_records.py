"""One owner per on-disk schema (diffq/core/records.py): what the sink writes is an
ImageRecord, and every reader's columns are ImageRecord's fields."""

from __future__ import annotations

import glob
import io
import json
import tarfile

import pytest
from PIL import Image
from pydantic import ValidationError

from diffq.core import layout
from diffq.core.contract import BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.progress import ProgressSummary
from diffq.core.records import ImageRecord, RunDefaults, RunManifest, ShapeSummary
from diffq.core.storage import open_storage
from diffq.worker.sink.store import Sink
from tests.helpers import MEASURED
from tests.test_export import run_defaults

SHAPE = ShapeKey(model="tiny", height=24, width=40, batch_size=4, max_sequence_length=64, cfg=False)
FIELDS = ImageRecord.fields()


def sink_run(out: str, batches: int = 2) -> list[BatchMessage]:
    """A run folder whose images, records and credits the real sink wrote."""
    storage = open_storage(out)
    messages = [BatchMessage(run_id="r", out=out, batch_id=f"b{b}", shape=SHAPE,
                             params=BatchParams(num_inference_steps=2, guidance_scale=1.0),
                             items=[BatchItem(id=f"i{b}-{n}", prompt=f"p\u2028{n}", seed=n) for n in range(4)])
                for b in range(batches)]
    storage.put_bytes(layout.MANIFEST, RunManifest(
        run_id="r", created_at=0.0, source="p.jsonl", out=out, total=4 * batches, batches=batches, plan_parts=1,
        shapes=[ShapeSummary(shape=SHAPE, queue=SHAPE.queue, items=4 * batches, batches=batches)],
        defaults=run_defaults(SHAPE),
        diffq_version="test").model_dump_json().encode())
    sink = Sink()
    try:
        for message in messages:
            images = [Image.new("RGB", (SHAPE.width, SHAPE.height), (n * 60, 0, 0)) for n in range(4)]
            sink.submit(storage, message, images, MEASURED).credited.result(timeout=60)
    finally:
        sink.close()
    return messages


def test_the_sink_writes_image_records(tmp_path):
    out = str(tmp_path / "run")
    messages = sink_run(out)
    storage = open_storage(out)
    for message in messages:
        lines = storage.get_bytes(layout.record_key(message.batch_id)).decode().splitlines()
        assert len(lines) == len(message.items)  # a prompt's U+2028 does not split a line
        for line, item in zip(lines, message.items):
            assert list(json.loads(line)) == FIELDS
            record = ImageRecord.model_validate_json(line)
            assert (record.id, record.prompt, record.batch_id) == (item.id, item.prompt, message.batch_id)
            assert (record.requested_height, record.requested_width) == (record.height, record.width) == (24, 40)
            assert record.worker == MEASURED["worker"] and record.store_s >= 0
    assert ProgressSummary(storage).refresh().done == 8


def test_fetch_export_and_report_columns_are_the_record_fields(tmp_path):
    import pyarrow.parquet as pq

    from diffq.results.export import export
    from diffq.results.fetch import fetch
    from diffq.results.report import build_report

    out = str(tmp_path / "run")
    sink_run(out)
    fetch(out, tmp_path / "fetched")
    metadata = [json.loads(line) for line in (tmp_path / "fetched/metadata.jsonl").read_text().splitlines()]
    assert len(metadata) == 8 and all(list(line) == FIELDS for line in metadata)

    export(out, tmp_path / "folder", format="imagefolder")
    lines = (tmp_path / "folder/metadata.jsonl").read_text().splitlines()
    assert [list(json.loads(line)) for line in lines] == [FIELDS] * 8

    export(out, tmp_path / "pq", format="parquet")
    table = pq.read_table(glob.glob(str(tmp_path / "pq/*.parquet"))[0])
    assert table.column_names == ["image", *FIELDS]
    assert str(table.schema.field("height").type) == "int32" and str(table.schema.field("seed").type) == "int64"

    export(out, tmp_path / "wds", format="webdataset")
    with tarfile.open(glob.glob(str(tmp_path / "wds/*.tar"))[0]) as tar:
        samples = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")]
    assert len(samples) == 8 and all(sorted(s) == sorted(FIELDS) for s in samples)

    report = build_report(out)
    assert len(report.sample) == 8 and all(isinstance(r, ImageRecord) for r in report.sample)
    assert report.workers[0].worker == MEASURED["worker"]


def test_a_record_field_the_schema_lacks_fails_the_batch_at_once(tmp_path):
    """A typo in what the task hands over is a bug, not an outage: no retrying for
    retry_for_s (default settings here), the error reaches the ack."""
    out = str(tmp_path / "run")
    message = BatchMessage(run_id="r", out=out, batch_id="b0", shape=SHAPE,
                           params=BatchParams(num_inference_steps=2, guidance_scale=1.0),
                           items=[BatchItem(id="i", prompt="p", seed=1)])
    sink = Sink()
    try:
        handed = sink.submit(open_storage(out), message, [Image.new("RGB", (40, 24))], {**MEASURED, "devcie": "x"})
        assert isinstance(handed.stored.exception(timeout=30), ValidationError)
        assert isinstance(handed.credited.exception(timeout=30), ValidationError)
    finally:
        sink.close()
    assert not open_storage(out).exists(layout.record_key("b0"))


def test_records_parse_strictly():
    line = json.dumps({name: 1 for name in FIELDS})
    with pytest.raises(ValidationError):
        ImageRecord.model_validate_json(line)  # ids and prompts are strings
    assert ImageRecord.dtypes()["tp_ranks_agree"] == "bool"


def test_every_api_name_resolves():
    from diffq import api

    for name in api.__all__:
        assert callable(getattr(api, name)), name


def test_the_image_decodes_where_the_record_says(tmp_path):
    out = str(tmp_path / "run")
    sink_run(out, batches=1)
    storage = open_storage(out)
    record = ImageRecord.model_validate_json(storage.get_bytes(layout.record_key("b0")).splitlines()[1])
    image = Image.open(io.BytesIO(storage.get_bytes(record.file_name)))
    assert image.size == (record.width, record.height) and image.getpixel((0, 0)) == (60, 0, 0)


# Manifests as earlier diffq versions wrote them (`defaults` an untyped dict): the
# first one's keys, and today's, whose JSON the typed defaults must write unchanged.
OLD_MANIFEST = {
    "schema_version": 1, "run_id": "r", "created_at": 1.7e9, "source": "p.jsonl", "out": "/runs/r", "total": 8,
    "batches": 2, "plan_parts": 1, "shapes": [], "diffq_version": "0.1.0",
    "defaults": {"model": "tiny", "batch_size": 4, "steps": 4, "guidance_scale": 1, "max_sequence_length": 64,
                 "height": 128, "width": 128, "format": "png", "dtype": "bf16", "seed_base": "r"}}
CURRENT_DEFAULTS = {
    "model": "tiny", "batch_size": 4, "steps": 4, "guidance_scale": 1.0, "max_sequence_length": 64, "height": 128,
    "width": 128, "format": "png", "dtype": "auto", "seed_base": "r", "fit": "crop", "size_buckets": ["64x96"],
    "keep_columns": ["style"], "embed_metadata": False, "speedup": "taylorseer:cache_interval=3",
    "unreproducible_speedup": False, "lora": [{"path": "/loras/a.safetensors", "scale": 0.5, "revision": None}]}


def test_manifests_written_with_untyped_defaults_still_load():
    old = RunManifest.model_validate_json(json.dumps(OLD_MANIFEST))
    assert (old.defaults.model, old.defaults.dtype, old.defaults.guidance_scale) == ("tiny", "bf16", 1.0)
    # What a run before a field existed did, and the field is not one it stated.
    assert (old.defaults.fit, old.defaults.size_buckets, old.defaults.keep_columns) == ("none", None, [])
    assert old.defaults.recorded() == {**OLD_MANIFEST["defaults"], "guidance_scale": 1.0}

    current = RunManifest.model_validate_json(json.dumps({**OLD_MANIFEST, "defaults": CURRENT_DEFAULTS}))
    assert json.loads(current.model_dump_json())["defaults"] == CURRENT_DEFAULTS
    assert list(json.loads(current.model_dump_json())["defaults"]) == list(CURRENT_DEFAULTS)  # key order too
    assert current.defaults.recorded() == CURRENT_DEFAULTS
    with pytest.raises(ValidationError):  # a typo in a key is an error, as everywhere in the manifest
        RunDefaults.model_validate({**CURRENT_DEFAULTS, "stpes": 4})


def test_submit_records_every_default_in_the_typed_order():
    from diffq.core.options import GenerationOptions
    from diffq.producer.submit import make_options, manifest_defaults

    options, defaults = make_options(model="tiny", options=GenerationOptions.of(size_buckets="64x96", fit="crop"))
    recorded = RunDefaults.model_validate(manifest_defaults(options, defaults, "r", ["style"]))
    assert list(recorded.recorded()) == list(RunDefaults.model_fields)


def test_an_item_recorded_twice_counts_once_and_a_failed_one_until_done():
    from diffq.core.runfolder import ItemSet, failed_items, first_records

    base = ImageRecord(file_name="images/x.png", id="x", prompt="p", seed=0, height=8, width=8, steps=1,
                       guidance_scale=1.0, model="tiny", run_id="r", batch_id="b", queue="q", device="cpu:0",
                       worker="w", generate_s=0.1, generate_started_at=0.0, generate_ended_at=0.1, store_s=0.1,
                       finished_at=1.0)

    def record(item_id: str, batch_id: str) -> ImageRecord:
        return base.model_copy(update={"id": item_id, "batch_id": batch_id})

    seen = ItemSet(["a"])
    batches = [[record("a", "b0"), record("b", "b0")], [record("b", "b0.r1"), record("c", "b0.r1")],
               [record("c", "b0.s0")]]
    kept = list(first_records(batches, seen))
    assert [[(r.id, r.batch_id) for r in new] for new in kept] == [[("b", "b0")], [("c", "b0.r1")]]
    assert len(seen) == 3 and "c" in seen and "d" not in seen
    done = {"b0": {"a"}, "b1": set()}
    assert failed_items([("b0", ["a", "e"]), ("b1", ["a", "f"])], done.__getitem__) == {"e", "a", "f"}
