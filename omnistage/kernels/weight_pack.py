"""Weights in the native linear kernel's layout (linear.c): 64-column panels of float32,
bfloat16, int8 (one scale per output column), int4 or int8g (one scale per group of inputs and
output column). Packing and quantizing happen once, at load: from a float (in, out) weight
(`pack`), or from codes and scales quantized elsewhere (`pack_codes`: a GGUF q4_0 / q8_0
tensor, kept exactly).

Quantization of the weights is symmetric:
- int8: scale = max |w| of the column / 127, q = round(w / scale) in -127..127;
- int4: per group of `group_size` inputs, scale = -(the signed weight of largest magnitude) / 8
  (as GGUF's q4_0), q = round(w / scale) in -8..7, stored as q + 8 in a nibble;
- int8g: per group, scale = max |w| / 127, q = round(w / scale) (as GGUF's q8_0).
Activations stay float32, or (WeightFormat's `int4_activations` / `int8_activations`, where
the inputs and groups are multiples of 32) are rounded to int8 per block of 32 inputs when the
call comes: the int4k / int8k layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

PANEL = 64                    # output columns per panel (linear.c)
FORMATS = ("float32", "bfloat16", "int8", "int4", "int8g")
GROUPED = ("int4", "int8g")   # formats with one scale per group of inputs
ACTIVATION_BLOCK = 32         # int4k, int8k: inputs per activation scale (linear_dots.c's KB)


@dataclass(frozen=True)
class WeightFormat:
    """How linear weights are stored: one of FORMATS; int4 in groups of `group_size` inputs.
    `int4_activations` / `int8_activations`: what int4 / int8 and int8g weights multiply where
    their inputs and groups are multiples of 32: "int8", laid out for integer dot products
    against int8-rounded activations (`int4k` / `int8k`, linear_dots.c: llama.cpp's q4_0 x q8_0 /
    q8_0 x q8_0 numerics, up to ~2x the speed), or "float32" (exact)."""

    name: str = "float32"
    group_size: int = 64
    int4_activations: str = "int8"
    int8_activations: str = "int8"

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(FORMATS)}; got {self.name!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"int4 group size must be a positive integer; got {self.group_size!r}")
        for side in (self.int4_activations, self.int8_activations):
            if side not in ("int8", "float32"):
                raise ValueError(f"activations must be int8 or float32; got {side!r}")

    def integer_dots(self, name: str) -> bool:
        """Whether weights stored as `name` (int4, int8, int8g) multiply int8 activations."""
        return (self.int4_activations if name == "int4" else self.int8_activations) == "int8"

    def for_output_head(self) -> WeightFormat:
        """The format of a model's output head (lm_head): int4 keeps it in int8, as llama.cpp
        keeps its output matrix at 6+ bits: its error lands on the logits directly, with no
        later layer to average it out. (Measured on the `trained` tiny Qwen2: logits' max
        error 0.49 -> see docs/quantization.md.) That int8 head multiplies what the int4
        weights do (int4_activations)."""
        if self.name != "int4":
            return self
        return replace(self, name="int8", int8_activations=self.int4_activations)


def exact_format(weight_t: torch.Tensor, fmt: WeightFormat) -> WeightFormat:
    """The format to store `weight_t` in for `fmt`, narrowed where that rounds nothing: float32
    weights whose values are all bfloat16 (a bf16 checkpoint's, as every released omni model
    ships, widened at load) are kept as bfloat16, which the kernel widens back exactly. The
    products are the same bits (tests/llm/test_linear_kernel.py); the weights take half the
    memory and half the bandwidth (a single-row product up to ~2x faster)."""
    if fmt.name != "float32" or weight_t.dtype != torch.float32:
        return fmt
    if bool((weight_t.detach().view(torch.int32) & 0xFFFF).any()):     # bits below bf16's
        return fmt
    return replace(fmt, name="bfloat16")


@dataclass
class QuantizedCodes:
    """An (out, in) weight quantized outside our packer (a pre-quantized checkpoint), in a
    grouped format the kernel computes exactly: codes (out, in), uint8 0..15 for int4
    (w = (u - 8) * s) or int8 for int8g (w = q * s); scales (out, ceil(in / group_size))
    float32."""

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        assert self.format in GROUPED and self.codes.dim() == 2
        assert self.scales.shape == (self.codes.shape[0], -(-self.codes.shape[1] // self.group_size))

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32, each weight as the kernel computes it."""
        s = self.scales.repeat_interleave(self.group_size, dim=1)[:, :self.codes.shape[1]]
        return (self.codes.float() - (8 if self.format == "int4" else 0)) * s

    def as_int8g(self) -> QuantizedCodes:
        """The same weights as int8g codes, exactly: (u - 8) * s is q * s with q = u - 8."""
        if self.format == "int8g":
            return self
        return QuantizedCodes("int8g", (self.codes.to(torch.int16) - 8).to(torch.int8), self.scales,
                              self.group_size)

    @staticmethod
    def cat(parts: list[QuantizedCodes]) -> QuantizedCodes | None:
        """Parts stacked along the outputs (merged q|k|v, gate|up), exactly; None when their
        groups differ. Parts in different formats become int8g (lossless)."""
        if len({p.group_size for p in parts}) != 1:
            return None
        if len({p.format for p in parts}) != 1:
            parts = [p.as_int8g() for p in parts]
        return QuantizedCodes(parts[0].format, torch.cat([p.codes for p in parts]),
                              torch.cat([p.scales for p in parts]), parts[0].group_size)


