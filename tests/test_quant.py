"""Quantized transformer weights as a speed-up (`--speedup quant:SCHEME`, issue 61): the
scheme table (core/speedups.py SCHEMES) pinned against torchao, refused where a device,
dtype, compute capability or LoRA scaffold cannot take it; applied at load
(worker/device/quantize.py) on the tiny FLUX.1 and SD3 pipelines: images independent of
their batch neighbours, the transformer's stored bytes bounded and in every record,
full precision untouched beside it; `diffq run` end to end."""

from __future__ import annotations

import io
import json
import zlib

import numpy as np
import pytest

from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.core.speedups import PER_TENSOR, SCHEMES, SpeedupError, canonical, parse

# -- the table ---------------------------------------------------------------------------


def test_a_scheme_joins_a_spec_and_its_canonical_form():
    assert canonical(" TaylorSeer:use_lite_mode=true + QUANT:Int8WO + attention:_native_math") == \
        "taylorseer:use_lite_mode=true+quant:int8wo+attention:_native_math"
    assert parse("quant:int8dq").quant == "int8dq" and not parse("quant:int8dq").batch_dependent
    for spec, says in (("quant:int4", "one of int8wo, int8dq"), ("quant:int8wo+quant:int8dq", "given twice"),
                       ("quant", "expected quant:SCHEME")):
        with pytest.raises(SpeedupError, match=says):
            canonical(spec)


def test_a_per_tensor_activation_scale_runs_only_behind_the_reproducibility_flag():
    """One scale over the whole batch's activations: an image depends on its neighbours."""
    (tensor,) = [name for name, row in SCHEMES.items() if row.activations == PER_TENSOR]
    with pytest.raises(SpeedupError, match="one scale over the whole batch.*--unreproducible-speedup"):
        canonical(f"quant:{tensor}")
    assert canonical(f"quant:{tensor}", unreproducible=True) == f"quant:{tensor}"
    with pytest.raises(ValueError, match="--unreproducible-speedup"):
        BatchParams(num_inference_steps=2, guidance_scale=1.0, speedup=f"quant:{tensor}")


def test_each_row_builds_its_torchao_config_without_touching_inductor():
    """The configs exist in the installed torchao with the row's granularity, and
    quantizing leaves the process-wide Inductor settings as they were (torchao's default
    `set_inductor_config=True` would set them: torchao/quantization/utils.py
    recommended_inductor_config_setter)."""
    import torch
    import torch._inductor.config as inductor
    from torchao import quantization

    from diffq.worker.device.quantize import quantize, torchao_config

    for name, row in SCHEMES.items():
        config = torchao_config(name)
        assert type(config) is getattr(quantization, row.config) and config.set_inductor_config is False
        granularity = config.granularity if isinstance(config.granularity, (list, tuple)) else [config.granularity]
        wanted = quantization.PerTensor if row.activations == PER_TENSOR else quantization.PerRow
        assert all(isinstance(g, wanted) for g in granularity), (name, granularity)
    watched = ("coordinate_descent_tuning", "force_fuse_int_mm_with_mul", "fx_graph_cache")
    before = {key: getattr(inductor, key) for key in watched}
    for name in ("int8wo", "int8dq"):
        quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)), name)
    assert {key: getattr(inductor, key) for key in watched} == before


