"""LoRA adapters: header checks (core/adapters.py) and hot-swaps into a compiled pipeline
(worker/device/adapters.py) on the tiny FLUX.1 pipeline, CPU Inductor, regional compile."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from diffq.core import adapters as A
from diffq.core.adapters import AdapterError
from diffq.core.contract import AdapterRef, BatchItem, BatchMessage, BatchParams, ShapeKey, shape_from_queue
from diffq.core.records import BatchMeasures, ImageRecord
from diffq.worker.device.adapters import AdapterOrderError, AdapterSlot, AdapterCache, compiled_modules
from diffq.worker.device.backends import get_backend
from diffq.worker.device.pipeline_host import PipelineHost

STEPS, SIDE, BATCH = 2, 64, 2
RANKS = (4, 8, 16)


@pytest.fixture(scope="module")
def flux(tiny_pipelines):
    return tiny_pipelines["flux"]


@pytest.fixture(scope="module")
def loras(flux, tmp_path_factory):
    """Adapters of ranks 4 (q and v only: fewer targets than the others), 8 and 16."""
    from diffq.app.tiny import build_tiny_lora

    root = tmp_path_factory.mktemp("loras")
    return {rank: str(build_tiny_lora(flux, root / f"r{rank}.safetensors", rank=rank, seed=rank,
                                      targets=("to_q", "to_v") if rank == 4 else ("to_q", "to_k", "to_v", "to_out.0")))
            for rank in RANKS}


def _items():
    return [BatchItem(id=f"item-{k}", prompt=f"a tiny prompt {k}", seed=k) for k in range(BATCH)]


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image) for image in images]).astype(np.int16)


def _plain(flux, compile_: bool, adapter: str | None = None, scale: float = 1.0, *,
           stack: tuple[tuple[str, float], ...] = (), fused: bool = False) -> np.ndarray:
    """A plain diffusers run of the same items: the adapter (or each of `stack`, (path,
    scale) pairs) loaded the ordinary way (no hotswap) and set active with its scale
    (`fused`: then fused into the weights with `fuse_lora` and unloaded, as diffusers'
    docs do it), compiled as the host compiles (each repeated block's forward)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    stack = ((adapter, scale),) if adapter else stack
    for k, (path, _) in enumerate(stack):
        pipe.load_lora_weights(path, adapter_name=f"plain{k}")
    if stack:
        pipe.set_adapters([f"plain{k}" for k in range(len(stack))], [weight for _, weight in stack])
    if stack and fused:
        pipe.fuse_lora(adapter_names=[f"plain{k}" for k in range(len(stack))])
        pipe.unload_lora_weights()
    if compile_:
        # Each plain pipeline is a new module under the same block code: room for their graphs.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)
        options = get_backend("cpu").compile_options
        for module in pipe.transformer.modules():
            if type(module).__name__ in set(pipe.transformer._repeated_blocks):
                module.forward = torch.compile(module.forward, **options)
    items = _items()
    with torch.inference_mode():
        images = pipe([item.prompt for item in items], height=SIDE, width=SIDE, num_inference_steps=STEPS,
                      guidance_scale=1.0, max_sequence_length=16, output_type="pt",
                      generator=[torch.Generator("cpu").manual_seed(item.seed) for item in items]).images
    return _pixels(images.mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy())


# (adapter rank or None, scale), in the order the host serves them: every adapter and
# "none" after one another, the same adapter at a new scale, back to none.
SEQUENCE = [(None, 1.0), (8, 1.0), (16, 0.5), (4, 0.8), (8, 0.0), (8, 0.5), (None, 1.0), (16, 1.0), (4, 0.8)]


@pytest.fixture(scope="module")
def served(flux, loras):
    """One host, regional compile on CPU Inductor, serving SEQUENCE: images and graphs per batch."""
    torch._dynamo.reset()
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="regional")
    host.use_adapters(flux, A.layout(A.inspect(path) for path in loras.values()))
    shape = ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                     dtype="float32")
    out = []
    for rank, scale in SEQUENCE:
        adapters = (AdapterRef(path=loras[rank], scale=scale),) if rank else ()
        generated = host.generate(shape, BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                     adapters=adapters), _items())
        out.append((rank, scale, _pixels(generated.images), generated))
    return host, out


