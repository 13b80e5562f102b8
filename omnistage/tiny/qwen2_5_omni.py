"""Tiny random Qwen2.5-Omni (`Qwen2_5OmniForConditionalGeneration`) checkpoints, built offline.

Writes the layout of Qwen/Qwen2.5-Omni-3B/-7B: config.json (thinker: text + audio + vision;
talker; token2wav: DiT + BigVGAN; enable_audio_output), model.safetensors (shards + index above
`max_shard_size`; the real tensor names: thinker.model.*, thinker.audio_tower.*, thinker.visual.*,
talker.*, token2wav.code2wav_{dit,bigvgan}_model.*), generation_config.json, spk_dict.pt, the
tokenizer, processor configs and chat_template.json (see `omnistage.tiny.omni_files`). Same
(size, overrides, seed) -> identical bytes. `overrides` is nested like config.json and
deep-merged, e.g. {"thinker_config": {"text_config": {"num_hidden_layers": 3}}}; an untied
lm_head needs {"thinker_config": {"tie_word_embeddings": False, "text_config": {...: False}}}.

Ids. The thinker vocab is exactly the tokenizer; from its first added id B (real: 151643):
endoftext B, im_start B+1, im_end B+2 (eos), AUDIO B+3, audio_bos B+4, audio_eos B+5,
vision_bos B+9, vision_eos B+10, vision_pad B+11, IMAGE B+12, VIDEO B+13. The thinker *and*
talker configs carry these (the talker's 3D rope index reads thinker ids). Talker
tts_text_pad/start/end = <|tts_pad|>/<|tts_bos|>/<|tts_eos|> (B+22..24) and the speakers' text
bos <|tts_bos_chelsie|>/<|tts_bos_ethan|> (B+25, B+26) are real thinker tokens. Codec ids sit
above the codebook as the real 8292/8293/8294/8296 sit above 8192 codes: tiny 128 codes, pad
132, start 133, end 134, mask 136, talker vocab 144; small the real ids and vocab 8448. DiT
`num_embeds` = talker vocab (real 8193 < 8448): a random talker may emit any id.

Talker EOS = [codec pad, codec end] (tiny [132, 134]), as the real [8292, 8294] that HF's
`generate(talker_eos_token_id=...)` defaults to; HF does not read it from the config, so it is
written with the talker's other defaults as `talker_*` keys of generation_config.json, named
like `generate`'s keywords: `model.generate(ids, **talker_keys)` works. Measured: with these
weights the sampled talker (top-k 40) almost never draws EOS, so audio lasts
`talker_max_new_tokens` codes (50 codes = 1 s): tiny 64 (1.28 s), small 300 (6 s, the benchmark
anchor); `talker_min_new_tokens` (24 / 50) guards against the early EOS of other weights.

Sizes (`count_parameters`): tiny 0.58M: text 64 wide, 2 layers, 4/2 heads of 16 (GQA), mrope
[2, 3, 3] (sums to head_dim/2), vocab 512, tied; audio 2 layers of 32; vision 2 blocks of 32
(block 0 windowed, 1 full: fullatt_block_indexes [1]); talker 2 layers of 32, 4/2 heads of 16;
DiT 3 blocks of 32 (0 looks back, 1 ahead, 2 local); BigVGAN 64 channels (the least for six
halvings). small 92.9M: text 57.3M (512 wide, 12 layers, 8/2 heads of 64, inter 1792, vocab
32000, tied); audio 4.4M (5 layers of 256); vision 5.1M (4 blocks of 256, full at 1 and 3);
talker 17.2M (6 layers of 384, 6/2 heads of 64); DiT 7.1M (6 blocks of 256); BigVGAN 1.9M (192).
Both keep the real 128 mel bins, n_window 100, patch 14 x 2 frames, merge 2, window 112, DiT
block 24 and repeats 2, mel_dim 80, BigVGAN rates/kernels (240 samples per mel frame, 24 kHz).

Weights: `omnistage.tiny.init` scales for thinker and talker (greedy top-2 logit gaps far
above float noise); convolutions N(0, gain / sqrt(fan_in)); the DiT at gain 1 with its output
bias at a speech log-mel level; BigVGAN calibrated to a zero-mean waveform of RMS 0.1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

from omnistage.tiny.init import InitScale, reinit_convs_, reinit_weights_
from omnistage.tiny.omni_files import (
    SPEAKERS,
    OmniTokenIds,
    TalkerDefaults,
    build_omni_tokenizer,
    generation_config,
    make_speakers,
    write_processor_files,
    write_speakers,
)
from omnistage.tiny.spec import TinyArch, TinyBuildOptions, prepare_outdir

MEL_BINS = 128  # Whisper features of the audio tower (preprocessor feature_size)
MEL_DIM = 80  # DiT / BigVGAN mel channels
ROPE_THETA = 1e6


@dataclass(frozen=True)
class TextShape:
    """thinker_config.text_config (Qwen2-style decoder with 3D mrope)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    max_position_embeddings: int