def test_devices_dtypes_capability_and_adapters_refuse_with_the_reason():
    from diffq.core.families import Flux
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.quantize import capability_refusal
    from diffq.worker.device.speedups import refusal

    cpu, cuda = get_backend("cpu"), get_backend("cuda")
    for name in ("int8wo", "int8dq"):
        assert refusal(parse(f"quant:{name}"), cpu, "none", Flux) is None
        assert refusal(parse(f"taylorseer:use_lite_mode=true+quant:{name}"), cpu, "regional", Flux) is None
    assert "no float8 arithmetic on CPU" in refusal(parse("quant:fp8wo"), cpu, "none", Flux)
    assert "_check_hardware_support" in refusal(parse("quant:fp8dq"), cpu, "none", Flux)
    for device in ("neuron", "tpu"):
        reason = refusal(parse("quant:int8wo"), get_backend(device), "none", Flux)
        assert f"no {device} source" in reason and "int8_tensor.py" in reason
    assert "from bfloat16 weights only" in refusal(parse("quant:fp8dq"), cuda, "none", Flux, dtype="float32")
    assert refusal(parse("quant:fp8dq"), cuda, "none", Flux, dtype="bfloat16") is None
    assert "compute capability 8.9 or newer" in capability_refusal("fp8wo", cuda, (8, 6))
    assert capability_refusal("fp8wo", cuda, (9, 0)) is None and capability_refusal("int8wo", cuda, (7, 5)) is None
    assert "LoRA adapters" in refusal(parse("quant:int8wo"), cpu, "none", Flux, adapters=True)


def test_a_worker_refuses_a_scheme_before_loading_anything():
    """A batch whose scheme the worker cannot run fails as unsupported (permanent) before
    the model is read: the capability is read once, at the worker's start."""
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost, SpeedupUnsupported

    cuda = get_backend("cuda")
    host = PipelineHost(backend=cuda)
    host.speedups.capability, host.speedups._checked = (8, 0), True  # an A100
    shape = ShapeKey(model="/nowhere", height=64, width=64, batch_size=1, max_sequence_length=32, cfg=False)
    params = BatchParams(num_inference_steps=2, guidance_scale=1.0, speedup="quant:fp8wo")
    with pytest.raises(SpeedupUnsupported, match="needs compute capability 8.9 or newer on cuda; this device has 8.0"):
        host.generate(shape, params, [BatchItem(id="a", prompt="a", seed=1)])
    assert host._pipelines == {}


def test_run_refuses_a_scheme_the_device_cannot_run_before_anything_is_written(tmp_path, tiny_model):
    from typer.testing import CliRunner

    from diffq.app.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "height": 64, "width": 64}\n')
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(prompts), "--model", tiny_model, "--out", str(out), "--speedup",
                                      "quant:fp8dq", "--no-progress"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "quant:fp8dq on --device cpu: no float8 matmul on CPU" in result.output
    assert not out.exists()


# -- on the tiny pipelines --------------------------------------------------------------------

STEPS = 4


def _host(compile_mode: str = "none"):
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost

    return PipelineHost(backend=get_backend("cpu"), compile_mode=compile_mode)


def _generate(host, model: str, prompts: list[str], speedup: str | None, dtype: str = "float32",
              guidance: float = 1.0):
    shape = ShapeKey(model=model, height=64, width=64, batch_size=4, max_sequence_length=32, cfg=guidance > 1,
                     dtype=dtype)
    params = BatchParams(num_inference_steps=STEPS, guidance_scale=guidance, speedup=speedup)
    items = [BatchItem(id=f"i{k}", prompt=p, seed=zlib.crc32(p.encode()) % 10_000) for k, p in enumerate(prompts)]
    return host.generate(shape, params, items)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_quantized_images_do_not_depend_on_their_batch_neighbours(tiny_pipelines, family):
    """Weight-only and per-row dynamic int8: the same item in two batch compositions (and
    diffq's padding) is pixel-identical; it differs from full precision (the weights
    really changed), which stays as it was on the same host; every call reports the
    transformer's stored bytes: the linear weights' float32 bytes at least 60 % smaller,
    the whole FLUX.1 transformer at most 0.3x float32's (the tiny SD3's is mostly its
    positional-embedding buffer, which stays)."""
    import torch

    model, host = tiny_pipelines[family], _host()
    guidance = 4.0 if family == "sd3" else 1.0  # SD3's CFG doubles the batch: neighbours inside one call
    a = "a lighthouse at dusk"
    full = _generate(host, model, [a, "an old tram"], None, guidance=guidance)
    full_bytes = full.record_extra["transformer_weight_bytes"]
    (pipe,) = host._pipelines.values()
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in pipe.transformer.modules()
                       if isinstance(m, torch.nn.Linear))
    for scheme in ("int8wo", "int8dq"):
        spec = f"quant:{scheme}"
        crowded = _generate(host, model, [a, "a red fox", "rain on glass", "a desert road"], spec, guidance=guidance)
        padded = _generate(host, model, [a, "an old tram"], spec, guidance=guidance)
        assert np.array_equal(crowded.images[0], padded.images[0]), scheme
        assert not np.array_equal(full.images[0], padded.images[0]), f"{scheme} changed nothing: proves nothing"
        stored = padded.record_extra["transformer_weight_bytes"]
        assert stored == crowded.record_extra["transformer_weight_bytes"], scheme
        assert full_bytes - stored >= 0.6 * linear_bytes, (scheme, stored, full_bytes, linear_bytes)
        assert family != "flux" or stored <= 0.3 * full_bytes, (scheme, stored, full_bytes)
    again = _generate(host, model, [a, "an old tram"], None, guidance=guidance)
    assert np.array_equal(again.images[0], full.images[0])  # its own pipeline, unquantized
    assert len(host._pipelines) == 3 and host.recompiles == 0


