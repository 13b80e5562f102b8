"""Tiny random LongCat-Image checkpoints in diffusers format, built offline.

Two architectures share the components of meituan-longcat/LongCat-Image and differ only in the
pipeline class:
- `longcat_image`: LongCatImagePipeline (text to image).
- `longcat_image_edit`: LongCatImageEditPipeline (one input image), as LongCat-Image-Edit.

Folder: model_index.json, transformer/ (LongCatImageTransformer2DModel: Flux-style MMDiT,
double-stream then single-stream blocks over 2x2-packed latents), vae/ (AutoencoderKL,
Flux-style: 16 latent channels, which both pipelines hard-code; scaling 0.3611 / shift 0.1159),
text_encoder/ (Qwen2_5_VLForConditionalGeneration, vision tower included: the edit pipeline
shows it the input image), tokenizer/ (our offline BPE as Qwen2Tokenizer with Qwen2.5-VL's
special tokens), text_processor/ (the tokenizer + a Qwen2-VL image processor; see
`omnistage.tiny.qwen_image.build_vl_processor` for why its class is PaddleOCRVLProcessor, not
Qwen2VLProcessor) and scheduler/ (FlowMatchEulerDiscreteScheduler with dynamic shifting; the
pipelines' `calculate_shift` defaults are Flux's).

The text encoder, tokenizer and processor are Qwen-Image's tiny ones (`omnistage.tiny.qwen_image`:
the same classes). Size `tiny` (`count_parameters`): transformer ~0.03M (1 head x 16, rope axes
(4, 6, 6), 1 double + 1 single block, 64 in-channels = 16 x 2 x 2), VAE ~0.07M (channels
4/8/16/16, 1 layer per block, 16 latent channels), text encoder ~0.19M (64 wide x 2 layers + a
2-block 32-wide vision tower), vocab 512. `overrides` is nested per component, e.g.
{"transformer": {"num_single_layers": 2}, "text_encoder": {"text_config": {"num_hidden_layers": 3}}}.

Weights: diffusers' default init for the VAE; the transformer (see `TRANSFORMER_INIT`) and the
text encoder get `omnistage.tiny.init` scales, one seed per component.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    LongCatImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from omnistage.tiny.diffusers_folder import (
    PipelineFolder,
    component_seed,
    deep_merge,
    seeded,
    write_pipeline_folder,
)
from omnistage.tiny.init import InitScale, reinit_weights_
from omnistage.tiny.ovis_image import TRANSFORMER_INIT, TransformerShape  # the same Flux-style shapes
from omnistage.tiny.qwen_image import SIZES as QWEN_IMAGE_SIZES
from omnistage.tiny.qwen_image import (
    build_vl_processor,
    build_vl_tokenizer,
    text_encoder_config,
)
from omnistage.tiny.spec import TinyArch, TinyBuildOptions

LATENT_CHANNELS = 16  # both pipelines hard-code num_channels_latents = 16
# Dynamic (resolution-dependent) shift with the pipelines' own calculate_shift defaults.
LONGCAT_IMAGE_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
_VAE_SCALING, _VAE_SHIFT = 0.3611, 0.1159  # the Flux VAE's latent affine

@dataclass(frozen=True)
class VaeShape:
    block_out_channels: tuple[int, ...]  # len - 1 halvings: 4 -> 8x
    layers_per_block: int
    norm_num_groups: int  # divides every block width


@dataclass(frozen=True)
class LongCatImageSize:
    transformer: TransformerShape
    vae: VaeShape
    text_hidden_size: int  # = transformer joint_attention_dim / pooled_projection_dim


SIZES: dict[str, LongCatImageSize] = {
    "tiny": LongCatImageSize(
        # one head: the edit pipeline's sequences are ~9k tokens (the output and the input image
        # at ~1024x1024, + 512 text tokens), and attention is most of a tiny run's time
        transformer=TransformerShape(num_layers=1, num_single_layers=1, num_attention_heads=1,
                                     attention_head_dim=16, axes_dims_rope=(4, 6, 6)),
        vae=VaeShape(block_out_channels=(4, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
        text_hidden_size=QWEN_IMAGE_SIZES["tiny"].text.hidden_size,
    ),
}
PIPELINES = {"longcat_image": "LongCatImagePipeline", "longcat_image_edit": "LongCatImageEditPipeline"}


def transformer_config(size: LongCatImageSize) -> dict[str, Any]:
    return {
        **asdict(size.transformer),
        "patch_size": 1,
        "in_channels": 4 * LATENT_CHANNELS,  # 2x2 patches packed into channels
        "joint_attention_dim": size.text_hidden_size,
        "pooled_projection_dim": size.text_hidden_size,
    }


def vae_config(size: LongCatImageSize) -> dict[str, Any]:
    blocks = len(size.vae.block_out_channels)
    return {
        **asdict(size.vae),
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": LATENT_CHANNELS,
        "down_block_types": ["DownEncoderBlock2D"] * blocks,
        "up_block_types": ["UpDecoderBlock2D"] * blocks,
        "act_fn": "silu",
        # No attention in the VAE's middle block (the real one has it): the edit pipeline always
        # works at ~1024x1024, where a 16k-token attention would be most of a tiny run's time.
        "mid_block_add_attention": False,
        "sample_size": 1024,
        "scaling_factor": _VAE_SCALING,
        "shift_factor": _VAE_SHIFT,
        "force_upcast": True,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def build_components(options: TinyBuildOptions) -> dict[str, Any]:
    """The pipelines' components, in model_index order; deterministic for `options.seed`."""
    size, overrides = SIZES[options.size], options.overrides
    qwen_size = QWEN_IMAGE_SIZES[options.size]
    te_overrides = overrides.get("text_encoder", {})
    text_overrides = te_overrides.get("text_config", {})
    # The transformer's text width follows the text encoder's, overridden or not.
    size = replace(size, text_hidden_size=int(text_overrides.get("hidden_size", size.text_hidden_size)))
    tokenizer = build_vl_tokenizer(int(text_overrides.get("vocab_size", qwen_size.text.vocab_size)))

    with seeded(component_seed(options.seed, 0)):
        transformer = LongCatImageTransformer2DModel(
            **deep_merge(transformer_config(size), overrides.get("transformer", {})))
    reinit_weights_(transformer, component_seed(options.seed, 4), TRANSFORMER_INIT)
    with seeded(component_seed(options.seed, 1)):
        vae = AutoencoderKL(**deep_merge(vae_config(size), overrides.get("vae", {})))
    te_config = Qwen2_5_VLConfig(**deep_merge(text_encoder_config(qwen_size, tokenizer), te_overrides))
    with seeded(component_seed(options.seed, 2)):
        text_encoder = Qwen2_5_VLForConditionalGeneration(te_config).eval()
    reinit_weights_(text_encoder, component_seed(options.seed, 3), InitScale())
    scheduler = FlowMatchEulerDiscreteScheduler(
        **deep_merge(LONGCAT_IMAGE_SCHEDULER, overrides.get("scheduler", {})))
    return {
        "scheduler": scheduler,
        "text_encoder": text_encoder,
        "text_processor": build_vl_processor(tokenizer),
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
    }


def _builder(arch: str) -> TinyArch:
    def build(options: TinyBuildOptions) -> None:
        folder = PipelineFolder(PIPELINES[arch], build_components(options))
        write_pipeline_folder(folder, options.outdir, options.max_shard_size)

    return TinyArch(name=arch, sizes=tuple(SIZES), build=build)


LONGCAT_IMAGE = _builder("longcat_image")
LONGCAT_IMAGE_EDIT = _builder("longcat_image_edit")
