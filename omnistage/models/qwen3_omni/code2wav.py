"""Qwen3-Omni code2wav: codec frames (B, Q=16, T) at 12.5 Hz -> 24 kHz waveform (B, 1, S).

Built from `Qwen3OmniMoeCode2WavConfig` (or the `code2wav_config` dict of config.json); the
state names equal the checkpoint's under `code2wav.`. The pipeline:

  codes (B, Q, T) -> mean of the Q codebook embeddings          (B, T, E)
  -> causal transformer, sliding-window attention, RoPE        (B, T, E)
  -> per `upsampling_ratios` r: transposed conv x r, ConvNeXt   (B, E, T * prod(ratios))
  -> causal conv to `decoder_dim`, per `upsample_rates` u: SnakeBeta, trimmed transposed
     conv x u (halving the channels), 3 dilated residual units  (B, D / 2^n, ...)
  -> SnakeBeta, causal conv to 1 channel, clamp to [-1, 1]      (B, 1, S)

Lengths. Every convolution is causal except the decoder's transposed convs (kernel 2u,
stride u, u samples trimmed from each end): their output block m mixes input steps m and
m + 1, so each one drops the last block, which would need the next step. A window of T frames
therefore gives S = T * samples_per_frame - trimmed_samples samples (1920 and 555 at the
released config: each window ends 555 samples, 23 ms, short of its last frame's end), and
sample p depends only on frames 0 .. (p + trimmed_samples) // samples_per_frame: a frame
first shows trimmed_samples before its own span.

Streaming (transformers' `chunked_decode`): chunk [start, end) is decoded over the window
codes[start - ctx : end], ctx = min(left_context, start), and the first ctx * samples_per_frame
samples of the window are dropped. A chunk thus emits samples [start * spf, end * spf - trimmed)
of its window's time line, and the `trimmed_samples` before the next chunk's start are never
emitted: the chunks concatenated are shorter than a whole-utterance forward by
trimmed_samples per chunk boundary, and differ from it wherever ctx frames of context do not
cover the attention's reach (num_hidden_layers * (sliding_window - 1) frames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

from omnistage.errors import InvalidRequestError
from omnistage.kernels.code2wav_unit import Code2WavUnitKernel, UnitWeights
from omnistage.kernels.conv1d_tm import TimeMajorConvKernel
from omnistage.layers.activations import gelu
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding
from omnistage.layers.native_kernel import ParameterState, attach_kernel
from omnistage.layers.snake import TimeMajorSnakeBeta
from omnistage.layers.time_major import TimeMajorConv
from omnistage.layers.weights import load_prefixed, materialize, meta_embedding, require_complete

CHECKPOINT_PREFIX = "code2wav."
# Tensors a checkpoint may carry that are derived from the config, never read.
DERIVED_TENSORS = (".rotary_emb.inv_freq", ".rotary_emb.original_inv_freq", "code_offset")
RESIDUAL_DILATIONS = (1, 3, 9)       # the three residual units of each decoder block
CONVNEXT_KERNEL = 7
DECODER_KERNEL = 7


@dataclass(frozen=True)
class Code2WavConfig:
    """code2wav's shape, read from transformers' config (`from_hf`)."""
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    attention_bias: bool
    sliding_window: int | None       # a query sees itself and the sliding_window - 1 frames before
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int     # RoPE table size to start with (grown on demand)
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int

    @classmethod
    def from_hf(cls, config: Qwen3OmniMoeCode2WavConfig | Mapping) -> Code2WavConfig:
        if isinstance(config, Mapping):
            config = Qwen3OmniMoeCode2WavConfig(**config)
        rope = dict(config.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"code2wav RoPE type {rope['rope_type']!r} is not supported (only 'default')")
        if config.hidden_act != "silu":
            raise ValueError(f"code2wav activation {config.hidden_act!r} is not supported (only 'silu')")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads do not split into {kv_heads} key/value heads")
        return cls(
            codebook_size=config.codebook_size, num_quantizers=config.num_quantizers,
            hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size, attention_bias=bool(config.attention_bias),
            sliding_window=config.sliding_window, rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=config.max_position_embeddings,
            upsampling_ratios=tuple(config.upsampling_ratios),
            upsample_rates=tuple(config.upsample_rates), decoder_dim=config.decoder_dim)

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per codec frame: the product of every upsampling factor (1920)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def trimmed_samples(self) -> int:
        """Samples a window of T frames falls short of T * samples_per_frame (555).

        A trimmed transposed conv (kernel k, stride s) maps L -> L * s - (k - s); the
        upsampling ones have k = s (nothing lost), the decoder's k = 2s (s lost at that rate)."""
        short = 0
        for r in self.upsampling_ratios:
            short *= r
        for u in self.upsample_rates:
            short = short * u + u
        return short

    def num_samples(self, frames: int) -> int:
        """Samples a window (or a chunk, after its context is dropped) of `frames` frames gives."""
        return frames * self.samples_per_frame - self.trimmed_samples


