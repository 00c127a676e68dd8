"""LoRA adapters per row through a whole run: the `lora` field and `--lora` checked and
pinned by the producer (file:line:field, nothing enqueued on a bad one), rows batched by
adapter set under one shape whose key names the run's layout, `plan`'s adapter groups and
their padding, and (slow) one `diffq run --compile regional` mixing adapters row by row on
the tiny FLUX.1 pipeline, against plain diffusers runs of the same items."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diffq.core import adapters as A
from diffq.core.contract import BatchMessage
from diffq.core.runfolder import iter_records, read_manifest
from diffq.core.storage import open_storage
from diffq.producer.sources import InputError
from diffq.producer.submit import plan, submit
from tests.test_lora import _pixels, _plain, flux, loras, tolerance  # noqa: F401  (fixtures and the plain run)

SIDE, STEPS, BATCH = 64, 2, 2
ARGS = dict(height=SIDE, width=SIDE, steps=STEPS, batch_size=BATCH, max_sequence_length=16)


class Recording:
    """A publisher that keeps what it is given: what a broker would hold."""

    def __init__(self):
        self.published: list[BatchMessage] = []

    def publish(self, message: BatchMessage) -> None:
        self.published.append(message)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _submitted(tmp_path, rows, flux, **options) -> tuple[list[BatchMessage], str]:
    recording, out = Recording(), str(tmp_path / "out")
    submit(_jsonl(tmp_path / "prompts.jsonl", rows), out, model=flux, publisher=recording, window=None,
           **ARGS, **options)
    return recording.published, out


def _adapter_of(messages) -> dict[str, tuple]:
    """item id -> its batch's adapters as (path, scale)."""
    return {item.id: tuple((ref.path, ref.scale) for ref in message.params.adapters)
            for message in messages for item in message.items}


# --- the producer ---------------------------------------------------------------------


def test_rows_are_batched_by_adapter_set_under_one_shape_naming_the_layout(tmp_path, flux, loras):
    rows = ([{"id": f"none-{k}", "prompt": "p", "lora": "none"} for k in range(3)]
            + [{"id": f"default-{k}", "prompt": "p"} for k in range(3)]
            + [{"id": f"r4-{k}", "prompt": "p", "lora": f"{loras[4]}@0.8"} for k in range(2)]
            + [{"id": "r4-half", "prompt": "p", "lora": [{"path": loras[4], "scale": 0.5}]}])
    messages, out = _submitted(tmp_path, rows, flux, lora=f"{loras[8]}@0.5")
    layout = A.layout([A.inspect(loras[4]), A.inspect(loras[8])])
    assert layout.rank == 8
    assert {m.shape.lora for m in messages} == {layout.label} and len({m.shape.queue for m in messages}) == 1
    assert messages[0].shape.queue.endswith(f".nocfg.auto.{layout.label}")
    adapters = _adapter_of(messages)
    assert {k: v for k, v in adapters.items() if k.startswith("none")} == {f"none-{k}": () for k in range(3)}
    assert all(adapters[f"default-{k}"] == ((loras[8], 0.5),) for k in range(3))
    assert adapters["r4-0"] == adapters["r4-1"] == ((loras[4], 0.8),) and adapters["r4-half"] == ((loras[4], 0.5),)
    # One adapter set (with its scales) per batch: 2 + 2 + 1 + 1 batches.
    assert sorted(len(m.items) for m in messages) == [1, 1, 1, 2, 2, 2]
    revisions = {ref.path: ref.revision for m in messages for ref in m.params.adapters}
    assert revisions == {path: A.content_revision(Path(path).read_bytes()) for path in (loras[4], loras[8])}
    manifest = read_manifest(open_storage(out))
    assert manifest.adapter_layouts == {flux: layout} and manifest.adapter_revisions == revisions
    assert [ref.path for ref in manifest.defaults.lora] == [loras[8]]
    assert [s.shape.lora for s in manifest.shapes] == [layout.label]


def test_an_adapter_first_named_late_in_the_file_still_labels_every_batch(tmp_path, flux, loras):
    rows = [{"id": f"plain-{k}", "prompt": "p"} for k in range(7)] + [{"id": "late", "prompt": "p", "lora": loras[4]}]
    messages, _ = _submitted(tmp_path, rows, flux)
    assert sorted(item.id for m in messages for item in m.items) == sorted(row["id"] for row in rows)
    assert {m.shape.lora for m in messages} == {A.layout([A.inspect(loras[4])]).label}
    assert sorted(len(m.items) for m in messages) == [1, 1, 2, 2, 2]  # 7 without: 4 batches; 1 with: 1


def _set_runs(messages) -> list[tuple]:
    """The adapter sets in publishing order, one entry per run of consecutive batches."""
    sets = [tuple((ref.path, ref.scale) for ref in m.params.adapters) for m in messages]
    return [s for k, s in enumerate(sets) if k == 0 or sets[k - 1] != s]


