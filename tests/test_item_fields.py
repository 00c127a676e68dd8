"""Per-item negative_prompt, metadata and model: read, checked against the family, carried.

Producer side only (no workers): what reaches the messages, the plan and the
manifest, and what is refused at submit with file, line and field.
"""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffq.core.contract import MAX_METADATA_BYTES, BatchMessage
from diffq.core.runfolder import read_manifest
from diffq.core.storage import open_storage
from diffq.producer.sources import Defaults, InputError, read_prompts
from diffq.producer.submit import submit


class Collect:
    def __init__(self):
        self.messages: list[BatchMessage] = []

    def publish(self, message: BatchMessage) -> None:
        self.messages.append(message)


def jsonl(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def items_of(messages):
    return {item.id: item for message in messages for item in message.items}


def test_negative_prompt_and_metadata_reach_the_message(tmp_path, tiny_pipelines):
    rows = [{"id": "a", "prompt": "a fox", "negative_prompt": "blurry", "guidance_scale": 5.0,
             "metadata": {"source": "laion", "score": 0.7, "tags": ["x", "y"], "nested": {"k": None}}},
            {"id": "b", "prompt": "a dog", "guidance_scale": 5.0}]
    publisher = Collect()
    submit(jsonl(tmp_path, rows), str(tmp_path / "out"), model=tiny_pipelines["sd3"], publisher=publisher)
    items = items_of(publisher.messages)
    assert items["a"].negative_prompt == "blurry"
    assert items["a"].metadata == rows[0]["metadata"]
    assert (items["b"].negative_prompt, items["b"].metadata) == (None, None)
    # Rows without them carry no null fields in the message.
    plan = (tmp_path / "out" / "plan" / "part-000000.jsonl").read_text()
    assert '"id":"b","prompt":"a dog","seed":' in plan and plan.count('"negative_prompt"') == 1


def test_negative_prompt_on_a_family_without_one_is_refused_at_submit(tmp_path, tiny_pipelines):
    rows = [{"prompt": "ok"}, {"prompt": "a fox", "negative_prompt": "blurry", "guidance_scale": 4.0}]
    out = tmp_path / "out"
    with pytest.raises(InputError) as excinfo:
        submit(jsonl(tmp_path, rows), str(out), model=tiny_pipelines["flux2-klein"], publisher=Collect())
    assert str(excinfo.value) == (f"{tmp_path / 'p.jsonl'}:2: field 'negative_prompt': "
                                  "Flux2KleinPipeline (flux2-klein) takes no negative prompt")
    assert not out.exists()


def test_negative_prompt_without_cfg_is_refused_for_sd3(tmp_path, tiny_pipelines):
    rows = [{"prompt": "a fox", "negative_prompt": "blurry"}]  # default guidance 1.0: CFG off
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'negative_prompt': .*guidance_scale > 1"):
        submit(jsonl(tmp_path, rows), str(tmp_path / "out"), model=tiny_pipelines["sd3"], publisher=Collect())


def test_unknown_family_of_a_local_model_is_refused(tmp_path):
    model = tmp_path / "sdxl"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    rows = [{"prompt": "a"}]
    with pytest.raises(InputError, match=r"model_index.json: field '_class_name': StableDiffusionXLPipeline is "
                                         r"not in diffq's family table"):
        submit(jsonl(tmp_path, rows), str(tmp_path / "out"), model=str(model), publisher=Collect())
    rows = [{"prompt": "a", "model": str(model)}]
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'model': .*model_index.json: field '_class_name'"):
        list(read_prompts(jsonl(tmp_path, rows)))


def test_hub_model_passes_at_submit_and_keeps_the_conservative_cfg_rule(tmp_path):
    # Not a local folder: the producer cannot read the family; the worker decides.
    rows = [{"prompt": "a", "negative_prompt": "blurry", "guidance_scale": 4.0}]
    publisher = Collect()
    submit(jsonl(tmp_path, rows), str(tmp_path / "out"), model="org/some-model", publisher=publisher)
    assert publisher.messages[0].shape.cfg is True
    assert publisher.messages[0].items[0].negative_prompt == "blurry"


def test_cfg_bit_follows_the_family(tmp_path, tiny_pipelines):
    rows = [{"id": "1", "prompt": "a", "guidance_scale": 4.0}, {"id": "2", "prompt": "b", "guidance_scale": 1.0}]
    path = jsonl(tmp_path, rows)
    queues = {}
    for family in ("flux2-klein", "flux", "flux2", "sd3"):
        publisher = Collect()
        submit(path, str(tmp_path / family), model=tiny_pipelines[family], publisher=publisher)
        queues[family] = sorted(m.shape.queue.rsplit(".", 2)[1] for m in publisher.messages)
    # Only SD3's CFG doubles the batch (a new graph); the others share one queue.
    assert queues == {"flux2-klein": ["nocfg", "nocfg"], "flux": ["nocfg", "nocfg"],
                      "flux2": ["nocfg", "nocfg"], "sd3": ["cfg", "nocfg"]}


def test_rows_name_their_own_models(tmp_path, tiny_pipelines):
    klein, sd3 = tiny_pipelines["flux2-klein"], tiny_pipelines["sd3"]
    rows = [{"id": f"k{i}", "prompt": "k"} for i in range(3)]
    rows += [{"id": f"s{i}", "prompt": "s", "model": sd3, "guidance_scale": 5.0, "negative_prompt": "dark"}
             for i in range(2)]
    publisher = Collect()
    out = tmp_path / "out"
    result = submit(jsonl(tmp_path, rows), str(out), model=klein, publisher=publisher, batch_size=2)
    manifest = read_manifest(open_storage(str(out)))
    assert manifest.models == sorted([klein, sd3])
    by_model = {}
    for summary in manifest.shapes:
        by_model.setdefault(summary.shape.model, []).append(summary)
    assert {m: sum(s.items for s in shapes) for m, shapes in by_model.items()} == {klein: 3, sd3: 2}
    assert {s.queue for s in by_model[klein]}.isdisjoint({s.queue for s in by_model[sd3]})
    assert all(s.shape.cfg for s in by_model[sd3])
    for message in publisher.messages:
        assert {item.id[0] for item in message.items} == {"k" if message.shape.model == klein else "s"}
    assert result.total == 5 and result.batches == 3


def test_a_row_model_outside_the_family_rules_is_refused_on_its_line(tmp_path, tiny_pipelines):
    rows = [{"prompt": "a", "model": tiny_pipelines["sd3"], "negative_prompt": "x", "guidance_scale": 5.0},
            {"prompt": "b", "model": tiny_pipelines["flux"], "negative_prompt": "x", "guidance_scale": 5.0}]
    with pytest.raises(InputError, match=r"p.jsonl:2: field 'negative_prompt': FluxPipeline \(flux\)"):
        list(read_prompts(jsonl(tmp_path, rows), Defaults(model=tiny_pipelines["flux2-klein"])))


def test_metadata_must_be_an_object_and_is_capped(tmp_path):
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'metadata': Input should be a valid dictionary"):
        list(read_prompts(jsonl(tmp_path, [{"prompt": "a", "metadata": "text"}])))
    big = {"blob": "x" * MAX_METADATA_BYTES}
    with pytest.raises(InputError, match=rf"p.jsonl:1: field 'metadata': \d+ bytes of JSON, over the "
                                         rf"{MAX_METADATA_BYTES}-byte limit"):
        list(read_prompts(jsonl(tmp_path, [{"prompt": "a", "metadata": big}])))


def write_csv(path, header, rows):
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_csv_keep_columns_move_into_metadata(tmp_path):
    path = write_csv(tmp_path / "p.csv", ["prompt", "source", "score", "metadata", "negative_prompt"],
                     [["a fox", "laion", "0.7", '{"k": 1}', "blurry"], ["a dog", "coco", "", "", ""]])
    a, b = read_prompts(path, keep_columns=("source", "score"))
    assert a.metadata == {"k": 1, "source": "laion", "score": "0.7"}  # CSV cells are text
    assert a.negative_prompt == "blurry"
    assert b.metadata == {"source": "coco"} and b.negative_prompt is None
    # Without --keep-columns an unknown column is still an error.
    with pytest.raises(InputError, match=r"p.csv:2: field 'source': Extra inputs are not permitted"):
        list(read_prompts(path, keep_columns=("score",)))


def test_csv_metadata_cell_must_be_a_json_object(tmp_path):
    path = write_csv(tmp_path / "p.csv", ["prompt", "metadata"], [["a", "[1, 2]"]])
    with pytest.raises(InputError, match=r"p.csv:2: field 'metadata': expected a JSON object, got list"):
        list(read_prompts(path))


def test_parquet_keep_columns_and_struct_metadata(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "a", "aesthetic": 6.5, "url": "http://x/1", "metadata": {"src": "a"}},
        {"prompt": "b", "aesthetic": 5.0, "url": None, "metadata": None},
    ]), path)
    a, b = read_prompts(path, keep_columns=["aesthetic", "url"])
    assert a.metadata == {"src": "a", "aesthetic": 6.5, "url": "http://x/1"}  # typed, as stored
    assert b.metadata == {"aesthetic": 5.0}
    with pytest.raises(InputError, match="field 'aesthetic'"):
        list(read_prompts(path))