def quantize_codes(weight: torch.Tensor, fmt: WeightFormat) -> QuantizedCodes:
    """(out, in) float weight -> QuantizedCodes in a grouped `fmt` (as `pack` quantizes)."""
    packed = pack(weight.t(), replace(fmt, int4_activations="float32", int8_activations="float32"))
    k, n, g = packed.in_features, packed.out_features, -(-packed.in_features // fmt.group_size)
    codes = packed.codes() if fmt.name == "int4" else packed.panels          # (P, K, 64)
    codes = codes.transpose(0, 1).reshape(k, -1)[:, :n].t().contiguous()
    scales = packed.group_scales.transpose(0, 1).reshape(g, -1)[:, :n].t().contiguous()
    return QuantizedCodes(fmt.name, codes, scales, fmt.group_size)


@dataclass
class PackedWeight:
    """An (out_features, in_features) weight in the kernel's panels.

    panels: float32 / bfloat16 / int8 (num_panels, in, 64) (int8g too; bfloat16 columns in
    pairs: _pair_columns), or uint8 (num_panels, in, 32) for int4, or uint8 (num_panels, in / 8,
    64, 4) for int4k, or uint8 (num_panels, in / 4, 64, 4) for int8k (int4 / int8 whose inputs
    and groups are multiples of 32, laid out for integer dot products against int8
    activations: linear_dots.c; int8k bytes hold q + 128); column_scales: float32 (num_panels * 64,)
    for int8; group_scales: float32 (num_panels, ceil(in / group_size), 64) for int4, int4k,
    int8g and int8k (an int8 weight's column scales as one group of all inputs). Zero past
    out_features."""

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
        if self.format in (*GROUPED, "int4k", "int8k"):
            s = self.group_scales.repeat_interleave(self.group_size, dim=1)[:, :k]
            if self.format in ("int4", "int4k"):
                u = self.codes().float()                         # (P, K, 64)
                w = torch.addcmul(-8.0 * s, u, s)            # one rounding, like linear.c's FMA
            else:
                # int8k scales sums of products, not weights: the same product up to rounding.
                w = self.codes().float() * s
        else:
            w = (_pair_columns(self.panels, undo=True) if self.format == "bfloat16" else self.panels).float()
            if self.format == "int8":
                # linear.c scales the accumulated sum, not each weight: this is the same
                # product up to summation rounding.
                w = w * self.column_scales.view(num, 1, PANEL)
        return w.transpose(0, 1).reshape(k, num * PANEL)[:, :n].contiguous()

    def codes(self) -> torch.Tensor:
        """The codes as (num_panels, in, 64): int4 / int4k u (0..15) uint8; int8g / int8k q
        int8."""
        if self.format == "int4":
            return torch.cat([self.panels & 15, self.panels >> 4], dim=-1)
        if self.format == "int8g":
            return self.panels
        if self.format == "int8k":                           # (P, K/4, 64, 4): q + 128
            q = (self.panels.to(torch.int16) - 128).to(torch.int8)
            return q.transpose(2, 3).reshape(q.shape[0], -1, PANEL)
        p = self.panels                                      # (P, K/8, 64, 4)
        u = torch.cat([p & 15, p >> 4], dim=-1)              # (P, K/8, 64, 8): inputs 8c + i
        return u.permute(0, 1, 3, 2).reshape(p.shape[0], -1, PANEL)


def pack(weight_t: torch.Tensor, fmt: WeightFormat = WeightFormat()) -> PackedWeight:
    """(in, out) float weight -> PackedWeight in `fmt`."""
    name, group_size = fmt.name, fmt.group_size
    k, n = weight_t.shape
    num = -(-n // PANEL)
    w = weight_t.detach()
    if w.shape[1] != num * PANEL:                      # pad the output columns with zeros
        w = torch.nn.functional.pad(w, (0, num * PANEL - n))
    if name == "float32":
        return PackedWeight(name, _panels(w.float(), k, num), k, n)
    if name == "bfloat16":
        return PackedWeight(name, _pair_columns(_panels(w.to(torch.bfloat16), k, num)), k, n)
    w = w.float()
    if name == "int8":
        scale = w.abs().amax(dim=0) / 127                                      # (N_pad,)
        q = torch.round(w / _nonzero(scale)).clamp_(-127, 127).to(torch.int8)
        if fmt.integer_dots(name) and k % ACTIVATION_BLOCK == 0:    # one group of all K inputs
            return _grouped("int8g", q, scale.view(1, -1), k, n, fmt)
        return PackedWeight(name, _panels(q, k, num), k, n, column_scales=scale.contiguous())
    groups = -(-k // group_size)
    wg = torch.nn.functional.pad(w, (0, 0, 0, groups * group_size - k)).view(groups, group_size, -1)
    if name == "int4":
        extreme = wg.gather(1, wg.abs().argmax(dim=1, keepdim=True)).squeeze(1)   # (groups, N_pad)
        scale = extreme / -8
        q = torch.round(wg / _nonzero(scale).unsqueeze(1)).clamp_(-8, 7) + 8
    else:
        scale = wg.abs().amax(dim=1) / 127
        q = torch.round(wg / _nonzero(scale).unsqueeze(1)).clamp_(-127, 127)
    codes = q.view(-1, num * PANEL)[:k].to(torch.uint8 if name == "int4" else torch.int8)
    return _grouped(name, codes, scale, group_size, n, fmt)


def pack_codes(w: QuantizedCodes, fmt: WeightFormat = WeightFormat()) -> PackedWeight:
    """A weight quantized elsewhere, in panels exactly as its codes and scales say, against
    the activations `fmt` names for its format (fmt's name and group size are not used)."""
    n, k = w.codes.shape
    num = -(-n // PANEL)
    fill = 8 if w.format == "int4" else 0                  # padding columns weigh zero
    codes_t = torch.nn.functional.pad(w.codes.t(), (0, num * PANEL - n), value=fill)
    scales_t = torch.nn.functional.pad(w.scales.float().t(), (0, num * PANEL - n))
    return _grouped(w.format, codes_t, scales_t, w.group_size, n, fmt)


def _grouped(name: str, codes_t: torch.Tensor, scale: torch.Tensor, group_size: int,
             n: int, fmt: WeightFormat) -> PackedWeight:
    """codes_t (K, N_pad) (int4: uint8 0..15; int8g: int8) and scale (groups, N_pad) float32
    -> the PackedWeight of a grouped format (int4 as int4k, int8g as int8k where `fmt` asks
    for int8 activations and the shape allows it)."""
    k, num = codes_t.shape[0], codes_t.shape[1] // PANEL
    integer_dots = fmt.integer_dots(name) and k % ACTIVATION_BLOCK == 0 \
        and group_size % ACTIVATION_BLOCK == 0
    if name == "int4" and integer_dots:
        # int4k: per 8 inputs and column, 4 bytes: byte i = u(8c + i) | u(8c + 4 + i) << 4
        u = codes_t.view(k // 8, 2, 4, num, PANEL)                            # (K/8, 2, 4, P, 64)
        bytes_ = u[:, 0] | (u[:, 1] << 4)                                     # (K/8, 4, P, 64)
        panels = bytes_.permute(2, 0, 3, 1).contiguous()                      # (P, K/8, 64, 4)
        name = "int4k"
    elif name == "int8g" and integer_dots:
        # int8k: per 4 inputs and column, 4 bytes: byte i = q(4c + i) + 128
        u = (codes_t.to(torch.int16) + 128).to(torch.uint8).view(k // 4, 4, num, PANEL)
        panels = u.permute(2, 0, 3, 1).contiguous()                          # (P, K/4, 64, 4)
        name = "int8k"
    elif name == "int4":
        u = codes_t.view(k, num, PANEL)
        nibbles = u[..., :PANEL // 2] | (u[..., PANEL // 2:] << 4)            # (K, P, 32)
        panels = nibbles.transpose(0, 1).contiguous()
    else:
        panels = _panels(codes_t, k, num)
    return PackedWeight(name, panels, k, n, group_size,
                        group_scales=scale.reshape(-1, num, PANEL).transpose(0, 1).contiguous())


def _panels(w: torch.Tensor, k: int, num: int) -> torch.Tensor:
    """(K, num * 64) -> (num, K, 64) contiguous."""
    return w.reshape(k, num, PANEL).transpose(0, 1).contiguous()


def _pair_columns(panels: torch.Tensor, undo: bool = False) -> torch.Tensor:
    """bf16 panels (num, K, 64): each row's groups of 16 columns as 8 pairs (column i, column
    8 + i), so that linear.c widens one 32-bit word into two columns (a shift, a mask); `undo`:
    back to column order."""
    num, k = panels.shape[:2]
    shape = (num, k, PANEL // 16, 8, 2) if undo else (num, k, PANEL // 16, 2, 8)
    return panels.reshape(shape).transpose(-1, -2).reshape(num, k, PANEL).contiguous()


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Scales to divide by: an all-zero column or group has scale 0 and quantizes to 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