# ------------------------------------------------------------------ convolution parts
#
# The convolution stack runs time-major: activations (B, L, C) (a 16-channel 1x1 convolution
# at 24 kHz ran 2-3x slower in PyTorch's default layout, and every layer paid oneDNN's
# reorders both ways). No convolution runs in oneDNN, which made and kept a primitive per
# input shape, and a stream's windows bring ever new lengths: the residual units are one
# native pass each (use_native_units), the other convolutions the native time-major kernel
# (use_native_convolutions) where it serves them, else matrix products (layers/time_major.py).

class CausalStep(Protocol):
    """A layer of the causal convolution stack, time-major (B, L, C) -> (B, L * scale, C'):
    output j reads no input before needs_from(j) (and none past the input j // scale + 1)."""

    scale: int

    def needs_from(self, out_from: int) -> int:
        """The first input index the outputs from index `out_from` on read (may be < 0)."""


def run_causal(layers: Sequence[CausalStep], h: torch.Tensor, emit_from: int) -> torch.Tensor:
    """Runs the stack over h (B, L, C), index 0 the first layer's first input, and returns its
    output from index `emit_from` on. Each layer is fed only the inputs those outputs read: the
    front a causal layer would compute from its zero padding, or from inputs no wanted output
    reads, is never computed (a chunk's decode otherwise runs every layer over the decoder's
    whole reach, 19 input steps, though the 24 kHz layers reach back 0.2 steps). The same values
    as running every layer over everything and cutting (up to float rounding: the convolutions
    see shorter inputs)."""
    starts = [emit_from]
    for layer in reversed(layers):
        starts.append(max(0, layer.needs_from(starts[-1])))
    starts.reverse()         # starts[i]: where layer i's input begins; starts[-1]: emit_from
    at = 0                   # index of h's first row in the current layer's input
    for layer, start in zip(layers, starts):
        if start > at:
            h, at = h[:, start - at:], start
        h, at = layer(h), at * layer.scale
    return h[:, emit_from - at:]


class CausalConv(nn.Module):
    """Conv1d (stride 1; one group or depthwise) left-padded by its reach (kernel - 1) *
    dilation, time-major: (B, L, Cin) -> (B, L, Cout); output t sees inputs t - reach .. t.
    Run by the native time-major kernel where use_native_convolutions gave it one that serves
    the convolution, else as matrix products (layers/time_major.TimeMajorConv): never by
    oneDNN, whose primitive per input shape a stream of windows of ever new lengths kept making."""

    kernel: TimeMajorConvKernel | None = None      # set by use_native_convolutions

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.reach = (kernel - 1) * dilation
        self.run = TimeMajorConv(self.conv)

    scale = 1

    def needs_from(self, out_from: int) -> int:
        return out_from - self.reach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.kernel, self.reach, 0)


class TrimmedTransposedConv(nn.Module):
    """ConvTranspose1d(kernel k = s or 2s, stride s) with k - s samples cut from each end,
    time-major: (B, L, Cin) -> (B, L * s - (k - s), Cout). With k = s output block m is input m
    alone; with k = 2s it mixes inputs m and m + 1 (one frame of look-ahead, hence the cut
    tail). Run as a 1- or 2-tap convolution whose output channels are the s phases by the
    native time-major kernel where use_native_convolutions gave it one that serves it, else as
    matrix products (layers/time_major.TimeMajorConv): never by oneDNN (see CausalConv)."""

    kernel: TimeMajorConvKernel | None = None      # set by use_native_convolutions

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        if kernel not in (stride, 2 * stride):
            raise ValueError(f"code2wav's transposed convolutions have kernel = stride or 2 x stride; "
                             f"got kernel {kernel}, stride {stride}")
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.scale = stride
        self.run = TimeMajorConv(self.conv, cut=kernel - stride)

    def needs_from(self, out_from: int) -> int:
        """Output j mixes inputs j // stride and (with the trim) j // stride + 1."""
        return out_from // self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.kernel)