@pytest.fixture(scope="module")
def tolerance(flux):
    """What compiling alone changes: the base model compiled vs eager, in 8-bit levels (at least 1)."""
    return max(1, int(np.abs(_plain(flux, True) - _plain(flux, False)).max()))


def test_swaps_compile_nothing_after_the_first_batch(served):
    host, out = served
    assert out[0][3].graphs > 0  # the first batch compiled the blocks
    assert [generated.graphs for *_, generated in out[1:]] == [0] * (len(out) - 1)
    assert host.recompiles == 0
    slot = next(iter(host.adapter_slots.values()))
    assert slot.layout.rank == 16 and slot.swaps == len(SEQUENCE) - 1  # every batch changed the slot
    assert all(generated.adapter_swap_s > 0 for *_, generated in out[1:])


def test_no_adapter_equals_the_base_model_and_scale_zero_too(served, flux, tolerance):
    _, out = served
    base = _plain(flux, True)
    nones = [pixels for rank, _, pixels, _ in out if rank is None]
    zero = next(pixels for rank, scale, pixels, _ in out if scale == 0.0)
    for pixels in (*nones, zero):
        assert np.abs(pixels - base).max() <= tolerance
    # The host's own no-adapter batches, before and after adapters, are the same pixels.
    assert np.array_equal(nones[0], nones[1])


@pytest.mark.parametrize("rank,scale", [(8, 1.0), (16, 0.5), (4, 0.8)])
def test_hot_swapped_pixels_match_the_adapter_loaded_the_ordinary_way(served, flux, loras, tolerance, rank, scale):
    _, out = served
    pixels = next(p for r, s, p, _ in out if (r, s) == (rank, scale))
    plain = _plain(flux, True, loras[rank], scale)
    assert np.abs(pixels - plain).max() <= tolerance


def test_adapters_differ_far_beyond_the_compile_tolerance(served, tolerance):
    _, out = served
    full = {rank: pixels for rank, scale, pixels, _ in out if rank and scale == 1.0}
    base = out[0][2]
    for a, b in ((8, 16), (8, None), (16, None)):
        other = base if b is None else full[b]
        assert np.abs(full[a] - other).max() >= 10 * tolerance


def test_the_same_adapter_again_is_the_same_pixels(served, loras):
    host, out = served
    first = next(p for r, s, p, _ in out if (r, s) == (4, 0.8))
    last = out[-1][2]
    assert out[-1][:2] == (4, 0.8) and np.array_equal(first, last)
    # A new scale alone (8 at 0.0, then 0.5: no swap, the scaling tensors written) is the
    # same pixels as that scale after a full swap.
    scaled = next(p for r, s, p, _ in out if (r, s) == (8, 0.5))
    shape = ShapeKey(model=next(iter(host.adapter_layouts)), height=SIDE, width=SIDE, batch_size=BATCH,
                     max_sequence_length=16, cfg=False, dtype="float32")
    again = host.generate(shape, BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                             adapters=(AdapterRef(path=loras[8], scale=0.5),)), _items())
    assert again.adapter_swap_s > 0 and again.graphs == 0 and np.array_equal(_pixels(again.images), scaled)


