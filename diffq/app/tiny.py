"""Tiny random-weight diffusers pipelines, built fully offline.

They exercise the real pipeline classes (tokenizers, text encoders, transformer, VAE,
scheduler, save/load round trip) in tests and CPU benchmarks without the Hugging Face Hub.
Images are noise; only shapes, plumbing and determinism are meaningful.

Every VAE keeps the real 8x downsampling (four blocks), so as with the real models
height and width must be multiples of 16 (vae_scale_factor 8 x 2x2 latent packing, or
SD3's patch size 2). One builder per family of diffq.core.families.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

# The names of diffq.core.families' table, each with a builder below.
FAMILIES = ("flux2-klein", "flux", "sd3", "flux2")

# The 256 printable stand-ins that byte-level BPE uses for raw bytes: with no merges,
# every byte of any UTF-8 text is exactly one token, so no text is ever <unk>.
_BYTE_SYMBOLS = sorted(pre_tokenizers.ByteLevel.alphabet())

# Same rendering as Qwen3's template for one user turn with enable_thinking=False,
# which is how Flux2KleinPipeline formats every prompt.
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def build_tiny_pipeline(out_dir: str | Path, family: str = "flux2-klein", seed: int = 0) -> Path:
    """Save a tiny random pipeline of `family` to `out_dir` and return that path.

    Load it with `DiffusionPipeline.from_pretrained(out_dir, local_files_only=True)`.
    Weights depend only on `seed`; the caller's global torch RNG state is left untouched.
    """
    builders = {"flux2-klein": _flux2_klein, "flux": _flux, "sd3": _sd3, "flux2": _flux2}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    out = Path(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = builders[family]()
    pipe.save_pretrained(out)
    return out


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Both pipelines pass `mu` to set_timesteps, which needs dynamic shifting (as in the real configs).
    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)


def _vae_blocks() -> dict:
    # Four blocks give the real downsampling factor 2**3 = 8.
    return dict(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
        sample_size=64,
    )


def _flux_blocks(vae) -> dict:
    # Every Flux-style transformer (FluxTransformer2DModel, Flux2Transformer2DModel): one
    # double- and one single-stream block of two 16-wide heads over 2x2 packed latents.
    # The family adds its text width, RoPE axes (summing to attention_head_dim) and guidance.
    return dict(
        patch_size=1,
        in_channels=vae.config.latent_channels * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
    )


def _decoder_text(tokenizer, layers: int, hidden: int) -> dict:
    # The decoder-only text models (Qwen3 for Klein, Mistral for FLUX.2): `layers` deep so
    # that the pipeline's default text_encoder_out_layers index real hidden states
    # (hidden_states has num_hidden_layers + 1 entries).
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def _byte_tokenizer(specials: list[str], **kwargs) -> Qwen2Tokenizer:
    """Byte-level BPE with no merges (every byte one token) plus `specials`."""
    vocab = {s: i for i, s in enumerate(_BYTE_SYMBOLS)}
    for special in specials:
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024, **kwargs)


def _flux2_klein() -> DiffusionPipeline:
    tokenizer = _byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE

    hidden = 16
    # 28 layers: the pipeline's default text_encoder_out_layers are (9, 18, 27).
    text_encoder = Qwen3ForCausalLM(Qwen3Config(**_decoder_text(tokenizer, 28, hidden), tie_word_embeddings=True))
    vae = AutoencoderKLFlux2(**_vae_blocks())
    transformer = Flux2Transformer2DModel(
        **_flux_blocks(vae),
        joint_attention_dim=3 * hidden,  # three stacked text-encoder layers
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,  # as in Klein: no distilled guidance embedding
    )
    # is_distilled=False (the Klein *base* setting): guidance_scale > 1 runs a second,
    # unconditional transformer pass per step; guidance_scale <= 1 skips it.
    return Flux2KleinPipeline(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )


def _clip(hidden: int, model_class=CLIPTextModel):
    clip_vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    # CLIP's BPE marks the last symbol of each word with "</w>", so each byte needs both forms.
    for suffix in ("", "</w>"):
        for s in _BYTE_SYMBOLS:
            clip_vocab[s + suffix] = len(clip_vocab)
    # FluxPipeline and StableDiffusion3Pipeline pad CLIP prompts to tokenizer.model_max_length.
    tokenizer = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=77)
    text_encoder = model_class(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            projection_dim=hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            # Not 2, so the pooler looks up this eos id instead of CLIP's legacy argmax.
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    return tokenizer, text_encoder


def _t5(hidden: int):
    # T5 is SentencePiece Unigram with Metaspace pre-tokenization, not byte-level, so
    # its vocabulary is one piece per non-space Latin-1 character; anything else is <unk>.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(i), -3.0) for i in range(256) if chr(i).isprintable() and not chr(i).isspace()]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=hidden,
            d_kv=8,
            d_ff=2 * hidden,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",  # T5 v1.1, as used by Flux and SD3
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    return tokenizer, text_encoder


def _flux() -> DiffusionPipeline:
    clip_hidden, t5_hidden = 16, 16
    tokenizer, text_encoder = _clip(clip_hidden)
    tokenizer_2, text_encoder_2 = _t5(t5_hidden)

    # Real FLUX.1 VAE latent normalisation constants.
    vae = AutoencoderKL(
        **_vae_blocks(),
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    transformer = FluxTransformer2DModel(
        **_flux_blocks(vae),
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        axes_dims_rope=(4, 4, 8),
        guidance_embeds=True,  # FLUX.1-dev style: guidance_scale is an embedding input
    )
    return FluxPipeline(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def _sd3() -> DiffusionPipeline:
    """SD 3.5 Medium's layout: CLIP-L, CLIP-G (with projections) and T5; CFG by batch doubling."""
    clip_l, clip_g = 8, 16
    tokenizer, text_encoder = _clip(clip_l, CLIPTextModelWithProjection)
    tokenizer_2, text_encoder_2 = _clip(clip_g, CLIPTextModelWithProjection)
    # The pipeline pads the joined CLIP embeddings (clip_l + clip_g wide) to T5's width.
    t5_hidden = 32
    tokenizer_3, text_encoder_3 = _t5(t5_hidden)
    vae = AutoencoderKL(**_vae_blocks(), scaling_factor=1.5305, shift_factor=0.0609)  # SD3's constants
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=vae.config.latent_channels,
        out_channels=vae.config.latent_channels,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=t5_hidden,
        caption_projection_dim=16,
        pooled_projection_dim=clip_l + clip_g,
        pos_embed_max_size=96,  # latent positions up to 96 patches: 1536 px, as the real model
        dual_attention_layers=(0,),  # SD 3.5 style (MMDiT-X), with its RMS q/k norm
        qk_norm="rms_norm",
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


