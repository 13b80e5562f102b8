"""Qwen3-Omni's audio tower (the thinker's `audio_tower`): log-mel features -> thinker embeddings.

The maths of transformers' `Qwen3OmniMoeAudioEncoder`. Per audio of T log-mel frames (the
128-bin Whisper features of qwen2_5_omni/audio_features.py, 100 frames/s), with C = 2 * n_window
input frames per chunk (100), D = d_model, ch = downsample_hidden_size, and
    s(c) = frames after one Conv2d(k3, s2, p1) = ceil(c / 2),  s3(c) = s(s(s(c))):
1. chunks: T is cut into k = ceil(T / C) chunks; all but the last hold C frames, the last the
   rest (C when T is a multiple of C). In an audio of several chunks the last one is zero-padded
   to C frames; an audio of one chunk is not padded (see "Padding").     -> (k, 1, mel, C or T)
2. conv stem, per chunk: three Conv2d(k3, s2, p1) + GELU over (frequency, time)
                                                          -> (k, ch, s3(mel), s3(C or T))
   channels x frequency flattened channel-major, conv_out (no bias) -> (k, s3(C or T), D)
3. sinusoidal positions 0, 1, ... added in every chunk (they restart per chunk);
   the padded frames of the last chunk dropped, chunks concatenated        -> (n, D)
   n = num_audio_tokens(T, n_window) = (T // C) * s3(C) + s3(T mod C): 13 per 100 frames;
4. encoder layers (pre-LayerNorm, bidirectional attention, GELU MLP). Attention stays inside
   windows of r = n_window_infer // C consecutive chunks (r * s3(C) tokens, counted from the
   audio's start; the last window holds the rest): 8 chunks = 104 tokens = 8 s for the checkpoint
   (n_window_infer 800);
5. ln_post, proj1, GELU, proj2                                             -> (n, output_dim).

The reference writes the windows as `cu_seqlens`: window = (post-conv length of the longest chunk
in the call) * r tokens. When any chunk of the call is full, that is r * s3(C), windows of r
chunks as above; when every audio of the call is shorter than C, each one is a single window.

Padding. The reference pads every chunk of a call to the longest chunk of that call. Padded
frames are not zero after conv2d1 (its bias goes through GELU), and a chunk whose length after a
conv is odd reads one padded frame at its end, so a short chunk's result depends on how far it
was padded: the reference's result for an audio of fewer than C frames changes when a longer
audio shares its call. We define an audio's result as the reference's on that audio alone: the
last chunk of a multi-chunk audio padded to C, a single chunk not padded.

Batch invariance: `forward` runs each audio as its own computation (its chunks batched through
the stem, its windows through attention), so an audio's rows are the same bits alone or with
others. Parameter names equal the checkpoint's under `thinker.audio_tower.`.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3OmniMoeAudioEncoderConfig

from omnistage.layers.activations import gelu
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.models.qwen2_5_omni.audio_encoder import sinusoid_table

CHECKPOINT_PREFIX = "thinker.audio_tower."


def _conv_frames(length: int, convs: int = 3) -> int:
    """Frames left after `convs` stride-2 convolutions (kernel 3, padding 1): ceil-halved each
    time; 0 stays 0."""
    for _ in range(convs):
        length = (length - 1) // 2 + 1
    return length


def num_audio_tokens(frames: int, n_window: int) -> int:
    """Encoder outputs (= audio placeholder tokens) for an audio of `frames` log-mel frames.

    Full chunks of 2 * n_window frames give s3(2 * n_window) tokens each, the rest s3(rest).
    Equals transformers' `_get_feat_extract_output_lengths`, which writes the per-chunk count as
    a literal 13 (= s3(100): right for n_window 49..52, the checkpoint's 50).
    """
    if frames < 0 or n_window < 1:
        raise ValueError(f"need frames >= 0 and n_window >= 1, got {frames}, {n_window}")
    full, rest = divmod(frames, 2 * n_window)
    return full * _conv_frames(2 * n_window) + _conv_frames(rest)


def audio_config(config: Qwen3OmniMoeAudioEncoderConfig | dict) -> Qwen3OmniMoeAudioEncoderConfig:
    """The config object, also from the dict `thinker_config.audio_config` of a config.json."""
    if isinstance(config, Qwen3OmniMoeAudioEncoderConfig):
        return config
    if isinstance(config, dict):
        return Qwen3OmniMoeAudioEncoderConfig(**config)
    raise TypeError(f"audio config must be a Qwen3OmniMoeAudioEncoderConfig or a dict, "
                    f"got {type(config).__name__}")


def _check_config(c: Qwen3OmniMoeAudioEncoderConfig) -> None:
    if c.activation_function != "gelu":
        raise ValueError(f"audio tower activation {c.activation_function!r} is not supported "
                         "(only 'gelu')")
    if c.d_model % c.encoder_attention_heads:
        raise ValueError(f"d_model {c.d_model} is not divisible by "
                         f"{c.encoder_attention_heads} heads")
    if c.n_window < 1 or c.n_window_infer < 2 * c.n_window:
        raise ValueError(f"need n_window >= 1 and n_window_infer >= 2 * n_window (an attention "
                         f"window of whole chunks), got {c.n_window}, {c.n_window_infer}")
    if _conv_frames(2 * c.n_window) > c.max_source_positions:
        raise ValueError(f"a chunk of {2 * c.n_window} frames needs more positions than "
                         f"max_source_positions {c.max_source_positions}")
    if c.conv_chunksize < 1:
        raise ValueError(f"conv_chunksize must be >= 1, got {c.conv_chunksize}")


class AudioAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads = num_heads
        kw = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(d_model, d_model, bias=True, **kw)
        self.k_proj = nn.Linear(d_model, d_model, bias=True, **kw)
        self.v_proj = nn.Linear(d_model, d_model, bias=True, **kw)
        self.out_proj = nn.Linear(d_model, d_model, bias=True, **kw)

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        """x: (n, D) one audio's frames; attention inside consecutive windows of `window` rows
        (the last one shorter)."""
        n, d = x.shape
        q, k, v = (proj(x).view(n, self.num_heads, -1).transpose(0, 1)          # (H, n, hd)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        full = n // window * window
        parts = []
        if full:                             # the full windows as one batch: (n / w, H, w, hd)
            def windows(t: torch.Tensor) -> torch.Tensor:
                return t[:, :full].unflatten(1, (-1, window)).transpose(0, 1)
            out = F.scaled_dot_product_attention(windows(q), windows(k), windows(v))
            parts.append(out.permute(0, 2, 1, 3).reshape(full, d))             # (full, D)
        if full < n:                         # the last, shorter window: (H, rest, hd)
            out = F.scaled_dot_product_attention(q[:, full:], k[:, full:], v[:, full:])
            parts.append(out.transpose(0, 1).reshape(n - full, d))             # (rest, D)
        return self.out_proj(torch.cat(parts) if len(parts) > 1 else parts[0])


class AudioEncoderLayer(nn.Module):
    def __init__(self, c: Qwen3OmniMoeAudioEncoderConfig, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.self_attn = AudioAttention(c.d_model, c.encoder_attention_heads, dtype, device)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model, **kw)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim, **kw)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model, **kw)
        self.final_layer_norm = nn.LayerNorm(c.d_model, **kw)

    def forward(self, h: torch.Tensor, window: int) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h), window)          # (n, D)
        h = h + self.fc2(gelu(self.fc1(self.final_layer_norm(h))))
        if h.dtype == torch.float16:       # as the reference: keep fp16 activations finite
            bound = torch.finfo(h.dtype).max - 1000
            h = h.clamp(-bound, bound)
        return h


class Qwen3OmniAudioEncoder(nn.Module):
    """forward(list of (num_mel_bins, T_i) features) -> list of (num_audio_tokens(T_i,
    n_window), output_dim); each audio's result is the reference's on that audio alone."""

    def __init__(self, config: Qwen3OmniMoeAudioEncoderConfig | dict,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        c = audio_config(config)
        _check_config(c)
        device = torch.device(device)
        kw = {"dtype": dtype, "device": device}
        self.config = c
        self.chunk_frames = 2 * c.n_window                                   # C
        chunk_tokens = _conv_frames(self.chunk_frames)                       # s3(C)
        self.window_tokens = chunk_tokens * (c.n_window_infer // self.chunk_frames)
        # input frames of an attention window: the rows of whole windows depend on theirs only
        self.window_frames = self.chunk_frames * (c.n_window_infer // self.chunk_frames)
        ch = c.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, stride=2, padding=1, **kw)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, stride=2, padding=1, **kw)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, stride=2, padding=1, **kw)
        self.conv_out = nn.Linear(ch * _conv_frames(c.num_mel_bins), c.d_model, bias=False, **kw)
        self.layers = nn.ModuleList(AudioEncoderLayer(c, dtype, device)
                                    for _ in range(c.encoder_layers))
        self.ln_post = nn.LayerNorm(c.d_model, **kw)
        self.proj1 = nn.Linear(c.d_model, c.d_model, **kw)
        self.proj2 = nn.Linear(c.d_model, c.output_dim, **kw)
        positions = sinusoid_table(chunk_tokens, c.d_model).to(**kw)        # (s3(C), D)
        self.register_buffer("positions", positions, persistent=False)
        self.requires_grad_(False)                  # inference only: no autograd graphs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     prefix: str = CHECKPOINT_PREFIX) -> None:
        """Fill every parameter from `(name, tensor)` pairs named `prefix + state key`."""
        require_complete(self, load_prefixed(self, weights, prefix), f"audio tower ({prefix})")

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        mel = self.config.num_mel_bins
        for i, f in enumerate(features):
            if f.ndim != 2 or f.shape[0] != mel or f.shape[1] == 0:
                raise ValueError(f"audio features {i} must be ({mel}, T >= 1), "
                                 f"got {tuple(f.shape)}")
        return [self._encode(f) for f in features]

    def _encode(self, features: torch.Tensor, pad_lone_chunk: bool = False) -> torch.Tensor:
        """(mel, T) -> (num_audio_tokens(T), output_dim), one audio (see encode_window)."""
        w = self.conv2d1.weight
        frames = features.shape[1]
        h = self._stem(self._chunks(features.to(w.device, w.dtype), pad_lone_chunk))  # (k, t, D)
        h = h.flatten(0, 1)[:num_audio_tokens(frames, self.config.n_window)]  # (n, D)
        for layer in self.layers:
            h = layer(h, self.window_tokens)
        return self.proj2(gelu(self.proj1(self.ln_post(h))))                # (n, out)

    def encode_window(self, features: torch.Tensor, in_longer_audio: bool) -> torch.Tensor:
        """(mel, T <= window_frames) -> its rows: one attention window of an audio, alone (the
        audio's rows are its windows' rows joined). In an audio longer than a chunk, a window
        of one short chunk (the audio's last) is zero-padded to C as in the whole audio's call:
        GELU(bias) in the padding reaches its last rows."""
        return self._encode(features, pad_lone_chunk=in_longer_audio)

    def _chunks(self, features: torch.Tensor, pad_lone_chunk: bool) -> torch.Tensor:
        """(mel, T) -> (k, 1, mel, L): chunks of C frames, the last zero-padded to C; a single
        chunk (T <= C) is kept at its own length L = T unless `pad_lone_chunk`."""
        mel, frames = features.shape
        size = self.chunk_frames
        if frames <= size and not pad_lone_chunk:
            return features[None, None]                                       # (1, 1, mel, T)
        k = -(-frames // size)
        padded = F.pad(features, (0, k * size - frames))                      # (mel, k * C)
        return padded.view(mel, k, size).transpose(0, 1).unsqueeze(1).contiguous()

    def _stem(self, chunks: torch.Tensor) -> torch.Tensor:
        """(k, 1, mel, L) -> (k, s3(L), D): convolutions, conv_out and positions, per group of
        conv_chunksize chunks (bounds the conv activations, as the reference does)."""
        out = []
        for group in chunks.split(self.config.conv_chunksize):
            x = F.gelu(self.conv2d1(group))                                   # (g, ch, mel/2, L/2)
            x = F.gelu(self.conv2d2(x))
            x = F.gelu(self.conv2d3(x))                                       # (g, ch, f, t)
            g, ch, f, t = x.shape
            x = self.conv_out(x.permute(0, 3, 1, 2).reshape(g, t, ch * f))    # (g, t, D)
            out.append(x + self.positions[:t])
        return torch.cat(out) if len(out) > 1 else out[0]
