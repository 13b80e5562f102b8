"""Qwen2.5-Omni vision tower: patches of many images/videos in one call -> LLM embeddings.

The tower (as transformers' Qwen2_5OmniVisionEncoder): a 3-D conv patch embedding, blocks of
pre-RMSNorm attention (2-D rotary over each patch's row and column) + SwiGLU MLP, and a merger
that fuses each merge x merge block of patches into one token of `out_hidden_size`.
Attention never crosses a frame: blocks in `fullatt_block_indexes` attend over a whole frame,
the others within windows of `window_size` pixels (window_size // patch // merge merge-units per
side). Tokens are permuted once so that every window is contiguous (frames stay contiguous), and
the merged tokens are permuted back at the end.

Batching: `forward` takes the patches of several images/videos (from different requests) and
packs them. Attention segments (windows, or frames) are grouped by length and each group is one
dense `scaled_dot_product_attention` call over (segments, heads, length, head_dim): no masks,
no padding, no per-segment Python loop. Each item's result equals that of running it alone.

Parameter names equal the checkpoint's under `thinker.visual.` (load with
omnistage.models.weights.load_prefixed + require_complete).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2_5OmniVisionEncoderConfig

from omnistage.layers.activations import gelu
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding
from omnistage.layers.weights import materialize

_ACTIVATIONS = {"silu": F.silu, "gelu": gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_NORM_EPS = 1e-6            # fixed in the reference model, not a config field


@dataclass
class _SegmentGroup:
    """Equal-length attention segments, attended in one SDPA call."""
    # (count*length,) packed positions, segment after segment; None: every token, in order
    index: torch.Tensor | None
    count: int
    length: int


@dataclass
class VisionBatchPlan:
    """Everything about a batch that depends only on its grids; built once per forward."""
    patch_order: torch.Tensor           # (S,) packed patch at each window-ordered position
    unit_restore: torch.Tensor          # (S/m²,) window-ordered merged token of each output row
    cos: torch.Tensor                   # (S, 1, head_dim) float32, window order
    sin: torch.Tensor
    window_groups: list[_SegmentGroup]  # attention within windows
    frame_groups: list[_SegmentGroup]   # attention within whole frames
    tokens_per_item: list[int]          # merged tokens (LLM embeddings) of each item


class PatchEmbed(nn.Module):
    def __init__(self, c: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        # Kept as the checkpoint's Conv3d weight (D, C, tps, p, p); applied as a matmul because a
        # conv whose input is exactly one kernel in size is one.
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, bias=False,
                              dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1))   # (S, C*tps*p*p) -> (S, D)


class VisionAttention(nn.Module):
    def __init__(self, c: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        d = c.hidden_size
        self.num_heads = c.num_heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d, dtype=dtype, device="meta")
                                             for _ in range(4))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                groups: list[_SegmentGroup]) -> torch.Tensor:
        S, D = x.shape
        q, k, v = (f(x).view(S, self.num_heads, -1) for f in (self.q, self.k, self.v))  # (S, H, hd)
        # Rotary in float32 (as the reference), then back to the compute dtype.
        q = RotaryEmbedding.apply(q.float(), rope).to(x.dtype)
        k = RotaryEmbedding.apply(k.float(), rope).to(x.dtype)
        return self.proj(_attend(q, k, v, groups).reshape(S, D))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            groups: list[_SegmentGroup]) -> torch.Tensor:
    """Bidirectional attention within segments. q, k, v: (S, H, hd) -> (S, H, hd)."""
    S, H, hd = q.shape

    def run(g: _SegmentGroup, qg, kg, vg) -> torch.Tensor:
        shape = (g.count, g.length, H, hd)
        qg, kg, vg = (t.reshape(shape).transpose(1, 2) for t in (qg, kg, vg))  # (n, H, L, hd)
        o = F.scaled_dot_product_attention(qg, kg, vg)
        return o.transpose(1, 2).reshape(g.count * g.length, H, hd)

    if len(groups) == 1 and groups[0].index is None:
        return run(groups[0], q, k, v)
    out = torch.empty_like(q)
    for g in groups:
        out.index_copy_(0, g.index, run(g, q[g.index], k[g.index], v[g.index]))
    return out


class VisionMLP(nn.Module):
    def __init__(self, c: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        if c.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {c.hidden_act!r} is not supported "
                             f"(supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[c.hidden_act]
        d, i = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(d, i, dtype=dtype, device="meta")
        self.up_proj = nn.Linear(d, i, dtype=dtype, device="meta")
        self.down_proj = nn.Linear(i, d, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, c: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size, _NORM_EPS, dtype)
        self.norm2 = RMSNorm(c.hidden_size, _NORM_EPS, dtype)
        self.attn = VisionAttention(c, dtype)
        self.mlp = VisionMLP(c, dtype)

    def forward(self, x, rope, groups):
        x = x + self.attn(self.norm1(x), rope, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge x merge block of patches (consecutive rows) -> one token."""

    def __init__(self, c: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype):
        super().__init__()
        d = c.hidden_size * c.spatial_merge_size ** 2
        self.ln_q = RMSNorm(c.hidden_size, _NORM_EPS, dtype)
        self.mlp = nn.Sequential(nn.Linear(d, d, dtype=dtype, device="meta"), nn.GELU(),
                                 nn.Linear(d, c.out_hidden_size, dtype=dtype, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x)                                       # (S, D)
        return self.mlp(x.view(-1, self.mlp[0].in_features))   # (S/m², out_hidden_size)


class Qwen2_5OmniVisionEncoder(nn.Module):
    CHECKPOINT_PREFIX = "thinker.visual."

    def __init__(self, config: Qwen2_5OmniVisionEncoderConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        c = config
        rope = c.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope type {rope['rope_type']!r} is not supported "
                             "(only 'axial')")
        if c.hidden_size % c.num_heads or (c.hidden_size // c.num_heads) % 4:
            raise ValueError("vision hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
        self.window_units = c.window_size // c.spatial_merge_size // c.patch_size
        if self.window_units < 1:
            raise ValueError(f"window_size {c.window_size} is smaller than one merge block "
                             f"({c.patch_size * c.spatial_merge_size} pixels)")
        self.config = c
        self.merge = c.spatial_merge_size
        self.head_dim = c.hidden_size // c.num_heads
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        self.full_attention_blocks = frozenset(c.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(c, dtype)
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.depth))
        self.merger = PatchMerger(c, dtype)
        materialize(self, device)          # parameters are filled by the checkpoint loader
        self.requires_grad_(False)
        # Axial rotary: head_dim/4 frequencies each for the row and the column.
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32) / (self.head_dim // 2)
        inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** quarter)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, pixel_values: Sequence[torch.Tensor],
                grid_thw: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """pixel_values[i]: (t*h*w, C*tps*p*p) patches of item i (vision_preprocess), grid_thw[i]:
        its (t, h, w). Returns, per item, (t*h*w / merge², out_hidden_size) embeddings."""
        if len(pixel_values) != len(grid_thw) or not grid_thw:
            raise ValueError("pass one grid_thw per pixel_values tensor, at least one")
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]       # tensors or lists too
        for pv, (t, h, w) in zip(pixel_values, grid_thw):
            if tuple(pv.shape) != (t * h * w, self.patch_dim) or h % self.merge or w % self.merge:
                raise ValueError(f"patches {tuple(pv.shape)} do not match grid {(t, h, w)} "
                                 f"(rows t*h*w, {self.patch_dim} columns, h and w multiples of "
                                 f"{self.merge})")
        plan = self.plan(grid_thw)
        x = self.patch_embed(torch.cat([pv.to(self.inv_freq.device) for pv in pixel_values]))
        x = x[plan.patch_order]                                         # (S, D) window order
        rope = (plan.cos, plan.sin)
        for i, block in enumerate(self.blocks):
            groups = plan.frame_groups if i in self.full_attention_blocks else plan.window_groups
            x = block(x, rope, groups)
        merged = self.merger(x)[plan.unit_restore]                     # (S/m², out) item order
        return list(merged.split(plan.tokens_per_item))

    def plan(self, grid_thw: Sequence[tuple[int, int, int]]) -> VisionBatchPlan:
        """Window permutation, rotary tables and attention segments of a batch of grids."""
        m2 = self.merge ** 2
        unit_orders, positions, window_lens, frame_lens, tokens = [], [], [], [], []
        units_before = 0
        for t, h, w in grid_thw:
            order, units_per_window = _window_order(t, h // self.merge, w // self.merge,
                                                    self.window_units)
            unit_orders.append(order + units_before)
            window_lens += [n * m2 for n in units_per_window]
            frame_lens += [h * w] * t
            positions.append(_patch_positions(t, h, w, self.merge))
            tokens.append(t * h * w // m2)
            units_before += tokens[-1]
        unit_order = torch.cat(unit_orders)                             # (U,)
        patch_order = (unit_order[:, None] * m2 + torch.arange(m2)).flatten()  # (S,)
        device = self.inv_freq.device
        pos = torch.cat(positions)[patch_order].to(device)             # (S, 2) row, column
        angles = (pos[:, :, None].float() * self.inv_freq).flatten(1)  # (S, hd/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]       # (S, 1, hd)
        return VisionBatchPlan(
            patch_order=patch_order.to(device), unit_restore=torch.argsort(unit_order).to(device),
            cos=angles.cos(), sin=angles.sin(),
            window_groups=_group_segments(window_lens, device),
            frame_groups=_group_segments(frame_lens, device), tokens_per_item=tokens)


def _window_order(t: int, rows: int, cols: int, size: int) -> tuple[torch.Tensor, list[int]]:
    """Merged units of a (t, rows, cols) grid listed window by window (windows of size x size
    units, row-major, edge windows smaller), and the unit count of each window."""
    nh, nw = -(-rows // size), -(-cols // size)
    grid = torch.full((t, nh * size, nw * size), -1, dtype=torch.long)
    grid[:, :rows, :cols] = torch.arange(t * rows * cols).view(t, rows, cols)
    windows = grid.view(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(-1, size * size)
    valid = windows >= 0                # every window holds >= 1 unit (ceil-sized padding)
    return windows[valid], valid.sum(1).tolist()


def _patch_positions(t: int, h: int, w: int, m: int) -> torch.Tensor:
    """(t*h*w, 2) row and column of each patch, in the merge-block order of the patches."""
    block_r = torch.arange(h // m).view(-1, 1, 1, 1) * m
    block_c = torch.arange(w // m).view(1, -1, 1, 1) * m
    inner = torch.arange(m)
    rows = (block_r + inner.view(1, 1, m, 1)).expand(h // m, w // m, m, m).flatten()
    cols = (block_c + inner.view(1, 1, 1, m)).expand(h // m, w // m, m, m).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def _group_segments(lengths: list[int], device: torch.device) -> list[_SegmentGroup]:
    """Consecutive segments of `lengths` tokens, grouped by length."""
    if len(set(lengths)) == 1:          # one length: the packed sequence is the batch as is
        return [_SegmentGroup(None, len(lengths), lengths[0])]
    lens = torch.tensor(lengths)
    starts = torch.cumsum(lens, 0) - lens
    groups = []
    for length in sorted(set(lengths)):
        first = starts[lens == length]                                  # (n,)
        index = (first[:, None] + torch.arange(length)).flatten()       # (n*length,)
        groups.append(_SegmentGroup(index.to(device), len(first), length))
    return groups