@dataclass(frozen=True)
class AudioShape:
    """thinker_config.audio_config (Whisper-style encoder); output_dim = text hidden size."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int


@dataclass(frozen=True)
class VisionShape:
    """thinker_config.vision_config (Qwen2.5-VL ViT); out_hidden_size = text hidden size."""

    hidden_size: int
    depth: int
    num_heads: int
    intermediate_size: int
    fullatt_block_indexes: tuple[int, ...]  # the other blocks use window attention


@dataclass(frozen=True)
class TalkerShape:
    """talker_config; embedding_size = text hidden size."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]
    tts_codec_pad_token_id: int
    tts_codec_start_token_id: int
    tts_codec_end_token_id: int
    tts_codec_mask_token_id: int


@dataclass(frozen=True)
class DiTShape:
    """token2wav_config.dit_config; num_embeds = talker vocab."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    emb_dim: int
    look_ahead_layers: tuple[int, ...]
    look_backward_layers: tuple[int, ...]
    enc_emb_dim: int  # speaker `cond` width
    enc_dim: int
    enc_channels: tuple[int, ...]  # last = sum of the middle ones (ECAPA feature aggregation)
    enc_attention_channels: int
    enc_se_channels: int


@dataclass(frozen=True)
class OmniSize:
    text: TextShape
    audio: AudioShape
    vision: VisionShape
    talker: TalkerShape
    dit: DiTShape
    bigvgan_channels: int  # upsample_initial_channel, >= 64 (six halvings)
    talker_defaults: TalkerDefaults
    ref_mel_frames: int  # speakers' ref_mel length


SIZES: dict[str, OmniSize] = {
    "tiny": OmniSize(
        text=TextShape(512, 64, 128, 2, 4, 2, 16, (2, 3, 3), 4096),
        audio=AudioShape(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64),
        vision=VisionShape(hidden_size=32, depth=2, num_heads=2, intermediate_size=64, fullatt_block_indexes=(1,)),
        talker=TalkerShape(144, 32, 64, 2, 4, 2, 16, (2, 3, 3), 132, 133, 134, 136),
        dit=DiTShape(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16, emb_dim=16,
                     look_ahead_layers=(1,), look_backward_layers=(0,), enc_emb_dim=16, enc_dim=16,
                     enc_channels=(16, 16, 16, 16, 48), enc_attention_channels=8, enc_se_channels=8),
        bigvgan_channels=64,
        talker_defaults=TalkerDefaults(max_new_tokens=64, min_new_tokens=24),
        ref_mel_frames=32,
    ),
    "small": OmniSize(
        text=TextShape(32000, 512, 1792, 12, 8, 2, 64, (8, 12, 12), 32768),
        audio=AudioShape(d_model=256, encoder_layers=5, encoder_attention_heads=4, encoder_ffn_dim=1024),
        vision=VisionShape(hidden_size=256, depth=4, num_heads=4, intermediate_size=688,
                           fullatt_block_indexes=(1, 3)),
        talker=TalkerShape(8448, 384, 1024, 6, 6, 2, 64, (8, 12, 12), 8292, 8293, 8294, 8296),
        dit=DiTShape(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=64, emb_dim=64,
                     look_ahead_layers=(3,), look_backward_layers=(0, 5), enc_emb_dim=192, enc_dim=128,
                     enc_channels=(128, 128, 128, 128, 384), enc_attention_channels=64, enc_se_channels=64),
        bigvgan_channels=192,
        talker_defaults=TalkerDefaults(max_new_tokens=300, min_new_tokens=50),
        ref_mel_frames=128,
    ),
}


def _mrope(section: tuple[int, int, int]) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": list(section)}


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_dict(size: OmniSize, ids: OmniTokenIds) -> dict[str, Any]:
    """The Qwen2_5OmniConfig fields of `size`, nested like config.json (before overrides)."""
    text, talker, dit = size.text, size.talker, size.dit
    # Multimodal ids, read by the thinker (embedding merge, rope index) and the talker (rope index).
    mm_ids = {
        "audio_token_index": ids.audio, "image_token_index": ids.image, "video_token_index": ids.video,
        "audio_start_token_id": ids.audio_bos, "audio_end_token_id": ids.audio_eos,
        "vision_start_token_id": ids.vision_bos, "vision_end_token_id": ids.vision_eos,
    }
    text_fields = {k: v for k, v in asdict(text).items() if k != "mrope_section"}
    talker_fields = {k: v for k, v in asdict(talker).items() if k != "mrope_section"}
    return {
        "enable_audio_output": True,
        "dtype": "float32",
        "thinker_config": {
            **mm_ids,
            "vision_token_id": ids.vision_pad,
            "user_token_id": ids.user,
            "bos_token_id": ids.im_start,  # as the real thinker config
            "eos_token_id": ids.im_end,
            "pad_token_id": ids.endoftext,
            "tie_word_embeddings": True,
            "text_config": {**text_fields, "rope_parameters": _mrope(text.mrope_section),
                            "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
            "audio_config": {**asdict(size.audio), "num_mel_bins": MEL_BINS, "output_dim": text.hidden_size,
                             "n_window": 100, "max_source_positions": 1500},
            "vision_config": {**asdict(size.vision), "out_hidden_size": text.hidden_size, "patch_size": 14,
                              "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
                              "in_channels": 3, "hidden_act": "silu"},
        },
        "talker_config": {
            **mm_ids,
            **talker_fields,
            "embedding_size": text.hidden_size,
            "rope_parameters": _mrope(talker.mrope_section),
            "max_position_embeddings": text.max_position_embeddings,
            "tts_text_pad_token_id": ids.tts_pad,
            "tts_text_start_token_id": ids.tts_bos,
            "tts_text_end_token_id": ids.tts_eos,
        },
        "token2wav_config": {
            "dit_config": {**asdict(dit), "num_embeds": talker.vocab_size, "mel_dim": MEL_DIM, "block_size": 24,
                           "repeats": 2, "ff_mult": 2, "enc_kernel_sizes": [5, 3, 3, 3, 1],
                           "enc_dilations": [1, 2, 3, 4, 1], "enc_res2net_scale": 2},
            "bigvgan_config": {"mel_dim": MEL_DIM, "upsample_initial_channel": size.bigvgan_channels},
        },
    }


def make_config(size: str, overrides: Mapping[str, Any], ids: OmniTokenIds) -> Qwen2_5OmniConfig:
    """Qwen2_5OmniConfig of `size` with `overrides` (nested like config.json) deep-merged in."""
    fields = _deep_merge(config_dict(SIZES[size], ids), overrides)
    return Qwen2_5OmniConfig(**fields)


def count_parameters(config: Qwen2_5OmniConfig) -> dict[str, int]:
    """Parameters per part (tied weights once), counted on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(config)
    parts = {
        "thinker_text": [model.thinker.model.language_model, model.thinker.lm_head],
        "audio_tower": [model.thinker.model.audio_tower],
        "vision_tower": [model.thinker.model.visual],
        "talker": [model.talker],
        "dit": [model.token2wav.code2wav_dit_model],
        "bigvgan": [model.token2wav.code2wav_bigvgan_model],
    }
    counts = {}
    for name, modules in parts.items():
        unique = {id(p): p for m in modules for p in m.parameters()}
        counts[name] = sum(p.numel() for p in unique.values())
    counts["total"] = sum(p.numel() for p in model.parameters())  # parameters() is deduplicated
    return counts


