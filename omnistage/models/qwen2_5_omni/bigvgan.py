"""Qwen2.5-Omni BigVGAN vocoder: log-mel (B, mel_dim, F) -> waveform (B, F * hop) at 24 kHz.

Built from `Qwen2_5OmniBigVGANConfig`; parameter names equal the checkpoint's names under
`token2wav.code2wav_bigvgan_model.`. The network is purely convolutional, so a window of mel
frames with `receptive_field()` frames of context on each side gives, after cropping, the same
samples as a run over the whole utterance (the streaming vocoder relies on it).

A window's run can be asked for part of its samples (`forward(mel, emit=...)`, what a stream
emits of a window): every layer then computes only the outputs those samples read, found by
walking the layers back from the emitted range (each layer's reach, `needs`). A stream's window
carries receptive_field() frames of context on each side, all of which the first, 1-sample-a-
frame layers read, but the 24 kHz layers reach a fraction of a frame: run whole, a 48-frame
chunk cost 120 frames at every layer (small checkpoint, 8 windows of 48 + 72 frames: 152 ms
whole, 90 ms for the 48 new frames; of 288 + 72: 477 against 412 ms).

Inside, every layer runs time-major (layers/time_major.py): activations (B, L, C). The
anti-aliased activations' depthwise resampling filters ran 3-9x slower in PyTorch's (B, C, L)
layout (oneDNN reordered every input and output). No convolution runs in oneDNN, which makes and
keeps a primitive (JIT) for every new (batch, length), and a stream's windows, batches and tails
keep making new ones: they run in a native kernel where it serves them (use_native_convolutions,
kernels/conv1d_tm.c; the upsamplers as convolutions whose output channels are the stride's
phases), else as matrix products.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.aa_snake import AntiAliasedSnakeKernel
from omnistage.kernels.conv1d_tm import TimeMajorConvKernel
from omnistage.layers import time_major
from omnistage.layers.time_major import TimeMajorConv
from omnistage.layers.native_kernel import attach_kernel
from omnistage.layers.snake import TimeMajorSnakeBeta
from omnistage.layers.weights import materialize

# The anti-aliased activations resample by 2 with 12-tap Kaiser-windowed sinc filters.
RESAMPLE_RATIO = 2
RESAMPLE_TAPS = 12
# Input steps on each side an anti-aliased activation's output step reads (upsampling FIR,
# SnakeBeta, downsampling FIR): 5 for 12 taps at ratio 2.
ACT_REACH = (2 * RESAMPLE_TAPS - 2) // (2 * RESAMPLE_RATIO)


# ---- computing part of a layer's outputs --------------------------------------------------
# Ranges are [lo, hi) of steps of a layer's input or output over the whole window (0: the
# window's first step at that layer's rate); `length`: the layer input's steps in the window.
# x holds the input steps [x_lo, x_lo + x.shape[1]) (at least what the range needs). The
# window's edges are the signal's: zeros (convolutions) or its edge steps repeated
# (activations) beyond them, as a run over the whole window pads.

def _clamp(lo: int, hi: int, length: int) -> tuple[int, int]:
    return max(lo, 0), min(hi, length)


def conv_needs(conv: nn.Conv1d, lo: int, hi: int, length: int) -> tuple[int, int]:
    """The input steps a stride-1 convolution's outputs [lo, hi) read (padding `p` each side)."""
    p, span = conv.padding[0], (conv.kernel_size[0] - 1) * conv.dilation[0]
    return _clamp(lo - p, hi - p + span, length)


def conv_part(run: TimeMajorConv, kernel: TimeMajorConvKernel | None, x: torch.Tensor, x_lo: int,
              lo: int, hi: int, length: int) -> torch.Tensor:
    """The convolution's outputs [lo, hi): its read range's steps with zeros where that range
    leaves the window (the module's own padding is not used)."""
    conv = run.conv
    p, span = conv.padding[0], (conv.kernel_size[0] - 1) * conv.dilation[0]
    s, e = conv_needs(conv, lo, hi, length)
    # output row o is step s - left + p + o: the first is lo
    return run(x[:, s - x_lo:e - x_lo], kernel, s - (lo - p), (hi - p + span) - e)


