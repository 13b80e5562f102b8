"""The non-weight files of a tiny Qwen3-Omni folder: the tokenizer with Qwen3-Omni's added
tokens and chat template, the processor configs, and generation_config.json with the talker's
defaults. (Qwen3-Omni keeps its voices in the config: talker_config.speaker_id.)

Token layout after the byte-level BPE ids B (real: B = 151643), as the real tokenizer:
    +0 <|endoftext|>  +1 <|im_start|>  +2 <|im_end|>  +3 <|object_ref_start|>
    +4 <|object_ref_end|>  +5 <|box_start|>  +6 <|box_end|>  +7 <|quad_start|>  +8 <|quad_end|>
    +9 <|vision_start|>  +10 <|vision_end|>  +11 <|vision_pad|>  +12 <|image_pad|>
    +13 <|video_pad|>                                   (special, real 151643..151656)
    +14 <tool_call> .. +21 <|file_sep|>  +22 <tool_response>  +23 </tool_response>
    +24 <think>  +25 </think>                           (plain, real 151657..151668)
    +26 <|audio_start|>  +27 <|audio_end|>  +28 <tts_pad>  +29 <tts_text_bos>
    +30 <tts_text_eod>  +31 <tts_text_bos_single>  +32 <|audio_pad|>   (real 151669..151675)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import AddedToken
from transformers import GenerationConfig, Qwen2Tokenizer

from omnistage.tiny.omni_files import preprocessor_config, video_preprocessor_config
from omnistage.tiny.tokenizer import ENDOFTEXT, IM_END, IM_START, OMNI_CHAT_TEMPLATE, build_qwen_tokenizer

SPEAKERS: tuple[str, ...] = ("Ethan", "Chelsie", "Aiden")   # the real checkpoint's voices

_SPECIAL = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
            "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>")
_PLAIN = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
          "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_AUDIO_TTS = ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
              "<tts_text_bos_single>", "<|audio_pad|>")

_ROLES = ("system", "user", "assistant")     # ChatML roles: one token each, as in the real vocab

# Attribute names the real tokenizer_config declares; Qwen3OmniMoeProcessor reads them.
NAMED_TOKENS = {
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
}

# Qwen3-Omni's template: ChatML without a default system turn; media parts render as
# <|audio_start|><|audio_pad|><|audio_end|>, <|vision_start|><|image_pad|><|vision_end|> and
# <|vision_start|><|video_pad|><|vision_end|> (the processor repeats each pad once per
# encoder output). Derived from the Qwen2.5-Omni template of omnistage.tiny.tokenizer.
_DEFAULT_SYSTEM = ("{%- if loop.first and message['role'] != 'system' -%}"
                   "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
                   "{%- endif -%}")
QWEN3_OMNI_CHAT_TEMPLATE = (
    OMNI_CHAT_TEMPLATE.replace(_DEFAULT_SYSTEM, "")
    .replace("<|audio_bos|><|AUDIO|><|audio_eos|>", "<|audio_start|><|audio_pad|><|audio_end|>")
    .replace("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_start|><|image_pad|><|vision_end|>")
    .replace("<|vision_bos|><|VIDEO|><|vision_eos|>", "<|vision_start|><|video_pad|><|vision_end|>")
)

# Qwen3-Omni's image/video preprocessing (Qwen3-VL): 16-pixel patches, mean/std 0.5.
_PATCH = 16
_HALF = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class Qwen3OmniTokenIds:
    """Thinker token ids the configs must agree with (all < the thinker vocab)."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image: int
    video: int
    audio_start: int
    audio_end: int
    audio: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    system: int        # the first token of "system", "user", "assistant" (ChatML roles)
    user: int
    assistant: int


@dataclass(frozen=True)
class Qwen3TalkerDefaults:
    """The talker's generation defaults (transformers' Qwen3OmniMoe generate()'s, but the
    length), written to generation_config.json as `talker_*`."""

    max_new_tokens: int
    # A random talker samples end-of-speech at any step (1 in ~50 at these settings): a floor
    # keeps a tiny model's speech from ending at its first frames (0: none)
    min_new_tokens: int = 0
    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05


def build_qwen3_omni_tokenizer(vocab_size: int, model_max_length: int) -> tuple[Qwen2Tokenizer, Qwen3OmniTokenIds]:
    added = [*_SPECIAL, *(AddedToken(t, special=False, normalized=False) for t in _PLAIN), *_AUDIO_TTS]
    tok = build_qwen_tokenizer(vocab_size, added, model_max_length, named_tokens=NAMED_TOKENS,
                               chat_template=QWEN3_OMNI_CHAT_TEMPLATE, whole_words=_ROLES)
    get = tok.convert_tokens_to_ids
    roles = {}
    for role in _ROLES:
        ids = tok.encode(role)
        if len(ids) != 1:   # transformers finds turns by the single token after <|im_start|>
            raise RuntimeError(f"the tiny tokenizer splits {role!r} into {ids}; it must be one token")
        roles[role] = ids[0]
    ids = Qwen3OmniTokenIds(
        endoftext=get(ENDOFTEXT), im_start=get(IM_START), im_end=get(IM_END),
        vision_start=get("<|vision_start|>"), vision_end=get("<|vision_end|>"),
        image=get("<|image_pad|>"), video=get("<|video_pad|>"),
        audio_start=get("<|audio_start|>"), audio_end=get("<|audio_end|>"), audio=get("<|audio_pad|>"),
        tts_pad=get("<tts_pad>"), tts_bos=get("<tts_text_bos>"), tts_eos=get("<tts_text_eod>"), **roles)
    return tok, ids


def generation_config(ids: Qwen3OmniTokenIds, codec_eos: int, defaults: Qwen3TalkerDefaults) -> GenerationConfig:
    talker = {f"talker_{k}": v for k, v in asdict(defaults).items()}
    talker["talker_eos_token_id"] = codec_eos
    return GenerationConfig(bos_token_id=ids.endoftext, eos_token_id=[ids.im_end, ids.endoftext],
                            pad_token_id=ids.endoftext, **talker)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_processor_files(outdir: Path) -> None:
    """preprocessor_config.json (WhisperFeatureExtractor, 128 bins; Qwen2-VL-style image
    processor with 16-pixel patches), video_preprocessor_config.json, chat_template.json."""
    vision = {"patch_size": _PATCH, "image_mean": _HALF, "image_std": _HALF,
              "processor_class": "Qwen3OmniMoeProcessor"}
    pre = {**preprocessor_config(), **vision,
           "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 16384}
    video = {**video_preprocessor_config(), **vision,
             "min_pixels": 128 * 32 * 32, "max_pixels": 768 * 32 * 32,
             "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}}
    _write_json(outdir / "preprocessor_config.json", pre)
    _write_json(outdir / "video_preprocessor_config.json", video)
    _write_json(outdir / "chat_template.json", {"chat_template": QWEN3_OMNI_CHAT_TEMPLATE})
