"""LoRA adapters from where runs keep them, pinned like models: s3:// (moto), gs://
(fake-gcs-server), folders and local files through the worker's pipeline host; a changed
adapter refused; the allow-list; the producer's validation helper; report and status by
adapter; qualify's hot-swap check. (A Hub id's loading code is not run here: no Hub.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from diffq.core import adapters as A
from diffq.core.adapters import AdapterError
from diffq.core.contract import AdapterRef, BatchItem, BatchMessage, BatchParams, ShapeKey
from diffq.core.storage import open_storage
from diffq.worker.device.adapters import AdapterCache, AdapterUnsupported
from diffq.worker.device.backends import get_backend
from diffq.worker.device.pipeline_host import PipelineHost
from tests.test_lora import flux, loras  # noqa: F401  (fixtures: the tiny FLUX.1 and adapters of ranks 4, 8, 16)

STEPS, SIDE, BATCH = 1, 64, 1


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFQ_MODEL_CACHE", str(tmp_path / "model-cache"))
    return tmp_path / "model-cache"


def _bucket(server, scheme: str) -> str:
    from tests.servers import unique_bucket_name

    return f"{scheme}://{server.make_bucket(unique_bucket_name())}"


@pytest.fixture(params=["s3", "gs"])
def store(request) -> str:
    """A fresh bucket on moto's server or fake-gcs-server."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    return _bucket(server, request.param)


def _shape(flux) -> ShapeKey:
    return ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                    dtype="float32")


def _host(flux, paths, cache: AdapterCache | None = None) -> PipelineHost:
    host = PipelineHost(backend=get_backend("cpu"), adapter_cache=cache or AdapterCache())
    host.use_adapters(flux, A.run_layout([("lora", path) for path in paths], flux))
    return host


def _generate(host, flux, refs: tuple[AdapterRef, ...]) -> np.ndarray:
    items = [BatchItem(id="item-0", prompt="a tiny prompt", seed=7)]
    generated = host.generate(_shape(flux), BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                        adapters=refs), items)
    return np.stack([np.asarray(image) for image in generated.images])


def _upload(store_url: str, local: str, key: str) -> None:
    open_storage(store_url).upload_file(local, key)


# --- object storage, folders and local files ------------------------------------------


def test_adapters_from_object_storage_and_folders_are_the_local_files_pixels(store, flux, loras, model_cache, tmp_path):
    folder = tmp_path / "style"
    folder.mkdir()
    shutil.copy(loras[8], folder / A.LORA_WEIGHT_NAME)
    _upload(store, loras[8], "loras/r8.safetensors")
    _upload(store, loras[8], f"loras/style/{A.LORA_WEIGHT_NAME}")
    paths = [loras[8], f"{store}/loras/r8.safetensors", f"{store}/loras/style", str(folder)]
    run = A.RunAdapters(flux)
    refs = [run.add(f"{path}@0.8", f"lora[{n}]") for n, path in enumerate(paths)]
    # Pinned: object storage by its listing's digest, local files and folders by their content's.
    revisions = [ref.revision for (ref,) in refs]
    assert all(revision.startswith("sha256:") for revision in revisions) and len(set(revisions[1:3])) == 2
    assert revisions[0] == revisions[3] == A.content_revision(open(loras[8], "rb").read())
    host = _host(flux, paths)
    pixels = [_generate(host, flux, ref) for ref in refs]
    base = _generate(host, flux, ())
    assert np.abs(pixels[0].astype(int) - base).max() > 4  # the adapter changes the image
    for other in pixels[1:]:
        assert np.array_equal(other, pixels[0])
    slot = next(iter(host.adapter_slots.values()))
    assert slot.cache.misses == 4  # each source was read, none was the local file in disguise
    # The object-storage adapters came through the node's model cache, one entry each.
    entries = sorted(p for p in model_cache.iterdir() if p.is_dir())
    assert len(entries) == 2
    assert {f.name for entry in entries for f in entry.iterdir() if f.suffix == ".safetensors"} == {
        "r8.safetensors", A.LORA_WEIGHT_NAME}


