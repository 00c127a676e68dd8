"""Pipeline families as data: what each diffusers pipeline class takes and means.

diffusers declares its models' quirks as class data (`_repeated_blocks`, `_tp_plan`,
`_no_split_modules`); this table does the same for the pipelines diffq drives, keyed
by pipeline class name (`model_index.json`'s `_class_name`). Torch-free: the producer
reads it to refuse a row the family cannot honour before anything is enqueued, and
to decide whether CFG belongs in the shape key; the worker builds each call from it,
so an argument a family does not take is never passed (nor silently dropped).

Every fact below is read from diffusers 0.42's source; tests/test_families.py pins
each against the installed classes and cites the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

# What `guidance_scale` means for a family, and so whether it changes the graph:
#   cfg-batch: > 1 runs classifier-free guidance by concatenating the unconditional
#              batch to the conditional one (the transformer sees 2B): a new graph,
#              so the CFG bit is part of the shape key.
#   cfg-pass:  > 1 runs a second transformer call over the same shapes (an
#              unconditional pass); same graph, twice the work, no shape-key bit.
#   embedded:  guidance-distilled: the value feeds the transformer's guidance
#              embedding; one pass, same graph whatever the value.
Guidance = Literal["cfg-batch", "cfg-pass", "embedded"]

# The call arguments every family takes and diffq always passes.
COMMON_ARGUMENTS = frozenset({"prompt", "height", "width", "num_inference_steps", "guidance_scale",
                              "max_sequence_length", "generator", "output_type"})


class FamilyError(ValueError):
    """A model whose family diffq does not know, or a request its family cannot honour."""


class Family:
    """One pipeline class's quirks. Subclasses only set class data."""

    name: ClassVar[str]  # what `diffq tiny-pipeline --family` and the docs call it
    pipeline_class: ClassVar[str]
    source: ClassVar[str]  # the diffusers file these facts come from
    call_arguments: ClassVar[frozenset[str]] = COMMON_ARGUMENTS
    guidance: ClassVar[Guidance]
    # Height and width must be multiples of this: VAE downsampling x latent patch size.
    size_multiple: ClassVar[int] = 16
    # The transformer declares `_repeated_blocks`, so `--compile regional` applies.
    repeated_blocks: ClassVar[bool]
    # Text-encoder components a tensor-parallel group loads sharded (their
    # transformers config declares a TP plan); every other encoder is replicated.
    tp_text_encoders: ClassVar[tuple[str, ...]] = ()
    # Step caches (core/speedups.py) run: the transformer mixes in CacheMixin and the
    # pipeline opens a cache context around each transformer call. Where not, why.
    step_caches: ClassVar[bool] = True
    step_caches_missing: ClassVar[str] = ""
    # Caches that fail on this family, and how (measured).
    cache_refusals: ClassVar[dict[str, str]] = {}
    # LoRA file layouts a run takes (core/adapters.py FILE_LAYOUTS): diffusers' own and a
    # raw PEFT save everywhere (diffq strips the prefix); others where the pipeline class's
    # `lora_state_dict` converts them and diffq checks the conversion (docs/prompts.md).
    lora_layouts: ClassVar[tuple[str, ...]] = ("diffusers", "peft")

    @classmethod
    def takes(cls, argument: str) -> bool:
        return argument in cls.call_arguments

    @classmethod
    def cfg_in_shape(cls, guidance_scale: float) -> bool:
        """The shape key's CFG bit: set only where CFG changes the traced batch."""
        return cls.guidance == "cfg-batch" and guidance_scale > 1.0

    @classmethod
    def refusal(cls, *, negative_prompt: str | None, guidance_scale: float) -> tuple[str, str] | None:
        """(field, why) if one item asks for what this family cannot do, else None."""
        if negative_prompt is not None:
            if not cls.takes("negative_prompt"):
                return "negative_prompt", f"{cls.pipeline_class} ({cls.name}) takes no negative prompt"
            if cls.guidance != "embedded" and guidance_scale <= 1.0:
                return "negative_prompt", (f"{cls.pipeline_class} ({cls.name}) uses a negative prompt only "
                                           f"with classifier-free guidance (guidance_scale > 1, got "
                                           f"{guidance_scale:g}); it would be ignored")
        return None

    @classmethod
    def compile_refusal(cls, compile_mode: str) -> str | None:
        if compile_mode == "regional" and not cls.repeated_blocks:
            return (f"{cls.pipeline_class} ({cls.name}): its transformer declares no repeated blocks, "
                    f"so --compile regional cannot apply; use --compile full or none")
        return None

    @classmethod
    def call_kwargs(cls, *, prompts: Sequence[str], negative_prompts: Sequence[str | None], height: int,
                    width: int, num_inference_steps: int, guidance_scale: float, max_sequence_length: int,
                    generator) -> dict:
        """The pipeline call for one padded batch: only arguments the family takes."""
        kwargs = dict(prompt=list(prompts), height=height, width=width, num_inference_steps=num_inference_steps,
                      guidance_scale=guidance_scale, max_sequence_length=max_sequence_length,
                      generator=generator, output_type="pt")  # worker/device/pipeline_host.py: to_arrays
        if cls.takes("negative_prompt"):
            # "" is what the pipelines encode for an absent negative prompt.
            kwargs["negative_prompt"] = [text or "" for text in negative_prompts]
        return {name: value for name, value in kwargs.items() if cls.takes(name)}


