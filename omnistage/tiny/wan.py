"""Tiny random Wan2.2 video checkpoints in diffusers format, built offline.

- `wan`: WanPipeline shaped like Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts, `transformer`
  (high noise: timesteps >= boundary_ratio * 1000) and `transformer_2` (low noise), with
  `boundary_ratio` 0.875 in model_index.json.
- `wan_i2v`: WanImageToVideoPipeline shaped like Wan2.2-I2V-A14B-Diffusers: no image encoder
  (`image_encoder` / `image_processor` recorded as [null, null]), boundary_ratio 0.9, and
  experts that take the noise latents, the 4-channel first-frame mask and the encoded
  condition video: in_channels = 2 * z_dim + 4 (real 36 = 16 + 4 + 16).

Shared components: vae/ (AutoencoderKLWan, the Wan2.1 VAE: 4x temporal, 8x spatial
compression), text_encoder/ (UMT5EncoderModel), tokenizer/ (T5Tokenizer with a Unigram model,
see `build_umt5_tokenizer`), scheduler/ (UniPCMultistepScheduler with flow sigmas, flow_shift
3.0 as the -Diffusers repos ship it; Wan's own sample_shift is 12.0 for T2V-A14B, 5.0 for
I2V-A14B: pass another scheduler config through `overrides` to change it).

Size `tiny` (`count_parameters`): each expert 0.05M (2 layers of 2 heads x 16, ffn 64,
freq_dim 256), VAE 0.16M (base_dim 4, z_dim 4), UMT5 0.04M (32 wide x 2 layers, 2 heads of 16,
gated-GELU ffn 64), vocab 512. The pipelines need height/width multiples of 16 and
num_frames = 4k + 1 (e.g. 5 frames at 32x32).
`overrides` is nested per component: {"transformer": {...}, "transformer_2": {...}, "vae":
{...}, "text_encoder": {...}, "scheduler": {...}, "pipeline": {"boundary_ratio": 0.5}}.

Note: diffusers 0.42's WanImageToVideoPipeline runs every prompt through `ftfy.fix_text`
without checking that ftfy is installed (WanPipeline checks); without ftfy, pass
`prompt_embeds` / `negative_prompt_embeds` to it (the tests encode them with WanPipeline).

Weights: diffusers' default init for the experts and the VAE, transformers' T5 init for the
text encoder (T5 attention has no 1/sqrt(d) scale, so the Qwen-tuned gains would saturate it);
each component draws from its own seed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from omnistage.errors import InvalidRequestError
from omnistage.tiny.diffusers_folder import (
    PipelineFolder,
    component_seed,
    deep_merge,
    seeded,
    write_pipeline_folder,
)
from omnistage.tiny.spec import TinyArch, TinyBuildOptions
from omnistage.tiny.tokenizer import load_corpus

T5_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as T5/UMT5
# Wan-AI/Wan2.1-T2V-*-Diffusers scheduler_config.json (the Wan2.2 A14B repos ship the same).
WAN_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}
# The Wan2.1 VAE's latent statistics (16 channels); smaller z_dims take a prefix.
_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916)
I2V_MASK_CHANNELS = 4  # the first-frame mask, one channel per frame of a 4-frame latent step


@dataclass(frozen=True)
class WanSize:
    # each expert (WanTransformer3DModel)
    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    ffn_dim: int
    # vae (AutoencoderKLWan)
    vae_base_dim: int
    z_dim: int
    # text encoder (UMT5EncoderModel) and tokenizer
    vocab_size: int
    d_model: int  # = experts' text_dim
    d_kv: int
    d_ff: int
    t5_layers: int
    t5_heads: int


SIZES: dict[str, WanSize] = {
    "tiny": WanSize(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, vae_base_dim=4, z_dim=4,
                    vocab_size=512, d_model=32, d_kv=16, d_ff=64, t5_layers=2, t5_heads=2),
}


@dataclass(frozen=True)
class Variant:
    pipeline_class: str
    boundary_ratio: float  # expert switch: transformer for t >= ratio * 1000, transformer_2 below
    image_to_video: bool


VARIANTS: dict[str, Variant] = {
    "wan": Variant("WanPipeline", boundary_ratio=0.875, image_to_video=False),
    "wan_i2v": Variant("WanImageToVideoPipeline", boundary_ratio=0.9, image_to_video=True),
}


def build_umt5_tokenizer(vocab_size: int) -> T5Tokenizer:
    """A T5Tokenizer (Unigram model, as UMT5's SentencePiece) of `vocab_size` ids, learned offline.

    Why not `tokenizers`' UnigramTrainer: its EM runs in parallel and measurably returns
    different pieces from run to run. Instead the pieces come from a BPE trained on
    `corpus.txt` under T5's pre-tokenizer (whitespace split + "▁" metaspace; deterministic),
    and each piece's Unigram score is its log frequency when the corpus is tokenized with that
    BPE (add-one smoothed): one EM step of a unigram language model, a pure function of the text.
    Ids: <pad> 0, </s> 1, <unk> 2, then the pieces; characters absent from the corpus are <unk>,
    as in a SentencePiece model without byte fallback. The corpus yields at most ~4500 pieces.
    """
    metaspace = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(T5_SPECIAL_TOKENS), min_frequency=0,
                                  show_progress=False)
    lines = load_corpus().splitlines()
    bpe.train_from_iterator(lines, trainer=trainer)
    pieces = [piece for piece, _ in sorted(bpe.get_vocab().items(), key=lambda item: item[1])]
    reached = len(pieces) + len(T5_SPECIAL_TOKENS)
    if reached != vocab_size:
        # More: the corpus' characters alone exceed the request; fewer: the corpus ran out of merges.
        bound = f"at least {reached}" if reached > vocab_size else f"at most {reached}"
        raise InvalidRequestError(f"vocab_size {vocab_size} cannot be reached with the offline corpus: use {bound}",
                                  param="vocab_size")
    counts = Counter(token for encoding in bpe.encode_batch(lines) for token in encoding.tokens)
    total = sum(counts.values()) + len(pieces)
    scores = [(piece, math.log((counts[piece] + 1) / total)) for piece in pieces]
    vocab = [(token, 0.0) for token in T5_SPECIAL_TOKENS] + scores
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def expert_config(size: WanSize, variant: Variant) -> dict[str, Any]:
    in_channels = 2 * size.z_dim + I2V_MASK_CHANNELS if variant.image_to_video else size.z_dim
    return {
        "patch_size": [1, 2, 2],
        "num_attention_heads": size.num_attention_heads,
        "attention_head_dim": size.attention_head_dim,
        "in_channels": in_channels,
        "out_channels": size.z_dim,
        "text_dim": size.d_model,
        "freq_dim": 256,
        "ffn_dim": size.ffn_dim,
        "num_layers": size.num_layers,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": None,  # Wan2.2 A14B: no CLIP image embeddings
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
    }


def vae_config(size: WanSize) -> dict[str, Any]:
    return {
        "base_dim": size.vae_base_dim,
        "z_dim": size.z_dim,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "latents_mean": list(_LATENTS_MEAN[: size.z_dim]),
        "latents_std": list(_LATENTS_STD[: size.z_dim]),
    }


def text_encoder_config(size: WanSize, vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "d_model": size.d_model,
        "d_kv": size.d_kv,
        "d_ff": size.d_ff,
        "num_layers": size.t5_layers,
        "num_heads": size.t5_heads,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu",
        "layer_norm_epsilon": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "dtype": "float32",
    }


def build_components(options: TinyBuildOptions, variant: Variant) -> dict[str, Any]:
    """The pipeline's components, in model_index order; deterministic for `options.seed`."""
    size, overrides = SIZES[options.size], options.overrides
    # The experts' channels follow the VAE's and the text encoder's widths, overridden or not.
    size = replace(size, z_dim=int(overrides.get("vae", {}).get("z_dim", size.z_dim)),
                   d_model=int(overrides.get("text_encoder", {}).get("d_model", size.d_model)))
    tokenizer = build_umt5_tokenizer(int(overrides.get("text_encoder", {}).get("vocab_size", size.vocab_size)))
    experts = {}
    for index, name in enumerate(("transformer", "transformer_2")):
        with seeded(component_seed(options.seed, index)):
            experts[name] = WanTransformer3DModel(**deep_merge(expert_config(size, variant), overrides.get(name, {})))
    with seeded(component_seed(options.seed, 2)):
        vae = AutoencoderKLWan(**deep_merge(vae_config(size), overrides.get("vae", {})))
    # The embedding covers the tokenizer (real UMT5: 256384 rows for 256300 tokens).
    te_fields = deep_merge(text_encoder_config(size, len(tokenizer)), overrides.get("text_encoder", {}))
    with seeded(component_seed(options.seed, 3)):
        text_encoder = UMT5EncoderModel(UMT5Config(**te_fields)).eval()
    components: dict[str, Any] = {}
    if variant.image_to_video:
        components |= {"image_encoder": None, "image_processor": None}
    return components | {
        "scheduler": UniPCMultistepScheduler(**deep_merge(WAN_SCHEDULER, overrides.get("scheduler", {}))),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": experts["transformer"],
        "transformer_2": experts["transformer_2"],
        "vae": vae,
    }


def _builder(arch: str) -> TinyArch:
    variant = VARIANTS[arch]

    def build(options: TinyBuildOptions) -> None:
        pipeline_config = {"boundary_ratio": variant.boundary_ratio, "expand_timesteps": False}
        folder = PipelineFolder(
            variant.pipeline_class,
            build_components(options, variant),
            config=deep_merge(pipeline_config, options.overrides.get("pipeline", {})),
        )
        write_pipeline_folder(folder, options.outdir, options.max_shard_size)

    return TinyArch(name=arch, sizes=tuple(SIZES), build=build)


WAN = _builder("wan")
WAN_I2V = _builder("wan_i2v")