def test_keep_column_clashing_with_a_metadata_key_is_an_error(tmp_path):
    path = write_csv(tmp_path / "p.csv", ["prompt", "src", "metadata"], [["a", "x", '{"src": "y"}']])
    with pytest.raises(InputError, match=r"p.csv:2: field 'src': is both a kept column and a key"):
        list(read_prompts(path, keep_columns=("src",)))


def test_regional_compile_of_sd3_is_refused_before_any_worker_starts(tmp_path, tiny_pipelines):
    from tests.helpers import diffq

    prompts = jsonl(tmp_path, [{"prompt": "a", "height": 64, "width": 64}])
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", tiny_pipelines["sd3"], "--out", str(out), "--compile", "regional",
                 check=False)
    assert proc.returncode == 2
    assert ("StableDiffusion3Pipeline (sd3): its transformer declares no repeated blocks, so --compile regional "
            "cannot apply; use --compile full or none") in " ".join(proc.stderr.split())
    assert not out.exists()
    proc = diffq("worker", "--broker", "memory://", "--queues", "q", "--model", tiny_pipelines["sd3"],
                 "--compile", "regional", "--plan", check=False)
    assert proc.returncode == 2 and "declares no repeated blocks" in proc.stderr


def test_plan_lists_the_models_and_takes_keep_columns(tmp_path, tiny_pipelines):
    from tests.helpers import diffq

    klein, sd3 = tiny_pipelines["flux2-klein"], tiny_pipelines["sd3"]
    path = write_csv(tmp_path / "p.csv", ["prompt", "model", "source"], [["a", "", "x"], ["b", sd3, "y"]])
    proc = diffq("plan", str(path), "--model", klein, "--keep-columns", "source", "--json")
    plan = json.loads(proc.stdout)
    assert plan["models"] == sorted([klein, sd3]) and plan["total"] == 2 and len(plan["shapes"]) == 2
    proc = diffq("plan", str(path), "--model", klein, check=False)
    assert proc.returncode == 2 and "p.csv:2: field 'source'" in " ".join(proc.stderr.split())
