"""y = x W^T + bias with the product in int8 (linear_w8a8.c): weights quantized once per
output column, each row of x per call, exact int32 sums (AMX tiles where the CPU and the OS
allow them, else VNNI where the CPU has it, else plain C: the same bits). For compute-bound
GEMMs already at the bf16 peak; what it costs in accuracy is the caller's to state (the
quantization of both sides, ~1/254 of each row's and column's largest value). A LayerNorm before
(each row normalized, then * weight + bias, as it is quantized) and a gated residual after
(res + gate * y) can run in the same call (RowNorm, GatedResidual)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.kernels.build import build_library, narrow_vectors, without_vnni
from omnistage.kernels.linear import pointer
from omnistage.kernels.weight_pack import PANEL, WeightFormat, pack

SOURCE = Path(__file__).with_name("linear_w8a8.c")
ACTIVATIONS = {"none": 0, "gelu_tanh": 1}    # linear_w8a8.c's act
MAX_IN = 66000            # 255 * 127 * K (the biased sum) stays below 2^31


@dataclass(frozen=True)
class RowNorm:
    """LayerNorm over the last dimension with this weight and bias (k,) float32, as
    F.layer_norm(x, (k,), weight, bias, eps) computes it (within float rounding)."""
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


@dataclass(frozen=True)
class GatedResidual:
    """y -> res + gate * y: res shaped as the output, gate (out,) (broadcast over rows)."""
    res: torch.Tensor
    gate: torch.Tensor


class _Fuse(ctypes.Structure):
    """linear_w8a8.c's W8A8Fuse."""
    _fields_ = [("norm_w", ctypes.c_void_p), ("norm_b", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("res", ctypes.c_void_p), ("ldr", ctypes.c_int64), ("gate", ctypes.c_void_p)]


class _Matrix(ctypes.Structure):
    """linear_w8a8.c's W8A8Matrix."""
    _fields_ = [("panels", ctypes.c_void_p), ("sw", ctypes.c_void_p), ("comp", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


@dataclass(frozen=True)
class W8A8Weight:
    """A weight in linear_w8a8.c's layout (see there)."""
    panels: torch.Tensor       # (num_panels, ceil(K / 4) * 256) int8
    scales: torch.Tensor       # (num_panels * 64,) float32: sw per column, 0 past N
    comp: torch.Tensor         # (num_panels * 64,) int32: 128 * sum_k qw per column
    out_features: int
    in_features: int


def pack_w8a8(weight: torch.Tensor) -> W8A8Weight:
    """(out, in) float weight -> its int8 panels: the native linear kernel's int8 weight format
    (q = round(w / sw), sw = max |w| / 127 per output column, 0 for an all-zero column),
    regrouped in 4-input chunks."""
    n, k = weight.shape
    if k > MAX_IN:
        raise ValueError(f"w8a8 linear: {k} inputs; int32 sums hold at most {MAX_IN}")
    packed = pack(weight.detach().cpu().t(), WeightFormat("int8", int8_activations="float32"))   # (P, K, 64)
    panels, k4 = packed.panels.shape[0], (k + 3) // 4
    q = torch.nn.functional.pad(packed.panels, (0, 0, 0, 4 * k4 - k))       # K padded with zeros
    # (panel, group, 4, column) -> (panel, group, column, 4): a chunk is 64 columns x 4 inputs
    layout = q.view(panels, k4, 4, PANEL).transpose(2, 3).contiguous().view(panels, k4 * 256)
    comp = (128 * packed.panels.to(torch.int32).sum(dim=1)).view(-1).to(torch.int32)   # sum gives int64
    return W8A8Weight(layout, packed.column_scales, comp, n, k)


class W8A8Kernel:
    """The compiled kernel (raises NativeBuildError where it does not build). narrow: the
    8-lane build a CPU without AVX-512 runs (AVX-VNNI where this CPU has it), and with
    vnni=False the plain C path; amx=False: VNNI even where the CPU has AMX (tests run every
    path)."""

    def __init__(self, narrow: bool = False, amx: bool = True, vnni: bool = True):
        defines, flags = narrow_vectors() if narrow else ({}, ())
        flags = flags if vnni else (*flags, *without_vnni())
        lib = ctypes.CDLL(str(build_library(SOURCE, defines, flags)))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.linear_w8a8
        self._fn.argtypes = [p, i64, p, p, p, p, ctypes.c_int32, p, i64, i64, i64, i64, ctypes.c_int32,
                             ctypes.POINTER(_Fuse)]
        self._fn.restype = None
        self._ffn = lib.linear_w8a8_ffn
        self._ffn.argtypes = [p, i64, ctypes.POINTER(_Matrix), ctypes.POINTER(_Matrix), p, i64, i64,
                              ctypes.c_int32, ctypes.POINTER(_Fuse), ctypes.POINTER(_Fuse)]
        self._ffn.restype = None
        lib.linear_w8a8_vnni.restype = lib.linear_w8a8_amx.restype = ctypes.c_int
        self.vnni = bool(lib.linear_w8a8_vnni())
        self.amx = amx and bool(lib.linear_w8a8_amx())    # asks the OS for the tiles once

    @property
    def address(self) -> int:
        """linear_w8a8's address, for calls from C (dit_stack.c)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    @property
    def feed_forward_address(self) -> int:
        """linear_w8a8_ffn's address, for calls from C (dit_stack.c)."""
        return ctypes.cast(self._ffn, ctypes.c_void_p).value

    def feed_forward(self, x: torch.Tensor, up: W8A8Weight, up_bias: torch.Tensor | None, down: W8A8Weight,
                     down_bias: torch.Tensor | None, norm: RowNorm | None = None,
                     residual: GatedResidual | None = None) -> torch.Tensor:
        """self(self(x, up, up_bias, "gelu_tanh", norm), down, down_bias, residual=residual) in one
        call, row block by row block (linear_w8a8_ffn): the same bits. x (..., in) float32."""
        if up.out_features != down.in_features or x.shape[-1] != up.in_features:
            raise ValueError(f"w8a8 feed-forward: x {tuple(x.shape)}, up ({up.out_features}, {up.in_features}), "
                             f"down ({down.out_features}, {down.in_features})")
        for w, b in ((up, up_bias), (down, down_bias)):
            if b is not None and b.shape != (w.out_features,):
                raise ValueError(f"w8a8 feed-forward: a bias {tuple(b.shape)} for {w.out_features} outputs")
        flat = _rows(x)
        m = flat.shape[0]
        y = torch.empty(m, down.out_features, dtype=torch.float32)
        up_fuse, keep_up = self._fuse(norm, None, m, up)
        down_fuse, keep_down = self._fuse(None, residual, m, down)
        biases = [None if b is None else b.float().contiguous() for b in (up_bias, down_bias)]
        mats = [_Matrix(w.panels.data_ptr(), w.scales.data_ptr(), w.comp.data_ptr(), pointer(b),
                        w.out_features, w.in_features) for w, b in ((up, biases[0]), (down, biases[1]))]
        if m:
            self._ffn(flat.data_ptr(), flat.stride(0), ctypes.byref(mats[0]), ctypes.byref(mats[1]), y.data_ptr(),
                      down.out_features, m, int(self.amx), up_fuse, down_fuse)
        del keep_up, keep_down, biases
        return y.view(*x.shape[:-1], down.out_features)

    def __call__(self, x: torch.Tensor, w: W8A8Weight, bias: torch.Tensor | None,
                 activation: str = "none", norm: RowNorm | None = None,
                 residual: GatedResidual | None = None) -> torch.Tensor:
        """x (..., in) float32 on the CPU -> (..., out) float32; bias (out,) float32 or None;
        activation "none" or "gelu_tanh" (GELU's tanh form, in the same pass); norm: x's rows
        layer-normed first; residual: added after the activation."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"w8a8 linear: activation {activation!r}, not one of {sorted(ACTIVATIONS)}")
        if x.shape[-1] != w.in_features or (bias is not None and bias.shape != (w.out_features,)):
            raise ValueError(f"w8a8 linear: x {tuple(x.shape)}, weight ({w.out_features}, "
                             f"{w.in_features}), bias {None if bias is None else tuple(bias.shape)}")
        flat = _rows(x)
        b = None if bias is None else bias.float().contiguous()
        m = flat.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        fuse, keep = self._fuse(norm, residual, m, w)
        if m:
            self._fn(flat.data_ptr(), flat.stride(0), w.panels.data_ptr(), w.scales.data_ptr(),
                     w.comp.data_ptr(), None if b is None else b.data_ptr(), ACTIVATIONS[activation], y.data_ptr(),
                     w.out_features, m, w.out_features, w.in_features, int(self.amx), fuse)
        del keep
        return y.view(*x.shape[:-1], w.out_features)

    @staticmethod
    def _fuse(norm: RowNorm | None, residual: GatedResidual | None, m: int, w: W8A8Weight
              ) -> tuple[_Fuse | None, list[torch.Tensor]]:
        """The W8A8Fuse for a call (None: nothing fused) and the tensors it points into (the
        caller keeps them alive through the call)."""
        if norm is None and residual is None:
            return None, []
        keep: list[torch.Tensor] = []

        def vector(t: torch.Tensor, size: int, what: str) -> int:
            if t.numel() != size:
                raise ValueError(f"w8a8 linear: {what} has {t.numel()} values, not {size}")
            keep.append(t.reshape(size).float().contiguous())
            return keep[-1].data_ptr()

        fuse = _Fuse()
        if norm is not None:
            fuse.norm_w = vector(norm.weight, w.in_features, "norm weight")
            fuse.norm_b = vector(norm.bias, w.in_features, "norm bias")
            fuse.eps = norm.eps
        if residual is not None:
            res = residual.res.reshape(-1, w.out_features)
            if res.shape[0] != m:
                raise ValueError(f"w8a8 linear: residual of {res.shape[0]} rows for {m}")
            if res.stride(-1) != 1 or res.dtype != torch.float32:
                res = res.float().contiguous()
            keep.append(res)
            fuse.res, fuse.ldr = res.data_ptr(), res.stride(0)
            fuse.gate = vector(residual.gate, w.out_features, "gate")
        return fuse, keep


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) as the kernel reads it: (rows, in), float32, unit stride along in."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1 or flat.dtype != torch.float32:
        flat = flat.float().contiguous()
    return flat
