"""Tiny random Z-Image (ZImagePipeline) checkpoints in diffusers format, built offline.

The layout of Tongyi-MAI/Z-Image-Turbo: model_index.json, transformer/
(ZImageTransformer2DModel: single-stream DiT with noise/context refiner layers, patch 2),
vae/ (AutoencoderKL, Flux-style: no quant convs, scaling 0.3611 / shift 0.1159), text_encoder/
(Qwen3Model: the pipeline reads its second-to-last hidden state), tokenizer/ (our offline BPE as
Qwen2Tokenizer with a Qwen3 chat template: the pipeline formats prompts with
`apply_chat_template(..., enable_thinking=True)`), scheduler/ (FlowMatchEulerDiscreteScheduler,
Z-Image-Turbo's: static shift 3.0).

Size `tiny` (`count_parameters`): transformer 0.36M (dim 32, 2 heads of 16 with rope axes
(4, 6, 6), 2 layers + 1 noise and 1 context refiner, 4 latent channels; the timestep MLP keeps
its fixed 1024-wide middle), VAE 0.25M (channels 8/16/32/32, 1 layer per block, 4 latent
channels), Qwen3 0.11M (64 wide x 2 layers, GQA 4/2 heads of 16), vocab 512. `overrides` is nested per component, e.g.
{"transformer": {"n_layers": 3}, "text_encoder": {"num_hidden_layers": 3}}.

Weights: diffusers' default init for the transformer and VAE (one seed per component); the text
encoder gets `omnistage.tiny.init` scales.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from omnistage.tiny.diffusers_folder import (
    PipelineFolder,
    component_seed,
    deep_merge,
    seeded,
    write_pipeline_folder,
)
from omnistage.tiny.init import InitScale, reinit_weights_
from omnistage.tiny.qwen_image import VL_SPECIAL_TOKENS
from omnistage.tiny.spec import TinyArch, TinyBuildOptions
from omnistage.tiny.tokenizer import ENDOFTEXT, IM_END, build_qwen_tokenizer

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json.
Z_IMAGE_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
# Flux VAE latent affine, as Z-Image-Turbo's vae/config.json.
_VAE_SCALING, _VAE_SHIFT = 0.3611, 0.1159

# Qwen3's template for what the pipeline renders (string contents): no default system turn;
# `enable_thinking=False` pre-fills an empty think block, as the real template does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
_THINK_TOKENS = ("<think>", "</think>")  # plain (non-special) added tokens in Qwen3


@dataclass(frozen=True)
class TransformerShape:
    dim: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    n_refiner_layers: int
    axes_dims: tuple[int, int, int]  # sums to dim / n_heads


@dataclass(frozen=True)
class VaeShape:
    block_out_channels: tuple[int, ...]  # len - 1 halvings: 4 -> 8x
    layers_per_block: int
    latent_channels: int  # = transformer in_channels
    norm_num_groups: int  # divides every block width


@dataclass(frozen=True)
class TextShape:
    vocab_size: int
    hidden_size: int  # = transformer cap_feat_dim
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


@dataclass(frozen=True)
class ZImageSize:
    transformer: TransformerShape
    vae: VaeShape
    text: TextShape


SIZES: dict[str, ZImageSize] = {
    "tiny": ZImageSize(
        transformer=TransformerShape(dim=32, n_heads=2, n_kv_heads=2, n_layers=2, n_refiner_layers=1,
                                     axes_dims=(4, 6, 6)),
        vae=VaeShape(block_out_channels=(8, 16, 32, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8),
        text=TextShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
}


def build_qwen3_tokenizer(vocab_size: int) -> Qwen2Tokenizer:
    """Our offline BPE with Qwen3's special tokens (as Qwen2.5-VL's) and think tokens."""
    added = [*VL_SPECIAL_TOKENS, *(AddedToken(t, special=False, normalized=False) for t in _THINK_TOKENS)]
    return build_qwen_tokenizer(vocab_size, added, model_max_length=40960, chat_template=QWEN3_CHAT_TEMPLATE)


def transformer_config(size: ZImageSize) -> dict[str, Any]:
    shape = size.transformer
    return {
        **asdict(shape),
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": size.vae.latent_channels,
        "cap_feat_dim": size.text.hidden_size,
        "qk_norm": True,
        "norm_eps": 1e-5,
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_lens": [1024, 512, 512],
    }


def vae_config(size: ZImageSize) -> dict[str, Any]:
    shape = size.vae
    blocks = len(shape.block_out_channels)
    return {
        **asdict(shape),
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * blocks,
        "up_block_types": ["UpDecoderBlock2D"] * blocks,
        "act_fn": "silu",
        "mid_block_add_attention": True,
        "sample_size": 1024,
        "scaling_factor": _VAE_SCALING,
        "shift_factor": _VAE_SHIFT,
        "force_upcast": True,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def text_encoder_config(size: ZImageSize, tokenizer: Qwen2Tokenizer) -> dict[str, Any]:
    return {
        **asdict(size.text),
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "dtype": "float32",
    }


def with_overrides(size: ZImageSize, overrides: dict) -> ZImageSize:
    """The transformer's channels follow the VAE's and the text encoder's widths, overridden or not."""
    text_overrides = overrides.get("text_encoder", {})
    return replace(size, vae=replace(size.vae, latent_channels=int(
        overrides.get("vae", {}).get("latent_channels", size.vae.latent_channels))),
        text=replace(size.text, hidden_size=int(text_overrides.get("hidden_size", size.text.hidden_size))))


def shared_components(options: TinyBuildOptions, size: ZImageSize, scheduler_config: dict) -> dict[str, Any]:
    """The tokenizer, VAE, Qwen3 text encoder and scheduler (Z-Image's; Ovis-Image reuses them)."""
    overrides = options.overrides
    text_overrides = overrides.get("text_encoder", {})
    tokenizer = build_qwen3_tokenizer(int(text_overrides.get("vocab_size", size.text.vocab_size)))
    with seeded(component_seed(options.seed, 1)):
        vae = AutoencoderKL(**deep_merge(vae_config(size), overrides.get("vae", {})))
    te_config = Qwen3Config(**deep_merge(text_encoder_config(size, tokenizer), text_overrides))
    with seeded(component_seed(options.seed, 2)):
        text_encoder = Qwen3Model(te_config).eval()
    reinit_weights_(text_encoder, component_seed(options.seed, 3), InitScale())
    scheduler = FlowMatchEulerDiscreteScheduler(**deep_merge(scheduler_config, overrides.get("scheduler", {})))
    return {"scheduler": scheduler, "text_encoder": text_encoder, "tokenizer": tokenizer, "vae": vae}


def build_components(options: TinyBuildOptions) -> dict[str, Any]:
    """ZImagePipeline's components, in model_index order; deterministic for `options.seed`."""
    size = with_overrides(SIZES[options.size], options.overrides)
    shared = shared_components(options, size, Z_IMAGE_SCHEDULER)
    with seeded(component_seed(options.seed, 0)):
        transformer = ZImageTransformer2DModel(**deep_merge(transformer_config(size),
                                                            options.overrides.get("transformer", {})))
    tokenizer, text_encoder, vae, scheduler = (shared[k] for k in ("tokenizer", "text_encoder", "vae", "scheduler"))
    return {
        "scheduler": scheduler,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
    }


def build(options: TinyBuildOptions) -> None:
    folder = PipelineFolder("ZImagePipeline", build_components(options))
    write_pipeline_folder(folder, options.outdir, options.max_shard_size)


Z_IMAGE = TinyArch(name="z_image", sizes=tuple(SIZES), build=build)