def test_the_header_is_read_by_ranged_reads_on_every_store(store, loras, monkeypatch):
    from diffq.core.storage.gcs import GCSStorage
    from diffq.core.storage.s3 import S3Storage

    _upload(store, loras[8], "loras/r8.safetensors")
    _upload(store, loras[4], f"loras/style/{A.LORA_WEIGHT_NAME}")

    def whole(*_):
        raise AssertionError("the whole object was read")

    monkeypatch.setattr(S3Storage, "get_bytes", whole)
    monkeypatch.setattr(GCSStorage, "get_bytes", whole)
    assert A.inspect(f"{store}/loras/r8.safetensors").modules == A.inspect(loras[8]).modules
    assert A.inspect(f"{store}/loras/style/").modules == A.inspect(loras[4]).modules
    with pytest.raises(AdapterError, match="no such file"):
        A.inspect(f"{store}/loras/missing.safetensors")


def test_a_file_beside_with_a_longer_name_is_not_the_adapter(store, loras):
    _upload(store, loras[8], "loras/r8.safetensors.old")
    with pytest.raises(AdapterError, match="no such file"):
        A.revision(f"{store}/loras/r8.safetensors")


# --- pinned: a changed adapter is refused ---------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_adapter_changed_since_it_was_pinned_is_refused(where, flux, loras, tmp_path, model_cache, request):
    from diffq.app.tiny import build_tiny_lora

    changed = str(build_tiny_lora(flux, tmp_path / "changed.safetensors", rank=8, seed=99))
    if where == "local":
        path = str(tmp_path / "style.safetensors")
        shutil.copy(loras[8], path)
        (ref,) = A.pin(A.parse_spec(path))
        shutil.copy(changed, path)
        said = "in the file"
    else:
        store = _bucket(request.getfixturevalue("s3_server"), "s3")
        _upload(store, loras[8], "loras/style.safetensors")
        path = f"{store}/loras/style.safetensors"
        (ref,) = A.pin(A.parse_spec(path))
        _upload(store, changed, "loras/style.safetensors")
        said = "in the store"
    assert A.revision(path) != ref.revision
    host = _host(flux, [path])
    with pytest.raises(AdapterUnsupported, match=rf"adapter {path}\S* changed since the run pinned it: "
                                                  rf"revision \S+ {said}, {ref.revision} pinned"):
        _generate(host, flux, (ref,))
    # At its new revision it is served.
    assert _generate(host, flux, A.pin(A.parse_spec(path))).shape == (BATCH, SIDE, SIDE, 3)


# --- the allow-list -------------------------------------------------------------------


def test_the_allow_list_is_prefixes_on_a_path_boundary(tmp_path):
    inside, beside = tmp_path / "loras" / "a.safetensors", tmp_path / "loras-evil" / "a.safetensors"
    prefixes = ["s3://bucket/loras", str(tmp_path / "loras"), "my-org"]
    assert A.allowed("s3://bucket/loras/a.safetensors", prefixes)
    assert A.allowed(str(inside), prefixes) and A.allowed(f"file://{inside}", prefixes)
    assert A.allowed("my-org/flux-style", prefixes)
    assert not A.allowed("s3://bucket/loras-evil/a.safetensors", prefixes)
    assert not A.allowed(str(beside), prefixes)
    assert not A.allowed(str(tmp_path / "loras" / ".." / "loras-evil" / "a.safetensors"), prefixes)
    assert not A.allowed("other-org/flux-style", prefixes)
    assert A.allowed("anything/at-all", [])  # none set: any adapter


