"""Placeholder expansion vs transformers' Qwen2_5OmniProcessor.

The processor cannot be built here (its video processor imports torchvision), so the test
makes an instance with `object.__new__` and sets only what its replacement code reads: the
placeholder strings and the merge size of stand-in image/video processors. It then runs the
processor's own `replace_image_token`, `replace_audio_token`, `replace_video_token` (which
calls `replace_video_with_audio_token` and `get_chunked_index` when the audio of a video is
loaded) and `get_text_with_replacements` on the same media sizes (grid_thw, second_per_grid =
temporal_patch_size / fps, audio token counts from HF's `_get_feat_extract_output_lengths`),
tokenizes the expanded text, and compares token ids exactly with our expansion of the same
text. What is not exercised: HF's feature extractor / image / video processors themselves
(their outputs, grids and frame counts, are inputs here).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.audio_features import num_audio_tokens
from omnistage.models.qwen2_5_omni.prompt import (
    DEFAULT_SYSTEM_PROMPT,
    audio_item,
    expand_prompt,
    interleaved_video_audio,
)
from omnistage.models.qwen2_5_omni.rope_index import (
    AudioItem,
    ImageItem,
    OmniLayout,
    VideoItem,
    mrope_positions,
)

SPECIALS = ["<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>",
            "<|vision_bos|>", "<|vision_eos|>"]
WORDS = ["[UNK]", "hello", "what", "is", "in", "this", "clip", "and", "picture", "?", "describe",
         "user", "assistant", "video"]
TEMPORAL_PATCH = 2  # the video processor's temporal_patch_size: second_per_grid = 2 / fps


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


@pytest.fixture(scope="module")
def layout(tokenizer) -> OmniLayout:
    ids = [tokenizer.convert_tokens_to_ids(s) for s in SPECIALS[:5]]
    return OmniLayout(*ids, spatial_merge_size=2, position_id_per_seconds=25, seconds_per_chunk=2)


@pytest.fixture(scope="module")
def hf_processor():
    from transformers import Qwen2_5OmniProcessor

    proc = object.__new__(Qwen2_5OmniProcessor)
    proc.image_processor = SimpleNamespace(merge_size=2)
    proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=TEMPORAL_PATCH)
    proc.image_token, proc.audio_token, proc.video_token = SPECIALS[1], SPECIALS[0], SPECIALS[2]
    proc.audio_bos_token, proc.audio_eos_token = SPECIALS[3], SPECIALS[4]
    return proc


def hf_expand(proc, tokenizer, text, audios=(), images=(), videos=()):
    """HF's expansion. audios: feature frames; images: grids; videos: (grid, fps, frames|None).
    As in the processor, audio tracks of videos come after the standalone clips in its audio
    list and are linked through video_to_audio_indices; they get no <|AUDIO|> replacement."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths,
    )

    frames = list(audios) + [v[2] for v in videos if v[2]]
    video_to_audio, k = [], len(audios)
    for v in videos:
        video_to_audio.append(k if v[2] else None)
        k += bool(v[2])
    processed_audio = {"num_audio_tokens": _get_feat_extract_output_lengths(np.array(frames))}
    audio_repl = [proc.replace_audio_token(processed_audio, i) for i in range(len(frames))
                  if i not in video_to_audio]
    image_inputs = {"image_grid_thw": np.array(list(images))} if images else {}
    image_repl = [proc.replace_image_token(image_inputs, i) for i in range(len(images))]
    video_inputs = {"video_grid_thw": np.array([v[0] for v in videos]),
                    "video_second_per_grid": [TEMPORAL_PATCH / v[1] for v in videos]}
    kwargs = {"load_audio_from_video": any(v[2] for v in videos), "position_id_per_seconds": 25,
                  "seconds_per_chunk": 2.0}
    video_repl = [proc.replace_video_token(video_inputs, i, processed_audio=processed_audio,
                                           video_to_audio_indices=video_to_audio, **kwargs)
                  for i in range(len(videos))]
    expanded, _ = proc.get_text_with_replacements([text], image_repl, video_repl, audio_repl)
    return tokenizer.encode(expanded[0], add_special_tokens=False)


def ours(layout, tokenizer, text, audios=(), images=(), videos=()):
    return expand_prompt(
        text, layout, tokenizer=tokenizer, audios=[audio_item(f) for f in audios],
        images=[ImageItem(g) for g in images],
        videos=[VideoItem(g, TEMPORAL_PATCH / fps, audio_item(f) if f else None)
                for g, fps, f in videos])