def test_bfloat16_weights_keep_their_scales_biases_and_norms(tiny_pipelines):
    """From bfloat16 the int8 weights halve, and per-row scales, biases and norms stay as
    they were: at most 0.6x."""
    host = _host()
    model = tiny_pipelines["flux"]
    full = _generate(host, model, ["a"], None, dtype="bfloat16").record_extra["transformer_weight_bytes"]
    stored = _generate(host, model, ["a"], "quant:int8wo", dtype="bfloat16").record_extra["transformer_weight_bytes"]
    assert stored <= 0.6 * full, (stored, full)


def test_a_released_scheme_frees_its_pipeline_and_loads_again_the_same(tiny_pipelines):
    """PipelineHost.release (qualify probes each scheme alone where full compute ran out
    of memory): the scheme's pipeline and what is kept per pipeline go, full precision's
    stays; its next batch loads it again, traced anew, with the same image."""
    import weakref

    host, model = _host(), tiny_pipelines["flux"]
    full = _generate(host, model, ["a"], None)
    first = _generate(host, model, ["a"], "quant:int8wo")
    key = host.key(model, "float32", "int8wo")
    gone = weakref.ref(host._pipelines[key])
    assert host.release(model, "float32", "int8wo") and not host.release(model, "float32", "int8wo")
    assert gone() is None and key not in host.weight_bytes and key not in host._families
    assert list(host._pipelines) == [host.key(model, "float32")] and all(q is None for _, q in host._traced)
    again = _generate(host, model, ["a"], "quant:int8wo")
    assert np.array_equal(again.images[0], first.images[0]) and not np.array_equal(again.images[0], full.images[0])
    assert again.record_extra["transformer_weight_bytes"] == first.record_extra["transformer_weight_bytes"]
    assert host.recompiles == 0


def test_the_stored_bytes_count_a_subclass_by_its_inner_tensors():
    import torch

    from diffq.worker.device.quantize import quantize, weight_bytes

    layer = torch.nn.Linear(256, 128)
    assert weight_bytes(layer) == (256 * 128 + 128) * 4
    quantize(layer, "int8wo")
    # int8 data, per output row a float32 scale and an int8 zero point (Int8Tensor keeps
    # one even when symmetric), the float32 bias.
    assert weight_bytes(layer) == 256 * 128 + 128 * (4 + 1) + 128 * 4


@pytest.mark.slow
def test_a_scheme_compiles_regionally_with_no_steady_recompiles(tiny_pipelines):
    """Quantized before compiling: each block's graph is traced over the int8 weights
    once; later batches and a full-precision batch between them add no graph of the
    scheme's (full precision compiles its own once), and the compiled images are within
    a level or two of the eager scheme's."""
    from diffq.worker.device.pipeline_host import graphs_compiled

    model = tiny_pipelines["flux"]
    host = _host("regional")
    first = _generate(host, model, ["a lighthouse"], "quant:int8wo")
    assert first.graphs > 0
    _generate(host, model, ["a lighthouse"], None)
    graphs = graphs_compiled()
    for speedup in ("quant:int8wo", None, "quant:int8wo"):
        assert _generate(host, model, ["a lighthouse"], speedup).graphs == 0
    assert graphs_compiled() == graphs and host.recompiles == 0
    eager = _generate(_host(), model, ["a lighthouse"], "quant:int8wo")
    assert np.abs(first.images[0].astype(int) - eager.images[0].astype(int)).max() <= 2


