"""Speed-ups as run parameters (core/speedups.py, worker/device/speedups.py): the spec and its
table pinned against diffusers 0.42.1's config classes, each cache's image independent
of its batch neighbours with settings that force the skipping path, the backend table's
refusals per compile mode, and the per-block compile under which block-level caches
make no steady-state recompiles."""

from __future__ import annotations

import dataclasses
import zlib
import typing

import numpy as np
import pytest

from diffq.core.contract import BatchItem, BatchParams, ShapeKey
from diffq.core.speedups import BATCH, CACHES, SpeedupError, canonical, parse

# -- the spec and the table --------------------------------------------------------------


def test_a_spec_is_parsed_to_its_canonical_form():
    assert canonical("taylorseer:cache_interval=3") == "taylorseer:cache_interval=3"
    assert canonical(" TaylorSeer:use_lite_mode=TRUE,cache_interval=3 + attention:_native_math") == \
        "taylorseer:cache_interval=3,use_lite_mode=true+attention:_native_math"
    assert canonical("mag:threshold=0.06,mag_ratios=flux") == "mag:mag_ratios=flux,threshold=0.06"
    assert canonical("pyramidattentionbroadcast:spatial_attention_timestep_skip_range=100|800") == \
        "pyramidattentionbroadcast:spatial_attention_timestep_skip_range=100|800"
    assert canonical(None) is None and canonical("none") is None and canonical("") is None


@pytest.mark.parametrize("spec, says", [
    ("taylor:cache_interval=3", "unknown speed-up 'taylor'"),
    ("taylorseer:cache_interval=x", "'x' is not a int"),
    ("taylorseer:nope=1", "no field 'nope'"),
    ("taylorseer:cache_interval", "is not FIELD=VALUE"),
    ("taylorseer+mag:mag_ratios=flux", "one cache at a time"),
    ("mag:threshold=0.1", "mag needs mag_ratios=flux"),
    ("mag:num_inference_steps=4,mag_ratios=flux", "set by diffq from each batch"),
    ("faster", "fails on Flux"),
    ("sea", "never skips"),
    ("textkv", "nothing to cache"),
    ("attention:flash_hub", "Hugging Face Hub"),
    ("attention:native+attention:flex", "given twice"),
    ("firstblock:threshold=0.1", "--unreproducible-speedup"),
])
def test_a_spec_diffq_cannot_run_is_refused_with_the_reason(spec, says):
    with pytest.raises(SpeedupError, match=says.replace("|", r"\|").replace("+", r"\+")):
        canonical(spec)


def test_a_batch_dependent_cache_runs_only_when_asked_for_by_name():
    assert canonical("firstblock:threshold=0.1", unreproducible=True) == "firstblock:threshold=0.1"
    assert parse("firstblock").batch_dependent and not parse("taylorseer").batch_dependent


def test_the_table_matches_diffusers_config_classes():
    """diffusers/hooks/*.py (0.42.1): each offered field exists on its config class with
    the type the table parses it as; the classes diffq names are the ones diffusers has."""
    import diffusers
    import torch

    kinds = {"int": int, "float": float, "bool": bool, "dtype": torch.dtype}
    for name, row in CACHES.items():
        cls = getattr(diffusers, row.config)
        assert name == row.config.removesuffix("CacheConfig").removesuffix("Config").lower() or \
            name == "pyramidattentionbroadcast", name
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        for field, kind in row.fields.items():
            assert field in fields, (row.config, field)
            wanted = kinds.get(kind.rstrip("?"))
            if wanted is not None:
                assert wanted in (typing.get_args(hints[field]) or (hints[field],)), (row.config, field, hints[field])
        for filled in row.filled:
            assert filled in fields, (row.config, filled)
    # The batch-dependent decision, as diffusers writes it.
    import inspect

    from diffusers.hooks import first_block_cache

    source = inspect.getsource(first_block_cache)
    assert ".abs().mean()" in source and ".item()" in source and CACHES["firstblock"].decides == BATCH


def test_the_backend_table_says_what_each_compile_mode_offers():
    from diffq.core.families import Flux, Flux2Klein, StableDiffusion3
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.speedups import refusal

    cpu, neuron = get_backend("cpu"), get_backend("neuron")
    lite, attention_level = parse("taylorseer:use_lite_mode=true"), parse("taylorseer:cache_interval=3")
    mag, fbc, attention = parse("mag:mag_ratios=flux"), parse("firstblock"), parse("attention:_native_math")
    for speedup in (lite, attention_level, mag, fbc, attention):
        assert refusal(speedup, cpu, "none", Flux) is None, speedup
    for speedup in (lite, mag):
        assert refusal(speedup, cpu, "regional", Flux) is None
        assert "compiles the whole transformer" in refusal(speedup, cpu, "full", Flux)
    assert "inside each block" in refusal(attention_level, cpu, "regional", Flux)
    assert "recompiles every block" in refusal(attention, cpu, "regional", Flux)
    assert "graph break per step" in refusal(fbc, neuron, "none", Flux)
    assert "cannot run a step cache" in refusal(lite, cpu, "none", StableDiffusion3)
    assert "TypeError" in refusal(fbc, cpu, "none", Flux2Klein)
    assert refusal(attention, cpu, "none", StableDiffusion3) is None  # attention needs no cache context


