"""Qwen2.5-Omni token2wav DiT: codec codes + speaker -> mel velocity field for flow matching.

Built from `Qwen2_5OmniDiTConfig`; parameter names equal the checkpoint's names under
`token2wav.code2wav_dit_model.`. What differs from the reference's structure, for speed:
- Everything that does not change along the ODE is computed once per request, not per pass:
  the ECAPA speaker encoder over the reference mel, and the input projection of the speaker,
  reference and code embeddings. `input_embed.proj` is linear over the concatenation
  [x | ecapa(ref_mel) | code_emb | spk], so it splits into x @ Wx^T (per pass) plus a static
  term (per request and guidance row).
- Attention is block-local: a layer attends from block b to blocks [b - back, b + ahead]
  (back/ahead in {0, 1}); we gather those key blocks instead of masking a T x T matrix, or
  (use_native_attention, on CPUs) one native call per layer reads each window where it lies.
- One batch holds rows of many requests (different lengths, padded) and both guidance rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.build import NativeBuildError
from omnistage.kernels.dit_stack import (BlockModulation, BoundModulations, DiTLayerProducts,
                                         NativeDiTStack, StackProduct)
from omnistage.kernels.linear import NativeLinearKernel
from omnistage.kernels.linear_w8a8 import GatedResidual, RowNorm, W8A8Kernel, W8A8Weight, pack_w8a8
from omnistage.kernels.weight_pack import PackedWeight
from omnistage.kernels.window_attention import MAX_SLOTS, WindowAttentionKernel, unsupported_reason
from omnistage.layers.native_kernel import attach_kernel
from omnistage.layers.onednn import (onednn_bf16_available, onednn_linear_available, pack_weight,
                                     packed_linear)
from omnistage.layers.weights import materialize, meta_embedding

log = logging.getLogger(__name__)
NORM_EPS = 1e-6             # the modulated LayerNorms' epsilon


class DiTLinear(nn.Linear):
    """nn.Linear that may switch to oneDNN's packed fp32 GEMM on CPU (2.3x the default BLAS
    path on the AVX-512 Zen CPUs we serve from: 240 vs 104 GFLOP/s at 1200x256x256), to the
    native float32 linear kernel (linear.c), or to the native int8 product (W8A8,
    linear_w8a8.c)."""

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    packed_dtype: torch.dtype = torch.float32     # of the packed weight; activations go in as it
    w8a8: W8A8Weight | None = None                # the int8 weight, when packed for W8A8
    w8a8_kernel: W8A8Kernel | None = None
    native: PackedWeight | None = None            # the float32 weight, when packed for linear.c
    native_kernel: NativeLinearKernel | None = None

    def pack_for_onednn(self, dtype: torch.dtype = torch.float32, w8a8: W8A8Kernel | None = None,
                        native: NativeLinearKernel | None = None) -> None:
        """dtype bfloat16: weights and inputs rounded to bf16, sums in float32 (the CPU's bf16
        dot products); outputs rounded to bf16, then back to the input's dtype. w8a8: the
        product in int8 instead (the weight per output column, each input row per call, exact
        integer sums; float32 in and out), dtype unused. native (dtype float32, no w8a8): the
        native float32 kernel instead (faster than oneDNN's at a first chunk's few hundred
        rows, and a row's result the same in any batch)."""
        w = self.weight
        if w8a8 is not None or (native is not None and dtype == torch.float32):
            if w8a8 is not None:
                self.w8a8, self.w8a8_kernel = pack_w8a8(w), w8a8
            else:
                self.native, self.native_kernel = native.pack(w.detach().float().t()), native
            self.packed_dtype = torch.float32
            self.packed_bias = None if self.bias is None else self.bias.detach().float().contiguous()
        else:
            self.packed, self.packed_dtype = pack_weight(w.to(dtype)), dtype
            self.packed_bias = None if self.bias is None else self.bias.detach().to(dtype)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None or self.w8a8 is not None or self.native is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_packed:
            return F.linear(x, self.weight, self.bias)
        return self.packed_call(x)

    def packed_call(self, x: torch.Tensor, post_op: str = "none", algorithm: str = "",
                    out_dtype: torch.dtype | None = None, norm: RowNorm | None = None,
                    residual: GatedResidual | None = None) -> torch.Tensor:
        """The packed GEMM with `post_op` fused ("none", or "gelu" with algorithm "tanh"); the
        result in out_dtype (x's). norm: x's rows layer-normed first; residual: res + gate * y
        after. The int8 product does both in its own passes (linear_w8a8.c); the other paths
        run them in torch around the GEMM (apply_norm, add_gated), as the block did before."""
        if self.w8a8 is not None:
            act = "none" if post_op == "none" else f"{post_op}_{algorithm}"
            y = self.w8a8_kernel(x, self.w8a8, self.packed_bias, act, norm, residual)
            return y.to(out_dtype or x.dtype)
        dtype = out_dtype or x.dtype
        if norm is not None:
            x = apply_norm(x, norm)
        if self.native is not None:
            y = self.native_kernel(x.float(), self.native, self.packed_bias)
            y = (y if post_op == "none" else F.gelu(y, approximate=algorithm)).to(dtype)
        else:
            y = packed_linear(x.to(self.packed_dtype), self.packed, self.packed_bias, post_op, algorithm).to(dtype)
        return y if residual is None else add_gated(residual, y)


# ---------------------------------------------------------------- ECAPA-TDNN speaker encoder

class TDNN(nn.Module):
    """Conv1d ('same' length, reflect padding) + ReLU over (B, C, T)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channel groups; group i>0 is convolved after adding group i-1's output (hierarchical)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(x.chunk(self.scale, dim=1))
        prev = None
        for i in range(1, self.scale):
            prev = self.blocks[i - 1](parts[i] if prev is None else parts[i] + prev)
            parts[i] = prev
        return torch.cat(parts, dim=1)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, squeeze, 1)
        self.conv2 = nn.Conv1d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (B, C, T)
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(cin, cout, 1, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout, 1, 1)
        self.se_block = SqueezeExcite(cout, se)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time of x (B, C, T) with weights w summing to 1 over T."""
    mean = (w * x).sum(dim=2)
    var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, var.clamp(min=1e-12).sqrt()


class AttentiveStatsPool(nn.Module):
    """Attention over time conditioned on the global mean/std, then weighted mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (B, C, T) -> (B, 2C, 1)
        t = x.shape[2]
        mean, std = _weighted_stats(x, torch.full_like(x[:, :1], 1.0 / t))
        ctx = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], 1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN over a reference mel (B, R, mel_dim) -> (B, enc_dim)."""

    def __init__(self, c):
        super().__init__()
        ch, ks, dil = c.enc_channels, c.enc_kernel_sizes, c.enc_dilations
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations need equal lengths")
        self.blocks = nn.ModuleList([TDNN(c.mel_dim, ch[0], ks[0], dil[0])])
        self.blocks.extend(SERes2NetBlock(ch[i - 1], ch[i], c.enc_res2net_scale, c.enc_se_channels,
                                          ks[i], dil[i]) for i in range(1, len(ch) - 1))
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], c.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, c.enc_dim, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = mel.transpose(1, 2)                       # (B, mel_dim, R)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))      # multi-layer feature aggregation
        return self.fc(self.asp(h)).squeeze(2)