# -- diffq run end to end ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, scheme", [("flux", "int8wo"), ("sd3", "int8dq")])
def test_a_run_with_a_scheme_names_it_in_every_record(tmp_path, tiny_pipelines, family, scheme):
    """The same prompt and seed in three batches (beside another row, beside a third,
    alone and padded): identical pixels; every record names the scheme and the
    transformer's stored bytes."""
    from PIL import Image

    from diffq.core.storage import open_storage
    from tests.helpers import assert_run_complete, diffq

    model = tiny_pipelines[family]
    rows = [{"id": "x1", "prompt": "a red fox", "seed": 5}, {"id": "a", "prompt": "a blue whale", "seed": 1},
            {"id": "x2", "prompt": "a red fox", "seed": 5}, {"id": "b", "prompt": "rain on glass", "seed": 2},
            {"id": "x3", "prompt": "a red fox", "seed": 5}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"height": 64, "width": 64, **row}) + "\n" for row in rows))
    out = tmp_path / "out"
    proc = diffq("run", str(prompts), "--model", model, "--out", str(out), "--batch-size", "2", "--steps", "2",
                 "--no-progress", "--speedup", f"quant:{scheme}")
    assert "5/5 images, 0 failed" in proc.stdout
    records = {r.id: r for r in assert_run_complete(str(out), prompts, steps=2, model=model)}
    assert {r.speedup for r in records.values()} == {f"quant:{scheme}"}
    assert all(r.reproducible and r.transformer_weight_bytes > 0 for r in records.values())
    assert len({r.batch_id for r in records.values()}) == 3
    storage = open_storage(str(out))
    pixels = [np.asarray(Image.open(io.BytesIO(storage.get_bytes(records[i].file_name)))) for i in ("x1", "x2", "x3")]
    assert all(np.array_equal(pixels[0], p) for p in pixels[1:])


def test_a_profile_that_chose_a_scheme_drives_the_run(tmp_path):
    """`qualify --speedups --profile` may choose a scheme for a shape: submit puts it in
    that shape's batches, the other shape keeps its own choice."""
    from diffq.core.profile import Budget, Candidate, ShapeChoice, SpeedupProfile
    from diffq.core.storage import open_storage
    from diffq.producer.submit import read_plan, submit

    profile = tmp_path / "profile.json"
    SpeedupProfile(model="m", device="cpu", compile="none", steps=4, dtype="float32", budget=Budget(min_psnr=35,
                   min_ssim=0.97), shapes=[
        ShapeChoice(height=64, width=64, chosen=Candidate(speedup="quant:int8wo", batch_size=2,
                                                          seconds_per_image=0.1, psnr=40, ssim=0.99)),
        ShapeChoice(height=128, width=128, chosen=Candidate(speedup=None, batch_size=4, seconds_per_image=0.3))],
    ).dump(profile)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "height": 64 if i % 2 else 128,
                                           "width": 64 if i % 2 else 128}) + "\n" for i in range(6)))
    out = str(tmp_path / "run")
    submit(prompts, out, model="m", broker_url="memory://", speedup=str(profile), batch_size="auto", steps=4)
    chosen = {(m.shape.height, m.shape.batch_size, m.params.speedup) for m in read_plan(open_storage(out))}
    assert chosen == {(64, 2, "quant:int8wo"), (128, 4, None)}


def test_the_compile_cache_namespace_holds_torchaos_version():
    from importlib import metadata

    from diffq.worker.device import compile_cache
    from diffq.worker.device.backends import get_backend

    assert f"torchao-{metadata.version('torchao')}" in compile_cache.namespace(get_backend("cpu"))