def test_batches_are_published_grouped_by_adapter_set_by_submit_and_the_feeder(tmp_path, flux, loras):
    # Rows round-robin over 6 sets (one with none): bucketed alone, each set's batches
    # would fill one after another's (s0 s1 … s5 s0 s1 …); published, each set's come together.
    scales = [None, 0.2, 0.4, 0.6, 0.8, 1.0]
    rows = [{"id": f"r{k}", "prompt": "p", "lora": "none" if scales[k % 6] is None else f"{loras[4]}@{scales[k % 6]}"}
            for k in range(6 * 2 * 3)]  # 3 batches of 2 per set
    (tmp_path / "all").mkdir()
    messages, _ = _submitted(tmp_path / "all", rows, flux)
    assert len(messages) == 18 and len(_set_runs(messages)) == 6  # one run of batches per set
    assert [s[0][1] if s else None for s in _set_runs(messages)] == scales  # the order their first batch came
    assert sorted(item.id for m in messages for item in m.items) == sorted(row["id"] for row in rows)
    # The same rows, the same order (resume's restore compares plan parts byte for byte).
    again, _ = _submitted(tmp_path, rows, flux)
    assert [(m.batch_id, [i.id for i in m.items]) for m in again] == [
        (m.batch_id, [i.id for i in m.items]) for m in messages]
    # Windowed: the feeder publishes the plan's order, so its first window is the first sets'.
    recording = Recording()
    submit(tmp_path / "prompts.jsonl", str(tmp_path / "windowed"), model=flux, publisher=recording, window=4,
           **ARGS)
    assert [m.batch_id for m in recording.published] == [m.batch_id for m in messages[:4]]


# A LoRA run planned before its plan was grouped by set: batch size 1, rows alternating
# over two sets, so the bucketing's order (a b a b) is not the grouped one (a a b b).
OLD_ROWS, OLD_ARGS = 4, {**ARGS, "batch_size": 1}


def _old_format_out(tmp_path: Path, flux, loras, monkeypatch) -> tuple[Path, Path]:
    """(prompts, OUT) as diffq wrote them before grouping by set: the plan in the
    bucketing's order (encode_plan without `grouped_by_set`), no `plan_by_set` in the
    manifest; nothing generated yet."""
    from diffq.core import layout
    from diffq.core.records import parse_plan_part
    from diffq.producer import submit as submitting

    rows = [{"id": f"r{k}", "prompt": f"a tiny prompt {k}", "seed": k, "lora": f"{loras[4]}@{0.4 if k % 2 else 0.8}"}
            for k in range(OLD_ROWS)]
    prompts, out = _jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(submitting, "grouped_by_set", lambda keyed: (message for _, message in keyed))
        submit(prompts, str(out), model=flux, publisher=Recording(), window=None, **OLD_ARGS)
    manifest = json.loads((out / layout.MANIFEST).read_text())
    assert manifest.pop("plan_by_set") is True  # what the current code records, taken out
    (out / layout.MANIFEST).write_text(json.dumps(manifest))
    stored = list(parse_plan_part((out / layout.plan_key(0)).read_bytes()))
    assert len(stored) == OLD_ROWS and len(_set_runs(stored)) == OLD_ROWS  # interleaved: grouped, the plan would differ
    return prompts, out


def test_a_lora_run_planned_before_grouping_by_set_keeps_its_plans_order_when_continued(
        tmp_path, flux, loras, monkeypatch):
    """`diffq run` on such an OUT re-encodes the plan in the order the manifest says it has:
    not RunDiffers, and a plan part a killed submit never wrote is restored in that order."""
    from diffq.core import layout
    from diffq.core.options import GenerationOptions
    from diffq.producer.resume import continuation
    from diffq.producer.submit import make_options, validate

    prompts, out = _old_format_out(tmp_path, flux, loras, monkeypatch)
    storage = open_storage(str(out))
    part = layout.plan_key(0)
    written = storage.get_bytes(part)
    storage.delete(part)
    options, defaults = make_options(model=flux, options=GenerationOptions.of(**OLD_ARGS))
    checked = validate(prompts, options, defaults)
    assert continuation(storage, read_manifest(storage), prompts=prompts, plan=checked,
                        options=options.with_layouts(checked.adapter_layouts), defaults=defaults) == 1
    assert storage.get_bytes(part) == written  # the same batches in the same order, ids and seeds
    # A run planned now records its grouping, and the same check holds it to that order.
    submit(prompts, str(tmp_path / "new"), model=flux, publisher=Recording(), window=None, **OLD_ARGS)
    assert read_manifest(open_storage(str(tmp_path / "new"))).plan_by_set


