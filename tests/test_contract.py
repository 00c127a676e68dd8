"""Shape keys, queue names, the batch message schema, bucketing and the run layout."""

import re
import tracemalloc

import pytest
from pydantic import ValidationError

from diffq.core import layout
from diffq.core.contract import MAX_MESSAGE_BYTES, BatchItem, BatchMessage, BatchParams, ShapeKey, queue_name
from diffq.producer.bucketing import Bucketer, RunOptions, bucket
from diffq.producer.sources import Prompt

SHAPE = ShapeKey(model="/models/tiny", height=128, width=64, batch_size=4, max_sequence_length=64, cfg=False)


def message(**overrides):
    data = dict(run_id="r1", out="/tmp/out", batch_id="b-1", shape=SHAPE,
                params=BatchParams(num_inference_steps=4, guidance_scale=1.0),
                items=[BatchItem(id="a", prompt="p", seed=1)])
    data.update(overrides)
    return BatchMessage(**data)


def test_queue_name_is_readable_and_broker_safe():
    name = queue_name(SHAPE)
    # No dtype given: auto, the serving device's default.
    assert name.startswith("diffq.tiny-") and name.endswith(".128x64.b4.l64.nocfg.auto")
    assert queue_name(SHAPE.model_copy(update={"dtype": "float32"})).endswith(".nocfg.fp32")
    assert re.fullmatch(r"[a-z0-9.-]+", name) and len(name) <= 80


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_queue_names_parse_back_with_their_dtype(dtype):
    from diffq.core.contract import is_shape_queue, queue_dtype, queue_slug, shape_from_queue

    shape = SHAPE.model_copy(update={"dtype": dtype})
    assert shape_from_queue(shape.queue, [shape.model]) == shape
    assert queue_dtype(shape.queue) == dtype and queue_slug(shape.queue) == shape.queue.split(".")[1]
    assert is_shape_queue(shape.queue, [shape.model], dtypes=("auto", dtype))
    assert not is_shape_queue(shape.queue, [shape.model], dtypes=tuple({"auto", "float32", "bfloat16", "float16"} - {dtype}))
    assert queue_dtype("diffq.dead") is None


def test_a_lora_layout_ends_the_queue_name_and_parses_back():
    from diffq.core.contract import is_shape_queue, queue_dtype, queue_from_entity_name, shape_from_queue

    shape = SHAPE.model_copy(update={"lora": "r16-0a1b2c3d"})
    assert shape.queue == queue_name(SHAPE) + ".r16-0a1b2c3d" and len(shape.queue) <= 80
    assert shape_from_queue(shape.queue, [shape.model]) == shape and queue_dtype(shape.queue) == "auto"
    assert is_shape_queue(shape.queue, [shape.model])
    assert queue_from_entity_name(shape.queue.replace(".", "-")) == shape.queue
    assert queue_from_entity_name(SHAPE.queue.replace(".", "-")) == SHAPE.queue
    assert "lora" not in SHAPE.model_dump(mode="json") and shape.model_dump(mode="json")["lora"] == "r16-0a1b2c3d"
    with pytest.raises(ValidationError):
        ShapeKey(**{**SHAPE.model_dump(), "lora": "R16.x"})


@pytest.mark.parametrize("device, runs", [("cpu", "float32"), ("cuda", "bfloat16"), ("neuron", "bfloat16"),
                                          ("tpu", "bfloat16")])
def test_an_auto_shape_runs_at_its_devices_default_and_a_pinned_one_as_pinned(device, runs):
    from diffq.worker.device.backends import get_backend

    backend = get_backend(device)
    assert backend.dtype_for("auto") == runs == backend.default_dtype
    assert backend.dtype_for("float32") == "float32"
    assert "auto" in backend.served_dtypes and backend.default_dtype in backend.served_dtypes


@pytest.mark.parametrize("field, value", [("height", 256), ("width", 128), ("batch_size", 8),
                                          ("max_sequence_length", 128), ("cfg", True),
                                          ("dtype", "bfloat16"), ("model", "/other/tiny"), ("lora", "r8-0123abcd")])
