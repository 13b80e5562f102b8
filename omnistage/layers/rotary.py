"""Rotary position embeddings: plain (1-D positions) and multimodal (3-D: time, height, width)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Rotate-half RoPE with cos/sin tables precomputed for every position (float32).

    Not an nn.Module on purpose: the tables are derived, never loaded, and must exist on the
    real device while parameters are still on the meta device.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device | str,
                 mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)                          # (D/2,)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                        # (P, D)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.max_positions = max_positions
        # Multimodal RoPE: frequency j takes its angle from axis t, h or w (both halves of the
        # rotate-half layout share the axis). Sectioned (Qwen2.5): consecutive runs of
        # mrope_section[i] frequencies per axis. Interleaved (Qwen3): h at j = 1, 4, 7, ... and
        # w at j = 2, 5, 8, ... below 3 * section[1] and 3 * section[2]; t everywhere else.
        self.axis_of_column: torch.Tensor | None = None
        if mrope_section is not None:
            if sum(mrope_section) != head_dim // 2:
                raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim/2 = {head_dim // 2}")
            if mrope_interleaved:
                axis = torch.zeros(head_dim // 2, dtype=torch.int64)
                for a in (1, 2):
                    axis[a:3 * mrope_section[a]:3] = a
            else:
                axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
            self.axis_of_column = torch.cat((axis, axis)).to(device)      # (D,)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, 1, D), for positions (T,) or, with mrope, (3, T).
        Done once per step, not per layer."""
        if positions.dim() == 1:
            return (self.cos[positions].unsqueeze(1).to(dtype),
                    self.sin[positions].unsqueeze(1).to(dtype))
        index = self.axis_of_column.expand(1, positions.shape[1], -1)     # (1, T, D)
        cos = self.cos[positions].gather(0, index)                        # (1, T, D)
        sin = self.sin[positions].gather(0, index)
        return cos.transpose(0, 1).to(dtype), sin.transpose(0, 1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: (T, H, D) heads to rotate (queries and keys may come in one tensor)."""
        cos, sin = cos_sin
        return (x * cos).addcmul_(_rotate_half(x), sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
