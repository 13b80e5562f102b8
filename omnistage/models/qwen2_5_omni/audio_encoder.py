"""Qwen2.5-Omni's audio tower (the thinker's `audio_tower`), batched across requests.

Per audio of T log-mel frames (128 bins, 100 frames/s):
1. cut into chunks of 2 * n_window frames (the last one shorter); each chunk goes through
   conv1 (k3, s1) + GELU and conv2 (k3, s2) + GELU on its own, zero-padded at its edges, so a
   chunk of c frames gives ceil(c / 2) frames of width d_model;
2. sinusoidal positions restart at 0 in every chunk;
3. pre-LN transformer layers whose attention stays inside a chunk (bidirectional);
4. the audio's frames, chunks concatenated, are averaged in pairs (stride-2 pooling, an odd last
   frame dropped), then LayerNorm and a projection to output_dim (the thinker's hidden size).
So T frames give `num_audio_tokens(T)` outputs, one per <|AUDIO|> placeholder.

Batching: the chunks of every audio in the call form one padded batch (K chunks, L frames);
pointwise work runs on the packed real frames (N rows), and attention runs as one
scaled_dot_product_attention over (K, heads, L, head_dim) with a key-padding mask. Only the
last chunk of each audio is ever shorter than the others, so the padding stays small.

Parameter names equal the checkpoint's under `thinker.audio_tower.`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2_5OmniAudioEncoderConfig

from omnistage.layers.activations import gelu
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.models.qwen2_5_omni.audio_features import num_audio_tokens

CHECKPOINT_PREFIX = "thinker.audio_tower."


def sinusoid_table(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """(length, channels) float32: [sin(p * w_i) | cos(p * w_i)], w_i geometric from 1 down to
    1 / max_timescale. Computed in float32 like the reference, so values match it bit for bit."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    half = channels // 2
    step = math.log(max_timescale) / (half - 1)
    inv_timescales = torch.exp(-step * torch.arange(half, dtype=torch.float32))   # (C/2,)
    angles = torch.arange(length)[:, None] * inv_timescales[None, :]              # (P, C/2)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


@dataclass
class ChunkLayout:
    """Where each audio's frames sit in one batched call (index tensors on the model device)."""
    num_chunks: int                 # K
    padded_len: int                 # L: post-conv frames of the longest chunk
    valid_rows: torch.Tensor        # (N,) flat row of each real frame in the (K * L) grid
    key_mask: torch.Tensor | None   # (K, 1, 1, L) bool, True where a key is real; None if no pad
    conv_mask: torch.Tensor         # (K, 1, Lc) model dtype, 1 on each chunk's input frames
    pool_rows: torch.Tensor         # (M,) packed row of the first frame of each pooled pair
    out_lengths: list[int]          # outputs per audio; sums to M


class AudioAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        kw = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(d_model, d_model, bias=True, **kw)
        self.k_proj = nn.Linear(d_model, d_model, bias=False, **kw)
        self.v_proj = nn.Linear(d_model, d_model, bias=True, **kw)
        self.out_proj = nn.Linear(d_model, d_model, bias=True, **kw)

    def forward(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        d, k_chunks, length = x.shape[1], layout.num_chunks, layout.padded_len   # x: (N, D)
        padded = layout.key_mask is not None
        # Projections run on the padded grid: one scatter of x instead of three of q, k, v; the
        # extra rows are at most one chunk per audio. Padded rows are masked out as keys.
        grid = (x.new_zeros(k_chunks * length, d).index_copy_(0, layout.valid_rows, x)
                if padded else x)                                             # (K * L, D)

        def heads(t: torch.Tensor) -> torch.Tensor:                           # -> (K, H, L, hd)
            return t.view(k_chunks, length, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(grid)), heads(self.k_proj(grid)),
                                             heads(self.v_proj(grid)), attn_mask=layout.key_mask)
        out = out.transpose(1, 2).reshape(k_chunks * length, d)
        if padded:
            out = out.index_select(0, layout.valid_rows)                      # (N, D)
        return self.out_proj(out)


class AudioEncoderLayer(nn.Module):
    def __init__(self, c: Qwen2_5OmniAudioEncoderConfig, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.self_attn = AudioAttention(c.d_model, c.encoder_attention_heads, dtype, device)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model, **kw)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim, **kw)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model, **kw)
        self.final_layer_norm = nn.LayerNorm(c.d_model, **kw)

    def forward(self, h: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h), layout)         # (N, D)
        h = h + self.fc2(gelu(self.fc1(self.final_layer_norm(h))))
        if h.dtype == torch.float16:       # as the reference: keep fp16 activations finite
            bound = torch.finfo(h.dtype).max - 1000
            h = h.clamp(-bound, bound)
        return h


