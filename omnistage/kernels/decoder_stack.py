"""A dense Qwen2/Qwen3-style decoder stack as one native call per step (decoder_stack.c): the
same linear and attention kernels as the per-op path, with the layer loop, RMSNorm, SiLU and
the residual adds in C instead of ~170 Python-dispatched ops per step."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.kernels.build import build_library
from omnistage.kernels.linear import LinearCall, NativeLinearKernel, pointer
from omnistage.kernels.paged_attention import PagedAttentionKernel
from omnistage.kernels.weight_pack import PackedWeight

SOURCE = Path(__file__).with_name("decoder_stack.c")
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _p), ("norm2", _p), ("q_norm", _p), ("k_norm", _p), ("kv", _p),
                ("qkv", LinearCall), ("o", LinearCall),
                ("gate_up", LinearCall), ("down", LinearCall)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("intermediate", _i64), ("heads", _i64),
                ("kv_heads", _i64), ("head_dim", _i64), ("num_blocks", _i64),
                ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", _p), ("rope_write", _p), ("decode", _p), ("prefill", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("cos", _p), ("sin", _p), ("cs_stride", _i64), ("slots", _p),
                ("decodes", _i64), ("decode_width", _i64), ("decode_tables", _p), ("decode_lens", _p),
                ("prefills", _i64), ("prefill_width", _i64), ("prefill_tables", _p),
                ("prefill_starts", _p), ("prefill_lens", _p), ("prefill_ctx", _p),
                ("out_count", _i64), ("out_rows", _p)]


@dataclass(frozen=True)
class Product:
    """One linear layer in the native kernel's layout: its packed weight and bias."""

    weight: PackedWeight
    bias: torch.Tensor | None          # (out,) float32 contiguous


@dataclass(frozen=True)
class DenseLayer:
    """What one decoder layer hands the stack: float32 CPU tensors that outlive it."""

    norm1: torch.Tensor                # (hidden,) input RMSNorm weight
    norm2: torch.Tensor                # (hidden,) post-attention RMSNorm weight
    kv: torch.Tensor                   # the layer's cache (2, Hkv, num_blocks, block, D)
    qkv: Product                       # (hidden) -> (Hq + 2 Hkv) D, q | k | v
    o: Product                         # Hq D -> hidden
    gate_up: Product                   # hidden -> 2 * intermediate, gate | up
    down: Product                      # intermediate -> hidden
    q_norm: torch.Tensor | None = None  # (head_dim,) Qwen3's per-head query RMSNorm weight
    k_norm: torch.Tensor | None = None  # (head_dim,) ... key; both or neither


class NativeDecoderStack:
    """The layers of one model bound once (pointers to its weights and caches); each call
    runs one step's rows through all of them."""

    def __init__(self, linear: NativeLinearKernel, attention: PagedAttentionKernel,
                 layers: list[DenseLayer], eps: float, scale: float, final_norm: torch.Tensor):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        self._run = lib.decoder_stack_f32
        self._run.argtypes = [ctypes.POINTER(_Stack), ctypes.POINTER(_Step), _p, _p]
        self._run.restype = ctypes.c_int
        self._layers, self._final_norm = layers, final_norm    # keeps the tensors alive
        assert final_norm.dtype == torch.float32 and final_norm.is_contiguous()
        first = layers[0]
        self.hidden = first.norm1.shape[0]
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        for layer in layers:
            self._check(layer, heads, kv_heads, head_dim, attention.kv_dtype)
        rope, decode, prefill = attention.addresses()
        self._array = (_Layer * len(layers))(*(self._layer(linear, x) for x in layers))
        self._stack = _Stack(len(layers), self.hidden, first.down.weight.in_features, heads, kv_heads,
                             head_dim, first.kv.shape[2], eps, scale, self._array,
                             final_norm.data_ptr(), rope, decode, prefill)
        work_floats = lib.decoder_stack_work
        work_floats.argtypes = [ctypes.POINTER(_Stack), _i64]
        work_floats.restype = _i64
        self._work_per_row = work_floats(ctypes.byref(self._stack), 1)   # linear in the rows
        self._work = torch.empty(0)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 native, out_rows: torch.Tensor | None) -> torch.Tensor:
        """h (T, hidden): the first layer's input (not modified) -> the last layer's output
        after the final norm, (T, hidden) or (R, hidden) for out_rows (R,) ascending. cos,
        sin, slots and `native` (the step's NativeBatches) as the per-op path gets them."""
        t = h.shape[0]
        assert h.shape[1] == self.hidden and h.dtype == torch.float32 and cos.stride() == sin.stride()
        out = h.contiguous().clone()
        need = self._work_per_row * t
        if self._work.numel() < need:       # grown, never shrunk: no page faults per step
            self._work = torch.empty(need)
        rows = None if out_rows is None else out_rows.contiguous()
        step = _Step(t, cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(),
                     native.decode_lens.shape[0], _width(native.decode_tables),
                     native.decode_tables.data_ptr(), native.decode_lens.data_ptr(),
                     native.prefill_lens.shape[0], _width(native.prefill_tables),
                     native.prefill_tables.data_ptr(), native.prefill_starts.data_ptr(),
                     native.prefill_lens.data_ptr(), native.prefill_ctx.data_ptr(),
                     0 if rows is None else rows.shape[0], None if rows is None else rows.data_ptr())
        if self._run(ctypes.byref(self._stack), ctypes.byref(step), out.data_ptr(), self._work.data_ptr()):
            raise MemoryError("decoder stack: an attention kernel could not allocate its scratch")
        return out if rows is None else out[:rows.shape[0]]

    @staticmethod
    def _layer(linear: NativeLinearKernel, x: DenseLayer) -> _Layer:
        calls = [linear.bind(p.weight, p.bias) for p in (x.qkv, x.o, x.gate_up, x.down)]
        return _Layer(x.norm1.data_ptr(), x.norm2.data_ptr(), pointer(x.q_norm), pointer(x.k_norm),
                      x.kv.data_ptr(), *calls)

    @staticmethod
    def _check(x: DenseLayer, heads: int, kv_heads: int, head_dim: int,
               kv_dtype: torch.dtype) -> None:
        """The shapes the C code trusts."""
        hidden = x.norm1.shape[0]
        for t in (x.norm1, x.norm2, x.kv):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert x.norm1.dtype == x.norm2.dtype == torch.float32 and x.kv.dtype == kv_dtype
        assert (x.q_norm is None) == (x.k_norm is None)
        for t in (x.q_norm, x.k_norm):
            assert t is None or (t.shape == (head_dim,) and t.dtype == torch.float32 and t.is_contiguous())
        assert x.qkv.weight.in_features == x.gate_up.weight.in_features == hidden
        assert x.qkv.weight.out_features == (heads + 2 * kv_heads) * head_dim
        assert x.o.weight.in_features == heads * head_dim and x.o.weight.out_features == hidden
        assert x.gate_up.weight.out_features == 2 * x.down.weight.in_features
        assert x.down.weight.out_features == hidden
        for p in (x.qkv, x.o, x.gate_up, x.down):
            assert p.bias is None or (p.bias.is_contiguous() and p.bias.dtype == torch.float32)


def _width(tables: torch.Tensor) -> int:
    """Columns of a (N, W) block table; an empty one may come as (0,)."""
    return tables.shape[1] if tables.dim() == 2 else 0

