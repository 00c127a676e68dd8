"""The family table (diffq/core/families.py), pinned against diffusers 0.42 itself.

Each fact is read from the installed pipeline classes and their source files:
  diffusers/pipelines/flux/pipeline_flux.py                        FluxPipeline
  diffusers/pipelines/flux2/pipeline_flux2_klein.py                Flux2KleinPipeline
  diffusers/pipelines/flux2/pipeline_flux2.py                      Flux2Pipeline
  diffusers/pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py  StableDiffusion3Pipeline
  diffusers/models/transformers/transformer_{flux,flux2,sd3}.py    _repeated_blocks
and the tiny pipelines of every family (diffq.app.tiny), which use those classes.
"""

import inspect
import json
from pathlib import Path

import diffusers
import pytest
import transformers

from diffq.app.tiny import FAMILIES as TINY_FAMILIES
from diffq.core.families import BY_NAME, FAMILIES, FamilyError, family_for_class, family_of

DIFFUSERS = Path(diffusers.__file__).parent


def source_of(family) -> str:
    return (DIFFUSERS / family.source.removeprefix("diffusers/")).read_text()


def test_every_family_has_a_tiny_pipeline():
    assert set(TINY_FAMILIES) == set(BY_NAME)


@pytest.mark.parametrize("family", FAMILIES.values(), ids=lambda f: f.name)
def test_call_arguments_are_in_the_pipeline_signature(family):
    pipeline = getattr(diffusers, family.pipeline_class)
    assert inspect.getsourcefile(pipeline).endswith(family.source.removeprefix("diffusers/"))
    accepted = inspect.signature(pipeline.__call__).parameters
    assert family.call_arguments <= set(accepted), family.call_arguments - set(accepted)


def test_negative_prompt_facts():
    # Klein and FLUX.2 take no negative_prompt at all.
    for name in ("Flux2KleinPipeline", "Flux2Pipeline"):
        assert "negative_prompt" not in inspect.signature(getattr(diffusers, name).__call__).parameters
        assert not FAMILIES[name].takes("negative_prompt")
    # FluxPipeline takes one but uses it only under true_cfg_scale > 1, which diffq does not drive.
    assert "do_true_cfg = true_cfg_scale > 1 and has_neg_prompt" in source_of(FAMILIES["FluxPipeline"])
    assert not FAMILIES["FluxPipeline"].takes("negative_prompt")
    # SD3 encodes it whenever CFG is on ("" when absent).
    assert 'negative_prompt = negative_prompt or ""' in source_of(FAMILIES["StableDiffusion3Pipeline"])
    assert FAMILIES["StableDiffusion3Pipeline"].takes("negative_prompt")


def test_guidance_meaning_is_read_from_the_source():
    evidence = {
        "StableDiffusion3Pipeline": ("cfg-batch", "torch.cat([latents] * 2) if self.do_classifier_free_guidance"),
        "Flux2KleinPipeline": ("cfg-pass", "return self._guidance_scale > 1 and not self.config.is_distilled"),
        "FluxPipeline": ("embedded", "if self.transformer.config.guidance_embeds:"),
        "Flux2Pipeline": ("embedded", "guidance = torch.full([1], guidance_scale"),
    }
    assert set(evidence) == set(FAMILIES)
    for name, (meaning, line) in evidence.items():
        assert FAMILIES[name].guidance == meaning
        assert line in source_of(FAMILIES[name]), (name, line)
    # Only batch-doubling CFG changes the graph, so only it sets the shape key's bit.
    assert [f.name for f in FAMILIES.values() if f.cfg_in_shape(4.0)] == ["sd3"]
    assert not any(f.cfg_in_shape(1.0) for f in FAMILIES.values())


@pytest.fixture(scope="module")
def loaded(tiny_pipelines):
    from diffusers import DiffusionPipeline

    return {name: DiffusionPipeline.from_pretrained(path, local_files_only=True)
            for name, path in tiny_pipelines.items()}


def test_families_of_the_tiny_pipelines(tiny_pipelines, loaded):
    for name, path in tiny_pipelines.items():
        family = family_of(path)
        assert family is BY_NAME[name]
        assert type(loaded[name]).__name__ == family.pipeline_class


