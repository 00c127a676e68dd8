"""Exports read back by the real readers: webdataset, datasets (parquet, imagefolder), PIL."""

from __future__ import annotations

import glob
import io
import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from diffq.core import layout
from diffq.core.contract import ShapeKey
from diffq.core.progress import ProgressLog
from diffq.core.records import FailureRecord, ImageRecord, RunDefaults, RunManifest, ShapeSummary, jsonl
from diffq.results.export import Shard, export
from diffq.results.writers import FORMATS, WRITERS, Writer
from diffq.core.storage import open_storage

SHAPES = [ShapeKey(model="tiny", height=32, width=32, batch_size=8, max_sequence_length=64, cfg=False),
          ShapeKey(model="tiny", height=32, width=48, batch_size=8, max_sequence_length=64, cfg=False)]


def run_defaults(shape: ShapeKey) -> RunDefaults:
    """A manifest's `defaults` as submit records them."""
    return RunDefaults(model=shape.model, batch_size=shape.batch_size, steps=2, guidance_scale=1.0,
                       max_sequence_length=shape.max_sequence_length, height=shape.height, width=shape.width,
                       format="png", seed_base="synth")


def png(seed: int, shape: ShapeKey, size: int | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size or shape.height, size or shape.width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def make_run(url: str, n: int, *, failed_batches: int = 0, distinct: int | None = None, start: float = 1.7e9,
             workers: int = 2, image_side: int | None = None) -> list[str]:
    """A run folder as workers leave it: manifest, images, one record per batch of 8,
    each batch credited in its worker's progress segment.

    Batches alternate between two shapes and between `workers` workers, one batch
    finishing every 0.5 s; each worker's first batch takes 0.6 s, later ones 0.3 s. `distinct` reuses that many encoded images, which
    keeps synthesising thousands of items fast. Returns the item ids done.
    """
    storage = open_storage(url)
    total = n + 8 * failed_batches
    per_shape = [sum(1 for i in range(n) if (i // 8) % 2 == k) for k in (0, 1)]
    per_shape[0] += 8 * failed_batches
    storage.put_bytes(layout.MANIFEST, RunManifest(
        run_id="synth", created_at=start, source="synth.jsonl", out=url, total=total,
        batches=-(-total // 8), plan_parts=1, defaults=run_defaults(SHAPES[0]), diffq_version="0",
        shapes=[ShapeSummary(shape=s, queue=s.queue, items=items, batches=-(-items // 8))
                for s, items in zip(SHAPES, per_shape)]).model_dump_json().encode())
    cache: dict[tuple[int, int], bytes] = {}
    logs = [ProgressLog(storage, writer=f"w{worker}") for worker in range(workers)]
    ids = [f"item.{i:05d}" for i in range(n)]  # a dot, as WebDataset keys must survive it
    for b in range(0, n, 8):
        records = []
        worker = (b // 8) % workers
        finished = start + 10 + 0.5 * (b // 8)
        for i in range(b, min(b + 8, n)):
            shape = SHAPES[(i // 8) % 2]
            key = layout.image_key(ids[i], "png")
            slot = (i % distinct if distinct else i, shape.width)
            data = cache.get(slot) or cache.setdefault(slot, png(slot[0], shape, image_side))
            storage.put_bytes(key, data)
            generate_s = 0.6 if b < 8 * workers else 0.3
            records.append(ImageRecord(
                file_name=key, id=ids[i], prompt=f"prompt {i}", seed=i, height=shape.height,
                width=shape.width, steps=2, guidance_scale=1.0, model="tiny", run_id="synth",
                batch_id=f"b{b // 8:06d}", queue=shape.queue, device=f"cpu:{worker}",
                worker=f"w{worker}@host", generate_s=generate_s, generate_started_at=finished - generate_s - 0.05,
                generate_ended_at=finished - 0.05, store_s=0.05, finished_at=finished))
        storage.put_bytes(layout.record_key(f"b{b // 8:06d}"), jsonl(records))
        logs[worker].add(f"b{b // 8:06d}", records[0].queue, [record.id for record in records])
    for log in logs:
        log.flush()
    for f in range(failed_batches):
        storage.put_bytes(layout.failure_key(f"f{f}"), FailureRecord(
            run_id="synth", batch_id=f"f{f}", item_ids=[f"failed-{f}-{k}" for k in range(8)],
            error="RuntimeError: out of memory", attempts=3, worker="w0@host", failed_at=start + 20).model_dump_json()
            .encode())
    return ids


def read_webdataset(urls: list[str]) -> list[dict]:
    import webdataset as wds

    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil"))


def test_webdataset_shards_read_by_webdataset(tmp_path):
    ids = make_run(str(tmp_path / "run"), 40)
    result = export(str(tmp_path / "run"), tmp_path / "wds", format="webdataset", shard_size=16)
    assert result.files == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"] and result.images == 40
    samples = read_webdataset(sorted(glob.glob(str(tmp_path / "wds" / "*.tar"))))
    assert [s["json"]["id"] for s in samples] == ids
    for sample in samples:
        assert isinstance(sample["png"], Image.Image)
        assert sample["png"].size == (sample["json"]["width"], sample["json"]["height"])
    # Deterministic: a second export writes the same bytes.
    export(str(tmp_path / "run"), tmp_path / "again", format="webdataset", shard_size=16)
    assert (tmp_path / "wds/shard-000001.tar").read_bytes() == (tmp_path / "again/shard-000001.tar").read_bytes()


def test_parquet_loads_with_datasets_as_images(tmp_path):
    import datasets

    ids = make_run(str(tmp_path / "run"), 30)
    result = export(str(tmp_path / "run"), str(tmp_path / "pq"), format="parquet", shard_size=20, chunk=8)
    assert result.files == ["part-000000.parquet", "part-000001.parquet"]
    ds = datasets.load_dataset("parquet", data_files=sorted(glob.glob(str(tmp_path / "pq/*.parquet"))),
                               split="train", cache_dir=str(tmp_path / "hf"))
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds["id"] == ids and ds["seed"] == list(range(30))
    row = ds[9]
    assert row["image"].size == (row["width"], row["height"]) == (48, 32)
    assert row["prompt"] == "prompt 9" and row["worker"] == "w1@host"


def test_imagefolder_matches_fetch_and_loads(tmp_path):
    import datasets

    ids = make_run(str(tmp_path / "run"), 12)
    export(str(tmp_path / "run"), tmp_path / "folder", format="imagefolder")
    ds = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "folder"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert sorted(ds["id"]) == ids and ds[0]["image"].size[1] == 32
    # A second export finds every image in place and fetches nothing.
    (tmp_path / "run/images" / f"{ids[0]}.png").unlink()
    assert export(str(tmp_path / "run"), tmp_path / "folder", format="imagefolder").images == 12


def test_export_between_object_stores(tmp_path, gcs_bucket, s3_bucket):
    ids = make_run(gcs_bucket, 20, distinct=4)
    export(gcs_bucket, s3_bucket + "/wds", format="webdataset", shard_size=8)
    export(gcs_bucket, s3_bucket + "/pq", format="parquet", shard_size=50)
    export(gcs_bucket, s3_bucket + "/folder", format="imagefolder")
    dest = open_storage(s3_bucket)
    assert sorted(dest.list("wds/")) == [f"wds/shard-00000{i}.tar" for i in range(3)]
    for key in dest.list("wds/"):
        dest.download_file(key, tmp_path / key)
    assert [s["json"]["id"] for s in read_webdataset(sorted(glob.glob(str(tmp_path / "wds/*.tar"))))] == ids
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(dest.get_bytes("pq/part-000000.parquet")))
    assert table.column("id").to_pylist() == ids
    assert Image.open(io.BytesIO(table.column("image")[9].as_py()["bytes"])).size == (48, 32)
    lines = dest.get_bytes("folder/metadata.jsonl").decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ids
    assert dest.exists(f"folder/images/{ids[-1]}.png")


# Formats handed each image's bytes (imagefolder copies files store to store).
@pytest.mark.parametrize("format", [name for name, writer in WRITERS.items() if writer.reads_images])
def test_export_memory_does_not_grow_with_the_run(tmp_path, format):
    n = 2100
    make_run(str(tmp_path / "run"), n, distinct=64, image_side=48)
    image_bytes = sum(f.stat().st_size for f in (tmp_path / "run/images").iterdir())
    # Imported before tracing: their modules are not the export's memory (pyarrow pulls
    # in pandas the first time it converts a bool column).
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    tracemalloc.start()
    try:
        result = export(str(tmp_path / "run"), tmp_path / format, format=format, shard_size=700, chunk=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.images == n and result.bytes == image_bytes and len(result.files) == 3
    # One shard alone is a third of the image bytes; the peak is a few chunks.
    assert peak < image_bytes / 6, f"peak {peak / 1e6:.1f} MB for {image_bytes / 1e6:.1f} MB of images"


def test_unknown_format_is_refused(tmp_path):
    make_run(str(tmp_path / "run"), 1)
    with pytest.raises(ValueError, match="unknown export format"):
        export(str(tmp_path / "run"), tmp_path / "x", format="zip")


def test_a_format_is_one_row_of_the_writer_table(tmp_path, monkeypatch):
    """A writer class in WRITERS is all export needs: it is handed every image of its
    shard in position order, with its bytes, and closed once."""
    calls = []

    class Listing(Writer):
        name = "listing"

        def write(self, position, record, image):
            calls.append((position, record.id, len(image)))
            self.on_image(len(image), False)

        def close(self):
            calls.append("closed")
            return ["listing.txt"]

    monkeypatch.setitem(WRITERS, Listing.name, Listing)
    ids = make_run(str(tmp_path / "run"), 20)
    result = export(str(tmp_path / "run"), tmp_path / "x", format="listing", shard_size=4, shard=Shard(1, 2))
    mine = [position for position in range(20) if (position // 4) % 2 == 1]
    assert [call[:2] for call in calls[:-1]] == [(position, ids[position]) for position in mine]
    assert calls[-1] == "closed" and result.files == ["listing.txt"] and result.images == len(mine)
    assert result.bytes == sum(call[2] for call in calls[:-1]) and result.run_images == 20


def test_fetch_only_new_and_progress(tmp_path):
    from diffq.results.fetch import fetch

    url = str(tmp_path / "run")
    make_run(url, 16)
    held = open_storage(url).get_bytes(layout.record_key("b000001"))
    open_storage(url).delete(layout.record_key("b000001"))
    calls = []
    assert fetch(url, tmp_path / "dest", on_progress=lambda done, total: calls.append((done, total))).downloaded == 8
    assert calls[-1] == (8, 8)
    open_storage(url).put_bytes(layout.record_key("b000001"), held)
    (tmp_path / "dest/images/item.00000.png").unlink()  # only_new does not look at files already listed
    result = fetch(url, tmp_path / "dest", only_new=True)
    assert (result.images, result.downloaded) == (16, 8)
    assert len((tmp_path / "dest/metadata.jsonl").read_text().splitlines()) == 16


def test_cli_export_report_watch(tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    url = str(tmp_path / "run")
    make_run(url, 16, failed_batches=1)
    runner = CliRunner()
    result = runner.invoke(app, ["export", url, str(tmp_path / "pq"), "--format", "parquet", "--shard-size", "10"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == ["part-000000.parquet", "part-000001.parquet"]
    result = runner.invoke(app, ["report", url, "--html", str(tmp_path / "r.html"), "--price-per-device-hour", "2"])
    assert result.exit_code == 0 and "per 1,000 images at 2 per device-hour" in result.output
    assert (tmp_path / "r.html").stat().st_size > 10_000
    result = runner.invoke(app, ["status", url, "--watch", "--json", "--interval", "0.1"])
    assert result.exit_code == 0 and json.loads(result.output.splitlines()[-1])["failed"] == 8
    assert runner.invoke(app, ["export", str(tmp_path / "nothing"), str(tmp_path / "x")]).exit_code == 2


# --shard i/n: n exporters split one export ---------------------------------------------
def make_overlapping_run(url: str, n: int = 100) -> list[str]:
    """make_run's folder plus what retries and resumes leave: a root batch recorded
    again in part by a resumed copy, and a root whose record is two split halves and
    a resumed copy overlapping both. Returns the item ids done."""
    from diffq.core.records import parse_record

    ids = make_run(url, n, distinct=16)
    storage = open_storage(url)

    def derived(root: str, batch_id: str, picks: slice) -> None:
        records = parse_record(storage.get_bytes(layout.record_key(root)))[picks]
        storage.put_bytes(layout.record_key(batch_id), jsonl(r.model_copy(update={"batch_id": batch_id})
                                                             for r in records))

    derived("b000003", "b000003.r5", slice(0, 3))  # already in its root's record
    for batch_id, picks in (("b000004.s0", slice(0, 4)), ("b000004.s1", slice(4, 8)), ("b000004.r9", slice(2, 6))):
        derived("b000004", batch_id, picks)
    storage.delete(layout.record_key("b000004"))
    return ids


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def union(trees: list[dict[str, bytes]]) -> dict[str, bytes]:
    merged: dict[str, bytes] = {}
    for part in trees:
        assert not merged.keys() & part.keys(), "two shards wrote the same file"
        merged |= part
    return merged


@pytest.mark.parametrize("format", FORMATS)
def test_shards_together_write_a_single_exports_files(tmp_path, format):
    ids = make_overlapping_run(str(tmp_path / "run"))
    run = str(tmp_path / "run")
    # 5 images a file: files end inside batches of 8, and the overlapping roots straddle them.
    single = export(run, tmp_path / "single", format=format, shard_size=5, chunk=3)
    assert single.run_images == single.images == len(ids)
    for n in (1, 3, 40):  # 40: more shards than files, some write nothing
        results = [export(run, tmp_path / f"n{n}-{i}", format=format, shard_size=5, chunk=3,
                          shard=Shard(i, n)) for i in range(n)]
        assert union([tree(tmp_path / f"n{n}-{i}") for i in range(n)]) == tree(tmp_path / "single")
        assert sum(r.images for r in results) == len(ids) and {r.run_images for r in results} == {len(ids)}
    if format != "imagefolder":
        assert len(single.files) == -(-len(ids) // 5)
    # Each item once, in the single export's order (its root's record first).
    if format == "webdataset":
        samples = read_webdataset(sorted(glob.glob(str(tmp_path / "single" / "*.tar"))))
        assert sorted(s["json"]["id"] for s in samples) == ids and len(samples) == len(ids)


def test_shards_export_at_once_into_one_bucket(tmp_path, s3_bucket):
    """n exporters at once into one destination prefix, as an indexed Job's pods do."""
    ids = make_overlapping_run(s3_bucket + "/run", n=60)
    export(s3_bucket + "/run", s3_bucket + "/single", format="webdataset", shard_size=7)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: export(s3_bucket + "/run", s3_bucket + "/sharded", format="webdataset",
                                       shard_size=7, shard=Shard(i, 4)), range(4)))
    storage = open_storage(s3_bucket)
    single = {key.removeprefix("single/"): storage.get_bytes(key) for key in storage.list("single/")}
    sharded = {key.removeprefix("sharded/"): storage.get_bytes(key) for key in storage.list("sharded/")}
    assert sharded == single and len(single) == -(-len(ids) // 7)


def test_sharded_fetch_together_is_a_single_fetch(tmp_path):
    from diffq.results.fetch import fetch

    run = str(tmp_path / "run")
    ids = make_overlapping_run(run)
    single = fetch(run, tmp_path / "single", shard_size=6)
    assert (single.images, single.downloaded, single.run_images) == (len(ids), len(ids), len(ids))
    lines = (tmp_path / "single/metadata.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == ids
    # The same lines as an imagefolder export: fetch and export agree on the order.
    export(run, tmp_path / "exported", format="imagefolder")
    assert (tmp_path / "exported/metadata.jsonl").read_bytes() == (tmp_path / "single/metadata.jsonl").read_bytes()
    results = [fetch(run, tmp_path / f"part{i}", shard_size=6, shard=Shard(i, 3)) for i in range(3)]
    assert union([tree(tmp_path / f"part{i}") for i in range(3)]) == tree(tmp_path / "single")
    assert sum(r.images for r in results) == len(ids) and not (tmp_path / "part1/metadata.jsonl").exists()
    # Resumable per shard: a second pass downloads only what went missing.
    before = [tree(tmp_path / f"part{i}") for i in range(3)]
    (owner,) = [i for i in range(3) if (tmp_path / f"part{i}" / layout.image_key(ids[-1], "png")).exists()]
    (tmp_path / f"part{owner}" / layout.image_key(ids[-1], "png")).unlink()
    again = [fetch(run, tmp_path / f"part{i}", shard_size=6, shard=Shard(i, 3)).downloaded for i in range(3)]
    assert again == [int(i == owner) for i in range(3)]
    assert [tree(tmp_path / f"part{i}") for i in range(3)] == before
    with pytest.raises(ValueError, match="only-new"):
        fetch(run, tmp_path / "part1", only_new=True, shard=Shard(1, 3))


def test_shard_parsing_and_the_cli(tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    assert Shard.parse("3/8") == Shard(3, 8) and str(Shard.parse(" 0 / 1 ")) == "0/1" and Shard().whole
    for bad in ("8/8", "-1/4", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="I/N"):
            Shard.parse(bad)
    run = str(tmp_path / "run")
    ids = make_run(run, 24)
    runner = CliRunner()
    for i in range(2):
        result = runner.invoke(app, ["export", run, str(tmp_path / "wds"), "--format", "webdataset",
                                     "--shard-size", "10", "--shard", f"{i}/2", "--no-progress"])
        assert result.exit_code == 0 and f"(shard {i}/2 of {len(ids)} images)" in result.output, result.output
    assert sorted(p.name for p in (tmp_path / "wds").iterdir()) == [f"shard-00000{k}.tar" for k in range(3)]
    # fetch splits by runs of 1,000 images: 24 are all shard 0's, with metadata.jsonl.
    for i, images in ((0, 24), (1, 0)):
        result = runner.invoke(app, ["fetch", run, str(tmp_path / f"dest{i}"), "--shard", f"{i}/2", "--no-progress"])
        assert result.exit_code == 0 and f"{images} images" in result.output, result.output
        assert f"(shard {i}/2 of 24 images)" in result.output
        assert len(list((tmp_path / f"dest{i}/images").iterdir())) == images
        assert (tmp_path / f"dest{i}/metadata.jsonl").exists() == (i == 0)
    for command in (["export", run, str(tmp_path / "x")], ["fetch", run, str(tmp_path / "y")]):
        result = runner.invoke(app, [*command, "--shard", "2/2"])
        assert result.exit_code == 2 and "0 ≤ I < N" in result.output
    result = runner.invoke(app, ["fetch", run, str(tmp_path / "y"), "--shard", "0/2", "--only-new"])
    assert result.exit_code == 2 and "only-new" in result.output