@pytest.mark.slow
def test_diffq_run_finishes_a_lora_run_planned_before_grouping_by_set(tmp_path, flux, loras, monkeypatch):
    from diffq.core import layout
    from tests.helpers import diffq

    prompts, out = _old_format_out(tmp_path, flux, loras, monkeypatch)
    plan_before = (out / layout.plan_key(0)).read_bytes()
    args = ("run", str(prompts), "--model", flux, "--out", str(out), "--batch-size", "1", "--steps", str(STEPS),
            "--height", str(SIDE), "--width", str(SIDE), "--max-sequence-length", "16", "--no-progress")
    proc = diffq(*args)
    assert f"{OLD_ROWS}/{OLD_ROWS} images, 0 failed" in proc.stdout, proc.stdout + proc.stderr
    storage = open_storage(str(out))
    lines = [json.loads(line) for key in storage.list("records/") for line in storage.get_bytes(key).splitlines()]
    assert sorted(line["id"] for line in lines) == [f"r{k}" for k in range(OLD_ROWS)]  # each exactly once
    assert len(list(storage.list("images/"))) == OLD_ROWS
    assert (out / layout.plan_key(0)).read_bytes() == plan_before  # not rewritten in the grouped order
    assert "nothing left to run" in diffq(*args).stdout


def test_plan_shows_the_adapter_groups_and_what_grouping_costs_in_padding(tmp_path, flux, loras):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    rows = ([{"prompt": "p", "lora": "none"}] * 3 + [{"prompt": "p"}] * 3
            + [{"prompt": "p", "lora": f"{loras[4]}@0.8"}] * 2)
    prompts = _jsonl(tmp_path / "prompts.jsonl", rows)
    result = plan(prompts, model=flux, lora=[f"{loras[8]}@0.5"], **ARGS).to_json()
    groups = {g["label"]: (g["items"], g["batches"], g["padded_slots"]) for g in result["adapters"]["groups"]}
    assert groups == {"none": (3, 2, 1), f"{loras[8]}@0.5": (3, 2, 1), f"{loras[4]}@0.8": (2, 1, 0)}
    # Without grouping the 8 items of the one shape would fill 4 batches, no padding.
    assert (result["batches"], result["padded_slots"]) == (5, 2)
    assert {k: result["adapters"][k] for k in ("batches_without_grouping", "extra_batches",
                                                "extra_padded_slots")} == {"batches_without_grouping": 4,
                                                                           "extra_batches": 1,
                                                                           "extra_padded_slots": 2}
    assert result["adapters"]["layouts"][flux]["rank"] == 8
    cli = ["plan", str(prompts), "--model", flux, "--lora", f"{loras[8]}@0.5", "--batch-size", "2",
           "--height", "64", "--width", "64"]
    table = CliRunner().invoke(app, cli)
    assert table.exit_code == 0, table.output
    assert "LoRA adapter groups" in table.output and "costs 1 batches and 2 padded slots" in table.output
    as_json = json.loads(CliRunner().invoke(app, [*cli, "--json"]).output)
    assert as_json["adapters"]["extra_batches"] == 1


def test_plan_shows_per_lora_mode_the_set_changes_compiles_and_the_scaffolds_share(tmp_path, flux, loras):
    from diffusers import FluxTransformer2DModel
    from typer.testing import CliRunner

    from diffq.app.cli import app

    # Two shapes: 64² over three sets (none, r4, r8), 32x64 over one (r8).
    rows = ([{"prompt": "p", "lora": "none"}] * 2 + [{"prompt": "p", "lora": f"{loras[4]}@0.8"}] * 2
            + [{"prompt": "p", "lora": f"{loras[8]}@0.5"}] * 3
            + [{"prompt": "p", "lora": f"{loras[8]}@0.5", "height": 32, "width": 64}] * 2)
    prompts = _jsonl(tmp_path / "prompts.jsonl", rows)
    adapters = plan(prompts, model=flux, **ARGS).to_json()["adapters"]
    assert sorted(adapters["sets_per_queue"].values()) == [1, 3]
    modes = adapters["modes"]
    assert (modes["swap"]["set_changes"], modes["swap"]["compiles"]) == (4, 2)
    assert (modes["fuse"]["set_changes"], modes["fuse"]["compiles"]) == (4, 2)
    assert (modes["compile"]["compiles"], modes["compile"]["compiles_where_weights_are_graph_inputs"]) == (4, 2)
    # The scaffold's share, counted here from the loaded transformer's Linear modules:
    # K slots × padded rank × (in + out) per target, against every Linear's in × out.
    transformer = FluxTransformer2DModel.from_pretrained(flux, subfolder="transformer")
    linears = {name: module for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    layout = A.layout([A.inspect(loras[4]), A.inspect(loras[8])])
    extra = layout.slots * layout.rank * sum(linears[t].in_features + linears[t].out_features for t in layout.targets)
    share = 100 * extra / sum(m.in_features * m.out_features for m in linears.values())
    assert modes["swap"]["scaffold_percent"] == pytest.approx(share, abs=0.01)
    assert adapters["layouts"][flux]["scaffold_percent"] == pytest.approx(share, abs=0.01)
    assert ("warning" in modes["swap"]) == (share > 5)  # a tiny transformer's width is near the rank
    table = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux, "--batch-size", "2", "--height", "64",
                                     "--width", "64"], env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    assert "per --lora-mode" in table.output and f"+{modes['swap']['scaffold_percent']:g} % linear work" in table.output
    assert "4 (per shape and set where weights are baked; 2 where they are graph inputs)" in table.output
    assert ("warning: the swap scaffold adds" in table.output) == (share > 5)


