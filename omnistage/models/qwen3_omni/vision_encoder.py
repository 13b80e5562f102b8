"""Qwen3-Omni vision tower (the thinker's `visual`): patches -> LLM embeddings + DeepStack features.

The maths of transformers' `Qwen3OmniMoeVisionEncoder` (a Qwen3-VL ViT):
- patch embedding: a Conv3d over one (C, temporal_patch_size, p, p) patch (with bias), applied
  here as the matmul it is;
- a learned absolute position table of side x side entries (side = sqrt(num_position_embeddings)),
  resampled to each frame's (h, w) patch grid by bilinear interpolation with align_corners=True
  (edge taps clamped), and added to every frame;
- blocks of pre-LayerNorm attention (2-D axial rotary over each patch's row and column, half of
  the rotary frequencies each) + a GELU MLP (linear_fc1 / linear_fc2). Attention never crosses a
  frame; there are no windows;
- `merger`: LayerNorm over each patch, then every merge x merge block of patches (consecutive
  rows, see vision_preprocess) -> one token of out_hidden_size through Linear-GELU-Linear;
- DeepStack: after block `deepstack_visual_indexes[j]`, `merger_list[j]` turns the hidden states
  into extra tokens (the same shape as the main ones). Unlike `merger`, it normalises after the
  merge (LayerNorm over merge² * hidden). The thinker adds the j-th feature (in block order) to
  its hidden states at the visual positions after decoder layer j.

Batch invariance: `forward` runs each image/video on its own (one computation per item, its
frames batched in one attention call), so an item's rows are the same bits alone or with
others, whatever the batch.

Parameter names equal the checkpoint's under `thinker.visual.` (load with
omnistage.layers.weights.load_prefixed + require_complete).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3OmniMoeVisionEncoderConfig

from omnistage.layers.activations import gelu
from omnistage.layers.rotary import RotaryEmbedding
from omnistage.layers.weights import materialize, meta_embedding

_ACTIVATIONS = {"silu": F.silu, "gelu": gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_NORM_EPS = 1e-6            # fixed in the reference model, not a config field

Grid = tuple[int, int, int]
Rope = tuple[torch.Tensor, torch.Tensor]


def vision_config(config: Qwen3OmniMoeVisionEncoderConfig | dict) -> Qwen3OmniMoeVisionEncoderConfig:
    """The config object, also from the dict `thinker_config.vision_config` of a config.json."""
    if isinstance(config, Qwen3OmniMoeVisionEncoderConfig):
        return config
    if isinstance(config, dict):
        return Qwen3OmniMoeVisionEncoderConfig(**config)
    raise TypeError(f"vision config must be a Qwen3OmniMoeVisionEncoderConfig or a dict, "
                    f"got {type(config).__name__}")


class PatchEmbed(nn.Module):
    def __init__(self, c: Qwen3OmniMoeVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        # Kept as the checkpoint's Conv3d (D, C, tps, p, p); a conv whose input is exactly one
        # kernel in size is a matmul.
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, bias=True,
                              dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)  # (S, P) -> (S, D)


class VisionAttention(nn.Module):
    def __init__(self, c: Qwen3OmniMoeVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        d = c.hidden_size
        self.num_heads = c.num_heads
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype, device="meta")      # rows: q | k | v
        self.proj = nn.Linear(d, d, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor, frames: int, rope: Rope) -> torch.Tensor:
        """x: (t*L, D) patches of `frames` frames of L patches each; rope: (L, 1, hd) tables."""
        S, D = x.shape
        qkv = self.qkv(x).view(frames, S // frames, 3, self.num_heads, -1)  # (t, L, 3, H, hd)
        q, k, v = qkv.unbind(2)                                             # (t, L, H, hd)
        # Rotary in float32 (as the reference), then back to the compute dtype.
        q = RotaryEmbedding.apply(q.float(), rope).to(x.dtype)
        k = RotaryEmbedding.apply(k.float(), rope).to(x.dtype)
        # Bidirectional attention within each frame: the frames are the SDPA batch.
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))               # (t, H, L, hd)
        return self.proj(o.transpose(1, 2).reshape(S, D))


class VisionMLP(nn.Module):
    def __init__(self, c: Qwen3OmniMoeVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        if c.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {c.hidden_act!r} is not supported "
                             f"(supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[c.hidden_act]
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size, dtype=dtype, device="meta")
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: Qwen3OmniMoeVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, _NORM_EPS, dtype=dtype, device="meta")
        self.norm2 = nn.LayerNorm(c.hidden_size, _NORM_EPS, dtype=dtype, device="meta")
        self.attn = VisionAttention(c, dtype)
        self.mlp = VisionMLP(c, dtype)

    def forward(self, x: torch.Tensor, frames: int, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), frames, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches (consecutive rows) -> one token of out_hidden_size.

    `norm_after_merge`: LayerNorm over the merged vector (DeepStack mergers) instead of over
    each patch before merging (the main merger)."""

    def __init__(self, c: Qwen3OmniMoeVisionEncoderConfig, dtype: torch.dtype,
                 norm_after_merge: bool):
        super().__init__()
        merged = c.hidden_size * c.spatial_merge_size ** 2
        self.norm_after_merge = norm_after_merge
        self.ln_q = nn.LayerNorm(merged if norm_after_merge else c.hidden_size, _NORM_EPS,
                                 dtype=dtype, device="meta")
        self.mlp = nn.Sequential(nn.Linear(merged, merged, dtype=dtype, device="meta"), nn.GELU(),
                                 nn.Linear(merged, c.out_hidden_size, dtype=dtype, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.mlp[0].in_features
        if self.norm_after_merge:
            x = self.ln_q(x.reshape(-1, merged))           # (S/m², m²*D)
        else:
            x = self.ln_q(x).reshape(-1, merged)           # (S, D) -> (S/m², m²*D)
        return self.mlp(x)                                 # (S/m², out_hidden_size)


class Qwen3OmniVisionEncoder(nn.Module):
    CHECKPOINT_PREFIX = "thinker.visual."

    def __init__(self, config: Qwen3OmniMoeVisionEncoderConfig | dict,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        c = self.config = vision_config(config)
        _check_config(c)
        self.merge = c.spatial_merge_size
        self.head_dim = c.hidden_size // c.num_heads
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        self.side = int(round(c.num_position_embeddings ** 0.5))
        # Block index -> the DeepStack merger that reads its output.
        self.deepstack_after = {layer: j for j, layer in enumerate(c.deepstack_visual_indexes)}
        self.merger_list = nn.ModuleList(PatchMerger(c, dtype, norm_after_merge=True)
                                         for _ in c.deepstack_visual_indexes)
        self.patch_embed = PatchEmbed(c, dtype)
        self.pos_embed = meta_embedding(c.num_position_embeddings, c.hidden_size, dtype)
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.depth))
        self.merger = PatchMerger(c, dtype, norm_after_merge=False)
        materialize(self, device)          # parameters are filled by the checkpoint loader
        self.requires_grad_(False)
        # Axial rotary: head_dim/4 frequencies, used for the row and again for the column.
        theta = (c.rope_parameters or {}).get("rope_theta", 10000.0)
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32) / (self.head_dim // 2)
        self.register_buffer("inv_freq", (1.0 / theta ** quarter).to(device), persistent=False)

    @property
    def num_deepstack(self) -> int:
        return len(self.merger_list)

    def forward(self, pixel_patches: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_patches: (N, C*tps*p*p) rows of every item, item after item (vision_preprocess);
        grid_thw: (t, h, w) of each item. Returns the embeddings (N/merge², out_hidden_size)
        that replace the items' placeholder tokens, in item order, and `num_deepstack` DeepStack
        features of the same shape (in block order)."""
        grids = self._check_inputs(pixel_patches, grid_thw)
        x = pixel_patches.to(self.inv_freq.device)
        outs = [self.encode_item(rows, g)
                for rows, g in zip(x.split([t * h * w for t, h, w in grids]), grids)]
        embeds = torch.cat([main for main, _ in outs])
        deepstack = [torch.cat([deep[j] for _, deep in outs]) for j in range(self.num_deepstack)]
        return embeds, deepstack

    def encode_item(self, patches: torch.Tensor, grid: Grid
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One image/video: patches (t*h*w, P) -> main (t*h*w/m², out) and DeepStack features."""
        t, h, w = grid
        pos, rope = self.frame_tables(h, w)               # (h*w, D) float32, (h*w, 1, hd) x2
        x = self.patch_embed(patches)                      # (t*h*w, D)
        x = (x.view(t, h * w, -1) + pos.to(x.dtype)).view(t * h * w, -1)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, t, rope)
            if i in self.deepstack_after:
                deepstack.append(self.merger_list[self.deepstack_after[i]](x))
        return self.merger(x), deepstack

    def frame_tables(self, h: int, w: int) -> tuple[torch.Tensor, Rope]:
        """For one frame of h x w patches, in merge-block order: the resampled absolute position
        embeddings (h*w, D) float32 and the rotary (cos, sin), each (h*w, 1, head_dim) float32."""
        device = self.inv_freq.device
        raster = _merge_block_order(h, w, self.merge).to(device)     # (h*w,) raster index
        pos = self._resampled_positions(h, w).flatten(0, 1)[raster]   # (h*w, D)
        rc = torch.stack([raster // w, raster % w], dim=-1)          # (h*w, 2) row, column
        angles = (rc[:, :, None].float() * self.inv_freq).flatten(1)  # (h*w, hd/2): rows | cols
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]     # (h*w, 1, hd)
        return pos, (angles.cos(), angles.sin())

    def _resampled_positions(self, h: int, w: int) -> torch.Tensor:
        """The side x side position table bilinearly resampled to (h, w, D) float32, corners
        aligned (as F.interpolate(align_corners=True))."""
        device = self.inv_freq.device
        rows, row_w = _bilinear_taps(h, self.side, device)           # (h, 2) each
        cols, col_w = _bilinear_taps(w, self.side, device)           # (w, 2) each
        index = rows[:, None, :, None] * self.side + cols[None, :, None, :]   # (h, w, 2, 2)
        weight = row_w[:, None, :, None] * col_w[None, :, None, :]           # (h, w, 2, 2)
        index, weight = index.flatten(2), weight.flatten(2)                  # (h, w, 4)
        table = self.pos_embed.weight                                         # (side², D)
        out = table[index[..., 0]] * weight[..., 0, None]                     # (h, w, D) float32
        for k in range(1, 4):           # one tap at a time: no (h, w, 4, D) temporary
            out += table[index[..., k]] * weight[..., k, None]
        return out

    def _check_inputs(self, pixel_patches: torch.Tensor, grid_thw) -> list[Grid]:
        grids = [tuple(int(v) for v in g) for g in grid_thw]          # tensors or lists too
        if not grids or any(len(g) != 3 or min(g) < 1 for g in grids):
            raise ValueError(f"grid_thw must hold at least one (t, h, w) of positive sizes, "
                             f"got {grids}")
        for t, h, w in grids:
            if h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)}: h and w must be multiples of the merge size "
                                 f"{self.merge}")
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_patches.dim() != 2 or tuple(pixel_patches.shape) != (rows, self.patch_dim):
            raise ValueError(f"patches {tuple(pixel_patches.shape)} do not match grids {grids} "
                             f"(need ({rows}, {self.patch_dim}): sum of t*h*w rows, "
                             f"C*temporal_patch_size*patch_size² columns)")
        return grids


