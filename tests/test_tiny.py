"""The tiny offline pipelines load and run through the real diffusers pipeline classes."""

import hashlib
import socket

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, StableDiffusion3Pipeline
from PIL import Image

from diffq.app.tiny import FAMILIES, build_tiny_pipeline

torch.set_num_threads(1)

EXPECTED_CLASS = {"flux2-klein": Flux2KleinPipeline, "flux": FluxPipeline, "sd3": StableDiffusion3Pipeline,
                  "flux2": Flux2Pipeline}
SIZE = 64
STEPS = 2


def _no_network(*args, **kwargs):
    raise AssertionError("tiny pipelines must load and run without network access")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    family = request.param
    path = build_tiny_pipeline(tmp_path_factory.mktemp(family), family=family)
    # HF_HUB_OFFLINE is read by huggingface_hub at import time, so also refuse sockets outright.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", _no_network)
        pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return family, path, pipe


def _generate(pipe, prompts, seeds, **kwargs):
    return pipe(
        prompt=prompts,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
        output_type="pil",
        **kwargs,
    ).images


def _pixels(image):
    return np.asarray(image, dtype=np.int16)


def test_saved_size_and_class(tiny):
    family, path, pipe = tiny
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 5 * 2**20
    assert type(pipe) is EXPECTED_CLASS[family]
    # 8x VAE like the real models: images must be multiples of 16.
    assert pipe.vae_scale_factor == 8


def test_batch_of_two_with_generator_list(tiny):
    _, _, pipe = tiny
    images = _generate(pipe, ["a red fox", "a blue whale"], (1, 2))
    assert len(images) == 2
    assert all(isinstance(im, Image.Image) and im.size == (SIZE, SIZE) for im in images)
    assert not np.array_equal(_pixels(images[0]), _pixels(images[1]))


def test_item_independent_of_batch_neighbours(tiny):
    _, _, pipe = tiny
    first = _generate(pipe, ["a red fox", "a blue whale"], (1, 2))[0]
    other_neighbour = _generate(pipe, ["a red fox", "a much longer, different prompt"], (1, 3))[0]
    alone = _generate(pipe, ["a red fox"], (1,))[0]
    # Measured pixel-exact on CPU; allow one 8-bit level for other BLAS builds.
    assert np.abs(_pixels(first) - _pixels(other_neighbour)).max() <= 1
    assert np.abs(_pixels(first) - _pixels(alone)).max() <= 1


def test_runs_with_default_call_arguments(tiny):
    _, _, pipe = tiny
    # Everything else (max_sequence_length=512, guidance, Klein's text_encoder_out_layers) at defaults.
    images = pipe(prompt="a red fox", height=SIZE, width=SIZE, num_inference_steps=STEPS).images
    assert len(images) == 1 and images[0].size == (SIZE, SIZE)


def test_classifier_free_guidance_switch(tiny):
    """What guidance_scale does per family, as the family table says (diffq/core/families.py)."""
    family, _, pipe = tiny
    calls = []
    handle = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        if family == "flux2-klein":
            # Not distilled: guidance_scale > 1 adds an unconditional pass per step, same batch.
            assert pipe.config.is_distilled is False
            _generate(pipe, ["a red fox"], (1,), guidance_scale=1.0)
            assert calls == [1] * STEPS
            calls.clear()
            _generate(pipe, ["a red fox"], (1,), guidance_scale=4.0)
            assert calls == [1] * 2 * STEPS
        elif family == "sd3":
            # CFG concatenates the unconditional batch: the transformer sees 2B.
            _generate(pipe, ["a red fox"], (1,), guidance_scale=1.0)
            assert calls == [1] * STEPS
            calls.clear()
            _generate(pipe, ["a red fox"], (1,), guidance_scale=5.0, negative_prompt=["blurry"])
            assert calls == [2] * STEPS
        else:
            # Guidance-distilled: guidance_scale is an embedding input, one pass whatever its value.
            assert pipe.transformer.config.guidance_embeds is True
            _generate(pipe, ["a red fox"], (1,), guidance_scale=1.0)
            _generate(pipe, ["a red fox"], (1,), guidance_scale=4.0)
            assert calls == [1] * 2 * STEPS
            if family == "flux":
                # FluxPipeline's "true CFG" needs true_cfg_scale and a negative prompt (not driven by diffq).
                calls.clear()
                _generate(pipe, ["a red fox"], (1,), true_cfg_scale=4.0, negative_prompt="blurry")
                assert calls == [1] * 2 * STEPS
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    pipe = DiffusionPipeline.from_pretrained(build_tiny_pipeline(tmp_path_factory.mktemp("sd3"), family="sd3"),
                                             local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sd3_negative_prompt_changes_the_image(sd3):
    pipe = sd3
    plain = _generate(pipe, ["a red fox"], (1,), guidance_scale=5.0)[0]
    negative = _generate(pipe, ["a red fox"], (1,), guidance_scale=5.0, negative_prompt=["blurry, dark"])[0]
    assert not np.array_equal(_pixels(plain), _pixels(negative))


def test_sd3_has_three_text_encoders(sd3):
    pipe = sd3
    names = [type(pipe.text_encoder).__name__, type(pipe.text_encoder_2).__name__, type(pipe.text_encoder_3).__name__]
    assert names == ["CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel"]


def _digest(path):
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*.safetensors"))
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_deterministic_in_seed(tmp_path, family):
    state = torch.get_rng_state()
    a = _digest(build_tiny_pipeline(tmp_path / "a", family=family, seed=0))
    b = _digest(build_tiny_pipeline(tmp_path / "b", family=family, seed=0))
    c = _digest(build_tiny_pipeline(tmp_path / "c", family=family, seed=1))
    assert a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)
    assert torch.equal(torch.get_rng_state(), state)


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        build_tiny_pipeline(tmp_path, family="nope")
    for family in FAMILIES:
        assert family in str(excinfo.value)


def test_the_hosts_8_bit_arrays_are_diffusers_own_pil_pixels(tiny):
    """The worker asks for output_type="pt" and scales to 8 bits where the tensor is
    (worker/device/pipeline_host.py to_arrays); diffusers' "pil" path does the same float32
    arithmetic on the host (diffusers/image_processor.py: VaeImageProcessor.postprocess,
    pt_to_numpy, numpy_to_pil: (images * 255).round().astype("uint8")). Same pixels."""
    from diffq.worker.device.pipeline_host import to_arrays

    _family, _path, pipe = tiny
    pil = _generate(pipe, ["a red fox", "a blue car"], [1, 2])
    tensor = pipe(prompt=["a red fox", "a blue car"], height=SIZE, width=SIZE, num_inference_steps=STEPS,
                  generator=[torch.Generator("cpu").manual_seed(s) for s in (1, 2)], output_type="pt").images
    arrays = to_arrays(tensor)
    assert [a.dtype for a in arrays] == [np.uint8, np.uint8] and arrays[0].shape == (SIZE, SIZE, 3)
    assert all(np.array_equal(np.asarray(p), a) for p, a in zip(pil, arrays))
