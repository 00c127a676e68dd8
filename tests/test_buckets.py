"""Size buckets (--size-buckets, --fit) and `diffq plan`."""

import io
import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis
from PIL import Image
from typer.testing import CliRunner

from diffq.app.cli import app
from tests.helpers import MEASURED
from diffq.core.contract import FITS, BatchMessage, ShapeKey
from diffq.core.runfolder import read_manifest
from diffq.core.storage import open_storage
from diffq.producer.sizes import PRESETS, BucketSpecError, parse_buckets
from diffq.producer.sources import Defaults, InputError, read_prompts
from diffq.core.options import GenerationOptions
from diffq.producer.submit import MAX_REQUESTED_SIZES, make_options, read_plan, validate

BUCKETS_DOC = Path(__file__).resolve().parents[1] / "docs" / "prompts.md"  # "Size buckets and plans"
ENV = {"COLUMNS": "300", "NO_COLOR": "1"}


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- mapping -------------------------------------------------------------------------

def test_odd_requested_sizes_go_to_the_nearest_aspect(tmp_path):
    buckets = parse_buckets("1024x1024,832x1216,1216x832,640x1536")
    assert buckets.nearest(1001, 999) == (1024, 1024)
    assert buckets.nearest(333, 517) == (832, 1216)  # 0.644: nearer 0.684 than 0.417
    assert buckets.nearest(517, 333) == (1216, 832)
    assert buckets.nearest(7, 1000) == (640, 1536)
    assert buckets.nearest(16384, 1) == (1216, 832)  # no bucket that tall: the nearest one
    rows = [{"id": "a", "prompt": "a", "height": 333, "width": 517},
            {"id": "b", "prompt": "b", "height": 1001, "width": 999},
            {"id": "c", "prompt": "c"}]  # the default size is requested too: 100x70
    path = write_rows(tmp_path / "p.jsonl", rows)
    prompts = list(read_prompts(path, Defaults(height=100, width=70, size_buckets=buckets)))
    assert [(p.requested_height, p.requested_width, p.height, p.width) for p in prompts] == [
        (333, 517, 832, 1216), (1001, 999, 1024, 1024), (100, 70, 1216, 832)]
    # Without buckets the same file is refused, naming the row: sizes must be compilable.
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'height': 333 is not a multiple of 16"):
        list(read_prompts(path, Defaults()))


@pytest.mark.parametrize("spec, asked, expected", [
    # 1:1 is exactly halfway (in log terms) between 2:1 and 1:2: the larger area wins.
    ("256x512,1024x512", (100, 100), (1024, 512)),
    ("1024x512,256x512", (100, 100), (1024, 512)),
    # 3:2 is halfway between 9:4 and 1:1 (1.5 / 1 == 2.25 / 1.5): exact, not a float accident.
    ("576x256,256x256", (480, 320), (576, 256)),
    ("576x256,512x512", (480, 320), (512, 512)),
    # Same distance and the same area: the bucket listed first.
    ("1024x256,512x512", (200, 100), (1024, 256)),
    ("512x512,1024x256", (200, 100), (512, 512)),
])
def test_ties_go_to_the_larger_area_then_the_first_listed(spec, asked, expected):
    assert parse_buckets(spec).nearest(*asked) == expected


def test_presets_are_documented_with_their_sizes():
    readme = BUCKETS_DOC.read_text()
    assert len(PRESETS["aspect-1024"]) == 9 and (1024, 1024) in PRESETS["aspect-1024"]
    for name, sizes in PRESETS.items():
        assert all(h % 16 == 0 and w % 16 == 0 for h, w in sizes)
        assert all((w, h) in sizes for h, w in sizes), "every landscape bucket has its portrait"
        listed = ", ".join(f"{h}x{w}" for h, w in sizes)
        assert f"`{name}`: {listed}" in readme, f"docs/prompts.md does not list {name} as: {listed}"
        assert parse_buckets(name).sizes == sizes
    # Presets and sizes mix; names are case-insensitive.
    assert parse_buckets("ASPECT-256,512x128").sizes == PRESETS["aspect-256"] + ((512, 128),)
    assert parse_buckets("aspect-1024").nearest(1080, 1920) == (768, 1344)