def test_every_shape_field_changes_the_queue(field, value):
    assert queue_name(SHAPE.model_copy(update={field: value})) != queue_name(SHAPE)


def test_message_round_trips_through_json():
    original = message()
    assert BatchMessage.from_json_payload(original.to_json()) == original
    assert BatchMessage.from_json_payload(original.model_dump(mode="json")) == original


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.update(extra=1), "Extra inputs"),
    (lambda d: d["items"].append(dict(d["items"][0])), "unique"),
    (lambda d: d.update(items=[]), "at least 1 item"),
    (lambda d: d.update(batch_id="../escape"), "pattern"),
    (lambda d: d.update(items=[{"id": str(i), "prompt": "p", "seed": 1} for i in range(5)]), "more than its shape"),
    (lambda d: d["shape"].update(height=-1), "greater than 0"),
    (lambda d: d.update(schema_version=2), "schema_version"),
])
def test_invalid_messages_are_rejected(mutate, fragment):
    data = message().model_dump(mode="json")
    mutate(data)
    with pytest.raises(ValidationError, match=fragment):
        BatchMessage.model_validate(data)


def test_oversized_message_refused_before_parsing():
    with pytest.raises(ValueError, match="exceeds"):
        BatchMessage.from_json_payload(b"{" + b" " * MAX_MESSAGE_BYTES + b"}")


def prompts(n, sizes=((64, 64), (128, 64), (128, 128))):
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        yield Prompt(line=i + 1, id=str(i), prompt=f"p{i}", height=h, width=w, seed=None,
                     num_inference_steps=4, guidance_scale=1.0)


def test_bucketing_groups_by_shape_and_pads_only_the_last_batch():
    batches = list(bucket(prompts(10), RunOptions(model="m", batch_size=3), seed_base="s"))
    by_shape = {}
    for batch in batches:
        assert len({(i.id) for i in batch.items}) == len(batch.items)
        by_shape.setdefault((batch.shape.height, batch.shape.width), []).append(len(batch.items))
    # 10 prompts over 3 shapes: 4, 3, 3 items -> batches [3, 1], [3], [3]
    assert sorted(by_shape.values()) == [[3], [3], [3, 1]]
    assert sum(len(b.items) for b in batches) == 10


def test_bucketing_splits_by_call_params_within_a_shape():
    rows = [Prompt(line=i, id=str(i), prompt="p", height=64, width=64, seed=None,
                   num_inference_steps=2 + i % 2, guidance_scale=1.0) for i in range(4)]
    batches = list(bucket(rows, RunOptions(model="m", batch_size=4), seed_base="s"))
    assert sorted(b.params.num_inference_steps for b in batches) == [2, 3]
    assert {b.shape for b in batches} == {batches[0].shape}


def test_bucketing_memory_is_bounded_by_shapes_times_batch_size():
    bucketer = Bucketer(RunOptions(model="m", batch_size=8), seed_base="s")
    tracemalloc.start()
    peak_open = 0
    for prompt in prompts(20_000):
        bucketer.add(prompt)
        peak_open = max(peak_open, bucketer.open_items)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak_open <= 3 * 7
    assert peak < 2_000_000  # a few batches, not 20,000 prompts


@pytest.mark.parametrize("item_id", ["../x", "/abs", "a/../../b", "a\\b", "a\x00b", "\x1b[31m", "x" * 500,
                                     ".", "..", "", "con", "a b"])
def test_image_keys_never_escape_the_run_folder(item_id):
    key = layout.image_key(item_id, "png")
    name = key.removeprefix("images/")
    assert key.startswith("images/") and "/" not in name and "\\" not in name
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", name) and not name.startswith(".")
    assert len(name) <= 130


def test_safe_names_keep_distinct_ids_distinct():
    ids = ["a/b", "a_b", "a b", "a?b", "A_B"]
    assert len({layout.safe_name(i) for i in ids}) == len(ids)
    assert layout.safe_name("demo-001") == "demo-001"