def test_a_run_without_adapters_is_as_before(tmp_path, flux):
    messages, out = _submitted(tmp_path, [{"prompt": "p"}, {"prompt": "q", "lora": "none"}], flux)
    for message in messages:
        data = json.loads(message.model_dump_json())
        assert "lora" not in data["shape"] and "adapters" not in data["params"]
        assert re.fullmatch(r"diffq\.[a-z0-9-]+\.64x64\.b2\.l16\.nocfg\.auto", message.shape.queue)
    manifest = json.loads(open_storage(out).get_bytes("manifest.json"))
    assert "adapter_layouts" not in manifest and "adapter_revisions" not in manifest
    assert plan(tmp_path / "prompts.jsonl", model=flux, **ARGS).to_json().keys() == {
        "total", "batches", "compiles", "models", "padded_slots", "shapes"}


def test_csv_parquet_and_txt_rows_take_the_shorthand_json_or_the_default(tmp_path, flux, loras):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cells = {"a": f"{loras[4]}@0.8", "b": json.dumps({"path": loras[8], "scale": 0.5}), "c": "none", "d": ""}
    path = tmp_path / "prompts.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "prompt", "lora"])
        writer.writerows([[key, "p", cell] for key, cell in cells.items()])
    want = {"a": ((loras[4], 0.8),), "b": ((loras[8], 0.5),), "c": (), "d": ((loras[16], 1.0),)}
    recording = Recording()
    submit(path, str(tmp_path / "csv-out"), model=flux, publisher=recording, window=None, lora=loras[16], **ARGS)
    assert _adapter_of(recording.published) == want
    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": list(cells), "prompt": ["p"] * 4, "lora": [cells[k] or None for k in cells]}),
                   parquet)
    recording = Recording()
    submit(parquet, str(tmp_path / "pq-out"), model=flux, publisher=recording, window=None, lora=loras[16], **ARGS)
    assert _adapter_of(recording.published) == want
    structs = tmp_path / "structs.parquet"  # a struct column: the object form
    pq.write_table(pa.table({"id": ["s"], "prompt": ["p"], "lora": [{"path": loras[8], "scale": 0.25}]}), structs)
    recording = Recording()
    submit(structs, str(tmp_path / "struct-out"), model=flux, publisher=recording, window=None, **ARGS)
    assert _adapter_of(recording.published) == {"s": ((loras[8], 0.25),)}
    text = tmp_path / "prompts.txt"  # TXT rows take --lora
    text.write_text("a\nb\n")
    recording = Recording()
    submit(text, str(tmp_path / "txt-out"), model=flux, publisher=recording, window=None, lora=f"{loras[4]}@-1",
           **ARGS)
    assert set(_adapter_of(recording.published).values()) == {((loras[4], -1.0),)}


def _bad(kind: str, tmp_path: Path) -> tuple[str, str]:
    """(an adapter spec of this kind of bad, what its refusal says)."""
    from safetensors.torch import save_file

    q = "transformer.transformer_blocks.0.attn.to_q"
    path = tmp_path / f"{kind}.safetensors"
    if kind == "wrong model":  # FLUX.1-dev's own width (3072), not the tiny model's
        save_file({f"{q}.lora_A.weight": torch.zeros(4, 3072), f"{q}.lora_B.weight": torch.zeros(3072, 4)}, str(path))
        return str(path), "another model"
    if kind == "corrupt header":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
        return str(path), "corrupt header"
    if kind == "text encoder":
        save_file({"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
                   "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)},
                  str(path))
        return str(path), "text-encoder LoRA"
    if kind == "incompatible config":
        save_file({f"{q}.lora_A.weight": torch.zeros(4, 32), f"{q}.lora_B.weight": torch.zeros(32, 4)}, str(path),
                  metadata={"lora_adapter_metadata": json.dumps({"transformer.use_dora": True})})
        return str(path), "DoRA"
    if kind == "refused layout":  # kohya's bias delta: diffusers' converter would drop it with a log line
        proj = "lora_unet_double_blocks_0_img_attn_proj"
        save_file({f"{proj}.lora_down.weight": torch.zeros(4, 32), f"{proj}.lora_up.weight": torch.zeros(32, 4),
                   f"{proj}.alpha": torch.tensor(4.0), f"{proj}.diff_b": torch.zeros(32)}, str(path))
        return str(path), "a bias or norm delta"
    if kind == "missing file":
        return str(tmp_path / "nowhere.safetensors"), "no such file"
    if kind == "scale out of range":
        return f"{path}@80", "less than or equal to 4"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["wrong model", "corrupt header", "text encoder", "incompatible config",
                                  "refused layout", "missing file", "scale out of range", "not allowed"])