def test_the_producer_and_the_worker_refuse_an_adapter_outside_the_allow_list(flux, loras, monkeypatch):
    from diffq.core.settings import Settings
    from diffq.worker.delivery.admission import Admission
    from diffq.worker.delivery.outcomes import LETTERED, Refused

    allowed = str(Path(loras[8]).parent / "elsewhere")
    with pytest.raises(AdapterError, match=r"field 'lora\[0\]\.path': .* not under DIFFQ_ALLOWED_ADAPTERS"):
        A.RunAdapters(flux, allowed_prefixes=[allowed]).add([{"path": loras[8], "scale": 0.5}])
    monkeypatch.setenv("DIFFQ_ALLOWED_ADAPTERS", json.dumps([allowed]))
    admission = Admission.of(object(), Settings())
    shape = _shape(flux)
    batch = BatchMessage(run_id="r1", out="/runs/r1", batch_id="b-1", shape=shape,
                         params=BatchParams(num_inference_steps=1, guidance_scale=1.0,
                                            adapters=(AdapterRef(path=loras[8]),)),
                         items=[BatchItem(id="a", prompt="p", seed=1)]).model_dump(mode="json")
    _, refusal = admission.check(batch, shape.queue)
    assert refusal.why is Refused.UNKNOWN_ADAPTER and Refused.UNKNOWN_ADAPTER in LETTERED
    assert loras[8] in refusal.reason and "DIFFQ_ALLOWED_ADAPTERS" in refusal.reason
    batch["params"]["adapters"] = []
    assert admission.check(batch, shape.queue)[1] is None


# --- the producer's validation helper -------------------------------------------------


def test_the_runs_layout_from_its_specs_or_the_field_at_fault(flux, loras, tmp_path):
    got = A.run_layout([("lora", f"{loras[4]}@0.5"), ("lora", {"path": loras[8]}), ("lora", None)], flux)
    assert got.rank == 8 and set(got.targets) == set(A.inspect(loras[4]).targets) | set(A.inspect(loras[8]).targets)
    assert A.run_layout([("lora", None), ("lora", [])], flux) is None
    assert got.slots == 1 and A.run_layout([("lora", [loras[4], f"{loras[8]}@0.5"]), ("lora", loras[16])],
                                           flux).slots == 2
    cases = [
        ([("lora", str(tmp_path / "missing.safetensors"))], "field 'lora': .*no such file"),
        ([("lora", loras[4]), ("lora", [loras[4], {"path": str(tmp_path / "x.safetensors")}])],
         r"field 'lora\[1\]\.path': .*no such file"),
        ([("lora", [loras[4], loras[8], loras[16], "x.safetensors", "y.safetensors"])],
         r"field 'lora': 5 adapters in one set: at most 4 stack"),
        ([("lora", {"path": loras[4], "scale": 80})], r"field 'lora\.scale'"),
        ([("lora", str(tmp_path))], rf"field 'lora': .*{A.LORA_WEIGHT_NAME}: no such file"),
    ]
    for specs, match in cases:
        with pytest.raises(AdapterError, match=match):
            A.run_layout(specs, flux)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3072),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 4)}, str(other))
    with pytest.raises(AdapterError, match=r"field 'lora\.path': .*another model"):
        A.run_layout([("lora", {"path": str(other)})], flux)


# --- report and status by adapter -----------------------------------------------------


def _adapter_run(url: str) -> dict:
    """make_run's folder (64 items, 8 batches, 2 workers, 2 shapes) with adapters and
    graphs written into its records: batches 0-3 under a.safetensors at 0.5 or 1, 4-5 under
    b, 6-7 none; each worker's first batch compiled 3 graphs, batch 7 recompiled 1."""
    from diffq.core import layout
    from diffq.core.records import jsonl
    from diffq.core.runfolder import read_records, record_keys
    from tests.test_export import make_run

    make_run(url, 64)
    storage = open_storage(url)
    plan = {0: ("a.safetensors", 0.5), 1: ("a.safetensors", 0.5), 2: ("a.safetensors", 1.0),
            3: ("a.safetensors", 1.0), 4: ("b.safetensors", 1.0), 5: ("b.safetensors", 1.0)}
    for batch_id, records in list(read_records(storage, record_keys(storage))):
        b = int(batch_id[1:])
        adapter = plan.get(b)
        update = {"graphs_compiled": 3 if b < 2 else (1 if b == 7 else 0),
                  "adapters": [{"path": f"s3://m/loras/{adapter[0]}", "scale": adapter[1],
                                "revision": f"sha256:{adapter[0][0] * 8}"}] if adapter else None,
                  "adapter_swap_s": 0.01 if adapter else 0.0}
        storage.put_bytes(layout.record_key(batch_id), jsonl(r.model_copy(update=update) for r in records))
    return plan