class AudioEncoder(nn.Module):
    """forward(list of (num_mel_bins, T_i) features) -> list of (num_audio_tokens(T_i),
    output_dim); each audio's result equals the reference run on that audio alone."""

    def __init__(self, config: Qwen2_5OmniAudioEncoderConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        c = config
        if c.activation_function != "gelu":
            raise ValueError(f"audio tower activation {c.activation_function!r} is not "
                             "supported (only 'gelu')")
        if c.n_window > c.max_source_positions:
            raise ValueError(f"n_window {c.n_window} exceeds max_source_positions "
                             f"{c.max_source_positions}")
        device = torch.device(device)
        kw = {"dtype": dtype, "device": device}
        self.config = c
        self.chunk_frames = 2 * c.n_window          # input frames per chunk
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1, **kw)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1, **kw)
        # In the checkpoint but unused (by the reference too); kept so loading finds its place.
        self.audio_bos_eos_token = nn.Embedding(2, c.output_dim, **kw)
        self.layers = nn.ModuleList(AudioEncoderLayer(c, dtype, device)
                                    for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model, **kw)
        self.proj = nn.Linear(c.d_model, c.output_dim, **kw)
        positions = sinusoid_table(c.max_source_positions, c.d_model).to(**kw)
        self.register_buffer("positions", positions, persistent=False)      # (P, D)
        self.requires_grad_(False)                  # inference only: no autograd graphs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     prefix: str = CHECKPOINT_PREFIX) -> None:
        """Fill every parameter from `(name, tensor)` pairs named `prefix + state key`."""
        require_complete(self, load_prefixed(self, weights, prefix), f"audio tower ({prefix})")

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        if not features:
            return []
        lengths = self._check(features)
        chunks, chunk_lens = self._chunk(features, lengths)                  # (K, mel, Lc)
        layout = self._layout(lengths, chunk_lens, chunks.shape[2])
        # conv1's output past a chunk's end is zeroed, so conv2 sees the chunk's own zero padding.
        x = gelu(self.conv1(chunks)) * layout.conv_mask                      # (K, D, Lc)
        x = gelu(self.conv2(x)).transpose(1, 2)                             # (K, L, D)
        x = x + self.positions[:layout.padded_len]
        h = x.reshape(-1, x.shape[2]).index_select(0, layout.valid_rows)      # (N, D)
        for layer in self.layers:
            h = layer(h, layout)
        pooled = (h[layout.pool_rows] + h[layout.pool_rows + 1]) / 2          # (M, D)
        out = self.proj(self.ln_post(pooled))                                 # (M, output_dim)
        return list(out.split(layout.out_lengths))

    def _check(self, features: list[torch.Tensor]) -> list[int]:
        mel = self.config.num_mel_bins
        for i, f in enumerate(features):
            if f.ndim != 2 or f.shape[0] != mel or f.shape[1] == 0:
                raise ValueError(f"audio features {i} must be ({mel}, T >= 1), "
                                 f"got {tuple(f.shape)}")
        return [f.shape[1] for f in features]

    def _chunk(self, features: list[torch.Tensor],
               lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """All chunks of all audios, zero-padded: (K, mel, Lc), and each chunk's frames."""
        size, parts, chunk_lens = self.chunk_frames, [], []
        w = self.conv1.weight
        for f, t in zip(features, lengths):
            k = -(-t // size)
            f = F.pad(f.to(w.device, w.dtype), (0, k * size - t))              # (mel, k * C)
            parts.append(f.view(f.shape[0], k, size).transpose(0, 1))         # (k, mel, C)
            chunk_lens += [size] * (k - 1) + [t - (k - 1) * size]
        longest = max(chunk_lens)
        return torch.cat(parts)[:, :, :longest].contiguous(), chunk_lens

    def _layout(self, lengths: list[int], chunk_lens: list[int], chunk_width: int) -> ChunkLayout:
        """Index tensors, built on the host from the lengths, moved to the device once."""
        dev, dtype = self.conv1.weight.device, self.conv1.weight.dtype
        conv_mask = torch.arange(chunk_width)[None, :] < torch.tensor(chunk_lens)[:, None]
        post = torch.tensor([(c - 1) // 2 + 1 for c in chunk_lens])          # (K,) conv2 output
        padded_len = int(post.max())
        real = torch.arange(padded_len)[None, :] < post[:, None]              # (K, L)
        frames = [(t - 1) // 2 + 1 for t in lengths]                          # per audio, post-conv
        out_lengths = [num_audio_tokens(t) for t in lengths]
        starts = torch.tensor([0] + frames[:-1]).cumsum(0)                    # packed row offsets
        pool_rows = torch.cat([s + 2 * torch.arange(m) for s, m in zip(starts.tolist(),
                                                                          out_lengths)])
        return ChunkLayout(
            num_chunks=len(chunk_lens), padded_len=padded_len,
            valid_rows=real.flatten().nonzero().squeeze(1).to(dev),
            key_mask=None if bool(real.all()) else real[:, None, None, :].to(dev),
            conv_mask=conv_mask[:, None, :].to(dev, dtype),
            pool_rows=pool_rows.to(dev), out_lengths=out_lengths)