def test_a_bad_adapter_is_refused_at_submit_naming_file_line_field_and_nothing_is_enqueued(
        kind, tmp_path, flux, loras, monkeypatch):
    if kind == "not allowed":
        monkeypatch.setenv("DIFFQ_ALLOWED_ADAPTERS", json.dumps([str(tmp_path / "allowed")]))
        spec, says = loras[8], "not under DIFFQ_ALLOWED_ADAPTERS"
    else:
        spec, says = _bad(kind, tmp_path)
    rows = [{"prompt": "fine"}, {"prompt": "fine too", "lora": "none"}, {"prompt": "bad", "lora": spec},
            {"prompt": "never read"}]
    prompts = _jsonl(tmp_path / "prompts.jsonl", rows)
    recording, out = Recording(), tmp_path / "out"
    with pytest.raises(InputError) as caught:
        submit(prompts, str(out), model=flux, publisher=recording, window=None, **ARGS)
    field = "lora.scale" if kind == "scale out of range" else "lora"
    assert str(caught.value).startswith(f"{prompts}:3: field '{field}': ")
    assert says in str(caught.value)
    assert recording.published == [] and not out.exists()  # nothing enqueued, nothing written


def test_a_bad_lora_option_is_refused_before_any_row(tmp_path, flux):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "p"}])
    missing = str(tmp_path / "missing.safetensors")
    result = CliRunner().invoke(app, ["run", str(prompts), "--model", flux, "--out", str(tmp_path / "out"),
                                      "--lora", missing, "--no-progress"])
    assert result.exit_code == 2 and "field '--lora[0].path'" in result.output and "no such file" in result.output
    assert not (tmp_path / "out").exists()
    five = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux,
                                    *(arg for k in range(5) for arg in ("--lora", f"{k}.safetensors"))])
    assert five.exit_code == 2 and "--lora: 5 adapters in one set: at most 4 stack" in " ".join(five.output.split())
    twice = CliRunner().invoke(app, ["plan", str(prompts), "--model", flux, "--lora", "a.safetensors",
                                     "--lora", "a.safetensors@0.5"])
    assert twice.exit_code == 2 and "names an adapter twice" in twice.output


def test_stacked_sets_are_batched_whole_and_give_the_layout_its_slots(tmp_path, flux, loras):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    pair = [f"{loras[4]}@0.8", {"path": loras[8], "scale": 0.5}]
    rows = ([{"id": f"none-{k}", "prompt": "p", "lora": "none"} for k in range(2)]
            + [{"id": f"one-{k}", "prompt": "p", "lora": f"{loras[4]}@0.8"} for k in range(2)]
            + [{"id": f"pair-{k}", "prompt": "p", "lora": pair} for k in range(3)]
            + [{"id": "reversed", "prompt": "p", "lora": pair[::-1]}]
            + [{"id": f"default-{k}", "prompt": "p"} for k in range(2)])
    messages, out = _submitted(tmp_path, rows, flux, lora=[f"{loras[16]}", f"{loras[8]}@0.25"])
    layout = A.layout([A.inspect(loras[4]), A.inspect(loras[8]), A.inspect(loras[16])], slots=2)
    assert layout.label == f"r16x2-{layout.digest}"
    assert {m.shape.lora for m in messages} == {layout.label} and len({m.shape.queue for m in messages}) == 1
    assert read_manifest(open_storage(out)).adapter_layouts == {flux: layout}
    adapters = _adapter_of(messages)
    assert all(adapters[f"pair-{k}"] == ((loras[4], 0.8), (loras[8], 0.5)) for k in range(3))
    assert adapters["reversed"] == ((loras[8], 0.5), (loras[4], 0.8))  # the row's order, in its own batch
    assert all(adapters[f"default-{k}"] == ((loras[16], 1.0), (loras[8], 0.25)) for k in range(2))
    # One whole set per batch: none 1, one 1, pair 2 (3 items), reversed 1, default 1.
    assert sorted(len(m.items) for m in messages) == [1, 1, 2, 2, 2, 2]
    shown = json.loads(CliRunner().invoke(app, ["plan", str(tmp_path / "prompts.jsonl"), "--model", flux, "--json",
                                                "--batch-size", "2", "--height", "64", "--width", "64"]).output)
    groups = {g["label"]: g["items"] for g in shown["adapters"]["groups"]}
    assert groups[f"{loras[4]}@0.8, {loras[8]}@0.5"] == 3 and shown["adapters"]["layouts"][flux]["slots"] == 2
    table = CliRunner().invoke(app, ["plan", str(tmp_path / "prompts.jsonl"), "--model", flux, "--batch-size", "2",
                                     "--height", "64", "--width", "64"])
    said = " ".join(table.output.split())
    assert f"layout {shown['adapters']['layouts'][flux]['label']} (" in said
    assert "at rank 8, 2 slots (sets stack up to 2 adapters)" in said