class ConvNeXtBlock(nn.Module):
    """x + gamma * MLP(LayerNorm(causal depthwise conv(x))), time-major: (B, L, C) -> (B, L, C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, CONVNEXT_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.empty(dim))

    scale = 1

    def needs_from(self, out_from: int) -> int:
        return self.dwconv.needs_from(out_from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x))
        return x + self.pwconv2(gelu(self.pwconv1(y))) * self.gamma


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(dilated causal conv k7(snake(x)))), time-major: (B, L, C) -> (B, L, C)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = TimeMajorSnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, DECODER_KERNEL, dilation=dilation)
        self.act2 = TimeMajorSnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)
        self.kernel: Code2WavUnitKernel | None = None      # set by use_native_units
        self._packed: tuple[ParameterState, UnitWeights] | None = None

    scale = 1

    def needs_from(self, out_from: int) -> int:
        return self.conv1.needs_from(self.conv2.needs_from(out_from))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.supports(x, self.conv2.conv.out_channels):
            return self.kernel(x, self.packed())             # one pass (kernels/code2wav_unit.c)
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def packed(self) -> UnitWeights:
        """The parameters in the native kernel's layout, packed again after any of them
        changed (a load after use_native_units: ParameterState)."""
        params = list(self.parameters())
        if self._packed is None or not self._packed[0].matches(params):
            c1, c2 = self.conv1.conv, self.conv2.conv
            w = UnitWeights(
                conv1=c1.weight.detach().float().permute(2, 1, 0).contiguous(), dilation=c1.dilation[0],
                bias1=None if c1.bias is None else c1.bias.detach().float().contiguous(),
                conv2=c2.weight.detach().float()[:, :, 0].t().contiguous(),
                bias2=None if c2.bias is None else c2.bias.detach().float().contiguous(),
                snake1=self.act1.parameters_for_kernel(), snake2=self.act2.parameters_for_kernel())
            self._packed = (ParameterState.of(params), w)
        return self._packed[1]


def use_native_convolutions(model: nn.Module) -> int:
    """Run `model`'s causal and trimmed transposed convolutions in the native time-major
    kernel (kernels/conv1d_tm.c) where it builds and serves them (float32 CPU activations,
    packed weights up to its MAX_WEIGHT_BYTES; others stay matrix products). -> how many
    modules took it (0: it did not build). Their weights are packed here, not amid the first
    decode's activations: with freed memory retained (host_memory=retain), small lasting blocks
    between a step's large ones kept the heap ~80 MB larger."""
    took = (attach_kernel(model, CausalConv, TimeMajorConvKernel, "code2wav's causal convolutions")
            + attach_kernel(model, TrimmedTransposedConv, TimeMajorConvKernel, "code2wav's transposed convolutions"))
    for m in model.modules():
        if isinstance(m, (CausalConv, TrimmedTransposedConv)) and m.kernel is not None:
            m.run.packed()
    return took


def use_native_units(model: nn.Module) -> int:
    """Run every ResidualUnit of `model` as one native pass where the kernel builds (float32
    CPU activations with channels a multiple of 16; others keep the torch ops; values within
    float rounding of them). -> how many units took it (0: it did not build). Their weights
    are packed here (see use_native_convolutions)."""
    took = attach_kernel(model, ResidualUnit, Code2WavUnitKernel, "code2wav's residual units")
    for m in model.modules():
        if isinstance(m, ResidualUnit) and m.kernel is not None:
            m.packed()
    return took