A = "<|audio_bos|><|AUDIO|><|audio_eos|>"
I = "<|vision_bos|><|IMAGE|><|vision_eos|>"
V = "<|vision_bos|><|VIDEO|><|vision_eos|>"
CASES = {
    "text_only": ("hello what is this ?", {}),
    "one_audio": (f"user {A} what is in this clip ?", {"audios": [437]}),
    "image_audio_image": (f"user {I} and {A} describe {I} assistant",
                          {"audios": [120], "images": [(1, 6, 8), (1, 4, 2)]}),
    "videos_without_audio": (f"{V} and {V} ?", {"videos": [((6, 4, 6), 2.0, None),
                                                          ((3, 2, 2), 0.5, None)]}),
    "video_with_audio": (f"user {V} describe", {"videos": [((6, 4, 6), 2.0, 600)]}),
    "video_audio_slow_fps": (f"{V} ?", {"videos": [((4, 2, 4), 0.5, 1700)]}),
    "mixed_orders": (f"{A} hello {I} {V} what {A} is {V} this {I} ?",
                     {"audios": [200, 77], "images": [(1, 4, 6), (2, 2, 2)],
                      "videos": [((4, 4, 4), 1.0, 450), ((3, 2, 2), 2.0, 123)]}),
    "silent_and_sounding_videos": (f"{V} {A} {V}", {"audios": [90],
                                                    "videos": [((4, 2, 2), 2.0, None),
                                                               ((5, 2, 4), 2.0, 333)]}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_hf_processor_expansion(hf_processor, tokenizer, layout, name):
    text, media = CASES[name]
    ref = hf_expand(hf_processor, tokenizer, text, **media)
    got = ours(layout, tokenizer, text, **media)
    assert got.token_ids == ref
    # the same prompt as ids expands the same way
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert expand_prompt(ids, layout, audios=[audio_item(f) for f in media.get("audios", ())],
                         images=[ImageItem(g) for g in media.get("images", ())],
                         videos=[m for m in got.media if isinstance(m, VideoItem)]).token_ids == ref


def test_media_come_back_in_prompt_order(tokenizer, layout):
    text, media = CASES["mixed_orders"]
    got = ours(layout, tokenizer, text, **media)
    kinds = [type(m).__name__ for m in got.media]
    assert kinds == ["AudioItem", "ImageItem", "VideoItem", "AudioItem", "VideoItem", "ImageItem"]
    assert got.media[0] == AudioItem(num_audio_tokens(200))
    assert got.media[4].audio == AudioItem(num_audio_tokens(123))
    # and they lay out against the expanded ids without complaint
    pos = mrope_positions(got.token_ids, got.media, layout)
    assert pos.positions.shape == (3, len(got.token_ids))


@pytest.mark.parametrize("fps", [0.25, 0.5, 2 / 3, 1.0, 1.5, 2.0, 7.0, 24.0, 50.0])
@pytest.mark.parametrize("frames", [3, 101, 499, 2000, 4321])
def test_interleave_matches_hf_chunking(hf_processor, layout, tokenizer, fps, frames):
    """Many frame rates, including ones whose grid steps jump several chunks at once (HF's scan
    then makes one-token chunks) and float times that sit next to chunk thresholds."""
    video = VideoItem((9, 2, 4), TEMPORAL_PATCH / fps, audio_item(frames))
    ref = hf_expand(hf_processor, tokenizer, "<|VIDEO|>", videos=[((9, 2, 4), fps, frames)])
    assert interleaved_video_audio(video, layout) == ref


def test_num_audio_tokens_is_hf_formula():
    """The count audio_item uses (audio_features.num_audio_tokens) against the processor's."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths,
    )

    frames = np.arange(0, 3001)
    ref = _get_feat_extract_output_lengths(frames)
    assert [num_audio_tokens(int(f)) for f in frames] == ref.tolist()
    assert num_audio_tokens(3000) == 750  # 30 s of audio: 25 tokens per second


@pytest.mark.parametrize("text, media, param", [
    (f"{A} {A}", {"audios": [100]}, "audio"),
    (f"{I}", {"images": [(1, 2, 2)], "audios": [100]}, "audio"),
    ("hello", {"images": [(1, 2, 2)]}, "image"),
    (f"{V} {V}", {"videos": [((2, 2, 2), 2.0, None)]}, "video"),
])
def test_placeholder_count_mismatch_names_the_modality(tokenizer, layout, text, media, param):
    with pytest.raises(InvalidRequestError) as err:
        ours(layout, tokenizer, text, **media)
    assert err.value.param == param
    tag = {"audio": "<|AUDIO|>", "image": "<|IMAGE|>", "video": "<|VIDEO|>"}[param]
    assert tag in str(err.value)


def test_other_bad_input(layout):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        expand_prompt("hello", layout)
    with pytest.raises(InvalidRequestError, match="too short"):
        audio_item(2)  # 20 ms: no token


def test_default_system_prompt_is_the_one_the_talker_was_trained_with():
    assert DEFAULT_SYSTEM_PROMPT == (
        "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
        "perceiving auditory and visual inputs, as well as generating text and speech.")