def test_records_and_provenance_name_the_adapters(served, loras, tmp_path):
    from PIL import Image

    from diffq.worker.sink.store import encode, provenance

    _, out = served
    rank, scale, _, generated = out[1]
    params = BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                         adapters=(AdapterRef(path=loras[rank], scale=scale, revision="rev-1"),))
    message = BatchMessage(run_id="r", out=str(tmp_path), batch_id="b-1",
                           shape=ShapeKey(model="m", height=SIDE, width=SIDE, batch_size=BATCH,
                                          max_sequence_length=16, cfg=False), params=params, items=_items())
    measures = BatchMeasures(device="cpu:0", worker="w", generate_s=1.0, generate_started_at=0.0,
                             generate_ended_at=1.0, graphs_compiled=generated.graphs,
                             adapter_swap_s=generated.adapter_swap_s)
    record = ImageRecord.of(message, message.items[0], "images/item-0.png", measures, store_s=0.1, finished_at=2.0)
    assert record.adapters == [{"path": loras[rank], "scale": scale, "revision": "rev-1"}]
    assert record.graphs_compiled == 0 and record.adapter_swap_s > 0
    assert json.loads(record.model_dump_json())["adapters"][0]["revision"] == "rev-1"
    text = provenance(message, message.items[0], (SIDE, SIDE))
    assert json.loads(text["adapters"]) == record.adapters
    image = Image.open(__import__("io").BytesIO(encode(Image.new("RGB", (SIDE, SIDE)), "png", text)))
    assert json.loads(image.text["adapters"])[0]["path"] == loras[rank]
    # A batch without adapters: its message and record are as they were before adapters.
    plain = BatchParams(num_inference_steps=STEPS, guidance_scale=1.0)
    assert "adapters" not in plain.model_dump(mode="json")


def test_the_scaffold_goes_in_before_any_compile(flux, loras):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux, local_files_only=True)
    block = pipe.transformer.transformer_blocks[0]
    block.forward = torch.compile(block.forward)  # a per-block compile, which peft's own guard does not see
    assert compiled_modules(pipe.transformer) == ["transformer_blocks.0"]
    layout = A.layout([A.inspect(loras[8])])
    with pytest.raises(AdapterOrderError, match="before compiling"):
        AdapterSlot.install(pipe, layout, AdapterCache())
    # diffusers' compile_repeated_blocks (module.compile() per block) is seen too.
    fresh = FluxPipeline.from_pretrained(flux, local_files_only=True)
    fresh.transformer.compile_repeated_blocks()
    assert "transformer_blocks.0" in compiled_modules(fresh.transformer)
    with pytest.raises(AdapterOrderError, match="before compiling"):
        AdapterSlot.install(fresh, layout, AdapterCache())


def test_a_model_loaded_without_a_slot_refuses_adapters(served, flux, loras):
    host, _ = served
    with pytest.raises(AdapterOrderError, match="before compiling"):
        host.use_adapters(flux, A.AdapterLayout(targets=("transformer_blocks.0.attn.to_q",), rank=32))
    plain = PipelineHost(backend=get_backend("cpu"), compile_mode="none")
    shape = ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                     dtype="float32")
    params = BatchParams(num_inference_steps=1, guidance_scale=1.0, adapters=(AdapterRef(path=loras[8]),))
    with pytest.raises(ValueError, match="without an adapter slot"):
        plain.generate(shape, params, _items())


def test_the_adapter_cache_keeps_the_most_recent_within_its_bytes(loras):
    cache = AdapterCache()
    sizes = {rank: cache.get(AdapterRef(path=path)).nbytes for rank, path in loras.items()}
    small = AdapterCache(capacity=sizes[16] + sizes[8])
    for rank in (4, 8, 16, 8):
        small.get(AdapterRef(path=loras[rank]))
    assert (small.hits, small.misses) == (1, 3)
    small.get(AdapterRef(path=loras[4]))  # evicted by 16: read again
    assert small.misses == 4


def test_neuron_and_tpu_hosts_take_adapters_compiling_per_set(flux):
    # The backend rows as they are (no chip here): adapters no longer refused; `auto` is
    # compile there, a swap asked for is left to the change check.
    for device in ("neuron", "tpu"):
        host = PipelineHost(backend=get_backend(device), compile_mode="regional")
        assert host.lora_mode == "compile" and host.adapter_refusal() is None
        host.use_adapters(flux, A.AdapterLayout(targets=("x",), rank=4))
        assert host.adapter_layouts[flux].rank == 4
        assert PipelineHost(backend=get_backend(device), compile_mode="regional", lora_mode="swap").lora_mode == "swap"
    assert PipelineHost(backend=get_backend("cpu"), compile_mode="regional").lora_mode == "swap"