def test_a_set_of_more_than_four_adapters_is_refused_naming_file_line_field(tmp_path, flux, loras):
    rows = [{"prompt": "fine", "lora": [loras[4], loras[8]]},
            {"prompt": "too many", "lora": [loras[4], loras[8], loras[16], "x.safetensors", "y.safetensors"]}]
    prompts = _jsonl(tmp_path / "prompts.jsonl", rows)
    recording, out = Recording(), tmp_path / "out"
    with pytest.raises(InputError) as caught:
        submit(prompts, str(out), model=flux, publisher=recording, window=None, **ARGS)
    assert str(caught.value) == (f"{prompts}:2: field 'lora': 5 adapters in one set: at most 4 stack (each is a "
                                 f"LoRA slot every call of the run computes)")
    assert recording.published == [] and not out.exists()


def test_a_worker_takes_the_layout_from_the_manifest_and_refuses_another(tmp_path, flux, loras):
    from diffq.worker.delivery.runtime import Runtime
    from diffq.worker.delivery.spec import ChildSpec
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost
    from diffq.worker.sink.store import Sink

    (tmp_path / "eight").mkdir(), (tmp_path / "four").mkdir()
    eight, out = _submitted(tmp_path / "eight", [{"prompt": "p", "lora": loras[8]}], flux)
    four, out4 = _submitted(tmp_path / "four", [{"prompt": "p", "lora": loras[4]}], flux)
    storage, shape, storage4, shape4 = open_storage(out), eight[0].shape, open_storage(out4), four[0].shape
    assert shape.lora != shape4.lora  # two runs, two layouts of one model
    spec = ChildSpec(name="w", broker_url="memory://", queues=[shape.queue], allowed_out_prefixes=[])

    def pixels(host, message) -> np.ndarray:
        return _pixels(host.generate(message.shape, message.params, message.items).images)

    fresh = {}
    for name, message in (("eight", eight[0]), ("four", four[0])):  # each layout on a host of its own
        host = PipelineHost(backend=get_backend("cpu"))
        host.use_adapters(flux, read_manifest(open_storage(message.out)).adapter_layouts[flux])
        fresh[name] = pixels(host, message)
    # A worker that preloaded the model without a layout (a fleet's) serves both runs in
    # turn: each batch's pipeline is built around its run's layout on the device's turn.
    rt = Runtime(spec=spec, host=PipelineHost(backend=get_backend("cpu")), sink=Sink())
    rt.host.pipeline(flux, "auto")
    for storage_, message in ((storage, eight[0]), (storage4, four[0])):
        assert rt.run_problem(storage_, message.run_id) is None
        assert rt.adapter_problem(storage_, message.shape, message.params.adapters) is None
    assert not rt.host.adapter_slots  # the checks load nothing
    for name, message in (("eight", eight[0]), ("four", four[0]), ("eight", eight[0])):
        assert np.array_equal(pixels(rt.host, message), fresh[name]), name
        assert rt.host.adapter_layouts[flux].label == message.shape.lora
    # What the manifest does not say is refused.
    other = shape.model_copy(update={"lora": "r4-0000abcd"})
    assert "names LoRA layout r4-0000abcd" in rt.adapter_problem(storage, other)
    assert "says none" in rt.adapter_problem(storage, shape.model_copy(update={"model": "/elsewhere"}))
    ref = eight[0].params.adapters[0]
    assert "is not one run" in rt.adapter_problem(storage, shape, (ref.model_copy(update={"path": loras[16]}),))
    assert "pinned" in rt.adapter_problem(storage, shape, (ref.model_copy(update={"revision": "0" * 16}),))
    assert "is not one run" in rt.adapter_problem(storage, shape, four[0].params.adapters)  # another run's


# --- the worker: a step cache with adapters ---------------------------------------------


@pytest.mark.slow
def test_a_step_cache_runs_with_hot_swapped_adapters_and_no_steady_recompile(flux, loras):
    """taylorseer's hooks wrap the compiled blocks (regional compile) whose LoRA layers
    carry the slot: every adapter swaps under the cache, no batch after the first compiles."""
    from diffq.core.contract import AdapterRef, BatchItem, BatchParams, ShapeKey
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost

    torch._dynamo.reset()
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="regional")
    host.use_adapters(flux, A.layout(A.inspect(path) for path in loras.values()))
    shape = ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False)
    items = [BatchItem(id=f"i{k}", prompt=f"a tiny prompt {k}", seed=k) for k in range(BATCH)]
    cache = "taylorseer:cache_interval=3,use_lite_mode=true"

    def images(rank: int | None, speedup: str | None):
        adapters = (AdapterRef(path=loras[rank], scale=1.0),) if rank else ()
        generated = host.generate(shape, BatchParams(num_inference_steps=10, guidance_scale=1.0, speedup=speedup,
                                                     adapters=adapters), items)
        return _pixels(generated.images), generated.graphs

    first, graphs = images(None, cache)
    assert graphs > 0
    runs = [(rank, speedup, *images(rank, speedup)) for rank, speedup in
            [(8, cache), (16, cache), (8, None), (None, cache), (8, cache)]]
    assert [graphs for *_, graphs in runs] == [0] * len(runs) and host.recompiles == 0
    cached8, cached16, full8, none_again, cached8_again = (pixels for *_, pixels, _ in runs)
    assert np.array_equal(none_again, first) and np.array_equal(cached8_again, cached8)
    assert not np.array_equal(cached8, full8), "the cache never skipped a step: the test would prove nothing"
    assert not np.array_equal(cached8, cached16) and not np.array_equal(cached8, first)


