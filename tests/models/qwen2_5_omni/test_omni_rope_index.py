"""TMRoPE positions vs transformers' `get_rope_index` on a tiny Qwen2.5-Omni thinker.

Positions and deltas are integers, so they are compared exactly. Prompts are built with our
`expand_prompt` (checked against the HF processor in test_omni_prompt.py); HF's positions do
not read the tokens inside a media run, so they are an independent oracle for the layout.
"""

from __future__ import annotations

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.prompt import audio_item, expand_prompt
from omnistage.models.qwen2_5_omni.rope_index import (
    AudioItem,
    ImageItem,
    OmniLayout,
    VideoItem,
    chunk_spans,
    mrope_positions,
    talker_prompt_positions,
)

AUDIO, IMAGE, VIDEO, AUDIO_BOS, AUDIO_EOS, VISION_BOS, VISION_EOS = 50, 51, 52, 53, 54, 55, 56


@pytest.fixture(scope="module")
def hf_thinker():
    from transformers import (
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    audio = {"num_mel_bins": 16, "d_model": 16, "encoder_layers": 1,
             "encoder_attention_heads": 2, "encoder_ffn_dim": 16, "output_dim": 16,
             "n_window": 4, "max_source_positions": 64}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
              "out_hidden_size": 16, "spatial_merge_size": 2, "fullatt_block_indexes": [0]}
    text = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [1, 1, 2]}}
    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=audio, vision_config=vision, text_config=text,
        audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO,
        audio_start_token_id=AUDIO_BOS, audio_end_token_id=AUDIO_EOS,
        vision_start_token_id=VISION_BOS, vision_end_token_id=VISION_EOS)
    return Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module")
def layout(hf_thinker) -> OmniLayout:
    return OmniLayout.from_thinker_config(hf_thinker.config)


def build(spec: list[tuple], seed: int = 0):
    """Prompt ids with text around each media item, our media lists, and HF's kwargs.

    spec items: ("audio", frames) | ("image", grid) | ("video", grid, second_per_grid,
    audio_frames or None). HF's audio lengths run in prompt order over standalone and in-video
    audio alike, as its processor emits them.
    """
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 40, (n,), generator=g).tolist()
    ids: list[int] = text(5)
    audios, images, videos, frames, grids, vgrids, spgs = [], [], [], [], [], [], []
    for kind, *args in spec:
        if kind == "audio":
            ids += [AUDIO_BOS, AUDIO, AUDIO_EOS]
            audios.append(audio_item(args[0]))
            frames.append(args[0])
        elif kind == "image":
            ids += [VISION_BOS, IMAGE, VISION_EOS]
            images.append(ImageItem(args[0]))
            grids.append(args[0])
        else:
            grid, spg, a_frames = args
            ids += [VISION_BOS, VIDEO, VISION_EOS]
            videos.append(VideoItem(grid, spg, audio_item(a_frames) if a_frames else None))
            vgrids.append(grid)
            spgs.append(spg)
            if a_frames:
                frames.append(a_frames)
        ids += text(int(torch.randint(1, 4, (1,), generator=g)))
    hf_kwargs = {"audio_seqlens": torch.tensor(frames) if frames else None,
                 "image_grid_thw": torch.tensor(grids) if grids else None,
                 "video_grid_thw": torch.tensor(vgrids) if vgrids else None,
                 "second_per_grids": torch.tensor(spgs) if spgs else None}
    return ids, {"audios": audios, "images": images, "videos": videos}, hf_kwargs


def hf_positions(model, ids: list[int], hf_kwargs: dict, use_audio_in_video: bool):
    x = torch.tensor([ids])
    pos, delta = model.get_rope_index(x, attention_mask=torch.ones_like(x),
                                      use_audio_in_video=use_audio_in_video, **hf_kwargs)
    return pos[:, 0], int(delta)