def up_needs(up: nn.ConvTranspose1d, lo: int, hi: int, length: int) -> tuple[int, int]:
    """The input steps a transposed convolution's outputs [lo, hi) read: output j takes input
    i where 0 <= j + pad - i * stride < kernel."""
    k, u, pad = up.kernel_size[0], up.stride[0], up.padding[0]
    return _clamp(-((k - 1 - pad - lo) // u), (hi - 1 + pad) // u + 1, length)


def up_part(run: TimeMajorConv, kernel: TimeMajorConvKernel | None, x: torch.Tensor, x_lo: int,
            lo: int, hi: int, length: int) -> torch.Tensor:
    """The transposed convolution's outputs [lo, hi) (output row o of input steps from s is
    step s * stride + o; the outputs near a cut edge, which miss inputs, are not among them)."""
    s, e = up_needs(run.conv, lo, hi, length)
    y = run(x[:, s - x_lo:e - x_lo], kernel)
    first = lo - s * run.conv.stride[0]
    return y[:, first:first + hi - lo]


def act_needs(lo: int, hi: int, length: int) -> tuple[int, int]:
    return _clamp(lo - ACT_REACH, hi + ACT_REACH, length)


def act_part(act: nn.Module, x: torch.Tensor, x_lo: int, lo: int, hi: int, length: int) -> torch.Tensor:
    """An anti-aliased activation's outputs [lo, hi): it runs over its read range and pads that
    range's edges with their steps, right at the window's edges, and elsewhere only in outputs
    within ACT_REACH of them, which are dropped."""
    s, e = act_needs(lo, hi, length)
    return act(x[:, s - x_lo:e - x_lo])[:, lo - s:hi - s]


def kaiser_sinc(cutoff: float, half_width: float, taps: int, device: torch.device) -> torch.Tensor:
    """Low-pass FIR (taps,) with unit DC gain: sinc at `cutoff` (cycles/sample) under a Kaiser
    window whose beta follows Kaiser's formula for the transition width `half_width`."""
    half = taps // 2
    atten = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95      # stop-band dB
    if atten > 50.0:
        beta = 0.1102 * (atten - 8.7)
    elif atten >= 21.0:
        beta = 0.5842 * (atten - 21) ** 0.4 + 0.07886 * (atten - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(taps, periodic=False, beta=beta, dtype=torch.float32, device=device)
    n = torch.arange(-half, half, device=device) + 0.5 if taps % 2 == 0 else \
        torch.arange(taps, device=device) - half
    h = 2 * cutoff * window * torch.sinc(2 * cutoff * n)
    return h / h.sum()


class AntiAliasedSnake(nn.Module):
    """Upsample x2 (replicate-padded polyphase transposed conv) -> SnakeBeta -> low-pass and
    downsample x2. Length is kept, time-major: (B, L, C) -> (B, L, C)."""

    kernel: AntiAliasedSnakeKernel | None = None      # set by use_native_activations

    def __init__(self, channels: int, device: torch.device):
        super().__init__()
        self.act = TimeMajorSnakeBeta(channels)
        # Not a buffer: derived, never loaded, and it must live on the real device while the
        # parameters are still on the meta device.
        self.fir = kaiser_sinc(0.5 / RESAMPLE_RATIO, 0.6 / RESAMPLE_RATIO, RESAMPLE_TAPS, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.supports(x, RESAMPLE_TAPS):
            return self.kernel(x, self.fir, *self.act.parameters_for_kernel())   # one pass
        c, r, k = x.shape[2], RESAMPLE_RATIO, RESAMPLE_TAPS
        fir = self.fir.to(x.dtype).view(1, 1, 1, k).expand(c, 1, 1, k).contiguous()  # depthwise
        pad = k // r - 1
        up = F.conv_transpose2d(time_major.channels_last(time_major.replicate_pad(x, pad, pad)),
                                fir, stride=(1, r), groups=c)
        up = time_major.time_major(up) * r
        crop_l = pad * r + (k - r) // 2
        crop_r = pad * r + (k - r + 1) // 2
        y = self.act(up[:, crop_l:up.shape[1] - crop_r])
        y = time_major.replicate_pad(y, k // 2 - 1 + k % 2, k // 2)
        return time_major.time_major(F.conv2d(time_major.channels_last(y), fir, stride=(1, r), groups=c))


def use_native_activations(model: nn.Module) -> int:
    """Run every AntiAliasedSnake of `model` as one native pass (kernels/aa_snake.c) where it
    builds: float32 CPU activations; others keep the torch ops. ~5x the torch ops on the small
    checkpoint's activations (Zen 5: 96 x 670 steps 232 -> 47 us, 3 x 31690 494 -> 96 us);
    values within 2e-6 of them. -> how many took it (0: it did not build)."""
    return attach_kernel(model, AntiAliasedSnake, AntiAliasedSnakeKernel, "BigVGAN's anti-aliased activations")


class AMPBlock(nn.Module):
    """Three residual units (snake -> dilated conv -> snake -> conv) at one resolution,
    time-major: (B, L, C) -> (B, L, C)."""

    kernel: TimeMajorConvKernel | None = None      # set by use_native_convolutions

    def __init__(self, channels: int, kernel: int, dilations: list[int], device: torch.device):
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d,
                                              padding=(kernel - 1) * d // 2) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                    for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedSnake(channels, device)
                                         for _ in range(2 * len(dilations)))
        # convs1[i] at 2i, convs2[i] at 2i + 1
        self.runs = [TimeMajorConv(c) for pair in zip(self.convs1, self.convs2) for c in pair]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            p1, p2 = conv1.padding[0], conv2.padding[0]                 # symmetric
            y = self.runs[2 * i](self.activations[2 * i](x), self.kernel, p1, p1)
            x = x + self.runs[2 * i + 1](self.activations[2 * i + 1](y), self.kernel, p2, p2)
        return x

    @property
    def reach(self) -> int:
        """Input steps on each side an output step reads: per unit, both activations and both
        convolutions (each convolution's padding, symmetric)."""
        return sum(2 * ACT_REACH + c1.padding[0] + c2.padding[0] for c1, c2 in zip(self.convs1, self.convs2))


def use_native_convolutions(model: nn.Module) -> int:
    """Run the convolutions of every BigVGAN of `model` (conv_pre, the upsamplers as their
    phases' convolutions, the AMP blocks', conv_post) in the native time-major kernel
    (kernels/conv1d_tm.c) where it builds and serves them (float32 CPU activations, packed
    weights up to its MAX_WEIGHT_BYTES); the others run as matrix products (layers/time_major.py),
    never oneDNN. Four streams of 200-400 codes through the small checkpoint's vocoder stage (2
    cores, Intel Xeon; a new shape every tail, as in serving), the AMP blocks' alone against
    oneDNN: BigVGAN 1.46-1.73 -> 0.82-1.07 s a round. Weights packed here (TimeMajorConv.packed).
    -> how many modules took it (0: it did not build)."""
    took = (attach_kernel(model, AMPBlock, TimeMajorConvKernel, "BigVGAN's AMP-block convolutions")
            + attach_kernel(model, BigVGAN, TimeMajorConvKernel, "BigVGAN's other convolutions"))
    for m in model.modules():
        if isinstance(m, (AMPBlock, BigVGAN)) and m.kernel is not None:
            for run in m.runs:
                run.packed()
    return took


class BigVGAN(nn.Module):
    kernel: TimeMajorConvKernel | None = None      # set by use_native_convolutions

    def __init__(self, c, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config = c
        self.num_kernels = len(c.resblock_kernel_sizes)
        ch = c.upsample_initial_channel
        with torch.device("meta"):
            self.conv_pre = nn.Conv1d(c.mel_dim, ch, 7, padding=3)
            # One-element ModuleLists: the checkpoint names are ups.{i}.0.*
            self.ups = nn.ModuleList(
                nn.ModuleList([nn.ConvTranspose1d(ch >> i, ch >> (i + 1), k, u, padding=(k - u) // 2)])
                for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
            self.resblocks = nn.ModuleList(
                AMPBlock(ch >> (i + 1), k, list(d), device)
                for i in range(len(c.upsample_rates))
                for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
            out_ch = ch >> len(c.upsample_rates)
            self.activation_post = AntiAliasedSnake(out_ch, device)
            self.conv_post = nn.Conv1d(out_ch, 1, 7, padding=3, bias=False)
        # conv_pre, ups[i] at 1 + i, conv_post (the AMP blocks run their own)
        self.runs = [TimeMajorConv(c) for c in (self.conv_pre, *(up for (up,) in self.ups), self.conv_post)]
        materialize(self, device)
        self.to(dtype)

    @property
    def hop(self) -> int:
        """Waveform samples per mel frame."""
        return math.prod(self.config.upsample_rates)

    def receptive_field(self) -> int:
        """Mel frames of context, on each side, that bound what one output sample depends on.

        Summed per layer in mel-frame units (reach in samples / samples per frame at that layer):
        conv_pre, each transposed conv, the widest AMP block (each unit: two anti-aliased
        activations, a dilated and a plain conv: AMPBlock.reach), the final activation
        (ACT_REACH) and conv_post.
        """
        c = self.config
        frames, rate = 3.0, 1
        for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)):
            pad = (k - u) // 2
            frames += math.ceil(max(k - 1 - pad, pad) / u) / rate
            rate *= u
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            frames += max(b.reach for b in blocks) / rate
        frames += (ACT_REACH + 3) / rate
        return math.ceil(frames)

    def forward(self, mel: torch.Tensor, emit: tuple[int, int] | None = None) -> torch.Tensor:
        """mel (B, mel_dim, F) natural-log amplitudes -> (B, F * hop) in [-1, 1]; with emit =
        (first, end), only the samples of frames [first, end): (B, (end - first) * hop), each
        layer run over the outputs those samples read (see the module docstring). The same
        values as the whole window's, up to float rounding (convolutions of other lengths)."""
        x = _normalise_log_mel(mel).transpose(1, 2).contiguous()          # (B, F, mel_dim)
        frames = x.shape[1]
        first, end = (0, frames) if emit is None else emit
        if not 0 <= first < end <= frames:
            raise ValueError(f"emit must be frames (first, end) with 0 <= first < end <= {frames}; got {emit}")
        steps = self._steps()
        lengths = [frames]                       # each step's input length, then the output's
        for step in steps:
            lengths.append(lengths[-1] * step.scale)
        ranges = [(first * self.hop, end * self.hop)]   # each step's output range, last first
        for step, length in zip(reversed(steps), reversed(lengths[:-1])):
            ranges.append(step.needs(*ranges[-1], length))
        ranges.reverse()                         # ranges[i]: step i's input; [-1]: the samples
        h, h_lo = x[:, ranges[0][0]:ranges[0][1]], ranges[0][0]
        for step, (lo, hi), length in zip(steps, ranges[1:], lengths):
            h, h_lo = step.part(h, h_lo, lo, hi, length), lo
        return h.clamp(-1.0, 1.0).squeeze(2)

    def _steps(self) -> list[_Step]:
        """conv_pre; per resolution the transposed conv (x u) and the AMP blocks' mean; the
        final activation and conv_post."""
        steps = [_Step(partial(conv_part, self.runs[0], self.kernel), partial(conv_needs, self.conv_pre))]
        for i, (up,) in enumerate(self.ups):
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            steps += [_Step(partial(up_part, self.runs[1 + i], self.kernel), partial(up_needs, up), up.stride[0]),
                      _Step(partial(_blocks_part, blocks), partial(_blocks_needs, blocks))]
        return steps + [_Step(partial(act_part, self.activation_post), act_needs),
                        _Step(partial(conv_part, self.runs[-1], self.kernel), partial(conv_needs, self.conv_post))]


@dataclass(frozen=True)
class _Step:
    """One layer (or a resolution's blocks) of BigVGAN.forward: part(x, x_lo, lo, hi, length),
    needs(lo, hi, length) as conv_part / conv_needs; scale: output steps per input step."""
    part: Callable[..., torch.Tensor]
    needs: Callable[[int, int, int], tuple[int, int]]
    scale: int = 1


def _blocks_needs(blocks: Sequence[AMPBlock], lo: int, hi: int, length: int) -> tuple[int, int]:
    reach = max(b.reach for b in blocks)
    return _clamp(lo - reach, hi + reach, length)


def _blocks_part(blocks: Sequence[AMPBlock], x: torch.Tensor, x_lo: int, lo: int, hi: int,
                 length: int) -> torch.Tensor:
    """A resolution's AMP blocks, all on the same input, averaged (as transformers sums them).
    Every layer of the blocks runs over the whole input read (its edge steps padded, wrong only
    within the reach of an edge that is not the window's, which is cut): the units' ranges
    shrink by only ~a hundred steps, and at one length the blocks' 18 convolutions share 12
    oneDNN primitives instead of taking 18 of their own."""
    h = sum(b(x) for b in blocks) / len(blocks)
    return h[:, lo - x_lo:hi - x_lo]


def _normalise_log_mel(mel: torch.Tensor) -> torch.Tensor:
    """ln-amplitude mel -> dB (floor -115 dB, -20 dB reference) -> [-1, 1], as in training."""
    floor = torch.tensor(10 ** (-115 / 20), dtype=mel.dtype, device=mel.device)
    db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=floor)) - 20
    return torch.clamp(2 * ((db + 115) / 115) - 1, -1.0, 1.0)


@dataclass
class VocoderJob:
    """One vocoder window of a stream: mel (mel_dim, frames) from absolute frame `lo`; the
    samples of frames [first, end) are new."""
    window: torch.Tensor
    lo: int
    first: int
    end: int

    @property
    def emit(self) -> tuple[int, int]:
        """The new frames within the window."""
        return self.first - self.lo, self.end - self.lo


@torch.no_grad()
def vocode_windows(vocoder: BigVGAN, jobs: list[VocoderJob]) -> list[torch.Tensor]:
    """Each job's new samples ((end - first) * hop,). Windows of equal length and new frames
    share one batched pass (small windows, such as many streams' first chunks, cost little more
    together than one). Not the union of their new frames: every new layer shape costs oneDNN
    a primitive (a pass of lengths it has not seen took 102-130 ms against 31-53 ms again,
    2 windows), and a stream's windows come in a few shapes (its chunk schedule's)."""
    out: list[torch.Tensor | None] = [None] * len(jobs)
    groups: dict[tuple[int, tuple[int, int]], list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault((job.window.shape[1], job.emit), []).append(i)
    for (_, emit), idx in groups.items():
        wav = vocoder(torch.stack([jobs[i].window for i in idx]), emit=emit)
        for row, i in enumerate(idx):
            out[i] = wav[row]
    return out


class VocoderStream:
    """BigVGAN over mel that arrives in pieces. Each push vocodes the frames that have `context`
    frames of right context (every frame when final) over a window with `context` frames of
    left context, and returns only their samples: with context >= receptive_field() they equal
    one run over the whole mel. Holds at most `context` frames before the first sample not yet
    emitted, plus the frames pushed since."""

    def __init__(self, vocoder: BigVGAN, context: int):
        self.vocoder, self.context = vocoder, context
        self.mel: torch.Tensor | None = None     # (mel_dim, frames), frames from `start` on
        self.start = 0                           # = max(0, done - context)
        self.done = 0                            # frames already emitted as samples

    @torch.no_grad()
    def push(self, mel: torch.Tensor, final: bool = False) -> torch.Tensor | None:
        """mel (mel_dim, frames) following what was pushed before -> new samples, or None."""
        job = self.plan(mel, final)
        return None if job is None else self.complete(job, vocode_windows(self.vocoder, [job])[0])

    def plan(self, mel: torch.Tensor, final: bool = False) -> VocoderJob | None:
        """Take mel (see push); the window to vocode for the new samples, or None (none yet).
        complete() must follow with the window's waveform before the next plan()."""
        self.mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=1)
        total = self.start + self.mel.shape[1]
        end = total if final else total - self.context
        if end <= self.done:
            return None
        lo = max(self.start, self.done - self.context)
        return VocoderJob(self.mel[:, lo - self.start:], lo, self.done, end)

    def complete(self, job: VocoderJob, pcm: torch.Tensor) -> torch.Tensor:
        """pcm: the job's new samples (vocode_windows) -> them, the stream moved past them."""
        keep = max(self.start, job.end - self.context)
        self.mel, self.start, self.done = self.mel[:, keep - self.start:], keep, job.end
        return pcm

    def pending(self) -> bool:
        """Frames were pushed that have no samples out yet."""
        return self.mel is not None and self.start + self.mel.shape[1] > self.done

    def flush(self) -> torch.Tensor | None:
        """The mel ended: the samples not emitted yet, or None."""
        return None if self.mel is None else self.push(self.mel[:, :0], final=True)