# --- the header -------------------------------------------------------------------------


def _safetensors(path, tensors: dict[str, list[int]], metadata: dict | None = None, *, raw: bytes | None = None):
    header = {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}
    if metadata:
        header["__metadata__"] = metadata
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return str(path)


def test_header_reads_ranks_targets_and_fits_the_model(flux, loras):
    info = A.inspect(loras[4])
    assert info.ranks == {4} and all(name.rsplit(".", 1)[-1] in ("to_q", "to_v") for name in info.targets)
    weights = A.transformer_weights(flux)
    for path in loras.values():
        A.check_against(A.inspect(path), weights, flux)
    layout = A.layout(A.inspect(path) for path in loras.values())
    assert layout.rank == 16 and set(layout.targets) == set().union(*(A.inspect(p).targets for p in loras.values()))
    assert A.padded_rank(5) == 8 and A.padded_rank(16) == 16 and A.padded_rank(1) == 1


@pytest.mark.parametrize("tensors,metadata,raw,why", [
    ({"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": [4, 16]}, None, None, "text-encoder"),
    ({"transformer.transformer_blocks.0.attn.to_q.lokr_w1": [4, 4]}, None, None, "LoKr"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": [4, 32],
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": [32, 4],
      "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector": [32]}, None, None, "DoRA"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": [4, 32],
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": [32, 4]},
     {"lora_adapter_metadata": json.dumps({"transformer.use_dora": True})}, None, "DoRA"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": [4, 32]}, None, None, "without its pair"),
    ({"unet.down_blocks.0.attentions.0.to_q.lora_A.weight": [4, 32]}, None, None, "diffusers' format"),
    ({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": [4, 32]}, None, None, "without its pair"),
    ({}, None, b"{not json", "corrupt header"),
])
def test_header_refusals_name_the_reason(tmp_path, tensors, metadata, raw, why):
    path = _safetensors(tmp_path / "bad.safetensors", tensors, metadata, raw=raw)
    with pytest.raises(AdapterError, match=why) as caught:
        A.inspect(path, field="lora[0].path")
    assert caught.value.field == "lora[0].path"


def test_header_refuses_missing_short_and_wrong_model_files(tmp_path, flux):
    with pytest.raises(AdapterError, match="no such file"):
        A.inspect(str(tmp_path / "missing.safetensors"))
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(AdapterError, match="too short"):
        A.inspect(str(tmp_path / "short.safetensors"))
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**12))
    with pytest.raises(AdapterError, match="corrupt header"):
        A.inspect(str(tmp_path / "huge.safetensors"))
    other = _safetensors(tmp_path / "other.safetensors", {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": [4, 3072],
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": [3072, 4]})
    with pytest.raises(AdapterError, match="another model"):
        A.check_against(A.inspect(other), A.transformer_weights(flux), flux)


def test_header_is_a_ranged_read_on_object_storage(s3_bucket, loras):
    from diffq.core.storage import open_storage

    store = open_storage(s3_bucket)
    store.upload_file(loras[8], "loras/r8.safetensors")
    remote = A.inspect(f"{s3_bucket}/loras/r8.safetensors")
    assert remote.modules == A.inspect(loras[8]).modules
    with pytest.raises(AdapterError, match="no such file"):
        A.inspect(f"{s3_bucket}/loras/missing.safetensors")


def test_specs_parse_with_the_field_named():
    refs = A.parse_spec(["a.safetensors@0.8", {"path": "b.safetensors", "scale": 0.5}, "c@d/e.safetensors"])
    assert [(r.path, r.scale) for r in refs] == [("a.safetensors", 0.8), ("b.safetensors", 0.5),
                                                ("c@d/e.safetensors", 1.0)]
    assert A.parse_spec(None) == () and A.parse_spec([]) == ()
    with pytest.raises(AdapterError) as caught:
        A.parse_spec([{"path": "a.safetensors"}, {"path": "b.safetensors", "scale": 80}])
    assert caught.value.field == "lora[1].scale"
    with pytest.raises(AdapterError, match="twice"):
        A.parse_spec(["a.safetensors", "a.safetensors@0.5"])
    A.check_set(A.parse_spec([f"{k}.safetensors" for k in range(A.MAX_STACK)]))  # a stack: fine
    with pytest.raises(AdapterError, match=f"at most {A.MAX_STACK} stack") as caught:
        A.check_set(A.parse_spec([f"{k}.safetensors" for k in range(A.MAX_STACK + 1)]), "lora")
    assert caught.value.field == "lora"


def test_one_slot_keeps_the_layout_label_and_manifest_as_before():
    import hashlib

    one = A.AdapterLayout(targets=("a.to_q",), rank=16)
    assert one.label == "r16-" + hashlib.sha1(b"a.to_q").hexdigest()[:8]
    assert one.model_dump_json() == '{"targets":["a.to_q"],"rank":16}'  # the manifest's bytes
    two = A.AdapterLayout(targets=("a.to_q",), rank=16, slots=2)
    assert two.label == f"r16x2-{one.digest}" and two.model_dump()["slots"] == 2
    assert A.AdapterLayout.model_validate(two.model_dump(mode="json")) == two
    key = dict(model="m", height=64, width=64, batch_size=2, max_sequence_length=16, cfg=False)
    assert ShapeKey(**key, lora=two.label).queue != ShapeKey(**key, lora=one.label).queue
    assert shape_from_queue(ShapeKey(**key, lora=two.label).queue, ["m"]).lora == two.label


def test_an_item_is_the_same_pixels_beside_other_neighbours(served, loras):
    host, out = served
    first = next(p for r, s, p, _ in out if (r, s) == (16, 0.5))
    shape = ShapeKey(model=next(iter(host.adapter_layouts)), height=SIDE, width=SIDE, batch_size=BATCH,
                     max_sequence_length=16, cfg=False, dtype="float32")
    neighbours = [_items()[0], BatchItem(id="other", prompt="another prompt entirely", seed=99)]
    generated = host.generate(shape, BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                 adapters=(AdapterRef(path=loras[16], scale=0.5),)), neighbours)
    assert generated.graphs == 0
    assert np.array_equal(_pixels(generated.images)[0], first[0])


def test_tiny_lora_command(flux, tmp_path):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    result = CliRunner().invoke(app, ["tiny-lora", flux, str(tmp_path / "x.safetensors"), "--rank", "2",
                                      "--targets", "to_q"])
    assert result.exit_code == 0, result.output
    info = A.inspect(str(tmp_path / "x.safetensors"))
    assert info.ranks == {2} and {name.rsplit(".", 1)[-1] for name in info.targets} == {"to_q"}
    A.check_against(info, A.transformer_weights(flux), flux)
    bad = CliRunner().invoke(app, ["tiny-lora", flux, str(tmp_path / "x.bin"), "--rank", "2"])
    assert bad.exit_code != 0 and ".safetensors" in bad.output


# --- stacked adapters: a layout of two slots ------------------------------------------

# (the row's adapters as (rank, scale) pairs, in the row's order), as the host serves them:
# none, a stack, the same stack written the other way, one adapter in the two-slot layout,
# a stack sharing one adapter with the first, none again.
STACKED = [(), ((8, 1.0), (16, 0.5)), ((16, 0.5), (8, 1.0)), ((16, 0.5),), ((4, 0.8), (8, 1.0)), ()]


@pytest.fixture(scope="module")
def stacked(flux, loras):
    """One host whose layout has two slots, serving STACKED (regional compile, CPU Inductor)."""
    torch._dynamo.reset()
    host = PipelineHost(backend=get_backend("cpu"), compile_mode="regional")
    host.use_adapters(flux, A.layout((A.inspect(path) for path in loras.values()), slots=2))
    shape = ShapeKey(model=flux, height=SIDE, width=SIDE, batch_size=BATCH, max_sequence_length=16, cfg=False,
                     dtype="float32")
    out = []
    for stack in STACKED:
        adapters = tuple(AdapterRef(path=loras[rank], scale=scale) for rank, scale in stack)
        generated = host.generate(shape, BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                     adapters=adapters), _items())
        out.append((stack, _pixels(generated.images), generated))
    return host, out


