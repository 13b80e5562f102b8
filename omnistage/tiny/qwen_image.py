"""Tiny random Qwen-Image family checkpoints in diffusers format, built offline.

Four architectures share the components of Qwen/Qwen-Image and differ in the pipeline and the
transformer/VAE flags:
- `qwen_image`: QwenImagePipeline (text to image).
- `qwen_image_edit`: QwenImageEditPipeline (one input image), as Qwen/Qwen-Image-Edit.
- `qwen_image_edit_plus`: QwenImageEditPlusPipeline (several input images), as Qwen-Image-Edit-2509.
- `qwen_image_layered`: QwenImageLayeredPipeline (RGBA image -> layers), as Qwen-Image-Layered:
  an RGBA VAE (4 input channels), layer-3D rope and the is-RGB timestep condition.

Folder: model_index.json, transformer/ (QwenImageTransformer2DModel), vae/
(AutoencoderKLQwenImage), text_encoder/ (Qwen2_5_VLForConditionalGeneration, vision tower
included), tokenizer/ (our offline byte-level BPE as Qwen2Tokenizer with Qwen2.5-VL's special
tokens), scheduler/ (FlowMatchEulerDiscreteScheduler with Qwen-Image's real config) and, for the
pipelines that read images, processor/ (see `build_vl_processor`).

Sizes (`count_parameters`): tiny (~0.3M) — transformer 0.09M (2 layers of 2 heads x 16,
patch 2, 16 in-channels = 4 latent channels x 2 x 2), VAE 0.04M (base_dim 2, z_dim 4: the edit
pipelines VAE-encode their inputs at ~1024x1024 and Layered at 640x640 whatever the input size,
and there the VAE's cost grows with its width: measured, base_dim 8 -> 2 halves an edit run),
text encoder 0.19M (64 wide x 2 layers + a 2-block 32-wide vision tower), vocab 512. Layered's
VAE has z_dim 8 (see `build_components`).
small — Qwen-Image-shaped at benchmark scale: transformer 76.9M (8 layers of 4 heads x 128, 64
in-channels, rope axes (16, 56, 56)), VAE 10.1M (base_dim 27, z_dim 16, dims x[1, 2, 4, 4]),
text encoder 45.3M (512 wide x 7 layers, GQA 8/2, vocab 32000, tied, + a 4-block 256-wide
vision tower of 5.1M). `overrides` is nested per component, e.g. {"transformer": {"num_layers":
3}, "text_encoder": {"text_config": {"num_hidden_layers": 1}}, "scheduler": {...}}.

Weights: diffusers' default init for the transformer and VAE (built under a per-component seed);
the text encoder gets `omnistage.tiny.init` scales so its hidden states depend on the context.
Note: the pipelines drop the first 34 (text) / 64 (edit) prompt-template tokens, counts of the
real Qwen tokenizer; our smaller vocabularies spend more on the templates (tiny 87 / 176 tokens,
small 59 / 114), so the template's tail stays in the prompt embeddings. Any code that mirrors
the pipelines (same drop counts) matches them exactly; only a real tokenizer drops exactly the
template.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from transformers import (
    PaddleOCRVLProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
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
from omnistage.tiny.tokenizer import ENDOFTEXT, IM_END, build_qwen_tokenizer

# Qwen/Qwen-Image scheduler/scheduler_config.json (dynamic, exponential time shift).
QWEN_IMAGE_SCHEDULER: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# Qwen-Image's VAE latent statistics (16 channels); smaller z_dims take a prefix, so the
# pipeline's (de)normalisation stays non-trivial.
_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916)
ROPE_THETA = 1e6

# Qwen2.5-VL's special tokens after <|im_end|>, in the real order (real ids 151646..151656).
VL_SPECIAL_TOKENS = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# `tokenizer.image_token` / `.image_token_id`: what Qwen2-VL-style processors read.
VL_NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
# The real Qwen-Image-Edit processor/preprocessor_config.json values (CLIP statistics).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MIN_PIXELS, _MAX_PIXELS = 56 * 56, 28 * 28 * 16384


@dataclass(frozen=True)
class TransformerShape:
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int]  # sums to attention_head_dim


@dataclass(frozen=True)
class VaeShape:
    base_dim: int
    z_dim: int  # latent channels; the transformer sees z_dim * 4 (2x2 patches)
    num_res_blocks: int


@dataclass(frozen=True)
class TextEncoderShape:
    """Qwen2.5-VL: text decoder (its last hidden state is the prompt embedding) + vision tower."""

    vocab_size: int
    hidden_size: int  # = transformer joint_attention_dim
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2 (head_dim = hidden / heads)
    vision_hidden_size: int
    vision_depth: int
    vision_num_heads: int
    vision_intermediate_size: int
    vision_fullatt_block_indexes: tuple[int, ...]  # the other blocks use window attention


@dataclass(frozen=True)
class QwenImageSize:
    transformer: TransformerShape
    vae: VaeShape
    text: TextEncoderShape


SIZES: dict[str, QwenImageSize] = {
    "tiny": QwenImageSize(
        transformer=TransformerShape(num_layers=2, num_attention_heads=2, attention_head_dim=16,
                                     axes_dims_rope=(4, 6, 6)),
        vae=VaeShape(base_dim=8, z_dim=4, num_res_blocks=1),
        text=TextEncoderShape(512, 64, 128, 2, 4, 2, (2, 3, 3), 32, 2, 2, 64, (1,)),
    ),
    "small": QwenImageSize(
        transformer=TransformerShape(num_layers=8, num_attention_heads=4, attention_head_dim=128,
                                     axes_dims_rope=(16, 56, 56)),
        vae=VaeShape(base_dim=27, z_dim=16, num_res_blocks=2),
        text=TextEncoderShape(32000, 512, 1792, 7, 8, 2, (8, 12, 12), 256, 4, 4, 688, (1, 3)),
    ),
}


@dataclass(frozen=True)
class Variant:
    """What distinguishes one Qwen-Image pipeline's folder from another's."""

    pipeline_class: str
    with_processor: bool  # the pipeline reads images through a Qwen2-VL processor
    vae_input_channels: int = 3  # 4: RGBA (Layered)
    layered: bool = False  # transformer: layer-3D rope + additional (is-RGB) timestep condition


VARIANTS: dict[str, Variant] = {
    "qwen_image": Variant("QwenImagePipeline", with_processor=False),
    "qwen_image_edit": Variant("QwenImageEditPipeline", with_processor=True),
    "qwen_image_edit_plus": Variant("QwenImageEditPlusPipeline", with_processor=True),
    "qwen_image_layered": Variant("QwenImageLayeredPipeline", with_processor=True, vae_input_channels=4,
                                  layered=True),
}


def build_vl_tokenizer(vocab_size: int) -> Qwen2Tokenizer:
    """Our offline BPE with Qwen2.5-VL's special tokens, in the real order after <|im_end|>."""
    return build_qwen_tokenizer(vocab_size, VL_SPECIAL_TOKENS, model_max_length=32768, named_tokens=VL_NAMED_TOKENS)


