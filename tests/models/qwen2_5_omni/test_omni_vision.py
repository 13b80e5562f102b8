"""Qwen2.5-Omni vision: preprocessing and the vision tower against transformers.

Oracles: `Qwen2VLImageProcessorPil` (the image processor that runs without torchvision) and
transformers' `Qwen2_5OmniVisionEncoder`. HF's video processor needs torchvision, so video
preprocessing is checked against the image processor applied to each frame: a video row for
temporal patch g holds frame 2g then frame 2g+1 where an image row holds its one frame twice.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5OmniVisionEncoderConfig, Qwen2VLImageProcessorPil
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import \
    Qwen2_5OmniVisionEncoder as HFVisionEncoder

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.media.image import decode_image
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.qwen2_5_omni.vision_preprocess import (OPENAI_CLIP_STD,
                                                             VisionPreprocessConfig,
                                                             num_image_tokens, preprocess_image,
                                                             preprocess_video, smart_resize)
from omnistage.layers.weights import load_prefixed, require_complete

PREFIX = "thinker.visual."
SMALL = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)     # keeps test images small
ONE_GREY_LEVEL = 1 / 255 / min(OPENAI_CLIP_STD)              # one uint8 step after normalizing


def _noise_image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def _hf_image(img: Image.Image, min_pixels: int, max_pixels: int) -> tuple[np.ndarray, tuple]:
    out = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)(
        images=[img], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


# --- preprocessing ----------------------------------------------------------------------------

@pytest.mark.parametrize("h,w,bounds", [
    (20, 30, SMALL),            # upscaled to min_pixels
    (123, 457, SMALL),          # odd sizes, rounded
    (600, 500, SMALL),          # downscaled to max_pixels
    (56, 84, SMALL),            # already aligned
    (30, 2000, SMALL),          # wide
    (480, 640, {}),             # the real defaults (3136 .. 1,003,520 pixels)
])
def test_image_matches_hf_processor(h, w, bounds):
    img = _noise_image(h, w)
    ref, ref_grid = _hf_image(img, bounds.get("min_pixels", 56 * 56),
                              bounds.get("max_pixels", 28 * 28 * 1280))
    ours = preprocess_image(img, VisionPreprocessConfig(**bounds))
    assert ours.grid_thw == ref_grid
    assert ours.pixel_values.dtype == torch.float32
    # Same PIL resize and the same float64-then-float32 arithmetic: identical up to 1e-6.
    torch.testing.assert_close(ours.pixel_values, torch.from_numpy(ref), atol=1e-6, rtol=0)


def test_transparent_image_matches_hf_processor():
    rgba = np.random.default_rng(1).integers(0, 256, (70, 90, 4), np.uint8)
    img = Image.fromarray(rgba, "RGBA")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    ours = preprocess_image(decode_image(buf.getvalue()), VisionPreprocessConfig(**SMALL))
    ref, _ = _hf_image(img, **SMALL)                  # HF composites alpha on white too
    torch.testing.assert_close(ours.pixel_values, torch.from_numpy(ref), atol=1e-6, rtol=0)


def test_smart_resize_rejects_extreme_aspect_ratios():
    with pytest.raises(InvalidRequestError, match="aspect ratio") as e:
        smart_resize(10, 2500, 28, 3136, 1_000_000, param="image_url")
    assert e.value.param == "image_url"
    assert smart_resize(1000, 1000, 28, 3136, 28 * 28 * 64) == (224, 224)


def test_num_image_tokens():
    assert num_image_tokens((1, 16, 14), 2) == 56
    assert num_image_tokens((3, 8, 12), 2) == 72
    cfg = VisionPreprocessConfig(**SMALL)
    patches = preprocess_image(_noise_image(123, 457), cfg)
    assert num_image_tokens(patches.grid_thw, cfg.merge_size) * 4 == patches.num_patches


def test_config_from_preprocessor_json():
    cfg = VisionPreprocessConfig.from_dict({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25],
        "image_processor_type": "Qwen2VLImageProcessor"})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (3136, 12845056, (0.5,) * 3)
    sized = VisionPreprocessConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 900}})
    assert (sized.min_pixels, sized.max_pixels, sized.factor) == (100, 900, 28)


def _frames_from_hf_images(frames: np.ndarray, bounds: dict) -> tuple[torch.Tensor, tuple]:
    """Expected video patches: each frame through the HF image processor, frames paired."""
    per_frame = [_hf_image(Image.fromarray(f), **bounds) for f in frames]
    (_, h, w) = per_frame[0][1]
    rows = [torch.from_numpy(p).view(h * w, 3, 2, -1)[:, :, 0] for p, _ in per_frame]  # (N, C, pp)
    if len(rows) % 2:
        rows.append(rows[-1])                            # HF repeats the last frame
    video = torch.stack([torch.stack(rows[i:i + 2], dim=2) for i in range(0, len(rows), 2)])
    return video.reshape(-1, 3 * 2 * rows[0].shape[-1]), (len(rows) // 2, h, w)


def test_video_without_resize_matches_image_processor_on_frame_pairs():
    frames = np.random.default_rng(2).integers(0, 256, (5, 56, 84, 3), np.uint8)
    bounds = dict(min_pixels=56 * 56, max_pixels=56 * 84)
    ours = preprocess_video(frames, fps=2.0, cfg=VisionPreprocessConfig(
        video_min_pixels=bounds["min_pixels"], video_max_pixels=bounds["max_pixels"]))
    ref, grid = _frames_from_hf_images(frames, bounds)
    assert ours.grid_thw == grid == (3, 4, 6)
    assert ours.second_per_grid == 1.0
    torch.testing.assert_close(ours.pixel_values, ref, atol=1e-6, rtol=0)


def test_video_with_resize_is_within_one_grey_level_of_pil():
    # Video frames resize with torch's uint8 antialiased bicubic (HF's video path on CPU),
    # images with PIL's bicubic: they agree to one grey level, on all but a few pixels.
    frames = np.random.default_rng(3).integers(0, 256, (4, 90, 130, 3), np.uint8)
    bounds = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 12)
    ours = preprocess_video(frames, fps=4.0, cfg=VisionPreprocessConfig(
        video_min_pixels=bounds["min_pixels"], video_max_pixels=bounds["max_pixels"]))
    ref, grid = _frames_from_hf_images(frames, bounds)
    assert ours.grid_thw == grid and ours.second_per_grid == 0.5
    diff = (ours.pixel_values - ref).abs()
    assert diff.max() <= ONE_GREY_LEVEL + 1e-5
    assert (diff > 1e-5).float().mean() < 0.05


def test_default_video_bounds():
    cfg = VisionPreprocessConfig()
    frames = np.zeros((2, 48, 64, 3), np.uint8)         # tiny frames grow to >= 128 tokens
    out = preprocess_video(frames, fps=2.0, cfg=cfg)
    t, h, w = out.grid_thw
    assert t == 1 and h * w * 14 * 14 >= cfg.video_min_pixels


# --- the vision tower -------------------------------------------------------------------------

def _tiny_config(**kw) -> Qwen2_5OmniVisionEncoderConfig:
    # Real patch geometry (14 px, merge 2, temporal 2) so preprocessed images feed it; 56-px
    # windows = 2x2 merge units, so every test image spans several windows.
    base = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24,
                fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2)
    return Qwen2_5OmniVisionEncoderConfig(**{**base, **kw})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: HF's 0.02-std init makes outputs so small that atol means little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def hf_tower() -> HFVisionEncoder:
    torch.manual_seed(0)
    model = HFVisionEncoder(_tiny_config()).eval()
    _randomize(model, seed=0)
    return model


def _ours_from(hf: HFVisionEncoder, dtype=torch.float32) -> Qwen2_5OmniVisionEncoder:
    ours = Qwen2_5OmniVisionEncoder(hf.config, dtype=dtype, device="cpu")
    checkpoint = ((PREFIX + k, v) for k, v in hf.state_dict().items())
    require_complete(ours, load_prefixed(ours, checkpoint, PREFIX), "vision tower")
    return ours


@pytest.fixture(scope="module")
def batch() -> list:
    """Three images of different grids and one 5-frame video, preprocessed."""
    cfg = VisionPreprocessConfig(**SMALL, video_min_pixels=56 * 56, video_max_pixels=28 * 28 * 20)
    items = [preprocess_image(_noise_image(h, w, seed=i), cfg)
             for i, (h, w) in enumerate([(84, 140), (112, 112), (56, 168)])]
    frames = np.random.default_rng(9).integers(0, 256, (5, 84, 84, 3), np.uint8)
    items.append(preprocess_video(frames, fps=2.0, cfg=cfg))
    return items


def test_tower_batch_matches_hf_item_by_item(hf_tower, batch):
    ours = _ours_from(hf_tower)
    grids = [p.grid_thw for p in batch]
    assert grids == [(1, 6, 10), (1, 8, 8), (1, 4, 12), (3, 6, 6)]
    with torch.inference_mode():
        outs = ours([p.pixel_values for p in batch], grids)
        for p, out in zip(batch, outs):
            ref = hf_tower(p.pixel_values, grid_thw=torch.tensor([p.grid_thw])).pooler_output
            assert out.shape == (num_image_tokens(p.grid_thw, 2), 24)
            # fp32 throughout; the two differ only in summation order (conv as matmul, grouped
            # SDPA): measured ~2e-6 on O(0.5) outputs.
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_windows_matter_in_this_config(hf_tower, batch):
    """The parity test would catch windowing mistakes: with windows larger than every image
    (so window blocks attend over whole frames) the reference output changes."""
    wide = HFVisionEncoder(_tiny_config(window_size=1000)).eval()
    wide.load_state_dict(hf_tower.state_dict())
    p = batch[0]
    with torch.inference_mode():
        a = hf_tower(p.pixel_values, grid_thw=torch.tensor([p.grid_thw])).pooler_output
        b = wide(p.pixel_values, grid_thw=torch.tensor([p.grid_thw])).pooler_output
    assert (a - b).abs().max() > 1e-2
    plan = _ours_from(hf_tower).plan([p.grid_thw])
    assert sum(g.count for g in plan.window_groups) == 6      # 3x5 merge units, 2x2 windows
    assert sum(g.count for g in plan.frame_groups) == 1


def test_tower_order_of_items_does_not_matter(hf_tower, batch):
    ours = _ours_from(hf_tower)
    with torch.inference_mode():
        fwd = ours([p.pixel_values for p in batch], [p.grid_thw for p in batch])
        rev = ours([p.pixel_values for p in batch[::-1]], [p.grid_thw for p in batch[::-1]])
    for a, b in zip(fwd, rev[::-1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_tower_item_alone_equals_item_in_batch(hf_tower, batch):
    """Bit for bit: segments are attended per length group and every other op is per row."""
    ours = _ours_from(hf_tower)
    with torch.inference_mode():
        together = ours([p.pixel_values for p in batch], [p.grid_thw for p in batch])
        for p, out in zip(batch, together):
            assert torch.equal(ours([p.pixel_values], [p.grid_thw])[0], out)


def test_tower_bfloat16_is_close_to_float32(hf_tower, batch):
    ours32, ours16 = _ours_from(hf_tower), _ours_from(hf_tower, dtype=torch.bfloat16)
    pv, grids = [p.pixel_values for p in batch[:2]], [p.grid_thw for p in batch[:2]]
    with torch.inference_mode():
        for a, b in zip(ours32(pv, grids), ours16(pv, grids)):
            assert b.dtype == torch.bfloat16
            torch.testing.assert_close(b.float(), a, atol=0.1, rtol=0.05)


def test_tower_rejects_bad_inputs_and_incomplete_checkpoints(hf_tower, batch):
    ours = _ours_from(hf_tower)
    p = batch[0]
    with pytest.raises(ValueError, match="do not match grid"):
        ours([p.pixel_values], [(1, 6, 12)])
    state = {PREFIX + k: v for k, v in hf_tower.state_dict().items()
             if "blocks.2.mlp.up_proj" not in k}
    fresh = Qwen2_5OmniVisionEncoder(hf_tower.config)
    with pytest.raises(CheckpointError, match="lacks weights"):
        require_complete(fresh, load_prefixed(fresh, state.items(), PREFIX), "vision tower")