# Mistral's [INST] turn, without the system turn: Flux2Pipeline sends a 168-character
# system message first, which byte-level tokens would make longer than the short
# max_sequence_length tests use, truncating every prompt away.
_MISTRAL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '[INST]' }}{%- for part in message.content %}{{- part.text }}{%- endfor %}{{- '[/INST]' }}"
    "{%- endif %}{%- endfor %}"
)


def _flux2() -> DiffusionPipeline:
    """FLUX.2-dev's layout: a Mistral3 text encoder (Mistral text model + Pixtral vision tower)."""
    # FLUX.2-dev ships a PixtralProcessor, which transformers refuses to build without
    # torchvision; the pipeline only calls its apply_chat_template, which the
    # tokenizer has too, so the tiny pipeline's "tokenizer" is the tokenizer itself.
    tokenizer = _byte_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]"],
                                unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                extra_special_tokens=["[INST]", "[/INST]", "[IMG]"])
    tokenizer.chat_template = _MISTRAL_CHAT_TEMPLATE
    hidden = 16
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            # 30 layers: the pipeline's default text_encoder_out_layers are (10, 20, 30).
            text_config=dict(model_type="mistral", **_decoder_text(tokenizer, 30, hidden), sliding_window=None,
                             bos_token_id=tokenizer.bos_token_id),
            vision_config=dict(model_type="pixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=4, patch_size=4, image_size=64),
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=1,
            tie_word_embeddings=True,
        )
    )
    vae = AutoencoderKLFlux2(**_vae_blocks())
    transformer = Flux2Transformer2DModel(
        **_flux_blocks(vae),
        joint_attention_dim=3 * hidden,  # three stacked text-encoder layers
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,  # FLUX.2-dev: guidance-distilled, guidance_scale is an embedding input
    )
    return Flux2Pipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)


# What `tiny-lora` targets by default: the attention projections diffusers' own FLUX.1
# LoRA training script targets (examples/dreambooth/train_dreambooth_lora_flux.py).
TINY_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# lora_B is scaled by this after PEFT's random init: the tiny model's images then move
# well above the differences compiling alone makes (tests/test_lora.py compares them).
TINY_LORA_GAIN = 8.0


def build_tiny_lora(pipeline_dir: str | Path, out: str | Path, rank: int, seed: int = 0,
                    targets: tuple[str, ...] = TINY_LORA_TARGETS) -> Path:
    """Write a random LoRA adapter for the tiny pipeline's transformer to `out` (a
    .safetensors file in diffusers' LoRA format), built by PEFT with random A and B
    (PEFT's default leaves B zero, which would change no image). Weights depend only on
    `seed` and `rank`; the caller's torch RNG is left untouched."""
    import diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"{out}: the adapter file must end in .safetensors")
    pipeline_class = getattr(diffusers, DiffusionPipeline.load_config(str(pipeline_dir))["_class_name"])
    transformer_class = getattr(diffusers, DiffusionPipeline.load_config(str(pipeline_dir))["transformer"][1])
    transformer = transformer_class.from_pretrained(str(pipeline_dir), subfolder="transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # init_lora_weights=False: A and B both random (PEFT's "no-op" init is B = 0).
        # lora_alpha = rank: the scale diffusers assumes for a file without alphas.
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                           init_lora_weights=False))
    layers = {key: value * TINY_LORA_GAIN if ".lora_B." in key else value
              for key, value in get_peft_model_state_dict(transformer).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    pipeline_class.save_lora_weights(str(out.parent), transformer_lora_layers=layers, weight_name=out.name)
    return out