class DecoderBlock(nn.Module):
    """SnakeBeta, trimmed transposed conv x rate (cin -> cin / 2), three residual units,
    time-major: (B, L, cin) -> (B, L * rate - rate, cin / 2). `block` keeps the checkpoint's
    indices."""

    def __init__(self, cin: int, rate: int):
        super().__init__()
        cout = cin // 2
        self.block = nn.ModuleList([TimeMajorSnakeBeta(cin), TrimmedTransposedConv(cin, cout, 2 * rate, rate)]
                                   + [ResidualUnit(cout, d) for d in RESIDUAL_DILATIONS])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# ------------------------------------------------------------------ transformer parts

def sliding_causal_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True where query q may see key k: k <= q and k > q - window (a query sees
    itself and the window - 1 frames before it, as transformers' sliding-window mask)."""
    q = torch.arange(length, device=device).unsqueeze(1)
    k = torch.arange(length, device=device).unsqueeze(0)
    allowed = k <= q
    return allowed if window is None else allowed & (k > q - window)


class SlidingWindowAttention(nn.Module):
    """Causal multi-head (grouped-query) self-attention with RoPE: (B, T, E) -> (B, T, E)."""

    def __init__(self, c: Code2WavConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        e, bias = c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(e, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(e, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(e, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, e, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        """rope: (cos, sin), each (T, 1, head_dim); mask: (T, T) bool, True = may attend."""
        b, t, _ = x.shape
        q = RotaryEmbedding.apply(self.q_proj(x).view(b, t, self.heads, self.head_dim), rope)
        k = RotaryEmbedding.apply(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), rope)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))                 # (B, heads, T, D)
        if self.kv_heads != self.heads:      # key/value head j serves query heads j*g .. j*g+g-1
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)      # (B, heads, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: (..., E) -> (..., E)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch: (..., E) -> (..., E)."""

    def __init__(self, channels: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-norm block, each residual branch scaled: (B, T, E) -> (B, T, E)."""

    def __init__(self, c: Code2WavConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = SlidingWindowAttention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """The layers and final RMSNorm over frame embeddings: (B, T, E) -> (B, T, E). Positions
    are 0 .. T-1 in every call (a window starts at position 0, as in transformers)."""

    def __init__(self, c: Code2WavConfig, dtype: torch.dtype):
        super().__init__()
        self.config = c
        self.layers = nn.ModuleList(TransformerLayer(c, dtype) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.rope: RotaryEmbedding | None = None     # built on the real device by `init_rope`

    def init_rope(self, positions: int, device: torch.device) -> None:
        """(Re)build the cos/sin tables for positions 0 .. positions-1 (float32, on `device`)."""
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, positions, c.rope_theta, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.rope.max_positions:              # longer than any window so far: grow
            self.init_rope(max(t, 2 * self.rope.max_positions), self.rope.cos.device)
        cos, sin = self.rope.lookup(torch.arange(t, device=self.rope.cos.device), x.dtype)
        rope = (cos.to(x.device), sin.to(x.device))                      # each (T, 1, D)
        mask = sliding_causal_mask(t, self.config.sliding_window, x.device)
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.norm(x)


# ------------------------------------------------------------------ the vocoder

@dataclass
class Code2WavWindow:
    """One streamed chunk of one request: frames [start, end) of `codes`, decoded over a window
    with `context` = min(left_context, start) frames before `start` (transformers' rule)."""
    codes: torch.Tensor          # (Q, T) integer codes of the request so far, T >= end
    start: int
    end: int
    left_context: int = 25
    # False: emit what transformers' chunked_decode emits for the chunk (from start * spf: the
    # trimmed_samples before it were never emitted by the chunk before, a gap at every
    # boundary). True: emit from start * spf - trimmed_samples (a chunk with context), so the
    # chunks join without gaps into the whole-utterance decode's timeline (T * spf - trimmed
    # samples), equal to it where the context covers the decoder's reach.
    seamless: bool = False

    def emit_from(self, spf: int, trimmed: int) -> int:
        """Index in the window's waveform of the chunk's first emitted sample."""
        shift = trimmed if self.seamless and self.context * spf >= trimmed else 0
        return self.context * spf - shift

    @property
    def context(self) -> int:
        return min(self.left_context, self.start)

    @property
    def window_frames(self) -> int:
        return self.end - self.start + self.context

    def window(self) -> torch.Tensor:
        """(Q, context + end - start): the frames the chunk is decoded over."""
        return self.codes[:, self.start - self.context:self.end]

    def check(self) -> None:
        frames = self.codes.shape[-1] if self.codes.dim() == 2 else None
        if frames is None or not 0 <= self.start < self.end <= frames or self.left_context < 0:
            raise ValueError(f"a code2wav window needs codes (Q, T), 0 <= start < end <= T and "
                             f"left_context >= 0; got codes {tuple(self.codes.shape)}, "
                             f"[{self.start}, {self.end}), left_context {self.left_context}")


class Code2Wav(nn.Module):
    """codes (B, Q, T) -> waveform (B, 1, T * samples_per_frame - trimmed_samples) in [-1, 1]."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig | Mapping | Code2WavConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        c = config if isinstance(config, Code2WavConfig) else Code2WavConfig.from_hf(config)
        self.config = c
        device = torch.device(device)
        with torch.device("meta"):
            self.code_embedding = meta_embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
            self.pre_transformer = PreTransformer(c, dtype)
            # upsample.{i} = [transposed conv x r, ConvNeXt]: (B, L, E) -> (B, L * r, E)
            self.upsample = nn.ModuleList(
                nn.ModuleList([TrimmedTransposedConv(c.hidden_size, c.hidden_size, r, r),
                               ConvNeXtBlock(c.hidden_size)]) for r in c.upsampling_ratios)
            self.decoder = nn.ModuleList(self._decoder_layers(c))
        materialize(self, device)
        self.to(dtype)
        self.requires_grad_(False)                   # inference only
        self.pre_transformer.init_rope(c.max_position_embeddings, device)

    @staticmethod
    def _decoder_layers(c: Code2WavConfig) -> list[nn.Module]:
        """decoder.0: causal conv E -> D; decoder.1..n: blocks D -> D / 2^n; then SnakeBeta and
        a causal conv to one channel."""
        out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
        blocks = [DecoderBlock(c.decoder_dim // 2 ** i, u) for i, u in enumerate(c.upsample_rates)]
        return ([CausalConv(c.hidden_size, c.decoder_dim, DECODER_KERNEL)] + blocks
                + [TimeMajorSnakeBeta(out_dim), CausalConv(out_dim, 1, DECODER_KERNEL)])

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def trimmed_samples(self) -> int:
        return self.config.trimmed_samples

    def upsampler_steps(self) -> list[CausalStep]:
        """The upsampling pairs' layers, in order: transformer frames (B, T, E) -> the
        decoder's input (B, T * prod(upsampling_ratios), E)."""
        return [layer for pair in self.upsample for layer in pair]

    def decoder_steps(self) -> list[CausalStep]:
        """The decoder's layers, its blocks' one by one (what run_causal crops between): the
        decoder's input -> (B, L * prod(upsample_rates) - trimmed_samples, 1), not clamped."""
        layers: list[CausalStep] = []
        for layer in self.decoder:
            layers += list(layer.block) if isinstance(layer, DecoderBlock) else [layer]
        return layers

    @property
    def decoder_reach(self) -> int:
        """How many decoder input steps (at 12.5 Hz * prod(upsampling_ratios)) before the step
        of an output sample that sample can depend on: the causal layers' needs, followed from
        the last layer back (each block's transposed conv maps its output sample j to inputs
        j // u and j // u + 1). 19 steps (4.75 frames) at the released config, against the 25
        frames of left context a chunk's window carries for the transformer."""
        steps = 1 << 20                    # far from the start: no layer's needs clamp at 0
        need = steps * math.prod(self.config.upsample_rates)
        for layer in reversed(self.decoder_steps()):
            need = layer.needs_from(need)
        return steps - need

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     prefix: str = CHECKPOINT_PREFIX) -> set[str]:
        """Fill every parameter from tensors named `prefix + state name`; derived tensors (RoPE
        frequencies, codebook offsets) are skipped. CheckpointError if any is missing or misfits."""
        kept = ((k, w) for k, w in weights if not k.endswith(DERIVED_TENSORS))
        loaded = load_prefixed(self, kept, prefix)
        require_complete(self, loaded, f"code2wav ({prefix})")
        return loaded

    def check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """-> codes (B >= 1, Q, T >= 1) as long on the model's device; InvalidRequestError otherwise."""
        c = self.config
        if (not isinstance(codes, torch.Tensor) or codes.dim() != 3 or codes.shape[1] != c.num_quantizers
                or codes.numel() == 0 or codes.is_floating_point() or codes.is_complex()):
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise InvalidRequestError(f"code2wav takes integer codes (B, {c.num_quantizers}, T >= 1); "
                                      f"got {got}", param="codes")
        if int(codes.min()) < 0 or int(codes.max()) >= c.codebook_size:
            raise InvalidRequestError(f"codec ids must be in [0, {c.codebook_size})", param="codes")
        return codes.to(self.code_embedding.weight.device, torch.long)

    @torch.no_grad()
    def forward(self, codes: torch.Tensor, emit_from: int = 0) -> torch.Tensor:
        """codes (B, Q, T) -> (B, 1, num_samples(T) - emit_from), clamped to [-1, 1]: the
        waveform from sample emit_from of the window's time line on, each convolution run over
        only what those samples read (run_causal)."""
        h = self.frames(self.check_codes(codes))
        steps = self.upsampler_steps() + self.decoder_steps()
        return run_causal(steps, h, emit_from).transpose(1, 2).clamp(-1.0, 1.0)

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, Q, T) -> the transformer's output (B, T, E)."""
        c = self.config
        offsets = torch.arange(c.num_quantizers, device=codes.device).view(1, -1, 1) * c.codebook_size
        return self.pre_transformer(self.code_embedding(codes + offsets).mean(1))

    @torch.no_grad()
    def decode_windows(self, windows: list[Code2WavWindow]) -> list[torch.Tensor]:
        """Each window's chunk waveform (num_samples(end - start),), float, on the model's device.

        Invariant: for the window (codes, start, end, left_context) the result equals
        transformers' `chunked_decode(codes[None], chunk_size, left_context)` piece for the chunk
        [start, end), i.e. forward(codes[None, :, start - ctx:end])[0, 0, ctx * spf:], whatever
        the chunk sizes before it. Windows of equal length (context + chunk) share one forward.

        The transformer needs the window's context; the convolutions (most of the work: they
        run at up to 24 kHz) only what the emitted samples read, layer by layer (run_causal):
        the decoder's input from `decoder_reach` steps before the first emitted sample's step,
        its 24 kHz layers from a fraction of a step before, not the whole context (a 12-frame
        chunk with 25 frames of context: 16.75 frames into the decoder instead of 37). The
        samples are the same up to float rounding (the convolutions see shorter inputs)."""
        out: list[torch.Tensor | None] = [None] * len(windows)
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            w.check()
            by_len.setdefault(w.window_frames, []).append(i)
        spf = self.samples_per_frame
        for idx in by_len.values():
            starts = [windows[i].emit_from(spf, self.trimmed_samples) for i in idx]
            emit = min(starts)
            wav = self(torch.stack([windows[i].window() for i in idx]), emit)[:, 0]
            for row, (i, start) in enumerate(zip(idx, starts)):
                out[i] = wav[row, start - emit:]
        return out

    def decode_window(self, codes: torch.Tensor, start: int, end: int,
                      left_context: int = 25) -> torch.Tensor:
        """One request's chunk [start, end) of codes (Q, T): (num_samples(end - start),)."""
        return self.decode_windows([Code2WavWindow(codes, start, end, left_context)])[0]

    @torch.no_grad()
    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300,
                       left_context: int = 25) -> torch.Tensor:
        """Whole codes (B, Q, T) in fixed chunks, as transformers' `chunked_decode`: (B, 1, S)
        with S = sum over chunks of num_samples(chunk frames)."""
        if chunk_size < 1 or left_context < 0:
            raise ValueError(f"chunk_size must be >= 1 and left_context >= 0; got {chunk_size}, "
                             f"{left_context}")
        pieces, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk_size, total)
            ctx = min(left_context, start)
            pieces.append(self(codes[..., start - ctx:end])[..., ctx * self.samples_per_frame:])
            start = end
        return torch.cat(pieces, dim=-1)