# -- on the tiny Flux pipeline ----------------------------------------------------------------

STEPS = 28  # the many-step family: a 4-step distilled model has little to cache


def _host(compile_mode: str = "none"):
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import PipelineHost

    return PipelineHost(backend=get_backend("cpu"), compile_mode=compile_mode)


def _images(host, model: str, prompts: list[str], speedup: str | None, batch_size: int = 4, size: int = 64):
    shape = ShapeKey(model=model, height=size, width=size, batch_size=batch_size, max_sequence_length=32, cfg=False)
    params = BatchParams(num_inference_steps=STEPS, guidance_scale=1.0, speedup=speedup)
    items = [BatchItem(id=f"i{k}", prompt=prompt, seed=zlib.crc32(prompt.encode()) % 10_000) for k, prompt in enumerate(prompts)]
    return host.generate(shape, params, items).images


@pytest.fixture(scope="module")
def tiny_flux(tiny_pipelines):
    return tiny_pipelines["flux"]


@pytest.mark.parametrize("spec", ["taylorseer:cache_interval=3", "taylorseer:cache_interval=3,use_lite_mode=true",
                                  "mag:mag_ratios=flux,threshold=1000000000.0",
                                  "pyramidattentionbroadcast:spatial_attention_block_skip_range=3,"
                                  "spatial_attention_timestep_skip_range=-1|1001"])
def test_an_image_does_not_depend_on_its_batch_neighbours(tiny_flux, spec):
    """The same item in two batch compositions (and the padding diffq adds), each cache
    set to skip (cache_interval 3 skips two steps in three; a huge threshold makes mag
    skip as often as its max_skip_steps allows; PAB over every timestep): pixel-identical,
    and really cached (it differs from full compute)."""
    host = _host()
    a = "a lighthouse at dusk"
    crowded = _images(host, tiny_flux, [a, "a red fox", "rain on glass", "a desert road"], spec)
    padded = _images(host, tiny_flux, [a, "an old tram"], spec)
    assert np.array_equal(crowded[0], padded[0])
    full = _images(host, tiny_flux, [a, "an old tram"], None)
    assert not np.array_equal(full[0], padded[0]), "the cache never skipped: the test would prove nothing"
    # The cache's state does not leak from one batch into the next, nor does the cache
    # into a batch that asked for none.
    assert np.array_equal(_images(host, tiny_flux, [a, "an old tram"], spec)[0], padded[0])
    assert np.array_equal(_images(host, tiny_flux, [a, "an old tram"], None)[0], full[0])


def test_a_batch_dependent_cache_runs_only_when_the_batch_says_so_and_its_records_say_it(tiny_flux):
    from diffq.core.contract import BatchMessage
    from diffq.core.records import BatchMeasures, ImageRecord

    with pytest.raises(ValueError, match="--unreproducible-speedup"):
        BatchParams(num_inference_steps=STEPS, guidance_scale=1.0, speedup="firstblock:threshold=0.1")
    params = BatchParams(num_inference_steps=STEPS, guidance_scale=1.0, speedup="firstblock:threshold=0.1",
                         unreproducible=True)
    shape = ShapeKey(model=tiny_flux, height=64, width=64, batch_size=2, max_sequence_length=32, cfg=False)
    items = [BatchItem(id="a", prompt="a", seed=1)]
    assert len(_host().generate(shape, params, items).images) == 1
    message = BatchMessage(run_id="r", out="/r", batch_id="b", shape=shape, params=params, items=items)
    measures = BatchMeasures(device="cpu:0", worker="w", generate_s=1.0, generate_started_at=0.0,
                             generate_ended_at=1.0)
    record = ImageRecord.of(message, items[0], "images/a.png", measures, store_s=0.1, finished_at=2.0)
    assert (record.speedup, record.reproducible) == ("firstblock:threshold=0.1", False)
    lite = message.model_copy(update={"params": BatchParams(num_inference_steps=STEPS, guidance_scale=1.0,
                                                            speedup="taylorseer:use_lite_mode=true")})
    record = ImageRecord.of(lite, items[0], "images/a.png", measures, store_s=0.1, finished_at=2.0)
    assert (record.speedup, record.reproducible) == ("taylorseer:use_lite_mode=true", True)