def test_stacks_of_zero_one_and_two_compile_nothing_after_the_first_batch(stacked):
    host, out = stacked
    assert out[0][2].graphs > 0
    assert [generated.graphs for *_, generated in out[1:]] == [0] * (len(out) - 1)
    assert host.recompiles == 0
    slot = next(iter(host.adapter_slots.values()))
    assert slot.layout.slots == 2 and slot.names == ("diffq", "stack1")
    # The same set in the other order is the same slots: nothing swapped, the same pixels.
    assert out[2][2].adapter_swap_s == 0.0 and slot.swaps == len(STACKED) - 2
    assert np.array_equal(out[1][1], out[2][1])


def test_a_stack_matches_both_adapters_loaded_the_ordinary_way(stacked, flux, loras, tolerance):
    _, out = stacked
    for stack, pixels, _ in out:
        if len(stack) == 2:
            plain = _plain(flux, True, stack=tuple((loras[rank], scale) for rank, scale in stack))
            assert np.abs(pixels - plain).max() <= tolerance, stack
    # Each stack differs from either of its adapters alone far beyond the tolerance.
    alone = next(pixels for stack, pixels, _ in out if stack == ((16, 0.5),))
    assert np.abs(out[1][1] - alone).max() >= 10 * tolerance


def test_one_adapter_in_two_slots_equals_it_in_one_slot(stacked, served, tolerance):
    _, out = stacked
    _, single = served
    in_two = next(pixels for stack, pixels, _ in out if stack == ((16, 0.5),))
    in_one = next(pixels for rank, scale, pixels, _ in single if (rank, scale) == (16, 0.5))
    assert np.abs(in_two - in_one).max() <= tolerance
    assert np.array_equal(out[0][1], out[-1][1])  # none, before and after stacks


