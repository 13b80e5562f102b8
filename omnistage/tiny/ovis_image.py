"""Tiny random Ovis-Image (OvisImagePipeline) checkpoints in diffusers format, built offline.

The layout of AIDC-AI/Ovis-Image-7B: model_index.json, transformer/ (OvisImageTransformer2DModel:
Flux-style MMDiT, double-stream then single-stream blocks, 2x2-packed latents), vae/
(AutoencoderKL, Flux-style: no quant convs, scaling 0.3611 / shift 0.1159), text_encoder/
(Qwen3Model: the pipeline reads its last hidden state), tokenizer/ (our offline BPE as
Qwen2Tokenizer with a Qwen3 chat template: the pipeline formats prompts with
`apply_chat_template(..., enable_thinking=False)`), scheduler/ (FlowMatchEulerDiscreteScheduler
with dynamic shifting; the pipeline's `calculate_shift` defaults are Flux's).

The text encoder, tokenizer and VAE are Z-Image's tiny ones (`omnistage.tiny.z_image`: the same
component classes, Qwen3 + Flux VAE). Size `tiny` (`count_parameters`): transformer ~0.08M (2
heads x 16, rope axes (4, 6, 6), 1 double + 1 single block, 4 latent channels x 2 x 2), VAE
~0.25M, Qwen3 ~0.1M (64 wide x 2 layers, vocab 512). `overrides` is nested per component, e.g.
{"transformer": {"num_layers": 2}, "text_encoder": {"num_hidden_layers": 3}}.

Weights: diffusers' default init for the VAE; the transformer (see `TRANSFORMER_INIT`) and the
text encoder get `omnistage.tiny.init` scales, one seed per component.

Note: the pipeline drops the first 28 tokens of the templated prompt (`user_prompt_begin_id`,
the length of the real tokenizer's chat header + system prompt); ours spends more tokens on it,
so part of the system prompt stays in the embeddings. Code that mirrors the pipeline (the same
drop) matches it exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from diffusers import (
    OvisImageTransformer2DModel,
)

from omnistage.tiny.diffusers_folder import (
    PipelineFolder,
    component_seed,
    deep_merge,
    seeded,
    write_pipeline_folder,
)
from omnistage.tiny.init import InitScale, reinit_weights_
from omnistage.tiny.spec import TinyArch, TinyBuildOptions
from omnistage.tiny.z_image import SIZES as Z_IMAGE_SIZES
from omnistage.tiny.z_image import ZImageSize, shared_components, with_overrides

# Dynamic (resolution-dependent) shift with the pipeline's own calculate_shift defaults.
OVIS_IMAGE_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

# Diffusers' default init leaves a tiny transformer nearly deaf to the prompt (512 or 256 text
# positions, mostly padding, against a few image tokens): two prompts moved 64x64 pixels by
# <= 0.006. Linear gain 1.5 (measured): <= 0.06 (Ovis) / 0.13 (LongCat), while the seed still
# dominates the image (mean change ~0.12); at 2.5 the seed stops mattering.
TRANSFORMER_INIT = InitScale(linear_gain=1.5)


@dataclass(frozen=True)
class TransformerShape:
    num_layers: int  # double-stream blocks
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int]  # sums to attention_head_dim


@dataclass(frozen=True)
class OvisImageSize:
    transformer: TransformerShape
    shared: ZImageSize  # text encoder and VAE shapes (Z-Image's: the same component classes)


SIZES: dict[str, OvisImageSize] = {
    "tiny": OvisImageSize(
        transformer=TransformerShape(num_layers=1, num_single_layers=1, num_attention_heads=2,
                                     attention_head_dim=16, axes_dims_rope=(4, 6, 6)),
        shared=Z_IMAGE_SIZES["tiny"],
    ),
}


def transformer_config(size: OvisImageSize) -> dict[str, Any]:
    channels = 4 * size.shared.vae.latent_channels  # 2x2 patches packed into channels
    return {
        **asdict(size.transformer),
        "patch_size": 1,
        "in_channels": channels,
        "out_channels": channels,
        "joint_attention_dim": size.shared.text.hidden_size,
    }


def build_components(options: TinyBuildOptions) -> dict[str, Any]:
    """OvisImagePipeline's components, in model_index order; deterministic for `options.seed`."""
    size = SIZES[options.size]
    size = replace(size, shared=with_overrides(size.shared, options.overrides))
    components = shared_components(options, size.shared, OVIS_IMAGE_SCHEDULER)
    with seeded(component_seed(options.seed, 0)):
        transformer = OvisImageTransformer2DModel(
            **deep_merge(transformer_config(size), options.overrides.get("transformer", {})))
    reinit_weights_(transformer, component_seed(options.seed, 4), TRANSFORMER_INIT)
    return dict(sorted({**components, "transformer": transformer}.items()))   # model_index order


def build(options: TinyBuildOptions) -> None:
    folder = PipelineFolder("OvisImagePipeline", build_components(options))
    write_pipeline_folder(folder, options.outdir, options.max_shard_size)


OVIS_IMAGE = TinyArch(name="ovis_image", sizes=tuple(SIZES), build=build)