@pytest.mark.slow
def test_block_level_caches_run_in_the_regional_compile_with_no_steady_recompiles(tiny_flux):
    """--compile regional compiles each repeated block's own forward, so a cache's hooks
    (and their torch.compiler.disable'd decision) wrap the compiled blocks from outside:
    no graph breaks, and switching caches on and off between batches adds no graph."""
    from diffq.worker.device.pipeline_host import graphs_compiled

    host = _host("regional")
    eager = _host()
    spec = "taylorseer:cache_interval=3,use_lite_mode=true"
    first = _images(host, tiny_flux, ["a lighthouse"], spec)
    graphs = graphs_compiled()
    for speedup in (spec, None, "mag:mag_ratios=flux", spec):
        _images(host, tiny_flux, ["a lighthouse"], speedup)
    assert graphs > 0 and graphs_compiled() == graphs and host.recompiles == 0
    # Inductor's kernels round differently from eager's: within a level or two.
    reference = _images(eager, tiny_flux, ["a lighthouse"], spec)
    assert np.abs(first[0].astype(int) - reference[0].astype(int)).max() <= 2


# -- profiles drive runs ----------------------------------------------------------------------


def _profile(path):
    from diffq.core.profile import Budget, Candidate, ShapeChoice, SpeedupProfile

    SpeedupProfile(model="m", device="cpu", compile="none", steps=28, dtype="float32", load_s=2.0,
                   budget=Budget(min_psnr=35, min_ssim=0.97),
                   shapes=[ShapeChoice(height=64, width=64, chosen=Candidate(
                       speedup="taylorseer:cache_interval=3", batch_size=2, seconds_per_image=0.1, psnr=50, ssim=0.99)),
                       ShapeChoice(height=128, width=128, chosen=Candidate(speedup=None, batch_size=8,
                                                                          seconds_per_image=0.2))]).dump(path)
    return str(path)


def test_a_profile_gives_each_shape_its_own_speedup_and_batch_size(tmp_path):
    import json

    from diffq.core.runfolder import read_manifest
    from diffq.core.storage import open_storage
    from diffq.producer.submit import read_plan, submit

    profile = _profile(tmp_path / "profile.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "height": 64 if i % 2 else 128,
                                           "width": 64 if i % 2 else 128}) + "\n" for i in range(10)))
    out = str(tmp_path / "run")
    submit(prompts, out, model="m", broker_url="memory://", speedup=profile, batch_size="auto", steps=28)
    chosen = {(m.shape.height, m.shape.batch_size, m.params.speedup) for m in read_plan(open_storage(out))}
    assert chosen == {(64, 2, "taylorseer:cache_interval=3"), (128, 8, None)}
    defaults = read_manifest(open_storage(out)).defaults
    assert defaults.batch_size == "auto" and "64x64 b2: taylorseer:cache_interval=3" in defaults.speedup


def test_a_profile_without_a_rows_shape_or_auto_without_a_profile_is_refused(tmp_path):
    from diffq.producer.sources import InputError
    from diffq.producer.submit import plan

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "height": 64, "width": 64}\n{"prompt": "b", "height": 96, "width": 96}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: field 'height': the speed-up profile has no choice for 96x96"):
        plan(prompts, model="m", speedup=_profile(tmp_path / "profile.json"))
    with pytest.raises(ValueError, match="--batch-size auto takes each shape's batch size from a --speedup profile"):
        plan(prompts, model="m", batch_size="auto")


def test_options_built_once_are_passed_on_and_the_profile_read_once(tmp_path, monkeypatch):
    """The options object as the command line builds it goes through submit unvalidated
    again: the profile file is read once, and `batch_size` stays "auto" into the manifest."""
    import json

    from diffq.core.options import GenerationOptions
    from diffq.core.profile import SpeedupProfile
    from diffq.core.runfolder import read_manifest
    from diffq.core.storage import open_storage
    from diffq.producer.submit import read_plan, submit

    loads = []
    load = SpeedupProfile.load.__func__
    monkeypatch.setattr(SpeedupProfile, "load", classmethod(lambda cls, path: loads.append(path) or load(cls, path)))
    options = GenerationOptions.of(speedup=_profile(tmp_path / "profile.json"), batch_size="auto", steps=28)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "height": 64, "width": 64}) + "\n" for i in range(3)))
    out = str(tmp_path / "run")
    submit(prompts, out, model="m", broker_url="memory://", options=options)
    assert len(loads) == 1
    assert [(m.shape.batch_size, len(m.items)) for m in read_plan(open_storage(out))] == [(2, 2), (2, 1)]
    assert read_manifest(open_storage(out)).defaults.batch_size == "auto"
    with pytest.raises(TypeError, match="options given twice: as an object and as steps"):
        submit(prompts, str(tmp_path / "again"), model="m", broker_url="memory://", options=options, steps=4)
    with pytest.raises(ValueError, match="--fit crop needs --size-buckets"):
        GenerationOptions.of(fit="crop")


def test_plan_rates_read_a_profiles_tuned_rates(tmp_path):
    from diffq.app.fleet_plan import read_rates

    rates = {(r.height, r.batch_size): r for r in read_rates([_profile(tmp_path / "profile.json")])}
    assert set(rates) == {(64, 2), (128, 8)}
    assert rates[(64, 2)].steady_s == pytest.approx(0.2) and rates[(128, 8)].steady_s == pytest.approx(1.6)
    assert {r.device_kind for r in rates.values()} == {"cpu"} and rates[(64, 2)].startup_s == 2.0
