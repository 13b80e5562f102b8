"""Qwen2.5-Omni's audio input: Whisper-style log-mel features computed with torch (so they run
on the serving device), and the number of <|AUDIO|> placeholder tokens an audio takes.

What Qwen2_5OmniProcessor feeds the thinker, per audio of L samples at 16 kHz:
- the waveform is cut to the first `max_samples` (the checkpoint's preprocessor config:
  300 s for Qwen2.5-Omni) and zero-padded to exactly `max_samples` (padding="max_length");
- a centred (reflect-padded) STFT, n_fft 400 / hop 160 / periodic Hann, power spectrum, the last
  frame dropped; 128 Slaney mel filters over 0-8 kHz; log10 with a 1e-10 floor;
- values below (the audio's maximum - 8) are raised to it, then (x + 4) / 4;
- the model sees only the first ceil(L / 160) frames (`feature_attention_mask`).

We never build the padded `max_samples` signal: an audio padded with at least n_fft zeros has
the same frames over the audio as the fully padded one (the centred window of a frame reaches
n_fft/2 past its centre and the reflection at the end of the padded signal mirrors zeros), and
the frames further on are silent (log10(1e-10) = -10), so they cannot raise the maximum.
Only an audio within n_fft of the cap sees the end-of-signal reflection; it is padded to the
cap exactly, like HF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from omnistage.errors import InvalidRequestError

_LOG_FLOOR = 1e-10          # power floor before log10
_DYNAMIC_RANGE = 8.0        # log10 units (80 dB) kept below each audio's maximum


@dataclass(frozen=True)
class LogMelConfig:
    """Defaults are Qwen2.5-Omni's preprocessor_config.json."""
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    num_mel_bins: int = 128
    max_frequency: float = 8000.0       # Whisper's filters stop at 8 kHz whatever the rate
    # Samples the processor keeps (chunk_length * sampling_rate); longer audio is truncated, as
    # HF does. None: no cap (features of the whole audio, as if zero-padded).
    max_samples: int | None = 300 * 16000
    # "max_length": each audio as if zero-padded to max_samples (Qwen2.5-Omni's processor;
    # ceil(L / hop) frames). "longest": each audio transformed as it is, nothing appended (the
    # Qwen3-Omni processor's padding=True, truncation=False on one audio; floor(L / hop)
    # frames, the last ones seeing the reflection of the audio's own end).
    padding: str = "max_length"

    def __post_init__(self) -> None:
        if min(self.sample_rate, self.n_fft, self.hop_length, self.num_mel_bins) <= 0:
            raise ValueError(f"LogMelConfig fields must be positive: {self}")
        if self.n_fft % 2:
            raise ValueError(f"n_fft must be even, got {self.n_fft}")
        if self.padding not in ("max_length", "longest"):
            raise ValueError(f"padding must be 'max_length' or 'longest', got {self.padding!r}")
        if self.padding == "longest" and self.max_samples is not None:
            raise ValueError("padding='longest' keeps every sample: max_samples must be None")
        if self.max_samples is not None and self.max_samples < self.hop_length:
            raise ValueError(f"max_samples ({self.max_samples}) must hold at least one hop")

    @classmethod
    def from_preprocessor_config(cls, cfg: dict) -> "LogMelConfig":
        """From an HF preprocessor_config.json (WhisperFeatureExtractor keys and defaults)."""
        if cfg.get("dither", 0.0):
            raise ValueError("dither != 0 (random noise in the features) is not supported")
        rate = cfg.get("sampling_rate", 16000)
        return cls(sample_rate=rate, n_fft=cfg.get("n_fft", 400),
                   hop_length=cfg.get("hop_length", 160),
                   num_mel_bins=cfg.get("feature_size", 80),
                   max_samples=cfg.get("chunk_length", 30) * rate)

    def num_frames(self, num_samples: int) -> int:
        """Feature frames the model sees for an audio of `num_samples` samples."""
        n = num_samples if self.max_samples is None else min(num_samples, self.max_samples)
        if self.padding == "longest":
            return n // self.hop_length
        frames = -(-n // self.hop_length)                        # ceil
        if self.max_samples is not None:
            # HF drops the last mask entry when the cap is not a multiple of the hop.
            frames = min(frames, self.max_samples // self.hop_length)
        return frames

    @property
    def min_samples(self) -> int:
        """Shortest audio that yields one placeholder token (3 frames: 2 hops + 1 sample)."""
        return 2 * self.hop_length + 1


def num_audio_tokens(num_frames: int) -> int:
    """Placeholder tokens (= audio-encoder outputs) for an audio of `num_frames` feature frames:
    the encoder's stride-2 convolution halves the frames (rounding up), then stride-2 average
    pooling halves them again (rounding down). 0 for fewer than 3 frames."""
    after_conv = (num_frames - 1) // 2 + 1
    return max((after_conv - 2) // 2 + 1, 0)


def slaney_mel_filters(num_mel_bins: int, n_fft: int, sample_rate: int,
                       max_frequency: float, min_frequency: float = 0.0) -> np.ndarray:
    """(n_fft // 2 + 1, num_mel_bins) float64 triangular filters, equally spaced on the Slaney
    mel scale (linear below 1 kHz, logarithmic above), each scaled to unit area (Slaney norm)."""
    def to_mel(hz: np.ndarray) -> np.ndarray:
        hz = np.asarray(hz, dtype=np.float64)
        linear = 3.0 * hz / 200.0
        logarithmic = 15.0 + np.log(np.maximum(hz, 1e-300) / 1000.0) * (27.0 / np.log(6.4))
        return np.where(hz >= 1000.0, logarithmic, linear)

    def to_hz(mel: np.ndarray) -> np.ndarray:
        linear = 200.0 * mel / 3.0
        logarithmic = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
        return np.where(mel >= 15.0, logarithmic, linear)

    edges_mel = np.linspace(to_mel(min_frequency), to_mel(max_frequency), num_mel_bins + 2)
    edges = to_hz(edges_mel)                                            # (M + 2,) Hz
    bins = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)            # (F,) Hz of each FFT bin
    widths = np.diff(edges)                                             # (M + 1,)
    rising = (bins[:, None] - edges[None, :-2]) / widths[:-1]          # (F, M)
    falling = (edges[None, 2:] - bins[:, None]) / widths[1:]           # (F, M)
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


@dataclass
class AudioFeatures:
    features: list[torch.Tensor]   # per audio: (num_mel_bins, num_frames[i]) float32
    num_frames: list[int]          # valid feature frames per audio
    num_tokens: list[int]          # <|AUDIO|> placeholders (= encoder outputs) per audio


class LogMelExtractor:
    """Batched log-mel features on `device`. Holds the window and filters there."""

    def __init__(self, config: LogMelConfig | None = None,
                 device: torch.device | str = "cpu"):
        self.config = config or LogMelConfig()
        c = self.config
        self.device = torch.device(device)
        self.window = torch.hann_window(c.n_fft, device=self.device)            # periodic
        filters = slaney_mel_filters(c.num_mel_bins, c.n_fft, c.sample_rate, c.max_frequency)
        self.filters = torch.from_numpy(filters).to(self.device, torch.float32)  # (F, M)

    def __call__(self, audios: Sequence[np.ndarray | torch.Tensor],
                 param: str = "audio") -> AudioFeatures:
        """audios: mono waveforms at `config.sample_rate`, (L_i,) each.

        Raises InvalidRequestError (with `param`) for an audio too short to give one token.
        """
        c = self.config
        waves = [torch.as_tensor(a) for a in audios]
        if not waves:
            return AudioFeatures([], [], [])
        lengths = []
        for i, w in enumerate(waves):
            if w.ndim != 1:
                raise ValueError(f"audio {i} must be mono (L,), got shape {tuple(w.shape)}")
            if w.shape[0] < c.min_samples:
                raise InvalidRequestError(
                    f"{param} is too short ({w.shape[0]} samples); send at least "
                    f"{c.min_samples} samples ({c.min_samples / c.sample_rate * 1000:.0f} ms "
                    f"at {c.sample_rate} Hz)", param=param)
            lengths.append(w.shape[0] if c.max_samples is None else min(w.shape[0], c.max_samples))
        if c.padding == "longest" and len(set(lengths)) > 1:   # no audio padded by another
            parts = [self([w], param) for w in waves]
            return AudioFeatures(*([x for p in parts for x in getattr(p, f)]
                                   for f in ("features", "num_frames", "num_tokens")))
        signal_len = max(self._signal_length(n) for n in lengths)
        batch = torch.zeros(len(waves), signal_len, device=self.device)     # (B, S)
        for i, (w, n) in enumerate(zip(waves, lengths)):
            batch[i, :n] = w[:n].to(self.device, torch.float32, non_blocking=True)
        logmel = self._log_mel(batch)                                       # (B, M, S // hop)
        frames = [c.num_frames(n) for n in lengths]
        return AudioFeatures(features=[logmel[i, :, :t] for i, t in enumerate(frames)],
                             num_frames=frames, num_tokens=[num_audio_tokens(t) for t in frames])

    def _signal_length(self, n: int) -> int:
        """Samples to transform for an audio of n (capped) samples: n_fft zeros past its end
        suffice (see the module docstring), unless that reaches the cap."""
        cap = self.config.max_samples
        if self.config.padding == "longest":
            return n
        return n + self.config.n_fft if cap is None else min(n + self.config.n_fft, cap)

    def _log_mel(self, batch: torch.Tensor) -> torch.Tensor:
        c = self.config
        spec = torch.stft(batch, c.n_fft, c.hop_length, window=self.window,
                          return_complex=True)                              # (B, F, S//hop + 1)
        power = (spec[..., :-1].abs() ** 2).contiguous()                    # (B, F, T)
        mel = self.filters.T @ power                                        # (B, M, T)
        logmel = mel.clamp(min=_LOG_FLOOR).log10()
        peak = logmel.amax(dim=(1, 2), keepdim=True)                        # (B, 1, 1)
        logmel = torch.maximum(logmel, peak - _DYNAMIC_RANGE)
        return (logmel + 4.0) / 4.0