# --- one `diffq run` mixing adapters row by row -----------------------------------------

# id -> (prompt index: "a tiny prompt K" at seed K, as tests/test_lora.py's plain runs; the row's `lora`).
# Rows without the field take the run's --lora (rank 16 at scale 1); r16-again repeats
# r16-0's item in another batch (its group's last, padded); stack rows stack two adapters
# (the run's layout then has two slots).
ROWS = {"base-0": (0, "none"), "r4-0": (0, "R4@0.8"), "r8-0": (0, {"path": "R8", "scale": 0.5}),
        "zero-0": (0, [{"path": "R8", "scale": 0}]), "r16-0": (0, None), "s3-0": (0, "S3@0.5"),
        "base-1": (1, "none"), "r4-1": (1, "R4@0.8"), "r8-1": (1, {"path": "R8", "scale": 0.5}),
        "zero-1": (1, [{"path": "R8", "scale": 0}]), "r16-1": (1, None), "s3-1": (1, "S3@0.5"),
        "stack-0": (0, ["R4@0.8", {"path": "R8", "scale": 0.5}]), "stack-1": (1, ["R4@0.8", "R8@0.5"]),
        "r16-again": (0, None)}


def _spelled(value, paths: dict[str, str]):
    if isinstance(value, str):
        name, at, scale = value.partition("@")
        return paths.get(name, name) + at + scale
    if isinstance(value, dict):
        return {**value, "path": paths[value["path"]]}
    if isinstance(value, list):
        return [_spelled(one, paths) for one in value]
    return value


@pytest.fixture(scope="module")
def lora_run(flux, loras, s3_server, tmp_path_factory):
    from tests.helpers import diffq
    from tests.servers import unique_bucket_name

    root = tmp_path_factory.mktemp("lora-run")
    bucket = f"s3://{s3_server.make_bucket(unique_bucket_name())}"
    open_storage(bucket).upload_file(loras[8], "loras/r8.safetensors")
    paths = {"R4": loras[4], "R8": loras[8], "S3": f"{bucket}/loras/r8.safetensors"}
    rows = []
    for item_id, (k, lora) in ROWS.items():
        row = {"id": item_id, "prompt": f"a tiny prompt {k}", "seed": k, "height": SIDE, "width": SIDE}
        rows.append(row if lora is None else {**row, "lora": _spelled(lora, paths)})
    prompts = _jsonl(root / "prompts.jsonl", rows)
    out = root / "out"
    args = ("run", str(prompts), "--model", flux, "--out", str(out), "--batch-size", str(BATCH), "--steps",
            str(STEPS), "--max-sequence-length", "16", "--compile", "regional", "--lora", f"{loras[16]}@1",
            "--no-progress")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DIFFQ_MODEL_CACHE", str(root / "model-cache"))
        proc = diffq(*args)
        assert f"{len(ROWS)}/{len(ROWS)} images, 0 failed" in proc.stdout, proc.stdout + proc.stderr
        # The same command again continues the run: the same plan (layout, pinned revisions), nothing new made.
        again = diffq(*args)
        assert f"{len(ROWS)}/{len(ROWS)} images, 0 failed" in again.stdout, again.stdout + again.stderr
        other = diffq(*args[:-3], "--lora", f"{loras[16]}@0.5", "--no-progress", check=False)
        assert other.returncode == 2, other.stdout + other.stderr
        assert f"--lora: {loras[16]}@1 in OUT's manifest, {loras[16]}@0.5 now" in " ".join(other.stderr.split())
    return out, paths


