"""Tiny random Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`) checkpoints, built offline.

Writes the layout of Qwen/Qwen3-Omni-30B-A3B-Instruct: config.json (thinker: MoE text model +
AuT audio encoder + vision encoder with DeepStack; talker: MoE decoder with a shared expert,
text/hidden projections, codec head and the multi-codebook code predictor; code2wav;
enable_audio_output), model.safetensors (the real tensor names, experts one by one:
thinker.model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, talker.*, code2wav.*),
generation_config.json (thinker EOS; the talker's defaults as `talker_*` keys), the tokenizer
(omnistage.tiny.qwen3_omni_files), processor configs and chat_template.json. The voices live in
talker_config.speaker_id ({"ethan": id, ...}, codec ids). Same (size, overrides, seed) ->
identical bytes. `overrides` is nested like config.json and deep-merged; `enable_audio_output:
false` writes a Thinking/Captioner-like folder (text only: no talker, no code2wav).

Codec ids, as the real ones sit above the 2048-entry codebook in a 3072 vocabulary (pad 2148,
bos 2149, eos 2150, nothink 2155, think bos/eos 2156/2157, speakers 2301..2303): codebook C,
talker vocab C + 1024 (transformers' generate suppresses the top 1024 ids but EOS), specials
at C + 100.. as above. tiny C = 64; small the real ids.

Config fields transformers reads but does not declare are written as the real config.json has
them: talker_config.spatial_merge_size, thinker_config.vision_start_token_id.

Sizes (`count_parameters`): tiny ~0.6M (text 64 wide, 2 layers, 4 experts top-2; talker 32
wide, 2 layers, 4 experts top-2 + shared; code predictor 1 layer; code2wav 32 wide); small
~150M (text 512 wide, 8 layers, 8 experts top-2, vocab 32000; audio 4 layers of 256; vision 4
blocks of 256, DeepStack at 1..3; talker 384 wide, 4 layers, 8 experts top-2 + shared; code
predictor 3 layers of 384 (the talker's width: it reads the talker's states), 16 code groups;
code2wav 256 wide, 4 layers). 12.5 Hz codes (1920
samples per frame at 24 kHz), as the real model.

Weights: `omnistage.tiny.init` scales for every linear, embedding and norm; MoE experts and
routers at the same gains (a router's top-k gaps far above float noise, so every engine picks
the same experts); convolutions N(0, gain / sqrt(fan_in)); code2wav's LayerScale and ConvNeXt
gains raised from their near-zero init so each part matters, and its last convolution
calibrated to a zero-mean waveform of RMS 0.1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omnistage.tiny.init import InitScale, reinit_convs_, reinit_weights_
from omnistage.tiny.qwen2_5_omni import _deep_merge
from omnistage.tiny.qwen3_omni_files import (SPEAKERS, Qwen3OmniTokenIds, Qwen3TalkerDefaults,
                                             build_qwen3_omni_tokenizer, generation_config,
                                             write_processor_files)
from omnistage.tiny.spec import TinyArch, TinyBuildOptions, prepare_outdir

ROPE_THETA = 1e6
MEL_BINS = 128
POSITIONS_PER_SECOND = 13      # thinker/talker position_id_per_seconds (the real configs')


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE decoder (thinker text_config / talker text_config)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    mrope_section: tuple[int, int, int]    # sums to head_dim / 2
    max_position_embeddings: int = 32768   # (a tiny one keeps its KV pool, and start-up, small)


@dataclass(frozen=True)
class Qwen3OmniSize:
    text: MoeShape
    accept_hidden_layer: int        # the thinker layer whose output the talker reads
    audio: dict[str, int]           # audio_config fields
    vision: dict[str, Any]          # vision_config fields
    talker: MoeShape
    shared_expert_size: int
    codebook: int                   # code2wav codebook = code predictor vocab
    predictor: dict[str, int]       # code_predictor_config fields (hidden_size = the talker's)
    code2wav: dict[str, Any]
    talker_defaults: Qwen3TalkerDefaults


SIZES: dict[str, Qwen3OmniSize] = {
    "tiny": Qwen3OmniSize(
        text=MoeShape(640, 64, 2, 4, 2, 16, 32, 4, 2, (2, 3, 3), 4096),
        accept_hidden_layer=1,
        audio={"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
               "downsample_hidden_size": 16},
        vision={"hidden_size": 32, "depth": 2, "num_heads": 2, "intermediate_size": 64,
                "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        talker=MoeShape(64 + 1024, 32, 2, 4, 2, 16, 32, 4, 2, (2, 3, 3), 4096),
        shared_expert_size=32,
        codebook=64,
        predictor={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
        code2wav={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "intermediate_size": 64, "decoder_dim": 64},
        talker_defaults=Qwen3TalkerDefaults(max_new_tokens=40, min_new_tokens=16),
    ),
    "small": Qwen3OmniSize(
        text=MoeShape(32000, 512, 8, 8, 2, 64, 512, 8, 2, (8, 12, 12)),
        accept_hidden_layer=4,
        audio={"d_model": 256, "encoder_layers": 4, "encoder_attention_heads": 4, "encoder_ffn_dim": 1024,
               "downsample_hidden_size": 64},
        vision={"hidden_size": 256, "depth": 4, "num_heads": 4, "intermediate_size": 688,
                "num_position_embeddings": 576, "deepstack_visual_indexes": [1, 2, 3]},
        talker=MoeShape(2048 + 1024, 384, 4, 6, 2, 64, 384, 8, 2, (8, 12, 12)),
        shared_expert_size=384,
        codebook=2048,
        predictor={"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 3,
                   "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
        code2wav={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "intermediate_size": 768, "decoder_dim": 256},
        talker_defaults=Qwen3TalkerDefaults(max_new_tokens=75),
    ),
}


def _moe_fields(shape: MoeShape) -> dict[str, Any]:
    fields = {k: v for k, v in asdict(shape).items() if k not in ("mrope_section", "max_position_embeddings")}
    return {**fields, "intermediate_size": 2 * shape.moe_intermediate_size, "rms_norm_eps": 1e-6,
            "max_position_embeddings": shape.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                                "mrope_section": list(shape.mrope_section), "interleaved": True}}


def _codec_ids(codebook: int) -> dict[str, Any]:
    """The talker's codec specials, placed above the codebook as the real ones."""
    return {"codec_pad_id": codebook + 100, "codec_bos_id": codebook + 101,
            "codec_eos_token_id": codebook + 102, "codec_nothink_id": codebook + 107,
            "codec_think_bos_id": codebook + 108, "codec_think_eos_id": codebook + 109,
            "speaker_id": {name.lower(): codebook + 253 + i for i, name in enumerate(SPEAKERS)}}