# Gains of the re-initialisation (see the module docstring); linear/embedding/norm scales of
# the thinker and talker are `InitScale()`, the qwen2 builder's.
CONV_GAIN = 1.0  # audio/vision stems and the DiT's speaker encoder
DIT_SCALE = InitScale(embedding_gain=1.0, linear_gain=1.0, bias_std=0.02, norm_jitter=0.1)
MEL_CENTER = -5.0  # log-mel level of speech: the DiT output bias, the speakers' ref_mel mean
# BigVGAN: at gain 0.75 the signal neither dies nor saturates through the six upsampling
# stages (measured: 0.6 -> RMS ~0.01-0.09, 0.8 -> up to 0.6 with clipping, by seed); the
# output is then calibrated (see `calibrate_vocoder_`).
BIGVGAN_CONV_GAIN = 0.75
WAVEFORM_RMS = 0.1  # about -20 dBFS, a speech-like level


@torch.no_grad()
def reinit_omni_(model: Qwen2_5OmniForConditionalGeneration, seed: int, calibration_mel: torch.Tensor) -> None:
    """Deterministic weights for `seed`; each part draws from its own seeds (16 * seed + k).
    `calibration_mel` (1, mel_dim, T): a log-mel the vocoder's output level is calibrated on."""
    dit = model.token2wav.code2wav_dit_model
    bigvgan = model.token2wav.code2wav_bigvgan_model
    parts = [
        (model.thinker, InitScale(), CONV_GAIN),
        (model.talker, InitScale(), CONV_GAIN),
        (dit, DIT_SCALE, CONV_GAIN),
        (bigvgan, InitScale(), BIGVGAN_CONV_GAIN),
    ]
    for index, (part, scale, conv_gain) in enumerate(parts):
        reinit_weights_(part, 16 * seed + index, scale)
        gen = torch.Generator().manual_seed(16 * seed + 4 + index)
        reinit_convs_(part, gen, conv_gain, scale.bias_std)
    # The ODE integrates the predicted velocity over t in [0, 1] from N(0, 1) noise, so this
    # bias lands the mel near speech level instead of near 0 (= very loud).
    dit.proj_out.bias.add_(MEL_CENTER)
    calibrate_vocoder_(bigvgan, calibration_mel)