class Flux(Family):
    name = "flux"
    pipeline_class = "FluxPipeline"
    source = "diffusers/pipelines/flux/pipeline_flux.py"
    # guidance_scale feeds the guidance embedding (`if self.transformer.config.guidance_embeds`);
    # schnell has none and ignores it. FluxPipeline's negative_prompt acts only under
    # `true_cfg_scale > 1` (a second pass diffq does not drive), so diffq refuses it
    # rather than pass it to be ignored.
    guidance = "embedded"
    repeated_blocks = True  # FluxTransformer2DModel._repeated_blocks
    tp_text_encoders = ()  # CLIP and T5 declare no TP plan
    # FluxLoraLoaderMixin.lora_state_dict converts kohya (with or without ComfyUI's
    # `diffusion_model.`) and XLabs files (diffusers loaders/lora_pipeline.py).
    lora_layouts = ("diffusers", "peft", "kohya", "comfyui", "xlabs")


class _Flux2Pipelines(Family):
    """What both FLUX.2 pipelines (diffusers/pipelines/flux2/) share: the transformer
    class and one text encoder, whose config declares a TP plan (Qwen3 in Klein;
    Mistral3 in FLUX.2, through its Mistral text model)."""

    repeated_blocks = True  # Flux2Transformer2DModel._repeated_blocks
    tp_text_encoders = ("text_encoder",)


class Flux2Klein(_Flux2Pipelines):
    name = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    source = "diffusers/pipelines/flux2/pipeline_flux2_klein.py"
    # do_classifier_free_guidance = guidance_scale > 1 and not is_distilled: a second
    # transformer call with the embeddings of "" (no negative_prompt argument).
    guidance = "cfg-pass"
    cache_refusals = {"firstblock": "its hook fails inside Flux2TransformerBlock (TypeError, measured on "
                                    "diffusers 0.42.1)"}


class Flux2(_Flux2Pipelines):
    name = "flux2"
    pipeline_class = "Flux2Pipeline"
    source = "diffusers/pipelines/flux2/pipeline_flux2.py"
    guidance = "embedded"  # always fed as `guidance` to the transformer
    step_caches = False
    step_caches_missing = "Flux2Pipeline opens no cache context around its transformer calls"


class StableDiffusion3(Family):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    source = "diffusers/pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py"
    call_arguments = COMMON_ARGUMENTS | {"negative_prompt"}
    # latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance
    guidance = "cfg-batch"
    repeated_blocks = False  # SD3Transformer2DModel declares none
    tp_text_encoders = ()  # CLIP-L, CLIP-G and T5 declare no TP plan
    step_caches = False
    step_caches_missing = ("SD3Transformer2DModel does not mix in CacheMixin and StableDiffusion3Pipeline "
                           "opens no cache context (TaylorSeer applied by hand raises 'No cache context is set')")


FAMILIES: dict[str, type[Family]] = {f.pipeline_class: f for f in (Flux2Klein, Flux, StableDiffusion3, Flux2)}
BY_NAME: dict[str, type[Family]] = {f.name: f for f in FAMILIES.values()}


def cfg_bit(family: type[Family] | None, guidance_scale: float) -> bool:
    """The shape key's CFG bit; where the family is unknown (a hub id the producer cannot
    read), the conservative rule: CFG on above 1. It may split queues, never mix graphs."""
    return family.cfg_in_shape(guidance_scale) if family is not None else guidance_scale > 1.0


def family_for_class(class_name: str) -> type[Family]:
    try:
        return FAMILIES[class_name]
    except KeyError:
        raise FamilyError(f"{class_name} is not in diffq's family table "
                          f"(known: {', '.join(sorted(FAMILIES))})") from None


def local_class_name(model: str) -> str | None:
    """`_class_name` of a local pipeline folder's model_index.json, None if not a local pipeline."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return None
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError) as exc:
        raise FamilyError(f"{index}: not a readable model_index.json ({exc})") from None
    if not isinstance(name, str):
        raise FamilyError(f"{index}: field '_class_name' is missing")
    return name


def family_of(model: str) -> type[Family] | None:
    """The family of a local model folder; None where it cannot be read here (a hub id)."""
    name = local_class_name(model)
    if name is None:
        return None
    try:
        return family_for_class(name)
    except FamilyError as exc:
        raise FamilyError(f"{Path(model) / 'model_index.json'}: field '_class_name': {exc}") from None


def compile_refusal(models: Sequence[str], compile_mode: str) -> str | None:
    """Why `compile_mode` cannot serve one of these models, judged from the local ones'
    families before any worker starts (hub ids are checked by the worker on load)."""
    for model in models:
        family = family_of(model)
        if family is not None and (reason := family.compile_refusal(compile_mode)):
            return reason
    return None