def config_dict(size: Qwen3OmniSize, ids: Qwen3OmniTokenIds) -> dict[str, Any]:
    """The Qwen3OmniMoeConfig fields of `size`, nested like config.json (before overrides)."""
    text, talker = size.text, size.talker
    mm = {"audio_token_id": ids.audio, "image_token_id": ids.image, "video_token_id": ids.video,
          "vision_start_token_id": ids.vision_start, "audio_start_token_id": ids.audio_start,
          "position_id_per_seconds": POSITIONS_PER_SECOND}
    return {
        "enable_audio_output": True, "dtype": "float32",
        "im_start_token_id": ids.im_start, "im_end_token_id": ids.im_end,
        "tts_pad_token_id": ids.tts_pad, "tts_bos_token_id": ids.tts_bos, "tts_eos_token_id": ids.tts_eos,
        "system_token_id": ids.system, "user_token_id": ids.user, "assistant_token_id": ids.assistant,
        "thinker_config": {
            **mm, "user_token_id": ids.user, "tie_word_embeddings": False,
            "text_config": {**_moe_fields(text), "norm_topk_prob": True, "tie_word_embeddings": False},
            "audio_config": {**size.audio, "num_mel_bins": MEL_BINS, "output_dim": text.hidden_size,
                             "n_window": 50, "n_window_infer": 800, "max_source_positions": 1500},
            "vision_config": {**size.vision, "out_hidden_size": text.hidden_size, "patch_size": 16,
                              "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
                              "hidden_act": "gelu_pytorch_tanh"},
        },
        "talker_config": {
            **mm, **_codec_ids(size.codebook), "num_code_groups": 16,
            "thinker_hidden_size": text.hidden_size, "accept_hidden_layer": size.accept_hidden_layer,
            "spatial_merge_size": 2,
            "text_config": {**_moe_fields(talker), "norm_topk_prob": False,
                            "shared_expert_intermediate_size": size.shared_expert_size},
            "code_predictor_config": {**size.predictor, "vocab_size": size.codebook, "num_code_groups": 16,
                                      "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}},
        },
        "code2wav_config": {**size.code2wav, "codebook_size": size.codebook, "num_quantizers": 16,
                            "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    }


def make_config(size: str, overrides: Mapping[str, Any], ids: Qwen3OmniTokenIds) -> Qwen3OmniMoeConfig:
    return Qwen3OmniMoeConfig(**_deep_merge(config_dict(SIZES[size], ids), overrides))


def count_parameters(config: Qwen3OmniMoeConfig) -> dict[str, int]:
    """Parameters per part, counted on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    th = model.thinker
    parts = {"thinker_text": [th.model.language_model, th.lm_head], "audio_tower": [th.model.audio_tower],
             "vision_tower": [th.model.visual]}
    if config.enable_audio_output:
        parts |= {"talker": [model.talker.model, model.talker.codec_head, model.talker.text_projection,
                             model.talker.hidden_projection],
                  "code_predictor": [model.talker.code_predictor], "code2wav": [model.code2wav]}
    counts = {name: sum(p.numel() for m in mods for p in m.parameters()) for name, mods in parts.items()}
    counts["total"] = sum(p.numel() for p in model.parameters())
    return counts


CONV_GAIN = 1.0
CODE2WAV_CONV_GAIN = 0.75      # the decoder's eight upsampling convolutions neither die nor saturate
CODE2WAV_SCALE = InitScale(embedding_gain=1.0, linear_gain=1.0, bias_std=0.02, norm_jitter=0.1)
LAYER_SCALE = 0.3              # code2wav LayerScale / ConvNeXt gamma (HF init: 0.01 / 1e-6)
WAVEFORM_RMS = 0.1


@torch.no_grad()
def _reinit_moe_(module: nn.Module, gen: torch.Generator, gain: float) -> None:
    """Experts stored as 3-D parameters and routers (not nn.Linear): N(0, gain / sqrt(fan_in))."""
    for sub in module.modules():
        name = type(sub).__name__
        if name.endswith("Experts"):
            for param in (sub.gate_up_proj, sub.down_proj):        # (E, out, in)
                param.copy_(torch.randn(param.shape, generator=gen) * gain / param.shape[-1] ** 0.5)
        elif name.endswith("TopKRouter"):
            sub.weight.copy_(torch.randn(sub.weight.shape, generator=gen) * gain / sub.weight.shape[-1] ** 0.5)


@torch.no_grad()
def _reinit_code2wav_(code2wav: nn.Module, seed: int) -> None:
    reinit_weights_(code2wav, seed, CODE2WAV_SCALE)
    gen = torch.Generator().manual_seed(seed + 1)
    reinit_convs_(code2wav, gen, CODE2WAV_CONV_GAIN, CODE2WAV_SCALE.bias_std)
    for sub in code2wav.modules():
        name = type(sub).__name__
        if name.endswith("LayerScale"):
            sub.scale.copy_(LAYER_SCALE * (1 + 0.1 * torch.randn(sub.scale.shape, generator=gen)))
        elif name.endswith("ConvNeXtBlock"):
            sub.gamma.copy_(LAYER_SCALE * (1 + 0.1 * torch.randn(sub.gamma.shape, generator=gen)))
    # The last convolution: taps summing to zero per channel (no DC offset from SnakeBeta's
    # positive bias), scaled to a waveform of RMS WAVEFORM_RMS on random codes.
    last = code2wav.decoder[-1].conv
    last.weight.sub_(last.weight.mean(dim=-1, keepdim=True))
    if last.bias is not None:
        last.bias.zero_()
    cfg = code2wav.config
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 24), generator=gen)
    captured: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        code2wav(codes)
    finally:
        handle.remove()
    last.weight.mul_(WAVEFORM_RMS / captured[0].pow(2).mean().sqrt().clamp_min(1e-12))


@torch.no_grad()
def reinit_qwen3_omni_(model: Qwen3OmniMoeForConditionalGeneration, seed: int) -> None:
    """Deterministic weights for `seed`; each part draws from its own seeds (16 * seed + k)."""
    parts = [model.thinker] + ([model.talker] if model.has_talker else [])
    for index, part in enumerate(parts):
        reinit_weights_(part, 16 * seed + index, InitScale())
        gen = torch.Generator().manual_seed(16 * seed + 4 + index)
        reinit_convs_(part, gen, CONV_GAIN, InitScale().bias_std)
        _reinit_moe_(part, gen, InitScale().linear_gain)
    if model.has_talker:
        _reinit_code2wav_(model.code2wav, 16 * seed + 8)


def build(options: TinyBuildOptions) -> None:
    size = SIZES[options.size]
    thinker = options.overrides.get("thinker_config", {})
    text_overrides = thinker.get("text_config", {}) if isinstance(thinker, Mapping) else {}
    vocab_size = int(text_overrides.get("vocab_size", size.text.vocab_size))
    tokenizer, ids = build_qwen3_omni_tokenizer(vocab_size, model_max_length=32768)
    config = make_config(options.size, options.overrides, ids)
    with torch.random.fork_rng(devices=[]):          # seeding must not disturb the caller's RNG
        torch.manual_seed(options.seed)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    reinit_qwen3_omni_(model, options.seed)
    codec_eos = config.talker_config.codec_eos_token_id
    model.generation_config = generation_config(ids, codec_eos, size.talker_defaults)
    prepare_outdir(options.outdir)
    model.save_pretrained(options.outdir, max_shard_size=options.max_shard_size)
    tokenizer.save_pretrained(options.outdir, save_jinja_files=False)
    write_processor_files(options.outdir)


QWEN3_OMNI = TinyArch(name="qwen3_omni", sizes=tuple(SIZES), build=build)
