"""Qwen3-Omni vision tower against transformers' `Qwen3OmniMoeVisionEncoder` (main embeddings and
DeepStack features), its batch invariance, checkpoint checks, and our preprocessing with
Qwen3-VL's geometry (16-px patches, mean/std 0.5) against `Qwen2VLImageProcessorPil` (the image
processor Qwen3-Omni uses when torchvision is absent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil, Qwen3OmniMoeVisionEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import \
    Qwen3OmniMoeVisionEncoder as HFVisionEncoder

from omnistage.errors import CheckpointError
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.models.qwen2_5_omni.vision_preprocess import (VisionPreprocessConfig,
                                                             num_image_tokens, preprocess_image)
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder

PREFIX = "thinker.visual."
OUT = 48
# Qwen3-VL / Qwen3-Omni image geometry; small pixel bounds keep the test images small.
PRE = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=(0.5,) * 3,
           image_std=(0.5,) * 3, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 20)


def _config(**kw) -> Qwen3OmniMoeVisionEncoderConfig:
    # An 8x8 learned position grid, so every test grid (4..12 patches a side) is resampled;
    # DeepStack after blocks 2 and 1 (deliberately out of order: mergers follow the config's
    # order, outputs the block order).
    base = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16,
                temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=OUT,
                num_position_embeddings=64, deepstack_visual_indexes=[2, 1])
    return Qwen3OmniMoeVisionEncoderConfig(**{**base, **kw})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations with every part mattering: HF's init (0.02 std, unit norms, zero biases)
    would leave norms' and biases' mistakes invisible and outputs too small for atol."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "pos_embed" in name:
                p.copy_(noise)                            # as large as the patch embeddings
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def hf_tower() -> HFVisionEncoder:
    model = HFVisionEncoder(_config()).eval()
    _randomize(model, seed=0)
    return model


def _checkpoint(hf: HFVisionEncoder) -> dict[str, torch.Tensor]:
    return {PREFIX + k: v for k, v in hf.state_dict().items()}


def _ours_from(hf: HFVisionEncoder, dtype=torch.float32) -> Qwen3OmniVisionEncoder:
    ours = Qwen3OmniVisionEncoder(hf.config, dtype=dtype, device="cpu")
    require_complete(ours, load_prefixed(ours, _checkpoint(hf).items(), PREFIX), "vision tower")
    return ours


@pytest.fixture(scope="module")
def ours(hf_tower) -> Qwen3OmniVisionEncoder:
    return _ours_from(hf_tower)


def _patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


def _hf(hf: HFVisionEncoder, patches: torch.Tensor, grids: list) -> tuple[torch.Tensor, list]:
    with torch.inference_mode():
        out = hf(patches, grid_thw=torch.tensor(grids))
    return out.pooler_output, list(out.deepstack_features)


def _assert_parity(ours_out, ref_out) -> None:
    (main, deep), (ref_main, ref_deep) = ours_out, ref_out
    assert len(deep) == len(ref_deep) == 2
    # fp32 throughout; position embeddings and rotary tables are bit-identical to HF's, the rest
    # differs only in summation order (conv as matmul, one SDPA call over all frames): measured
    # max |diff| 2.3e-6 (main) / 2.5e-6 (DeepStack) on outputs of max |x| ~2.
    torch.testing.assert_close(main, ref_main, atol=1e-5, rtol=1e-5)
    for a, b in zip(deep, ref_deep):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


GRIDS = [(1, 4, 6), (1, 8, 4), (2, 4, 4), (4, 4, 4), (1, 12, 10)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_item_matches_hf(hf_tower, ours, grid):
    patches = _patches(grid, seed=sum(grid))
    with torch.inference_mode():
        got = ours(patches, [grid])
    assert got[0].shape == (num_image_tokens(grid, 2), OUT)
    assert [d.shape for d in got[1]] == [got[0].shape] * 2
    _assert_parity(got, _hf(hf_tower, patches, [grid]))


def test_several_items_in_one_hf_call_match_ours(hf_tower, ours):
    grids = GRIDS[:4]
    patches = torch.cat([_patches(g, seed=i) for i, g in enumerate(grids)])
    ref = _hf(hf_tower, patches, grids)
    with torch.inference_mode():
        _assert_parity(ours(patches, grids), ref)                              # one call
        tensor_grid = ours(patches, torch.tensor(grids))                        # grid as tensor
    assert torch.equal(tensor_grid[0], ours(patches, grids)[0])


def test_item_alone_equals_item_in_batch(ours):
    """Bit for bit: each item is its own computation."""
    grids = GRIDS
    items = [_patches(g, seed=10 + i) for i, g in enumerate(grids)]
    with torch.inference_mode():
        main, deep = ours(torch.cat(items), grids)
        sizes = [num_image_tokens(g, 2) for g in grids]
        for i, (p, g) in enumerate(zip(items, grids)):
            alone_main, alone_deep = ours(p, [g])
            assert torch.equal(alone_main, main.split(sizes)[i])
            for a, d in zip(alone_deep, deep):
                assert torch.equal(a, d.split(sizes)[i])


def test_negative_controls(hf_tower, ours):
    """The parity tests would catch mistakes, each by far more than their tolerance: a transposed
    position table, corners not aligned in the resampling, the DeepStack mergers taken in block
    order instead of the config's; and frames of a video do not see each other (in HF too)."""
    grid = (1, 4, 6)
    patches = _patches(grid, seed=3)
    ref_main, ref_deep = _hf(hf_tower, patches, [grid])
    transposed, swapped = _ours_from(hf_tower), _ours_from(hf_tower)
    side = transposed.side
    with torch.no_grad():
        table = transposed.pos_embed.weight
        table.copy_(table.view(side, side, -1).transpose(0, 1).reshape(side * side, -1))
    swapped.merger_list = torch.nn.ModuleList(swapped.merger_list[::-1])
    half_pixel = HFVisionEncoder(hf_tower.config).eval()
    half_pixel.load_state_dict(hf_tower.state_dict())
    half_pixel.interpolation_align_corners = False
    with torch.inference_mode():
        assert (transposed(patches, [grid])[0] - ref_main).abs().max() > 1e-2
        assert (_hf(half_pixel, patches, [grid])[0] - ref_main).abs().max() > 1e-2
        assert (swapped(patches, [grid])[1][0] - ref_deep[0]).abs().max() > 1e-1
    # Changing a video's second frame leaves the first frame's tokens exactly as they were.
    video = _patches((2, 4, 4), seed=4)
    other = torch.cat([video[:16], _patches((1, 4, 4), seed=5)])
    n = num_image_tokens((1, 4, 4), 2)
    for run in (lambda x: ours(x, [(2, 4, 4)])[0], lambda x: _hf(hf_tower, x, [(2, 4, 4)])[0]):
        with torch.inference_mode():
            a, b = run(video), run(other)
        torch.testing.assert_close(a[:n], b[:n], atol=0, rtol=0)
        assert (a[n:] - b[n:]).abs().max() > 1e-2
    assert (ref_deep[0] - ref_deep[1]).abs().max() > 1e-1
    assert (ref_deep[0] - ref_main).abs().max() > 1e-1


