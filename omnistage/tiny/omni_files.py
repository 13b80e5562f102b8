"""The non-weight files of a tiny Qwen2.5-Omni folder: the tokenizer with Omni's added tokens,
generation_config.json with the talker's defaults, the processor configs that HF's
`Qwen2_5OmniProcessor.save_pretrained` cannot write here (its video processor needs
torchvision), chat_template.json, and the speakers (spk_dict.pt).

Token layout (after the byte-level BPE ids, like the real tokenizer after its 151643 BPE ids):
    +0 <|endoftext|>  +1 <|im_start|>  +2 <|im_end|>
    +3 <|AUDIO|>  +4 <|audio_bos|>  +5 <|audio_eos|>  +6 <|box_end|>  +7 <|quad_start|>
    +8 <|quad_end|>  +9 <|vision_bos|>  +10 <|vision_eos|>  +11 <|vision_pad|>  +12 <|IMAGE|>
    +13 <|VIDEO|>                                     (special, real ids 151643..151656)
    +14 <tool_call>  +15 </tool_call>  +16 <|fim_prefix|>  +17 <|fim_middle|>
    +18 <|fim_suffix|>  +19 <|fim_pad|>  +20 <|repo_name|>  +21 <|file_sep|>
                                                      (plain added tokens, real 151657..151664)
    +22 <|tts_pad|>  +23 <|tts_bos|>  +24 <|tts_eos|>  +25 <|tts_bos_chelsie|>  +26 <|tts_bos_ethan|>
The last five are ours. The real model keeps its TTS text ids (pad 151859, start 151860, end
151861) and the speakers' text bos ids in the padding rows of its embedding, past the tokenizer;
here they are named special tokens inside the tokenizer, so the thinker vocab is exactly the
tokenizer (every id decodes, and `skip_special_tokens` drops them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import GenerationConfig, Qwen2_5OmniTalkerConfig, Qwen2Tokenizer

from omnistage.tiny.tokenizer import ENDOFTEXT, IM_END, IM_START, OMNI_CHAT_TEMPLATE, build_qwen_tokenizer

SPEAKERS: tuple[str, ...] = ("Chelsie", "Ethan")  # the real checkpoint's two voices; HF defaults to Chelsie

_OMNI_SPECIAL = (
    "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>",
)
_PLAIN = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
          "<|repo_name|>", "<|file_sep|>")
_TTS = ("<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>")
_SPEAKER_BOS = {name: f"<|tts_bos_{name.lower()}|>" for name in SPEAKERS}

# Attribute names the real tokenizer_config declares; Qwen2_5OmniProcessor reads them
# (`tokenizer.audio_token`, `tokenizer.image_token_id`, ...).
NAMED_TOKENS = {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}

# Processor values of the real Qwen2.5-Omni preprocessor_config.json.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_SAMPLING_RATE = 16000
_HOP_LENGTH = 160
_CHUNK_LENGTH = 300  # seconds of audio the feature extractor pads/truncates to at most
_IMAGE_PIXELS = (56 * 56, 28 * 28 * 16384)  # min_pixels, max_pixels
_VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)  # Qwen2_5OmniProcessor's video defaults


@dataclass(frozen=True)
class OmniTokenIds:
    """Thinker token ids the configs must agree with (all < the thinker vocab)."""

    endoftext: int
    im_start: int
    im_end: int
    audio: int  # <|AUDIO|>: audio_token_index
    audio_bos: int  # audio_start_token_id
    audio_eos: int  # audio_end_token_id
    vision_bos: int  # vision_start_token_id
    vision_eos: int  # vision_end_token_id
    vision_pad: int  # vision_token_id
    image: int  # <|IMAGE|>: image_token_index
    video: int  # <|VIDEO|>: video_token_index
    tts_pad: int  # talker tts_text_pad_token_id
    tts_bos: int  # talker tts_text_start_token_id
    tts_eos: int  # talker tts_text_end_token_id
    speaker_bos: dict[str, int] = field(default_factory=dict)  # spk_dict[name]["bos_token"]
    user: int | None = None  # first token of "user" (config user_token_id; unused by HF modeling)


@dataclass(frozen=True)
class TalkerDefaults:
    """The talker's generation defaults, written to generation_config.json as `talker_*`."""

    max_new_tokens: int
    min_new_tokens: int  # guards against an early EOS (a random talker's, with other weights)
    do_sample: bool = True  # the rest: HF's Qwen2_5OmniForConditionalGeneration.generate defaults
    top_k: int = 40
    top_p: float = 0.8
    temperature: float = 0.9
    repetition_penalty: float = 1.05