class InputEmbed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = DiTLinear(c.mel_dim + c.enc_dim + c.emb_dim + c.enc_emb_dim, c.hidden_size)
        self.spk_encoder = SpeakerEncoder(c)
        # Column ranges of proj.weight for [x | ecapa(ref_mel) | code_emb | spk]
        widths = [c.mel_dim, c.enc_dim, c.emb_dim, c.enc_emb_dim]
        self.cols = [(sum(widths[:i]), sum(widths[:i + 1])) for i in range(4)]
        self.mel_proj: DiTLinear | None = None   # part(0) as its own packed linear (pack_for_onednn)

    def part(self, i: int) -> torch.Tensor:
        a, b = self.cols[i]
        return self.proj.weight[:, a:b]

    def mel_terms(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, mel) -> (B, T, D): the ODE state's share of the input projection, the only
        share that changes between evaluations."""
        if self.mel_proj is not None and not torch.is_autocast_enabled(x.device.type):
            return self.mel_proj(x)
        return F.linear(x, self.part(0))


class CodecEmbed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.codec_embed = meta_embedding(c.num_embeds + 1, c.emb_dim)


class TimeEmbed(nn.Module):
    """Sinusoidal features of t (scaled by 1000) -> MLP."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([DiTLinear(freq_dim, dim), nn.SiLU(), DiTLinear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:     # (B,) -> (B, dim)
        half = self.freq_dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        ang = 1000 * t.unsqueeze(1) * freqs.unsqueeze(0)
        h = torch.cat([ang.sin(), ang.cos()], dim=-1).to(t.dtype)
        for layer in self.time_mlp:
            h = layer(h)
        return h