@torch.no_grad()
def calibrate_vocoder_(bigvgan: nn.Module, mel: torch.Tensor) -> None:
    """Make `conv_post` (the last, bias-free conv) give a zero-mean waveform of RMS
    `WAVEFORM_RMS` on `mel` (B, mel_dim, T): its taps are made to sum to zero per channel (the
    SnakeBeta activations add a positive offset that would otherwise become a DC offset), then
    scaled to the target RMS, measured before the final clamp to [-1, 1]."""
    conv = bigvgan.conv_post
    conv.weight.sub_(conv.weight.mean(dim=-1, keepdim=True))  # (1, C, K): zero DC gain
    captured: list[torch.Tensor] = []
    handle = conv.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        bigvgan(mel)
    finally:
        handle.remove()
    rms = captured[0].pow(2).mean().sqrt().clamp_min(1e-12)
    conv.weight.mul_(WAVEFORM_RMS / rms)


def build(options: TinyBuildOptions) -> None:
    size = SIZES[options.size]
    thinker = options.overrides.get("thinker_config", {})
    text_overrides = thinker.get("text_config", {}) if isinstance(thinker, Mapping) else {}
    vocab_size = int(text_overrides.get("vocab_size", size.text.vocab_size))
    max_len = int(text_overrides.get("max_position_embeddings", size.text.max_position_embeddings))
    tokenizer, ids = build_omni_tokenizer(vocab_size, model_max_length=max_len)
    config = make_config(options.size, options.overrides, ids)

    # fork_rng: seeding must not disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    dit = config.token2wav_config.dit_config
    speakers = make_speakers(ids, dit.enc_emb_dim, dit.mel_dim, size.ref_mel_frames, 16 * options.seed + 8)
    # A short slice keeps the calibration cheap: (1, T, mel_dim) -> (1, mel_dim, <=32)
    calibration_mel = speakers[SPEAKERS[0]]["ref_mel"][:, :32].transpose(1, 2)
    reinit_omni_(model, options.seed, calibration_mel)
    model.generation_config = generation_config(ids, config.talker_config, size.talker_defaults)

    prepare_outdir(options.outdir)
    model.save_pretrained(options.outdir, max_shard_size=options.max_shard_size)
    tokenizer.save_pretrained(options.outdir, save_jinja_files=False)  # template inside tokenizer_config
    write_processor_files(options.outdir)
    write_speakers(options.outdir / "spk_dict.pt", speakers)


QWEN2_5_OMNI = TinyArch(name="qwen2_5_omni", sizes=tuple(SIZES), build=build)