def build_omni_tokenizer(vocab_size: int, model_max_length: int) -> tuple[Qwen2Tokenizer, OmniTokenIds]:
    """The offline BPE with Omni's added tokens and chat template; ids of the tokens that matter."""
    added = [*_OMNI_SPECIAL, *(AddedToken(t, special=False, normalized=False) for t in _PLAIN),
             *_TTS, *_SPEAKER_BOS.values()]
    tok = build_qwen_tokenizer(vocab_size, added, model_max_length, named_tokens=NAMED_TOKENS,
                               chat_template=OMNI_CHAT_TEMPLATE)
    get = tok.convert_tokens_to_ids
    ids = OmniTokenIds(
        endoftext=get(ENDOFTEXT), im_start=get(IM_START), im_end=get(IM_END),
        audio=get("<|AUDIO|>"), audio_bos=get("<|audio_bos|>"), audio_eos=get("<|audio_eos|>"),
        vision_bos=get("<|vision_bos|>"), vision_eos=get("<|vision_eos|>"), vision_pad=get("<|vision_pad|>"),
        image=get("<|IMAGE|>"), video=get("<|VIDEO|>"),
        tts_pad=get(_TTS[0]), tts_bos=get(_TTS[1]), tts_eos=get(_TTS[2]),
        speaker_bos={name: get(token) for name, token in _SPEAKER_BOS.items()},
        user=tok.encode("user")[0],
    )
    return tok, ids


def make_speakers(
    ids: OmniTokenIds, enc_emb_dim: int, mel_dim: int, ref_frames: int, seed: int
) -> dict[str, dict[str, torch.Tensor | int]]:
    """spk_dict.pt's content: per speaker a text bos id, a `cond` (1, enc_emb_dim) x-vector-like
    N(0, 1) vector and a `ref_mel` (1, ref_frames, mel_dim) log-mel-like tensor.

    ref_mel ~ N(-5, 2) clipped to [-11.5, 2]: the range of natural log-mel magnitudes, which
    BigVGAN's dB normalisation maps into [-1, 1]. Deterministic for `seed`.
    """
    gen = torch.Generator().manual_seed(seed)
    speakers: dict[str, dict[str, torch.Tensor | int]] = {}
    for name in SPEAKERS:
        cond = torch.randn(1, enc_emb_dim, generator=gen)
        ref_mel = (-5.0 + 2.0 * torch.randn(1, ref_frames, mel_dim, generator=gen)).clamp(-11.5, 2.0)
        speakers[name] = {"bos_token": ids.speaker_bos[name], "cond": cond, "ref_mel": ref_mel}
    return speakers


def write_speakers(path: Path, speakers: dict[str, dict[str, torch.Tensor | int]]) -> None:
    """torch.save of ints and tensors only: loadable with `weights_only=True`, as HF requires."""
    torch.save(speakers, path)


def generation_config(
    ids: OmniTokenIds, talker: Qwen2_5OmniTalkerConfig, defaults: TalkerDefaults
) -> GenerationConfig:
    """Thinker ids as the qwen2 builder writes them, plus the talker's defaults as `talker_*`."""
    talker_kwargs = {f"talker_{k}": v for k, v in asdict(defaults).items()}
    talker_kwargs["talker_eos_token_id"] = [talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id]
    return GenerationConfig(
        bos_token_id=ids.endoftext,
        eos_token_id=[ids.im_end, ids.endoftext],
        pad_token_id=ids.endoftext,
        **talker_kwargs,
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def preprocessor_config() -> dict:
    """WhisperFeatureExtractor (128 mel bins, 16 kHz) + Qwen2-VL image processor fields, one file."""
    return {
        "processor_class": "Qwen2_5OmniProcessor",
        # audio: WhisperFeatureExtractor
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": _SAMPLING_RATE,
        "hop_length": _HOP_LENGTH,
        "n_fft": 400,
        "chunk_length": _CHUNK_LENGTH,
        "n_samples": _CHUNK_LENGTH * _SAMPLING_RATE,
        "nb_max_frames": _CHUNK_LENGTH * _SAMPLING_RATE // _HOP_LENGTH,
        "padding_side": "right",
        "padding_value": 0.0,
        "dither": 0.0,
        "return_attention_mask": True,
        # images: Qwen2VLImageProcessor (Qwen2VLImageProcessorPil loads it without torchvision)
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": _IMAGE_PIXELS[0],
        "max_pixels": _IMAGE_PIXELS[1],
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,  # PIL bicubic
    }


def video_preprocessor_config() -> dict:
    """Qwen2VLVideoProcessor fields (the class itself needs torchvision; the file does not)."""
    min_pixels, max_pixels = _VIDEO_PIXELS
    return {
        "processor_class": "Qwen2_5OmniProcessor",
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": False,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
    }


def write_processor_files(outdir: Path) -> None:
    """preprocessor_config.json, video_preprocessor_config.json and chat_template.json."""
    _write_json(outdir / "preprocessor_config.json", preprocessor_config())
    _write_json(outdir / "video_preprocessor_config.json", video_preprocessor_config())
    _write_json(outdir / "chat_template.json", {"chat_template": OMNI_CHAT_TEMPLATE})
