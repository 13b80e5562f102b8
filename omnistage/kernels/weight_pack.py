"""Weights in the native linear kernel's layout (linear.c): 64-column panels of float32,
bfloat16, int8 (one scale per output column) or int4 (one scale per group of inputs and
output column). Packing and quantizing happen once, at load, from a float (in, out) weight.

Quantization is symmetric and weight-only (activations stay float32):
- int8: scale = max |w| of the column / 127, q = round(w / scale) in -127..127;
- int4: per group of `group_size` inputs, scale = -(the signed weight of largest magnitude) / 8
  (as GGUF's q4_0), q = round(w / scale) in -8..7, stored as q + 8 in a nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64                    # output columns per panel (linear.c)
FORMATS = ("float32", "bfloat16", "int8", "int4")


@dataclass(frozen=True)
class WeightFormat:
    """How linear weights are stored: one of FORMATS; int4 in groups of `group_size` inputs."""

    name: str = "float32"
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(FORMATS)}; got {self.name!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"int4 group size must be a positive integer; got {self.group_size!r}")

    def for_output_head(self) -> WeightFormat:
        """The format of a model's output head (lm_head): int4 keeps it in int8, as llama.cpp
        keeps its output matrix at 6+ bits: its error lands on the logits directly, with no
        later layer to average it out. (Measured on the `trained` tiny Qwen2: logits' max
        error 0.49 -> see docs/quantization.md.)"""
        return WeightFormat("int8") if self.name == "int4" else self


@dataclass
class PackedWeight:
    """An (out_features, in_features) weight in the kernel's panels.

    panels: float32 / bfloat16 / int8 (num_panels, in, 64), or uint8 (num_panels, in, 32) for
    int4; column_scales: float32 (num_panels * 64,) for int8; group_scales: float32
    (num_panels, ceil(in / group_size), 64) for int4. Zero past out_features."""

    format: str
    panels: torch.Tensor
    in_features: int
    out_features: int
    group_size: int = 0
    column_scales: torch.Tensor | None = None
    group_scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.panels, self.column_scales, self.group_scales) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The (in, out) float32 weight the kernel computes with (each weight as linear.c
        widens or dequantizes it), for checks and references."""
        k, n, num = self.in_features, self.out_features, self.panels.shape[0]
        if self.format == "int4":
            u = torch.cat([self.panels & 15, self.panels >> 4], dim=-1).float()  # (P, K, 64)
            s = self.group_scales.repeat_interleave(self.group_size, dim=1)[:, :k]
            w = torch.addcmul(-8.0 * s, u, s)                # one rounding, like linear.c's FMA
        else:
            w = self.panels.float()
            if self.format == "int8":
                # linear.c scales the accumulated sum, not each weight: this is the same
                # product up to summation rounding.
                w = w * self.column_scales.view(num, 1, PANEL)
        return w.transpose(0, 1).reshape(k, num * PANEL)[:, :n].contiguous()


def pack(weight_t: torch.Tensor, fmt: WeightFormat = WeightFormat()) -> PackedWeight:
    """(in, out) float weight -> PackedWeight in `fmt`."""
    name, group_size = fmt.name, fmt.group_size
    k, n = weight_t.shape
    num = -(-n // PANEL)
    w = weight_t.detach()
    if w.shape[1] != num * PANEL:                      # pad the output columns with zeros
        w = torch.nn.functional.pad(w, (0, num * PANEL - n))
    if name in ("float32", "bfloat16"):
        dt = torch.float32 if name == "float32" else torch.bfloat16
        w = w.to(dt)
        return PackedWeight(name, _panels(w, k, num), k, n)
    w = w.float()
    if name == "int8":
        scale = w.abs().amax(dim=0) / 127                                      # (N_pad,)
        q = torch.round(w / _nonzero(scale)).clamp_(-127, 127).to(torch.int8)
        return PackedWeight(name, _panels(q, k, num), k, n, column_scales=scale.contiguous())
    groups = -(-k // group_size)
    wg = torch.nn.functional.pad(w, (0, 0, 0, groups * group_size - k)).view(groups, group_size, -1)
    extreme = wg.gather(1, wg.abs().argmax(dim=1, keepdim=True)).squeeze(1)   # (groups, N_pad)
    scale = extreme / -8
    q = torch.round(wg / _nonzero(scale).unsqueeze(1)).clamp_(-8, 7).view(-1, num * PANEL)[:k]
    u = (q + 8).to(torch.uint8).view(k, num, PANEL)
    nibbles = u[..., :PANEL // 2] | (u[..., PANEL // 2:] << 4)                # (K, P, 32)
    return PackedWeight(name, nibbles.transpose(0, 1).contiguous(), k, n, group_size,
                        group_scales=scale.view(groups, num, PANEL).transpose(0, 1).contiguous())


def _panels(w: torch.Tensor, k: int, num: int) -> torch.Tensor:
    """(K, num * 64) -> (num, K, 64) contiguous."""
    return w.reshape(k, num, PANEL).transpose(0, 1).contiguous()


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Scales to divide by: an all-zero column or group has scale 0 and quantizes to 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
