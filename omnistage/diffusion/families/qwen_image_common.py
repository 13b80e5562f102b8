"""What the Qwen-Image family and the families built on it share: a request's conditioning
and the latent <-> token packing of 2x2 patches, padded prompt rows, pixels out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class QwenCond:
    """Conditioning of one request, shared by its samples."""

    embeds: torch.Tensor                  # (T, D) prompt embeddings
    neg_embeds: torch.Tensor | None       # (T', D) negative prompt embeddings; None: no CFG
    cfg_scale: float
    img_shapes: tuple                     # ((frames, h/2, w/2), ...) output first, then inputs
    image_latents: torch.Tensor | None = None   # (1, L_in, 4C) packed input-image latents (edits)
    extra: dict = field(default_factory=dict)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): 2x2 patches as tokens, channel-major within a patch."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h * w, 4C) -> (B, C, 2h, 2w); h, w count packed tokens."""
    b, _, c4 = tokens.shape
    x = tokens.view(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 2 * h, 2 * w)


def pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad (T_i, D) rows to (R, T, D); the bool mask is None when no row is padded."""
    longest = max(r.shape[0] for r in rows)
    if all(r.shape[0] == longest for r in rows):
        return torch.stack(rows), None
    out = rows[0].new_zeros(len(rows), longest, rows[0].shape[1])
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return out, mask


def to_pixels(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [-1, 1] -> float32 (H, W, 3) in [0, 1], as diffusers' postprocess("np")."""
    return (image / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).float().cpu().numpy()