def test_bfloat16_is_close_to_float32(hf_tower, ours):
    ours16 = _ours_from(hf_tower, dtype=torch.bfloat16)
    grids = [(1, 4, 6), (2, 4, 4)]
    patches = torch.cat([_patches(g, seed=i) for i, g in enumerate(grids)])
    with torch.inference_mode():
        (m32, d32), (m16, d16) = ours(patches, grids), ours16(patches, grids)
    assert m16.dtype == torch.bfloat16
    for a, b in zip([m32, *d32], [m16, *d16]):
        torch.testing.assert_close(b.float(), a, atol=0.1, rtol=0.05)


def test_config_from_dict_and_bad_inputs(hf_tower):
    d = {**_config().to_dict(), "image_size": 768, "tokens_per_second": 2}   # config.json extras
    tower = Qwen3OmniVisionEncoder(d)
    assert tower.num_deepstack == 2 and tower.side == 8
    with pytest.raises(ValueError, match="do not match"):
        tower(_patches((1, 4, 6), 0), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples of the merge size"):
        tower(_patches((1, 3, 4), 0), [(1, 3, 4)])
    with pytest.raises(ValueError, match="not a square"):
        Qwen3OmniVisionEncoder(_config(num_position_embeddings=60))
    with pytest.raises(ValueError, match="distinct blocks"):
        Qwen3OmniVisionEncoder(_config(deepstack_visual_indexes=[1, 4]))


def test_loading_refuses_missing_and_misshapen_tensors(hf_tower):
    state = _checkpoint(hf_tower)
    fresh = Qwen3OmniVisionEncoder(hf_tower.config)
    missing = {k: v for k, v in state.items() if k != PREFIX + "merger_list.1.ln_q.bias"}
    with pytest.raises(CheckpointError, match="lacks weights"):
        require_complete(fresh, load_prefixed(fresh, missing.items(), PREFIX), "vision tower")
    misshapen = {**state, PREFIX + "pos_embed.weight": torch.zeros(100, 32)}
    with pytest.raises(CheckpointError, match="does not match"):
        load_prefixed(fresh, misshapen.items(), PREFIX)
    unknown = {**state, PREFIX + "deepstack_merger_list.0.ln_q.bias": torch.zeros(128)}
    with pytest.raises(CheckpointError, match="has no place"):
        load_prefixed(fresh, unknown.items(), PREFIX)


# --- end to end from an RGB image -------------------------------------------------------------

def _hf_image(img: Image.Image) -> tuple[np.ndarray, tuple]:
    proc = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                    image_mean=list(PRE["image_mean"]),
                                    image_std=list(PRE["image_std"]),
                                    size={"shortest_edge": PRE["min_pixels"],
                                          "longest_edge": PRE["max_pixels"]})
    out = proc(images=[img], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


@pytest.mark.parametrize("h,w", [(70, 100), (150, 90), (20, 30), (400, 260)])
def test_preprocessed_image_matches_hf_processor_and_tower(hf_tower, ours, h, w):
    rng = np.random.default_rng(h * w)
    # A smooth gradient plus noise: a real-looking RGB image, resized by PIL on both sides.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([yy * 255 / h, xx * 255 / w, (yy + xx) * 127 / (h + w)], axis=-1)
    rgb = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(rgb, "RGB")
    ref, ref_grid = _hf_image(img)
    got = preprocess_image(img, VisionPreprocessConfig(**PRE))
    assert got.grid_thw == ref_grid
    assert got.pixel_values.shape == (np.prod(ref_grid), 3 * 2 * 16 * 16)
    assert torch.equal(got.pixel_values, torch.from_numpy(ref))    # the same patches, bit for bit
    _assert_parity(ours(got.pixel_values, [got.grid_thw]),
                   _hf(hf_tower, torch.from_numpy(ref), [ref_grid]))


def test_preprocess_config_from_qwen3_preprocessor_json():
    cfg = VisionPreprocessConfig.from_dict({
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
        "max_pixels": 12845056, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})
    assert (cfg.patch_size, cfg.factor, cfg.image_std) == (16, 32, (0.5,) * 3)