def _images(out: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    storage = open_storage(str(out))
    return {record.id: np.asarray(Image.open(io.BytesIO(storage.get_bytes(record.file_name))).convert("RGB"))
            .astype(np.int16) for record in iter_records(storage)}


@pytest.mark.slow
def test_one_run_makes_every_image_once_and_compiles_only_its_first_batch(lora_run, flux, loras):
    out, paths = lora_run
    storage = open_storage(str(out))
    lines = [json.loads(line) for key in storage.list("records/") for line in storage.get_bytes(key).splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(ROWS) and len(list(storage.list("images/"))) == len(ROWS)
    manifest = read_manifest(storage)
    layout = manifest.adapter_layouts[flux]
    assert layout.rank == 16 and layout.slots == 2 and [s.shape.lora for s in manifest.shapes] == [layout.label]
    batches: dict[str, list[dict]] = {}
    for line in lines:
        batches.setdefault(line["batch_id"], []).append(line)
    assert len(batches) == 8  # none, r4, r8, zero, s3, stack: one each; r16: two
    ordered = sorted(batches.values(), key=lambda records: records[0]["generate_started_at"])
    assert ordered[0][0]["graphs_compiled"] > 0
    assert [records[0]["graphs_compiled"] for records in ordered[1:]] == [0] * 7
    assert all(len({r["graphs_compiled"] for r in records}) == 1 for records in ordered)
    # No --lora-mode: auto, recorded as what it resolved to on this device (the backend table's swap on CPU).
    assert {line.get("lora_mode") for line in lines if line.get("adapters")} == {"swap"}


@pytest.mark.slow
def test_records_and_provenance_name_each_adapters_revision(lora_run, flux, loras):
    from PIL import Image

    out, paths = lora_run
    storage = open_storage(str(out))
    revisions = read_manifest(storage).adapter_revisions
    assert revisions[loras[8]] == A.content_revision(Path(loras[8]).read_bytes())
    assert revisions[paths["S3"]] == A.revision(paths["S3"])  # the listing's digest
    want = {"base": None, "r4": [(loras[4], 0.8)], "r8": [(loras[8], 0.5)], "zero": [(loras[8], 0.0)],
            "r16": [(loras[16], 1.0)], "s3": [(paths["S3"], 0.5)], "stack": [(loras[4], 0.8), (loras[8], 0.5)]}
    for record in iter_records(storage):
        expected = want[record.id.split("-")[0]]
        if expected is None:
            assert record.adapters is None
            continue
        assert record.adapters == [{"path": path, "scale": scale, "revision": revisions[path]}
                                   for path, scale in expected]
        embedded = Image.open(io.BytesIO(storage.get_bytes(record.file_name))).text
        assert json.loads(embedded["adapters"]) == record.adapters


@pytest.mark.slow
def test_pixels_match_plain_diffusers_runs_of_each_adapter(lora_run, flux, loras, tolerance):
    out, _ = lora_run
    images = _images(out)

    def pair(name: str) -> np.ndarray:
        return np.stack([images[f"{name}-0"], images[f"{name}-1"]])

    base = _plain(flux, True)
    assert np.abs(pair("base") - base).max() <= tolerance  # no adapter: the base model's images
    assert np.array_equal(pair("zero"), pair("base"))  # scale 0: the same
    for name, rank, scale in (("r4", 4, 0.8), ("r8", 8, 0.5), ("r16", 16, 1.0)):
        assert np.abs(pair(name) - _plain(flux, True, loras[rank], scale)).max() <= tolerance, name
    stacked = _plain(flux, True, stack=((loras[4], 0.8), (loras[8], 0.5)))  # both loaded the ordinary way
    assert np.abs(pair("stack") - stacked).max() <= tolerance
    assert min(np.abs(pair("stack") - pair(one)).max() for one in ("r4", "r8")) >= 10 * tolerance
    assert np.abs(pair("r4") - pair("r16")).max() >= 10 * tolerance
    assert np.abs(pair("r16") - pair("base")).max() >= 10 * tolerance
    assert np.array_equal(pair("s3"), pair("r8"))  # from s3:// (moto): the local file's pixels
    assert np.array_equal(images["r16-again"], images["r16-0"])  # another batch, padded: the same item


def test_a_list_of_nulls_names_no_adapter_and_loses_no_batch(tmp_path, flux):
    """`[null]` (a Parquet list cell with a null, a CSV cell `[null]`) is no adapter: every
    row is still published, in a run without a layout (it used to stop the encoding at
    that row and publish only the batches before it)."""
    rows = [{"id": f"a-{k}", "prompt": "p"} for k in range(3)] + [{"id": "nulls", "prompt": "p", "lora": [None]}] \
        + [{"id": f"b-{k}", "prompt": "p"} for k in range(4)]
    messages, out = _submitted(tmp_path, rows, flux)
    assert sorted(item.id for m in messages for item in m.items) == sorted(row["id"] for row in rows)
    assert {m.shape.lora for m in messages} == {None} and all(m.params.adapters == () for m in messages)


def test_a_queue_name_longer_than_sqs_takes_is_refused_before_anything_is_written(tmp_path, flux, loras):
    """SQS takes queue names of at most 80 characters: a long model folder name, a big
    shape and a stacked layout can pass that; the submit says so and writes nothing
    (a run cut off at its first long queue would be half published)."""
    model = tmp_path / ("flux-dev-finetune-anime-" + "x" * 8)
    model.symlink_to(flux, target_is_directory=True)
    rows = [{"prompt": "p", "lora": [loras[8], loras[16]]}]
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"is 8\d characters; sqs takes at most 80"):
        submit(_jsonl(tmp_path / "prompts.jsonl", rows), str(out), model=str(model),
               broker_url="sqs://key:secret@localhost:1/", window=None, height=1024, width=1024, steps=2,
               batch_size=16, max_sequence_length=512, dtype="bfloat16")
    assert not out.exists()
    # The same names on Redis: no limit there.
    recording = Recording()
    submit(_jsonl(tmp_path / "prompts.jsonl", rows), str(out), model=str(model), publisher=recording, window=None,
           height=1024, width=1024, steps=2, batch_size=16, max_sequence_length=512, dtype="bfloat16")
    assert len(recording.published) == 1 and len(recording.published[0].shape.queue) > 80