# ---------------------------------------------------------------- transformer

@dataclass
class BatchLayout:
    """Where the valid frames of each row of a padded DiT batch are."""
    lengths: list[int]            # valid frames per row
    offsets: list[int]            # absolute frame index of each row's first frame (block-aligned)
    frames: int                   # padded length, a multiple of block_size


@dataclass(frozen=True)
class AttentionWindow:
    """What a (back, ahead) kind of layer needs to know of a batch to mask its windows, built
    once per solve: SDPA's mask (window_mask), and the rows' valid frames, which the native
    kernel takes instead."""
    mask: torch.Tensor | None     # (B*nb, 1, bs, W*bs) bool; None: nothing masked
    lengths: torch.Tensor         # (B,) int64


class Attention(nn.Module):
    kernel: WindowAttentionKernel | None = None     # set by DiTModel.use_native_attention

    def __init__(self, c):
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        inner = c.num_attention_heads * c.head_dim
        self.to_q = DiTLinear(c.hidden_size, inner)
        self.to_k = DiTLinear(c.hidden_size, inner)
        self.to_v = DiTLinear(c.hidden_size, inner)
        self.to_out = nn.ModuleList([DiTLinear(inner, c.hidden_size)])
        self.qkv: DiTLinear | None = None      # q|k|v in one packed GEMM (pack_for_onednn)

    def pack_for_onednn(self, dtype: torch.dtype = torch.float32, w8a8: W8A8Kernel | None = None,
                        native: NativeLinearKernel | None = None) -> None:
        """One GEMM for q, k and v (the same numbers as three: each output column is the same
        dot product), then the projections drop their own weights. w8a8, native: see DiTLinear."""
        q, k, v = self.to_q, self.to_k, self.to_v
        merged = DiTLinear(q.in_features, 3 * q.out_features, device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            merged.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        merged.pack_for_onednn(dtype, w8a8, native)
        self.qkv = merged
        for lin in (q, k, v):
            lin.weight = nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
            lin.bias = nn.Parameter(torch.empty(0, dtype=lin.bias.dtype), requires_grad=False)
        self.to_out[0].pack_for_onednn(dtype, w8a8, native)

    def forward(self, x: torch.Tensor, norm: RowNorm, gate: torch.Tensor, rope: torch.Tensor,
                bs: int, back: int, ahead: int, window: AttentionWindow) -> torch.Tensor:
        """x + gate * attention(LayerNorm(x) by `norm`)."""
        b, t, _ = x.shape
        nb, h, d = t // bs, self.heads, self.head_dim
        out, residual = self.to_out[0], GatedResidual(x, gate)
        if self.qkv is not None:
            # For the kernel, q|k|v stay in the GEMM's dtype and the kernel's output goes into
            # the output GEMM as it is: with bf16 GEMMs no float32 copy of either (the same
            # bits: the kernel widens exactly and rounds its output as .to(bfloat16) would).
            keep = self.qkv.packed_dtype if self.kernel is not None else None
            qkv = self.qkv.packed_call(x, out_dtype=keep, norm=norm).view(b, t, 3, h, d)
        else:
            xn = apply_norm(x, norm)
            qkv = torch.stack([self.to_q(xn), self.to_k(xn), self.to_v(xn)], dim=2).view(b, t, 3, h, d)
        if self.kernel is not None and self.kernel.supports(qkv, back, ahead):
            o = self.kernel(qkv, window.lengths, back, ahead, d ** -0.5, rope)
            if out.is_packed:
                return out.packed_call(o, out_dtype=x.dtype, residual=residual)
            return add_gated(residual, out(o))
        qkv = qkv.to(x.dtype) if self.qkv is not None else qkv
        # The checkpoint was trained with RoPE on head 0 only, pairs (2i, 2i+1) interleaved:
        # q's and k's head 0 rotated in one go (the kernel rotates them as it reads them).
        _rotate_head0(qkv, rope)
        q, k, v = qkv.unbind(2)
        qb = q.reshape(b, nb, bs, h, d).transpose(2, 3).reshape(b * nb, h, bs, d)
        kb, vb = (_key_windows(z.reshape(b, nb, bs, h, d).transpose(2, 3), back, ahead) for z in (k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=window.mask)   # (B*nb, H, bs, d)
        o = o.view(b, nb, h, bs, d).transpose(2, 3).reshape(b, t, h * d)
        return add_gated(residual, out(o))


def _rotate_head0(qkv: torch.Tensor, rope: torch.Tensor) -> None:
    """In place: head 0 of q and k in qkv (B, T, 3, H, d) rotated pairwise, pair (2i, 2i+1) as
    the complex number x_2i + i x_2i+1 times rope (B, T, 1, d/2) = cos + i sin of its angle:
    (x0 cos - x1 sin, x1 cos + x0 sin). One complex multiply over the strided view, where the
    real form took eight passes and a stack (~110 us against ~17 per layer on a first chunk)."""
    part = qkv[:, :, :2, 0].unflatten(-1, (-1, 2))                   # (B, T, 2, d/2, 2)
    if part.dtype == torch.float32:
        torch.view_as_complex(part).mul_(rope)
    else:         # bf16 under autocast: no complex type; rotated in float32, written back
        part.copy_(torch.view_as_real(torch.view_as_complex(part.float()) * rope))


def _key_windows(z: torch.Tensor, back: int, ahead: int) -> torch.Tensor:
    """(B, nb, H, bs, d) -> (B*nb, H, (back+1+ahead)*bs, d): for each block, the blocks
    b-back..b+ahead side by side (zeros outside the sequence; the mask hides them)."""
    b, nb, h, bs, d = z.shape
    if back == 0 and ahead == 0:
        return z.reshape(b * nb, h, bs, d)
    # Written slot by slot into one buffer (not padded, then concatenated: two more full
    # passes, ~10% of a first chunk's solve); only the slots outside the sequence are zeroed.
    win = z.new_empty(b, nb, h, (back + 1 + ahead) * bs, d)
    for i in range(back + 1 + ahead):            # slot i of block j holds block j - back + i
        slot, shift = win[:, :, :, i * bs:(i + 1) * bs], i - back
        lo, hi = max(0, -shift), nb - max(0, shift)
        slot[:, lo:hi] = z[:, lo + shift:hi + shift]
        slot[:, :lo].zero_()
        slot[:, hi:].zero_()
    return win.reshape(b * nb, h, -1, d)


def window_mask(layout: BatchLayout, bs: int, back: int, ahead: int,
                device: torch.device) -> torch.Tensor | None:
    """(B*nb, 1, bs, W*bs) bool: a valid query sees the in-sequence keys of its window; a
    padding query sees its whole window, so that no row is all-masked (its output is unused)."""
    nb = layout.frames // bs
    if back == 0 and ahead == 0 and all(n == layout.frames for n in layout.lengths):
        return None
    lengths = torch.tensor(layout.lengths, device=device).view(-1, 1, 1)
    blk = torch.arange(nb, device=device)
    key_blk = blk.view(nb, 1) + torch.arange(-back, ahead + 1, device=device)        # (nb, W)
    key_pos = (key_blk.unsqueeze(-1) * bs + torch.arange(bs, device=device)).flatten(1)  # (nb, W*bs)
    q_pos = blk.view(nb, 1) * bs + torch.arange(bs, device=device)                    # (nb, bs)
    valid_key = (key_pos >= 0) & (key_pos < lengths)                                  # (B, nb, W*bs)
    pad_query = q_pos >= lengths                                                      # (B, nb, bs)
    mask = valid_key.unsqueeze(2) | pad_query.unsqueeze(3)
    return mask.flatten(0, 1).unsqueeze(1)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        # Keys "0" and "3" are the checkpoint's (Linear, GELU, Dropout, Linear) positions.
        self.ff = nn.ModuleDict({"0": DiTLinear(dim, dim * mult), "3": DiTLinear(dim * mult, dim)})

    def forward(self, x: torch.Tensor, norm: RowNorm, gate: torch.Tensor) -> torch.Tensor:
        """x + gate * feed_forward(LayerNorm(x) by `norm`)."""
        up, down = self.ff["0"], self.ff["3"]
        residual = GatedResidual(x, gate)
        if up.is_packed and not torch.is_autocast_enabled(x.device.type):
            # GELU as the GEMM's post-op: one pass over the activations instead of two
            # (oneDNN's tanh-GELU; within ~1 ulp of F.gelu's); h stays in the GEMMs' dtype.
            h = up.packed_call(x, "gelu", "tanh", out_dtype=up.packed_dtype, norm=norm)
            return down.packed_call(h, out_dtype=x.dtype, residual=residual)
        return add_gated(residual, down(F.gelu(up(apply_norm(x, norm)), approximate="tanh")))


class AdaNorm(nn.Module):
    """Holds the linear producing per-row modulation from the time embedding."""

    def __init__(self, dim: int, parts: int):
        super().__init__()
        self.linear = DiTLinear(dim, dim * parts)
        self.parts = parts

    def forward(self, temb: torch.Tensor) -> list[torch.Tensor]:
        return list(self.linear(F.silu(temb)).chunk(self.parts, dim=-1))


def modulation(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> RowNorm:
    """LayerNorm(x) * (1 + scale) + shift as a LayerNorm's weight and bias; scale, shift (1, D):
    all rows share t."""
    # (dtypes follow x: under bf16 autocast the modulation comes out of a linear in bf16)
    return RowNorm((1 + scale[0]).to(x.dtype), shift[0].to(x.dtype), NORM_EPS)


def apply_norm(x: torch.Tensor, norm: RowNorm) -> torch.Tensor:
    """The modulated LayerNorm as one fused op."""
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, eps=norm.eps)


def add_gated(residual: GatedResidual, y: torch.Tensor) -> torch.Tensor:
    """res + gate * y in one pass; gate (1, D) broadcast over the rows."""
    return torch.addcmul(residual.res, residual.gate.view(-1), y)


class DiTBlock(nn.Module):
    def __init__(self, c, back: int, ahead: int):
        super().__init__()
        self.back, self.ahead = back, ahead
        self.attn_norm = AdaNorm(c.hidden_size, 6)
        self.attn = Attention(c)
        self.ff = FeedForward(c.hidden_size, c.ff_mult)

    def forward(self, x: torch.Tensor, mods: list[torch.Tensor], rope: torch.Tensor,
                bs: int, window: AttentionWindow) -> torch.Tensor:
        """mods: this block's attn_norm(temb), six (1, D) modulation vectors."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mods
        x = self.attn(x, modulation(x, scale_a, shift_a), gate_a, rope, bs, self.back, self.ahead, window)
        return self.ff(x, modulation(x, scale_f, shift_f), gate_f)


@dataclass
class SpeakerTerms:
    """Per-request constants of the input projection (bias included), one per guidance row."""
    cond: torch.Tensor            # (D,) from ecapa(ref_mel) and the speaker vector
    uncond: torch.Tensor          # (D,) from ecapa(zeros), zero speaker vector and code 0


class DiTModel(nn.Module):
    """Velocity field v(x, t | codes, speaker) over a padded batch of rows."""

    def __init__(self, c, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        rope = c.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"DiT rope type {rope.get('rope_type')!r} is not supported (only 'default')")
        self.config = c
        self.block_size, self.repeats, self.mel_dim = c.block_size, c.repeats, c.mel_dim
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.bf16_matmuls = False      # see forward()
        self._time_cache: dict[tuple[float, bool], tuple] = {}    # see time_terms()
        self.stack: NativeDiTStack | None = None                   # see use_native_stack()
        self._bound_cache: dict[tuple[float, bool], BoundModulations] = {}    # see _bound()
        with torch.device("meta"):          # no init work: every tensor is loaded
            self.time_embed = TimeEmbed(c.hidden_size)
            self.text_embed = CodecEmbed(c)
            self.input_embed = InputEmbed(c)
            self.transformer_blocks = nn.ModuleList(
                DiTBlock(c, int(i in c.look_backward_layers), int(i in c.look_ahead_layers))
                for i in range(c.num_hidden_layers))
            self.norm_out = AdaNorm(c.hidden_size, 2)
            self.proj_out = DiTLinear(c.hidden_size, c.mel_dim)
        materialize(self, torch.device(device))
        self.to(dtype)

    def speaker_terms(self, cond: torch.Tensor, ref_mel: torch.Tensor) -> SpeakerTerms:
        """cond (1, enc_emb_dim), ref_mel (1, R, mel_dim); computed once per request."""
        emb = self.input_embed
        ecapa = emb.spk_encoder(torch.cat([ref_mel, torch.zeros_like(ref_mel)]))      # (2, enc_dim)
        code0 = self.text_embed.codec_embed.weight[0]
        bias = emb.proj.bias
        c_row = bias + ecapa[0] @ emb.part(1).T + cond[0] @ emb.part(3).T
        u_row = bias + ecapa[1] @ emb.part(1).T + code0 @ emb.part(2).T
        return SpeakerTerms(c_row, u_row)

    def code_terms(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (T,) -> (T * repeats, D): the code embedding's share of the input projection."""
        e = self.text_embed.codec_embed(codes) @ self.input_embed.part(2).T
        return e.repeat_interleave(self.repeats, dim=0)

    def rope_angles(self, layout: BatchLayout, device: torch.device) -> torch.Tensor:
        """(B, T, 1, head_dim/2) complex64: cos + i sin of each row's absolute frame positions'
        angles (see _rotate_head0)."""
        d = self.config.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
        pos = (torch.tensor(layout.offsets, device=device).view(-1, 1)
               + torch.arange(layout.frames, device=device))
        ang = pos.unsqueeze(-1).float() * inv
        return torch.complex(ang.cos(), ang.sin()).unsqueeze(2)

    def forward(self, x: torch.Tensor, static: torch.Tensor, t: torch.Tensor,
                rope: torch.Tensor, windows: dict[tuple[int, int], AttentionWindow]) -> torch.Tensor:
        """x (B, T, mel), static (B, T, D) per-row constant input terms, t 0-d (shared by all rows)
        -> velocity (B, T, mel). rope, windows: rope_angles() and windows_for() of the batch's
        layout, built once per solve."""
        # Opt-in: matmuls in bfloat16 (autocast), ~1.4x on CPUs with bf16 units; the ODE state
        # stays float32. Off by default: the reference runs token2wav in float32.
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16_matmuls):
            mods, (scale, shift) = self.time_terms(t)
            h = self.input_embed.mel_terms(x) + static
            if self.stack is not None and not torch.is_autocast_enabled(x.device.type):
                # every kind of layer's window has the layout's lengths
                h = self.stack(h, self._bound(t, h, mods), next(iter(windows.values())).lengths, rope)
            else:
                for block, m in zip(self.transformer_blocks, mods):
                    h = block(h, m, rope, self.block_size, windows[(block.back, block.ahead)])
            return self.proj_out(apply_norm(h, modulation(h, scale, shift))).to(x.dtype)

    def time_terms(self, t: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Every block's modulation vectors and the output norm's (scale, shift) at time t.
        They depend on t alone, and every solve visits the same few t (its time grid): each is
        computed once and kept (the same numbers as computing it every pass)."""
        key = (float(t), self.bf16_matmuls)
        terms = self._time_cache.get(key)
        if terms is None:
            temb = self.time_embed(t.reshape(1))               # (1, D): every row is at the same t
            terms = ([b.attn_norm(temb) for b in self.transformer_blocks], self.norm_out(temb))
            if len(self._time_cache) < 4096:                   # grids are few; bound it anyway
                self._time_cache[key] = terms
        return terms

    def _bound(self, t: torch.Tensor, h: torch.Tensor, mods: list[list[torch.Tensor]]) -> BoundModulations:
        """The blocks' modulations at t bound for the stack, as DiTBlock.forward makes them
        (modulation(), the gates), once per t like time_terms."""
        key = (float(t), self.bf16_matmuls)
        bound = self._bound_cache.get(key)
        if bound is None:
            bound = self.stack.bind([BlockModulation(modulation(h, scale_a, shift_a), gate_a,
                                                     modulation(h, scale_f, shift_f), gate_f)
                                     for shift_a, scale_a, gate_a, shift_f, scale_f, gate_f in mods])
            if len(self._bound_cache) < 4096:
                self._bound_cache[key] = bound
        return bound

    def windows_for(self, layout: BatchLayout, device: torch.device) -> dict[tuple[int, int], AttentionWindow]:
        """The AttentionWindow of each (back, ahead) kind of layer."""
        kinds = {(b.back, b.ahead) for b in self.transformer_blocks}
        lengths = torch.tensor(layout.lengths, dtype=torch.int64, device=device)
        return {k: AttentionWindow(window_mask(layout, self.block_size, *k, device), lengths) for k in kinds}

    def use_native_attention(self) -> int:
        """Every block's attention as one native call (kernels/window_attention.c) where it
        builds and fits: float32 or bf16 on the CPU (with packed bf16 GEMMs q|k|v and the
        output stay bf16). On the small checkpoint (16 rows x 120 frames, 4 heads,
        Zen 5) a layer's attention with its window building took 0.65-2.7 ms, now 0.33-0.80 ms
        (RoPE included); values within ~1e-5 of SDPA's. -> how many layers took it (0: none)."""
        c = self.config
        if next(self.parameters()).device.type != "cpu" or unsupported_reason(c.head_dim, c.block_size):
            return 0
        return attach_kernel(self, Attention, lambda: WindowAttentionKernel(c.head_dim, c.block_size),
                             "the token2wav DiT's attention")

    def stack_fits(self) -> bool:
        """Whether this DiT's shapes suit the native attention and block stack (on the CPU,
        windows of at most MAX_SLOTS blocks): what use_native_stack needs besides the kernels
        building. The native float32 products pay off only inside the stack (alone, their
        GELU is a pass of its own, where oneDNN's GEMM applies it as it writes)."""
        c = self.config
        return (next(self.parameters()).device.type == "cpu"
                and unsupported_reason(c.head_dim, c.block_size) is None
                and all(b.back + 1 + b.ahead <= MAX_SLOTS for b in self.transformer_blocks))

    def pack_for_onednn(self, dtype: torch.dtype = torch.float32, w8a8: W8A8Kernel | None = None,
                        native: NativeLinearKernel | None = None) -> int:
        """Switch linears to oneDNN's packed GEMM where available, with weights (and GEMM
        inputs) in `dtype` (bfloat16: see DiTLinear.pack_for_onednn; the ODE state, norms,
        attention and residuals stay float32); returns how many. input_embed.proj stays plain
        (its weight is read in column slices); its mel columns, used at every evaluation, get a
        packed copy. w8a8: the products over every frame row (attention's q|k|v and output,
        the feed-forwards: ~90% of the solve's multiply-adds) in int8 instead (DiTLinear);
        native (float32, no w8a8): those products in the native float32 kernel instead."""
        p = next(self.parameters())
        if not onednn_linear_available(p.device, p.dtype) or (dtype == torch.bfloat16
                                                               and not onednn_bf16_available()):
            return 0
        self._time_cache.clear()      # computed by the other GEMM path
        attns = [m for m in self.modules() if isinstance(m, Attention)]
        for a in attns:
            a.pack_for_onednn(dtype, w8a8, native)
        ffs = {id(lin) for m in self.modules() if isinstance(m, FeedForward) for lin in m.ff.values()}
        done = {id(m) for a in attns for m in (a.to_q, a.to_k, a.to_v, a.to_out[0], a.qkv)}
        lins = [m for m in self.modules() if isinstance(m, DiTLinear) and m is not self.input_embed.proj
                and id(m) not in done]
        for m in lins:
            m.pack_for_onednn(dtype, *((w8a8, native) if id(m) in ffs else ()))
        emb = self.input_embed
        mel = emb.part(0)
        emb.mel_proj = DiTLinear(mel.shape[1], mel.shape[0], bias=False, device=mel.device, dtype=mel.dtype)
        with torch.no_grad():
            emb.mel_proj.weight.copy_(mel)
        emb.mel_proj.pack_for_onednn(dtype)
        return len(lins) + 2 * len(attns) + 1

    def use_native_stack(self) -> bool:
        """All blocks as one native call per evaluation (kernels/dit_stack.c) where every
        frame-row product is int8 or native float32 (pack_for_onednn with w8a8 or native) and
        every layer has the native attention (use_native_attention): the same kernels (int8:
        with the same arguments, so the same bits; float32: the norms, GELU and residuals in C,
        within float rounding of torch's); ~2.4 ms of Python less per evaluation. True when
        attached."""
        blocks = list(self.transformer_blocks)
        layers = [_stack_layer(b) for b in blocks]
        if not self.stack_fits() or not layers or any(x is None for x in layers):
            return False
        attn = blocks[0].attn
        lins = [lin for b in blocks for lin in (b.attn.qkv, b.attn.to_out[0], *b.ff.ff.values())]
        w8a8 = next((lin.w8a8_kernel for lin in lins if lin.w8a8 is not None), None)
        native = next((lin.native_kernel for lin in lins if lin.native is not None), None)
        try:
            self.stack = NativeDiTStack(attn.kernel, layers, self.config.hidden_size, attn.heads, NORM_EPS,
                                        w8a8=w8a8, linear=native)
        except NativeBuildError as e:
            log.info("the token2wav DiT's blocks stay one call each: %s", e)
            return False
        self._bound_cache.clear()
        return True


def _stack_layer(block: DiTBlock) -> DiTLayerProducts | None:
    """A block's products for the stack, or None where one is neither int8 nor native float32,
    or the block has no native attention (its window's width: DiTModel.stack_fits)."""
    a, ff = block.attn, block.ff.ff
    lins = (a.qkv, a.to_out[0], ff["0"], ff["3"])
    if a.kernel is None or any(lin is None or (lin.w8a8 is None and lin.native is None) for lin in lins):
        return None
    products = [StackProduct(lin.w8a8 if lin.w8a8 is not None else lin.native, lin.packed_bias) for lin in lins]
    return DiTLayerProducts(*products, back=block.back, ahead=block.ahead)