def test_report_and_status_group_by_adapter_and_show_a_steady_state_recompile(tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app
    from diffq.results.report import build_report, render_html, render_text, to_json
    from diffq.results.status import status

    url = str(tmp_path / "run")
    _adapter_run(url)
    report = build_report(url)
    groups = {g.label: g for g in report.by_adapter.rows()}
    labels = report.by_adapter.labels()  # paths shortened to what tells them apart
    groups = {labels[g.key]: g for g in report.by_adapter.rows()}
    a05 = "a@0.5"
    assert {label: (g.images, g.batches) for label, g in groups.items()} == {
        "none": (16, 2), a05: (16, 2), "a@1": (16, 2), "b@1": (16, 2)}
    # Batches 0 and 1 (each worker's first) took 0.6 s, the rest 0.3 s; a swap 0.01 s.
    assert groups[a05].images_per_s == pytest.approx(16 / (0.6 + 0.6 + 0.02))
    assert groups["none"].images_per_s == pytest.approx(16 / 0.6)
    graphs = {queue: (g.compiled, g.steady) for queue, g in report.by_adapter.graphs.items()}
    assert sorted(graphs.values()) == [(3, 0), (4, 1)]  # batch 7 (2nd shape) recompiled one
    text = render_text(report)
    assert "RECOMPILED 1 graph(s) after a worker's first batch (4 compiled in all)" in text
    assert a05 in text
    # One renderer's cells for text and HTML: img/s and swap_s filled, columns aligned.
    row = next(line for line in text.splitlines() if line.startswith("a@0.5 "))
    assert row.split() == ["a@0.5", "-", "16", "2", f"{16 / 1.22:.2f}", "0.020"], row
    header = next(line for line in text.splitlines() if line.startswith("adapters (path@scale)"))
    assert header.index("swap_s") + len("swap_s") == len(row)
    page = render_html(report)
    assert "<h2>Adapters</h2>" in page and "Recompiles after a worker" in page
    figures = to_json(report)
    assert sum(g["images"] for g in figures["adapters"]) == 64
    assert {a["revision"] for g in figures["adapters"] for a in g["adapters"]} == {"sha256:aaaaaaaa",
                                                                                  "sha256:bbbbbbbb"}
    st = status(url, by_adapter=True)
    assert sorted(g.images for g in st.by_adapter.rows()) == [16] * 4
    assert "by_adapter" not in status(url).to_json()
    result = CliRunner().invoke(app, ["status", url, "--by-adapter", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert sum(g["images"] for g in data["by_adapter"]["adapters"]) == 64
    assert sorted(g["after_first_batch"] for g in data["by_adapter"]["graphs"].values()) == [0, 1]
    table = CliRunner().invoke(app, ["status", url, "--by-adapter"])
    assert table.exit_code == 0 and "a steady-state recompile" in table.output, table.output


# --- qualify's hot-swap check ---------------------------------------------------------


def test_the_hotswap_check_compiles_nothing_over_swaps(flux, loras):
    from diffq.worker.device.hotswap_check import check_hotswap

    torch._dynamo.reset()
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="regional")
    run = A.RunAdapters(flux)
    refs = [ref for n, path in enumerate([loras[4], f"{loras[8]}@0.8"]) for ref in run.add(path, f"lora[{n}]")]
    result = check_hotswap(host, _shape(flux), refs, run.layout)
    assert result.first_graphs > 0
    assert [(s.change, s.adapter, s.scale) for s in result.swaps] == [
        ("adapter", loras[4], 1.0), ("scale", loras[4], 0.5), ("adapter", loras[8], 0.8), ("scale", loras[8], 0.4),
        ("none", None, None)]
    assert result.ok and [s.graphs_compiled for s in result.swaps] == [0] * 5
    assert all(s.swap_s > 0 for s in result.swaps)
    # Each change shows in the pixels; back to none is the first batch's pixels exactly (CPU).
    assert all(s.vs_none > 0 and s.vs_previous > 0 for s in result.swaps[:-1]) and result.swaps[-1].vs_none == 0
    assert result.unseen == []
    report = result.to_json()
    assert report["rank"] == 8 and report["graphs_after_first"] == 0
    assert report["swap_s"]["count"] == 2 and report["scale_change_s"]["count"] == 2 and report["none_s"]["count"] == 1