@pytest.mark.parametrize("spec, message", [
    ("1000x1024", "'1000x1024': 1000 is not a multiple of 16"),
    ("1024x1024,1024", "'1024': not HxW (e.g. 1024x1024) nor a preset (aspect-1024, aspect-512, aspect-256)"),
    ("sdxl", "'sdxl': not HxW"),
    ("", "empty; give HxW"),
    ("512x512,,256x512", "empty entry between commas"),
    ("0x512", "'0x512': 0 is outside 1..16384"),
    ("32768x512", "32768 is outside 1..16384"),
    ("512x512,512x512", "'512x512': 512x512 is listed twice"),
    ("512x512,1024x1024", "'1024x1024': 1024x1024 has the aspect ratio of 512x512"),
    ("aspect-256,aspect-512", "'aspect-512': 512x512 has the aspect ratio of 256x256"),
])
def test_bad_bucket_specs_are_refused_with_a_clear_error(spec, message):
    with pytest.raises(BucketSpecError, match=re.escape(f"--size-buckets: {message}" if message.startswith("'")
                                                        else message)):
        parse_buckets(spec)


def test_a_bad_spec_is_refused_before_anything_is_read_or_enqueued(make_redis_server, tmp_path):
    server = make_redis_server()
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "height": 100, "width": 100}])
    out = tmp_path / "out"
    result = cli("submit", path, "--model", "m", "--out", out, "--broker", server.url, "--size-buckets", "1000x1000")
    assert result.exit_code == 2
    assert "--size-buckets: '1000x1000': 1000 is not a multiple of 16" in result.output
    assert redis.Redis.from_url(server.url).dbsize() == 0 and not out.exists()
    result = cli("plan", path, "--model", "m", "--size-buckets", "512x512,1024x1024")
    assert result.exit_code == 2 and "has the aspect ratio of 512x512" in result.output
    result = cli("plan", path, "--model", "m", "--size-buckets", "512x512", "--fit", "squash")
    assert result.exit_code == 2 and "squash" in result.output
    result = cli("plan", path, "--model", "m", "--fit", "crop")
    assert result.exit_code == 2 and "--fit crop needs --size-buckets" in result.output


def test_shape_options_are_on_submit_run_and_plan():
    for command in ("submit", "run", "plan"):
        result = cli(command, "--help")
        assert result.exit_code == 0
        for option in ("--size-buckets", "--fit", "--model", "--batch-size", "--height", "--width"):
            assert option in result.output, f"diffq {command} lacks {option}"
    assert "--json" in cli("plan", "--help").output


# -- plan == submit ------------------------------------------------------------------

