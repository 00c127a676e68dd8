"""Tiny random-weight diffusers pipelines, built fully offline.

They exercise the real pipeline classes (tokenizers, text encoders, transformer, VAE,
scheduler, save/load round trip) in tests and CPU benchmarks without the Hugging Face Hub.
Images are noise; only shapes, plumbing and determinism are meaningful.

Both VAEs keep the real 8x downsampling (four blocks), so as with the real models
height and width must be multiples of 16 (vae_scale_factor 8 x 2x2 latent packing).
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
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

FAMILIES = ("flux2-klein", "flux")

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
    builders = {"flux2-klein": _flux2_klein, "flux": _flux}
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


def _flux2_klein() -> DiffusionPipeline:
    vocab = {s: i for i, s in enumerate(_BYTE_SYMBOLS)}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=1024,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE

    # 28 layers so the pipeline's default text_encoder_out_layers=(9, 18, 27) index real
    # intermediate hidden states (hidden_states has num_hidden_layers + 1 entries).
    hidden = 16
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=32,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )

    vae = AutoencoderKLFlux2(**_vae_blocks())
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=vae.config.latent_channels * 4,  # 2x2 patchified latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * hidden,  # three stacked text-encoder layers
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
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


def _flux() -> DiffusionPipeline:
    clip_vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    # CLIP's BPE marks the last symbol of each word with "</w>", so each byte needs both forms.
    for suffix in ("", "</w>"):
        for s in _BYTE_SYMBOLS:
            clip_vocab[s + suffix] = len(clip_vocab)
    # FluxPipeline pads CLIP prompts to tokenizer.model_max_length.
    tokenizer = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=77)
    clip_hidden = 16
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=clip_hidden,
            intermediate_size=32,
            projection_dim=clip_hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            # Not 2, so the pooler looks up this eos id instead of CLIP's legacy argmax.
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )

    # T5 is SentencePiece Unigram with Metaspace pre-tokenization, not byte-level, so
    # its vocabulary is one piece per non-space Latin-1 character; anything else is <unk>.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(i), -3.0) for i in range(256) if chr(i).isprintable() and not chr(i).isspace()]
    tokenizer_2 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    t5_hidden = 16
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=t5_hidden,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",  # T5 v1.1, as used by Flux
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            decoder_start_token_id=tokenizer_2.pad_token_id,
        )
    )

    # Real FLUX.1 VAE latent normalisation constants.
    vae = AutoencoderKL(
        **_vae_blocks(),
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=vae.config.latent_channels * 4,  # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
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
