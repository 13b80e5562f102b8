"""The token2wav DiT's blocks as one native call per evaluation (dit_stack.c): the same
products (int8 W8A8 or the native float32 linear kernel) and window attention as the per-block
path, with the block loop in C instead of ~30 Python-wrapped kernel calls and a dozen torch ops
per block."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.kernels.build import build_library
from omnistage.kernels.linear import LinearCall, NativeLinearKernel, pointer
from omnistage.kernels.linear_w8a8 import RowNorm, W8A8Kernel, W8A8Weight
from omnistage.kernels.weight_pack import PackedWeight
from omnistage.kernels.window_attention import MAX_SLOTS, WindowAttentionKernel

SOURCE = Path(__file__).with_name("dit_stack.c")
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _W8(ctypes.Structure):
    _fields_ = [("panels", _p), ("sw", _p), ("comp", _p), ("bias", _p)]


class _Product(ctypes.Structure):
    _fields_ = [("int8", ctypes.c_int32), ("w8", _W8), ("lin", LinearCall)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("out", _Product), ("up", _Product), ("down", _Product),
                ("back", _i64), ("ahead", _i64)]


class _Mod(ctypes.Structure):
    _fields_ = [("norm_w", _p), ("norm_b", _p), ("gate", _p)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("head_dim", _i64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("amx", ctypes.c_int32),
                ("layers", ctypes.POINTER(_Layer)), ("w8a8", _p), ("w8a8_ffn", _p), ("attend", _p)]


@dataclass(frozen=True)
class StackProduct:
    """One frame-row product of a block: its weight, int8 (W8A8Weight, for the W8A8 kernel) or
    float32 (PackedWeight, for the native linear kernel), and its float32 bias (or None)."""
    weight: W8A8Weight | PackedWeight
    bias: torch.Tensor | None


@dataclass(frozen=True)
class DiTLayerProducts:
    """What one DiT block hands the stack (tensors that outlive it)."""
    qkv: StackProduct          # D -> 3 * H * head_dim, q | k | v
    out: StackProduct          # H * head_dim -> D
    up: StackProduct           # D -> F (GELU after)
    down: StackProduct         # F -> D
    back: int                 # the attention's window in blocks
    ahead: int


@dataclass(frozen=True)
class BlockModulation:
    """A block's modulation at one time t, as the per-block path applies it: the attention's and
    the feed-forward's norm (RowNorm: 1 + scale, shift) and gate, float32 (D,) each."""
    attn_norm: RowNorm
    attn_gate: torch.Tensor
    ff_norm: RowNorm
    ff_gate: torch.Tensor


class BoundModulations:
    """Every block's modulation at one t, bound for the C code (keeps its tensors alive)."""

    def __init__(self, mods: list[BlockModulation], hidden: int, eps: float):
        vectors = []
        for m in mods:
            for norm, gate in ((m.attn_norm, m.attn_gate), (m.ff_norm, m.ff_gate)):
                if norm.eps != eps:
                    raise ValueError(f"dit stack: a norm's eps {norm.eps}, the stack's {eps}")
                vectors.append(tuple(_vector(v, hidden) for v in (norm.weight, norm.bias, gate)))
        self._keep = vectors
        self.array = (_Mod * len(vectors))(*(_Mod(*(v.data_ptr() for v in vs)) for vs in vectors))