CASES = {
    "text_only": [],
    "one_audio": [("audio", 437)],
    "one_image": [("image", (1, 6, 8))],
    "image_with_two_time_steps": [("image", (2, 4, 4))],
    "two_images_and_audio": [("image", (1, 4, 6)), ("audio", 120), ("image", (1, 8, 2))],
    "video_no_audio": [("video", (6, 4, 6), 1.0, None)],
    "video_no_audio_slow_fps": [("video", (5, 2, 4), 4.0, None)],
    "video_no_audio_odd_fps": [("video", (9, 2, 2), 2 / 3, None)],
    # float32 maths truncates 5 * 0.04 * 25 to 4 (float64 would give 5): HF's rounding is kept
    "video_no_audio_float32_rounding": [("video", (8, 2, 2), 0.04, None)],
    "mixed_no_audio_in_video": [("image", (1, 4, 4)), ("video", (4, 4, 4), 1.0, None),
                                ("audio", 333), ("video", (3, 2, 6), 0.5, None), ("audio", 99)],
}
CASES_AUDIO_IN_VIDEO = {
    "video_with_audio": [("video", (6, 4, 6), 1.0, 600)],
    # a long audio track: its chunks outnumber the video's
    "video_with_long_audio": [("video", (2, 2, 2), 1.0, 1000)],
    # the video outlasts its audio: the last piece laid out is a video chunk
    "video_with_short_audio": [("video", (8, 2, 4), 1.0, 150)],
    # one grid step spans several chunks: HF's scan then makes one-token chunks
    "video_with_audio_slow_fps": [("video", (4, 2, 4), 4.0, 1700)],
    # wide video, short audio: a video chunk's w ids outrun the last audio chunk
    "wide_video_short_audio": [("video", (2, 2, 48), 1.0, 40)],
    "mixed_orders": [("audio", 200), ("image", (1, 4, 6)), ("video", (4, 4, 4), 2.0, 450),
                     ("image", (2, 2, 2)), ("audio", 77), ("video", (3, 2, 2), 1.0, 123)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_hf_get_rope_index(hf_thinker, layout, name):
    _check(hf_thinker, layout, CASES[name], use_audio_in_video=False)


@pytest.mark.parametrize("name", list(CASES_AUDIO_IN_VIDEO))
def test_matches_hf_get_rope_index_with_audio_in_video(hf_thinker, layout, name):
    _check(hf_thinker, layout, CASES_AUDIO_IN_VIDEO[name], use_audio_in_video=True)


def _check(model, layout, spec, use_audio_in_video):
    ids, media, hf_kwargs = build(spec)
    expanded = expand_prompt(ids, layout, **media)
    ours = mrope_positions(expanded.token_ids, expanded.media, layout)
    ref_pos, ref_delta = hf_positions(model, expanded.token_ids, hf_kwargs, use_audio_in_video)
    assert ours.positions.dtype == torch.int64
    assert ours.positions.shape == (3, len(expanded.token_ids))
    assert torch.equal(ours.positions, ref_pos)
    assert ours.delta == ref_delta
    # the talker's text ids: the prompt plus two tokens; HF recomputes on the longer ids
    talker = talker_prompt_positions(ours)
    t_pos, t_delta = hf_positions(model, expanded.token_ids + [7, 9], hf_kwargs, use_audio_in_video)
    assert torch.equal(talker.positions, t_pos)
    assert talker.delta == t_delta


def test_last_piece_rule_is_exercised(hf_thinker, layout):
    """In the wide-video case text after the block restarts below the block's max, so the
    delta differs from what a plain 'continue after the last token' rule would give."""
    ids, media, _ = build(CASES_AUDIO_IN_VIDEO["wide_video_short_audio"])
    expanded = expand_prompt(ids, layout, **media)
    ours = mrope_positions(expanded.token_ids, expanded.media, layout)
    assert int(ours.positions.max()) > int(ours.positions[0, -1])
    assert ours.delta != int(ours.positions[0, -1]) + 1 - ours.positions.shape[1]


def test_text_only_positions_and_decode(layout):
    ours = mrope_positions([3, 1, 4, 1, 5], [], layout)
    assert torch.equal(ours.positions, torch.arange(5).expand(3, 5))
    assert ours.delta == 0 and ours.decode_position(0) == 5


def test_decode_continues_after_the_largest_position(layout):
    ids = [1, VISION_BOS] + [VIDEO] * 6 + [VISION_EOS, 2]
    ours = mrope_positions(ids, [VideoItem((3, 2, 4), 1.0)], layout)  # t ids 0, 25, 50
    # bos at 1, block starts at 2, its max is 2 + 50, eos 53, text 54
    assert ours.positions[:, -1].tolist() == [54, 54, 54]
    assert ours.decode_position(0) == 55 and ours.decode_position(3) == 58


def test_chunk_spans_match_hf_scan(hf_thinker):
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        values = torch.cumsum(torch.randint(0, 60, (n,), generator=g), 0)
        values[0] = 0
        tpc = int(torch.randint(1, 80, (1,), generator=g))
        assert chunk_spans(values // tpc) == hf_thinker.get_chunked_index(values, tpc, 0)


@pytest.mark.parametrize("ids, media, words", [
    ([1, VISION_BOS, IMAGE, VISION_EOS], [], "more media placeholders"),
    ([1, 2, 3], [ImageItem((1, 2, 2))], "no placeholder left"),
    ([1, VISION_BOS, IMAGE, IMAGE, VISION_EOS], [ImageItem((1, 2, 2))], "exactly 1 consecutive"),
    ([1, AUDIO_BOS, AUDIO, AUDIO_EOS], [ImageItem((1, 2, 2))], "not for an image"),
    ([1, VISION_BOS, VIDEO, VISION_EOS], [VideoItem((1, 2, 2), 1.0, AudioItem(1))],
     "<|audio_bos|>"),
    ([1, VISION_BOS, IMAGE, VISION_EOS], [ImageItem((1, 3, 2))], "merge size"),
])
def test_mismatched_prompt_is_an_invalid_request(layout, ids, media, words):
    with pytest.raises(InvalidRequestError, match=None) as err:
        mrope_positions(ids, media, layout)
    assert words in str(err.value)


def test_bad_descriptors_are_invalid_requests():
    with pytest.raises(InvalidRequestError):
        AudioItem(0)
    with pytest.raises(InvalidRequestError):
        ImageItem((1, 0, 2))
    with pytest.raises(InvalidRequestError):
        VideoItem((1, 2, 2), 0.0)
    with pytest.raises(InvalidRequestError):
        mrope_positions([], [], OmniLayout(AUDIO, IMAGE, VIDEO, AUDIO_BOS, AUDIO_EOS))