def build_vl_processor(tokenizer: Qwen2Tokenizer) -> PaddleOCRVLProcessor:
    """processor/: the tokenizer + a Qwen2-VL image processor (PIL backend), as the real folder.

    Why not `Qwen2VLProcessor`, the class the real model_index.json names: in transformers 5 it
    always loads a video processor, and that class needs torchvision (not installed here), so
    neither its constructor nor `from_pretrained` works. `PaddleOCRVLProcessor` is the same
    image path (an AutoImageProcessor + AutoTokenizer; each `tokenizer.image_token` repeated
    grid_t * grid_h * grid_w / merge_size**2 times) without a video processor, and loads from
    the same files: preprocessor_config.json (image_processor_type Qwen2VLImageProcessor) and
    the tokenizer files.
    """
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=list(_CLIP_MEAN),
        image_std=list(_CLIP_STD),
    )
    return PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def transformer_config(size: QwenImageSize, variant: Variant) -> dict[str, Any]:
    shape = size.transformer
    return {
        **asdict(shape),
        "patch_size": 2,
        "in_channels": 4 * size.vae.z_dim,
        "out_channels": size.vae.z_dim,
        "joint_attention_dim": size.text.hidden_size,
        "guidance_embeds": False,
        "zero_cond_t": False,
        "use_additional_t_cond": variant.layered,
        "use_layer3d_rope": variant.layered,
    }