class NativeDiTStack:
    """The blocks of one DiT bound once (pointers to their weights); each call runs one
    evaluation's rows through all of them. w8a8 / linear: the kernels of the int8 / float32
    products (None where no product is of that kind)."""

    def __init__(self, attention: WindowAttentionKernel, layers: list[DiTLayerProducts], hidden: int,
                 heads: int, eps: float, w8a8: W8A8Kernel | None = None,
                 linear: NativeLinearKernel | None = None):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        self._run = lib.dit_stack_f32
        self._run.argtypes = [ctypes.POINTER(_Stack), ctypes.POINTER(_Mod), _p, _i64, _i64, _p, _p, _p]
        self._run.restype = ctypes.c_int
        head_dim = attention.head_dim
        for layer in layers:
            _check(layer, hidden, heads * head_dim, w8a8, linear)
        self.hidden, self.heads, self.head_dim, self.eps = hidden, heads, head_dim, eps
        self.num_layers, self.block = len(layers), attention.block
        self._layers = layers                          # keeps the weights alive
        self._array = (_Layer * len(layers))(*(_layer(x, linear) for x in layers))
        self._stack = _Stack(len(layers), hidden, heads, head_dim, eps, head_dim ** -0.5,
                             int(w8a8 is not None and w8a8.amx), self._array,
                             None if w8a8 is None else w8a8.address,
                             None if w8a8 is None else w8a8.feed_forward_address, attention.address(torch.float32))
        work = lib.dit_stack_work
        work.argtypes = [ctypes.POINTER(_Stack), _i64]
        work.restype = _i64
        self._work_per_row = work(ctypes.byref(self._stack), 1)    # linear in the rows
        self._work = torch.empty(0)

    def bind(self, mods: list[BlockModulation]) -> BoundModulations:
        if len(mods) != self.num_layers:
            raise ValueError(f"dit stack: {len(mods)} modulations for {self.num_layers} blocks")
        return BoundModulations(mods, self.hidden, self.eps)

    def __call__(self, h: torch.Tensor, mods: BoundModulations, lengths: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) float32: the first block's input (not modified) -> the last block's
        output. lengths (B,) int64 valid frames per row; rope (B, T, 1, head_dim / 2)
        complex64 (DiTModel.rope_angles)."""
        b, t, d = h.shape
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if (d != self.hidden or h.dtype != torch.float32 or h.device.type != "cpu" or t % self.block
                or lengths.shape != (b,) or lengths.dtype != torch.int64
                or rope.shape != (b, t, 1, self.head_dim // 2) or rope.dtype != torch.complex64):
            raise ValueError(f"dit stack: h {tuple(h.shape)} {h.dtype}, lengths {tuple(lengths.shape)} "
                             f"{lengths.dtype}, rope {tuple(rope.shape)} {rope.dtype} (hidden "
                             f"{self.hidden}, block {self.block}, head_dim {self.head_dim})")
        out = h.contiguous().clone()
        need = self._work_per_row * b * t
        if self._work.numel() < need:       # grown, never shrunk: no page faults per evaluation
            self._work = torch.empty(need)
        lengths = lengths.contiguous()
        angles = torch.view_as_real(rope.contiguous())
        if self._run(ctypes.byref(self._stack), mods.array, out.data_ptr(), b, t, lengths.data_ptr(),
                     angles.data_ptr(), self._work.data_ptr()) != 0:
            raise MemoryError("dit stack: the attention kernel could not allocate its scratch")
        return out


def _vector(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.numel() != size:
        raise ValueError(f"dit stack: a modulation vector of {t.numel()} values, not {size}")
    return t.reshape(size).float().contiguous()


def _product(p: StackProduct, linear: NativeLinearKernel | None) -> _Product:
    w = p.weight
    if isinstance(w, W8A8Weight):
        return _Product(1, _W8(w.panels.data_ptr(), w.scales.data_ptr(), w.comp.data_ptr(), pointer(p.bias)),
                        LinearCall(None, None, None, 0, None, None, w.out_features, w.in_features))
    return _Product(0, _W8(), linear.bind(w, p.bias))


def _layer(x: DiTLayerProducts, linear: NativeLinearKernel | None) -> _Layer:
    return _Layer(*(_product(p, linear) for p in (x.qkv, x.out, x.up, x.down)), x.back, x.ahead)


def _check(x: DiTLayerProducts, hidden: int, inner: int, w8a8: W8A8Kernel | None,
           linear: NativeLinearKernel | None) -> None:
    """The shapes the C code trusts."""
    if not (x.qkv.weight.in_features == x.up.weight.in_features == hidden
            and x.qkv.weight.out_features == 3 * inner and x.out.weight.in_features == inner
            and x.out.weight.out_features == x.down.weight.out_features == hidden
            and x.up.weight.out_features == x.down.weight.in_features):
        raise ValueError(f"dit stack: a block's products do not chain (hidden {hidden}, heads x "
                         f"head_dim {inner})")
    if x.back < 0 or x.ahead < 0 or x.back + 1 + x.ahead > MAX_SLOTS:
        raise ValueError(f"dit stack: a window of {x.back} + 1 + {x.ahead} blocks (at most {MAX_SLOTS})")
    for p in (x.qkv, x.out, x.up, x.down):
        int8 = isinstance(p.weight, W8A8Weight)
        if (w8a8 if int8 else linear) is None:
            raise ValueError(f"dit stack: an {'int8' if int8 else 'float32'} product, and no kernel for it")
        if not int8 and p.weight.format != "float32":
            raise ValueError(f"dit stack: a {p.weight.format} product (float32 or int8 W8A8 only)")
        b = p.bias
        if b is not None and not (b.dtype == torch.float32 and b.is_contiguous()
                                  and b.shape == (p.weight.out_features,)):
            raise ValueError("dit stack: a bias must be float32, contiguous, one per output")