def _check_config(c: Qwen3OmniMoeVisionEncoderConfig) -> None:
    rope_type = (c.rope_parameters or {}).get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(f"vision rope type {rope_type!r} is not supported (only 'axial')")
    if not all(isinstance(v, int) for v in (c.patch_size, c.temporal_patch_size)):
        raise ValueError("vision patch_size and temporal_patch_size must be integers")
    if c.hidden_size % c.num_heads or (c.hidden_size // c.num_heads) % 4:
        raise ValueError("vision hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
    side = int(round(c.num_position_embeddings ** 0.5))
    if side < 1 or side * side != c.num_position_embeddings:
        raise ValueError(f"num_position_embeddings {c.num_position_embeddings} is not a square")
    indexes = list(c.deepstack_visual_indexes)
    if len(set(indexes)) != len(indexes) or not all(0 <= i < c.depth for i in indexes):
        raise ValueError(f"deepstack_visual_indexes {indexes} must be distinct blocks in "
                         f"[0, {c.depth})")


def _merge_block_order(h: int, w: int, m: int) -> torch.Tensor:
    """(h*w,) raster index (row*w + col) of each patch of a frame, in the order of the patch
    rows: merge blocks row-major, and within a block its m x m patches row-major."""
    raster = torch.arange(h * w).view(h // m, m, w // m, m)     # (block_r, in_r, block_c, in_c)
    return raster.transpose(1, 2).flatten()


def _bilinear_taps(size: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling `side` table entries at `size` points with corners aligned: for each point its
    two neighbouring entries (size, 2) long (clamped to the table) and their weights (size, 2)."""
    src = torch.arange(size, dtype=torch.float32, device=device) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low                                             # (size,)
    taps = (low.long()[:, None] + torch.arange(2, device=device)).clamp(max=side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)