def test_a_stack_beyond_the_layouts_slots_is_refused(served, loras):
    from diffq.worker.device.adapters import AdapterUnsupported

    host, _ = served
    slot = next(iter(host.adapter_slots.values()))
    with pytest.raises(AdapterUnsupported, match="1 slot"):
        slot.apply(None, (AdapterRef(path=loras[4]), AdapterRef(path=loras[8])))


def test_peft_swaps_leave_the_slots_as_diffusers_hotswap_did(flux, loras, monkeypatch):
    """The slots' weights and scalings after each batch's swaps, exactly as through diffusers'
    `load_lora_weights(..., hotswap=True)` (the path before peft's function was called directly)."""
    from diffusers import FluxPipeline

    def diffusers_swap(self, pipe, name, loaded):
        pipe.load_lora_weights(loaded.state_dict, adapter_name=name, hotswap=True)

    layout = A.layout((A.inspect(path) for path in loras.values()), slots=2)
    pipes = [FluxPipeline.from_pretrained(flux, local_files_only=True) for _ in range(2)]
    slots = [AdapterSlot.install(pipe, layout, AdapterCache()) for pipe in pipes]

    def state(pipe) -> dict:
        weights = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if ".lora_" in k}
        scalings = {f"{name}.{slot}": float(value) for name, module in pipe.transformer.named_modules()
                    if isinstance(getattr(module, "scaling", None), dict) for slot, value in module.scaling.items()}
        return {**weights, **scalings}

    for stack in STACKED[1:] + [((4, 1.0),), ((16, -1.0), (8, 0.25))] + STACKED[:1]:
        refs = tuple(AdapterRef(path=loras[rank], scale=scale) for rank, scale in stack)
        slots[0].apply(pipes[0], refs)
        with monkeypatch.context() as patched:
            patched.setattr(AdapterSlot, "_swap", diffusers_swap)
            slots[1].apply(pipes[1], refs)
        ours, theirs = state(pipes[0]), state(pipes[1])
        assert ours.keys() == theirs.keys() and len(ours) > 0
        for key, value in ours.items():
            assert torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key], key
    assert slots[0].swaps == slots[1].swaps > 0