def vae_config(size: QwenImageSize, variant: Variant) -> dict[str, Any]:
    z_dim = size.vae.z_dim
    return {
        **asdict(size.vae),
        "dim_mult": [1, 2, 4, 4],
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "input_channels": variant.vae_input_channels,
        "latents_mean": list(_LATENTS_MEAN[:z_dim]),
        "latents_std": list(_LATENTS_STD[:z_dim]),
    }


def text_encoder_config(size: QwenImageSize, tokenizer: Qwen2Tokenizer) -> dict[str, Any]:
    text = size.text
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (ENDOFTEXT, IM_END)}
    return {
        "dtype": "float32",
        "tie_word_embeddings": True,
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        "text_config": {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": text.num_key_value_heads,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                "mrope_section": list(text.mrope_section)},
            "tie_word_embeddings": True,
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
        },
        "vision_config": {
            "hidden_size": text.vision_hidden_size,
            "depth": text.vision_depth,
            "num_heads": text.vision_num_heads,
            "intermediate_size": text.vision_intermediate_size,
            "fullatt_block_indexes": list(text.vision_fullatt_block_indexes),
            "out_hidden_size": text.hidden_size,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "in_channels": 3,
            "hidden_act": "silu",
        },
    }


def build_components(options: TinyBuildOptions, variant: Variant) -> dict[str, Any]:
    """The pipeline's components, in model_index order; deterministic for `options.seed`."""
    size, overrides = SIZES[options.size], options.overrides
    z_dim = int(overrides.get("vae", {}).get("z_dim", size.vae.z_dim))
    if z_dim == variant.vae_input_channels:
        # The pipelines take an image tensor with z_dim channels for latents already; an RGBA
        # (4-channel) pipeline with z_dim 4 would skip encoding its input. Twice as many: 8.
        z_dim *= 2
    size = replace(size, vae=replace(size.vae, z_dim=z_dim))  # the transformer's channels follow
    text_overrides = overrides.get("text_encoder", {}).get("text_config", {})
    tokenizer = build_vl_tokenizer(int(text_overrides.get("vocab_size", size.text.vocab_size)))

    with seeded(component_seed(options.seed, 0)):
        transformer = QwenImageTransformer2DModel(
            **deep_merge(transformer_config(size, variant), overrides.get("transformer", {})))
    with seeded(component_seed(options.seed, 1)):
        vae_fields = deep_merge(vae_config(size, variant), overrides.get("vae", {})) | {"z_dim": z_dim}
        vae = AutoencoderKLQwenImage(**vae_fields)
    te_config = Qwen2_5_VLConfig(
        **deep_merge(text_encoder_config(size, tokenizer), overrides.get("text_encoder", {})))
    with seeded(component_seed(options.seed, 2)):
        text_encoder = Qwen2_5_VLForConditionalGeneration(te_config).eval()
    reinit_weights_(text_encoder, component_seed(options.seed, 3), InitScale())
    scheduler = FlowMatchEulerDiscreteScheduler(**deep_merge(QWEN_IMAGE_SCHEDULER, overrides.get("scheduler", {})))

    components: dict[str, Any] = {
        "scheduler": scheduler,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
    }
    if variant.with_processor:
        components["processor"] = build_vl_processor(tokenizer)
    return components


def _builder(arch: str) -> TinyArch:
    variant = VARIANTS[arch]

    def build(options: TinyBuildOptions) -> None:
        folder = PipelineFolder(variant.pipeline_class, build_components(options, variant))
        write_pipeline_folder(folder, options.outdir, options.max_shard_size)

    return TinyArch(name=arch, sizes=tuple(SIZES), build=build)


QWEN_IMAGE = _builder("qwen_image")
QWEN_IMAGE_EDIT = _builder("qwen_image_edit")
QWEN_IMAGE_EDIT_PLUS = _builder("qwen_image_edit_plus")
QWEN_IMAGE_LAYERED = _builder("qwen_image_layered")