def mixed_rows(n: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = {"id": f"r{i}", "prompt": f"prompt {i}",
               "height": rng.choice([97, 333, 512, 640, 721, 1080, 1920]),
               "width": rng.choice([97, 333, 512, 640, 721, 1080, 1920])}
        if i % 5 == 0:
            row["guidance_scale"] = 3.5  # CFG: its own queues
        if i % 7 == 0:
            row["num_inference_steps"] = 8  # same shape, separate batches
        rows.append(row)
    return rows


def test_plan_json_equals_what_submit_publishes(make_redis_server, tmp_path):
    server = make_redis_server()
    path = write_rows(tmp_path / "p.jsonl", mixed_rows(1500))
    shape_options = ["--model", "m", "--batch-size", "6", "--size-buckets", "aspect-1024", "--fit", "crop"]
    result = cli("plan", path, *shape_options, "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["total"] == 1500 and plan["compiles"] == len(plan["shapes"])
    assert {s["height"] for s in plan["shapes"]} | {s["width"] for s in plan["shapes"]} <= {
        side for size in PRESETS["aspect-1024"] for side in size}
    assert sum(s["items"] for s in plan["shapes"]) == 1500
    assert all(s["padded_slots"] == s["batches"] * 6 - s["items"] for s in plan["shapes"])
    assert any(s["padded_slots"] for s in plan["shapes"])  # partial batches exist here
    assert all(sum(r["items"] for r in s["requested"]) == s["items"] and s["requested_sizes"] == len(s["requested"])
               for s in plan["shapes"])
    assert not (tmp_path / "out").exists()  # plan wrote nothing

    out = tmp_path / "out"
    result = cli("submit", path, *shape_options, "--out", out, "--broker", server.url)
    assert result.exit_code == 0, result.output
    client = redis.Redis.from_url(server.url)
    assert {s["queue"]: s["batches"] for s in plan["shapes"]} == {
        queue.decode(): client.llen(queue) for queue in client.keys("diffq.*")}
    # The messages carry what the plan says: items and requested sizes per queue.
    messages = list(read_plan(open_storage(str(out))))
    items, asked = Counter(), Counter()
    for message in messages:
        assert message.params.fit == "crop"
        items[message.shape.queue] += len(message.items)
        for item in message.items:
            asked[message.shape.queue, item.requested_height, item.requested_width] += 1
    assert items == Counter({s["queue"]: s["items"] for s in plan["shapes"]})
    assert asked == Counter({(s["queue"], r["height"], r["width"]): r["items"]
                             for s in plan["shapes"] for r in s["requested"]})
    by_id = {row["id"]: row for row in mixed_rows(1500)}
    assert all((item.requested_height, item.requested_width) == (by_id[item.id]["height"], by_id[item.id]["width"])
               for message in messages for item in message.items)
    # The manifest keeps the same histogram and the buckets used (resolved from the preset).
    manifest = read_manifest(open_storage(str(out)))
    assert [{"queue": s.queue, "items": s.items, "batches": s.batches,
             "requested": [r.model_dump() for r in s.requested], "requested_sizes": s.requested_sizes}
            for s in manifest.shapes] == [
        {"queue": s["queue"], "items": s["items"], "batches": s["batches"], "requested": s["requested"],
         "requested_sizes": s["requested_sizes"]} for s in plan["shapes"]]
    assert manifest.defaults.size_buckets == [f"{h}x{w}" for h, w in PRESETS["aspect-1024"]]
    assert manifest.defaults.fit == "crop"


def test_plan_without_buckets_and_its_text(tmp_path):
    rows = [{"prompt": f"p{i}", "height": 64 if i % 2 else 128, "width": 64} for i in range(10)]
    path = write_rows(tmp_path / "p.jsonl", rows)
    plan = json.loads(cli("plan", path, "--model", "m", "--batch-size", "4", "--json").stdout)
    assert [(s["height"], s["width"], s["items"], s["batches"], s["padded_slots"]) for s in plan["shapes"]] == [
        (128, 64, 5, 2, 3), (64, 64, 5, 2, 3)]
    assert all("requested" not in s for s in plan["shapes"])
    from diffq import api

    # The Python API, same figures; what the dtype runs as per device is the CLI's (the
    # producer does not read the backend table).
    assert api.plan(path, model="m", batch_size=4).to_json() == {k: v for k, v in plan.items() if k != "dtype"}
    text = cli("plan", path, "--model", "m", "--batch-size", "4").stdout
    assert re.search(r"128x64 .*5 .*2 .*3 \(37\.5%\) .*diffq\.m-", text)
    assert re.search(r"total .*10 .*4 .*6 \(37\.5%\) .*2 queues", text)
    assert "2 compiles" in text
    # Buckets: the text names which requested sizes went to which bucket.
    text = cli("plan", path, "--model", "m", "--size-buckets", "64x64,128x64").stdout
    assert "128x64 <- 128x64 (5)" in text and "64x64 <- 64x64 (5)" in text


def test_plan_refuses_a_bad_file_like_submit(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    result = cli("plan", path, "--model", "m", "--size-buckets", "aspect-256")
    assert result.exit_code == 2
    assert f"{path}:2: field 'id': duplicate id 'x' (first seen on line 1)" in result.output.replace("\n", "")
    path = write_rows(tmp_path / "q.jsonl", [{"prompt": "a", "heigth": 100}])
    result = cli("plan", path, "--model", "m", "--size-buckets", "aspect-256")
    assert result.exit_code == 2 and "q.jsonl:1: field 'heigth'" in result.output


def test_plan_of_many_nearly_distinct_sizes(tmp_path):
    """200k bucketed rows of random sizes: every distinct size counted, the commonest
    kept. (How fast and how much memory: bench/plan.py, bench/producer.py.)"""
    rng = random.Random(1)
    sizes = [(rng.randrange(64, 2048), rng.randrange(64, 2048)) for _ in range(200_000)]
    with (tmp_path / "p.jsonl").open("w") as handle:
        for i, (height, width) in enumerate(sizes):
            handle.write(f'{{"prompt": "p {i}", "height": {height}, "width": {width}}}\n')
    options, defaults = make_options(model="m", options=GenerationOptions.of(batch_size=8, size_buckets="aspect-1024"))
    plan = validate(tmp_path / "p.jsonl", options, defaults)
    assert plan.total == 200_000 and len(plan.shapes) == 9
    assert sum(s.requested_sizes for s in plan.shapes) == len(set(sizes))  # nearly every size distinct
    # The manifest keeps the commonest sizes of each shape, not all of them.
    assert all(len(s.requested) == MAX_REQUESTED_SIZES for s in plan.shapes)
    assert all(a.items >= b.items for s in plan.shapes for a, b in zip(s.requested, s.requested[1:]))


@pytest.mark.parametrize("fold", [1, 7, 1000, 1 << 20])
def test_size_tally_counts_exactly_across_folds(fold, monkeypatch):
    """SizeTally folds its pending sizes into sorted arrays every FOLD sizes: the same
    counts and the same commonest sizes (ties: the smaller size first) as a Counter."""
    import heapq

    from diffq.producer.submit import SizeTally

    monkeypatch.setattr(SizeTally, "FOLD", fold)
    rng = random.Random(fold)
    sizes = [rng.choice([5, 9, 1 << 29]) if rng.random() < 0.3 else rng.randrange(1 << 20) for _ in range(5000)]
    tally = SizeTally()
    for size in sizes:
        tally.add(size)
    counted = Counter(sizes)
    assert len(tally) == len(counted)
    assert tally.commonest(64) == heapq.nsmallest(64, counted.items(), key=lambda e: (-e[1], e[0]))
    assert tally.commonest(10**6) == sorted(counted.items(), key=lambda e: (-e[1], e[0]))
    assert len(SizeTally()) == 0 and SizeTally().commonest(3) == []


# -- fit in the sink -----------------------------------------------------------------

def bucket_image(height: int, width: int) -> Image.Image:
    """Left half red, right half blue, a green centre column: what resize and crop keep."""
    image = Image.new("RGB", (width, height), (255, 0, 0))
    image.paste((0, 0, 255), (width // 2, 0, width, height))
    image.paste((0, 255, 0), (width // 2 - 2, 0, width // 2 + 2, height))
    return image


@pytest.mark.parametrize("fit", FITS)
def test_fit_stores_the_image_at_the_requested_size(tmp_path, fit):
    from diffq.worker.sink.store import Sink

    message = BatchMessage(
        run_id="r", out=str(tmp_path), batch_id="b-0", params={"num_inference_steps": 1, "guidance_scale": 1.0,
                                                               "fit": fit},
        shape=ShapeKey(model="m", height=64, width=128, batch_size=3, max_sequence_length=8, cfg=False),
        items=[{"id": "wide", "prompt": "p", "seed": 1, "requested_height": 50, "requested_width": 150},
               {"id": "odd", "prompt": "p", "seed": 2, "requested_height": 33, "requested_width": 71},
               {"id": "same", "prompt": "p", "seed": 3, "requested_height": 64, "requested_width": 128}])
    storage = open_storage(str(tmp_path))
    sink = Sink(threads=2)
    try:
        sink.submit(storage, message, [bucket_image(64, 128) for _ in range(3)], MEASURED).stored.result(30)
    finally:
        sink.close()
    records = {r["id"]: r for r in map(json.loads, storage.get_bytes("records/b-0.jsonl").decode().splitlines())}
    for item in message.items:
        record = records[item.id]
        assert (record["height"], record["width"]) == (64, 128)  # what was generated
        assert (record["requested_height"], record["requested_width"]) == (item.requested_height,
                                                                         item.requested_width)
        image = Image.open(io.BytesIO(storage.get_bytes(record["file_name"]))).convert("RGB")
        want = (128, 64) if fit == "none" else (item.requested_width, item.requested_height)
        assert image.size == want
        w, h = image.size
        left, right = image.getpixel((w // 8, h // 2)), image.getpixel((w - 1 - w // 8, h // 2))
        assert left[0] > 200 > left[2] and right[2] > 200 > right[0]  # halves stay where they were
        if fit == "crop" and item.id == "wide":
            # 64x128 scaled to cover 50x150 (x1.17) then cut to 150 wide: the full width
            # is kept, so a 4-px centre stripe is ~5 px wide; rows are cut top and bottom.
            assert sum(1 for x in range(w) if image.getpixel((x, h // 2))[1] > 200) in range(3, 8)
    if fit != "none":
        assert all(r["fit"] == fit for r in records.values())


def test_items_without_a_requested_size_record_the_generated_one(tmp_path):
    from diffq.worker.sink.store import Sink

    message = BatchMessage(
        run_id="r", out=str(tmp_path), batch_id="b-1", params={"num_inference_steps": 1, "guidance_scale": 1.0},
        shape=ShapeKey(model="m", height=32, width=48, batch_size=1, max_sequence_length=8, cfg=False),
        items=[{"id": "x", "prompt": "p", "seed": 1}])
    storage = open_storage(str(tmp_path))
    sink = Sink(threads=1)
    try:
        sink.submit(storage, message, [bucket_image(32, 48)], MEASURED).stored.result(30)
    finally:
        sink.close()
    record = json.loads(storage.get_bytes("records/b-1.jsonl"))
    assert (record["requested_height"], record["requested_width"]) == (32, 48) and record["fit"] == "none"


# -- end to end ----------------------------------------------------------------------

@pytest.mark.slow
def test_run_with_buckets_and_crop_stores_requested_sizes(tmp_path, tiny_model):
    rows = [{"id": "square-ish", "prompt": "a", "height": 50, "width": 70},
            {"id": "tall", "prompt": "b", "height": 100, "width": 33},
            {"id": "wide", "prompt": "c", "height": 33, "width": 100},
            {"id": "exact", "prompt": "d", "height": 64, "width": 64},
            {"id": "default", "prompt": "e"}]
    path = write_rows(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "diffq", "run", str(path), "--model", tiny_model, "--out", str(out),
                           "--batch-size", "2", "--steps", "1", "--size-buckets", "64x64,128x64,64x128",
                           "--fit", "crop", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "5/5 images, 0 failed" in proc.stdout
    storage = open_storage(str(out))
    records = {r["id"]: r for key in storage.list("records/")
               for r in map(json.loads, storage.get_bytes(key).decode().splitlines())}
    generated = {"square-ish": (64, 64), "tall": (128, 64), "wide": (64, 128), "exact": (64, 64),
                 "default": (64, 64)}
    for row in rows:
        record = records[row["id"]]
        requested = (row.get("height", 128), row.get("width", 128))
        assert (record["height"], record["width"]) == generated[row["id"]]
        assert (record["requested_height"], record["requested_width"]) == requested
        image = Image.open(io.BytesIO(storage.get_bytes(record["file_name"])))
        image.load()
        assert image.size == (requested[1], requested[0])
    assert len(list(storage.list("images/"))) == 5
    # The report shows requested vs generated sizes.
    report = cli("report", out, "--json")
    assert report.exit_code == 0, report.output
    shapes = {s["shape"]: s for s in json.loads(report.stdout)["shapes"]}
    assert shapes["64x64"]["requested"] == [{"height": 50, "width": 70, "items": 1},
                                            {"height": 64, "width": 64, "items": 1},
                                            {"height": 128, "width": 128, "items": 1}]
    assert shapes["128x64"]["requested"] == [{"height": 100, "width": 33, "items": 1}]
    text = cli("report", out).stdout
    assert "requested 50x70 (1), 64x64 (1), 128x128 (1)" in text