def test_repeated_blocks_and_size_multiple(loaded):
    for name, pipe in loaded.items():
        family = BY_NAME[name]
        assert bool(getattr(type(pipe.transformer), "_repeated_blocks", None)) is family.repeated_blocks, name
        # Flux-style pipelines pack 2x2 latent patches; SD3 patchifies in the transformer.
        patch = pipe.transformer.config.patch_size if name == "sd3" else 2
        assert pipe.vae_scale_factor * patch == family.size_multiple, name
    assert not BY_NAME["sd3"].repeated_blocks


def test_tp_text_encoders_are_those_declaring_a_plan(tiny_pipelines):
    """A TP group shards exactly the text encoders the table lists (and transformers
    can shard: the config, or a composite's text config, declares a TP plan)."""
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.tensor_parallel import Group, shard_load_kwargs

    group = Group(rank=0, world_size=2, backend=get_backend("cuda"))
    group.mesh = object()
    for name, path in tiny_pipelines.items():
        index = json.loads((Path(path) / "model_index.json").read_text())
        sharded = []
        for component, entry in index.items():
            if component.startswith("_") or not isinstance(entry, list) or entry[0] != "transformers":
                continue
            cls = getattr(transformers, entry[1])
            if shard_load_kwargs("transformers", cls, path, component, group) is not None:
                sharded.append(component)
        assert tuple(sharded) == BY_NAME[name].tp_text_encoders, name


def test_mistral3_tp_plan_reaches_the_text_model(tiny_pipelines):
    # transformers/distributed/mixin.py init_parallel_plans gathers the children's plans,
    # so tp_plan="auto" on Mistral3 shards its Mistral language model.
    from transformers import Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration.from_pretrained(tiny_pipelines["flux2"], subfolder="text_encoder")
    assert any(key.startswith("model.language_model.layers.") for key in model.tp_plan)


def test_refusals():
    sd3, klein, flux = BY_NAME["sd3"], BY_NAME["flux2-klein"], BY_NAME["flux"]
    assert sd3.refusal(negative_prompt="blurry", guidance_scale=5.0) is None
    field, why = sd3.refusal(negative_prompt="blurry", guidance_scale=1.0)
    assert field == "negative_prompt" and "guidance_scale > 1" in why
    assert klein.refusal(negative_prompt="blurry", guidance_scale=4.0) == (
        "negative_prompt", "Flux2KleinPipeline (flux2-klein) takes no negative prompt")
    assert flux.refusal(negative_prompt=None, guidance_scale=4.0) is None


def test_call_kwargs_pass_only_what_the_family_takes():
    common = dict(prompts=["a", "b"], negative_prompts=["blurry", None], height=64, width=64,
                  num_inference_steps=2, guidance_scale=5.0, max_sequence_length=32, generator=None)
    assert BY_NAME["sd3"].call_kwargs(**common)["negative_prompt"] == ["blurry", ""]
    assert "negative_prompt" not in BY_NAME["flux2"].call_kwargs(**common)
    assert set(BY_NAME["flux"].call_kwargs(**common)) == BY_NAME["flux"].call_arguments


def test_unknown_and_unreadable_models(tmp_path):
    assert family_of("black-forest-labs/FLUX.2-dev") is None  # not a local folder: the worker decides
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(FamilyError, match=r"model_index.json: field '_class_name': StableDiffusionXLPipeline "
                                          r"is not in diffq's family table"):
        family_of(str(tmp_path))
    with pytest.raises(FamilyError, match="known: Flux2KleinPipeline, Flux2Pipeline, FluxPipeline"):
        family_for_class("Nope")


def test_worker_refuses_a_pipeline_class_outside_the_table_before_loading(tmp_path):
    from diffq.worker.device.backends import get_backend
    from diffq.worker.device.pipeline_host import FamilyUnsupported, PipelineHost
    from diffq.worker.delivery.tasks import PERMANENT_ERRORS

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    host = PipelineHost(backend=get_backend("cpu"))
    with pytest.raises(FamilyUnsupported, match="StableDiffusionXLPipeline is not in diffq's family table"):
        host.pipeline(str(tmp_path), "float32")  # no unet folder: it would fail later if it got that far
    assert issubclass(FamilyUnsupported, PERMANENT_ERRORS)
