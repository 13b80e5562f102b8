"""Linear layers as native calls over weights packed in 64-column panels (linear.c): one
layout that streams at memory speed for a single row and runs a register-tiled GEMM for many,
with every row's result independent of the batch around it. Weights are float32, bfloat16,
int8 (per channel or per group) or int4 (weight_pack.py); activations and results float32."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library, narrow_vectors, pick_native, without_vnni
from omnistage.kernels.weight_pack import PackedWeight, WeightFormat, pack

SOURCE = Path(__file__).with_name("linear.c")
DOTS_SOURCE = Path(__file__).with_name("linear_dots.c")     # int4k / int8k: integer dot products
_SYMBOLS = {"float32": "linear_f32", "bfloat16": "linear_bf16", "int8": "linear_i8",
            "int4": "linear_i4", "int8g": "linear_i8g"}
_DOT_SYMBOLS = {"int4k": "linear_i4k", "int8k": "linear_i8k"}


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve a layer computing in `dtype` on `device` (None: it can)."""
    if device.type != "cpu":
        return f"it runs on CPUs (the weights are on {device})"
    if dtype != torch.float32:
        return f"it computes in float32 (this model in {str(dtype).removeprefix('torch.')})"
    return None


def native_linear_kernel(want: str, device: torch.device, dtype: torch.dtype
                         ) -> tuple[NativeLinearKernel | None, str | None]:
    """For `linear_kernel` = want (auto or native): the kernel, or (None, why it cannot serve
    here); `native` that cannot serve raises InvalidRequestError."""
    return pick_native("linear_kernel", want, unsupported_reason(device, dtype), NativeLinearKernel,
                       "auto, onednn or matmul")


class NativeLinearKernel:
    """The compiled kernel; shape-free, so one serves every layer of a model.

    wide_vectors=False builds the AVX2-width path (8 lanes, 3-row tiles) even on a CPU with
    AVX-512: the path CPUs without it take, so it is tested everywhere; vnni=False the
    paths of CPUs without VNNI (int4k / int8k dot products through AVX-512BW, or with
    wide_vectors=False plain AVX2 instead of AVX-VNNI)."""

    def __init__(self, wide_vectors: bool = True, vnni: bool = True):
        defines, flags = ({}, ()) if wide_vectors else narrow_vectors()
        flags = flags if vnni else (*flags, *without_vnni())
        lib = ctypes.CDLL(str(build_library(SOURCE, defines, flags)))
        dots = ctypes.CDLL(str(build_library(DOTS_SOURCE, defines, flags)))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.segmented = lib.linear_segments
        self.segmented.argtypes = [ctypes.POINTER(LinearCall), p, i64, p, p]
        self.segmented.restype = None
        self._fns = {}
        for library, symbols in ((lib, _SYMBOLS), (dots, _DOT_SYMBOLS)):
            for fmt, name in symbols.items():
                fn = getattr(library, name)
                fn.argtypes = [p, i64, p, p, i64, p, p, p, i64, i64, i64, i64]
                fn.restype = None
                self._fns[fmt] = fn

    def segments(self, weights: list[PackedWeight], biases: list[torch.Tensor | None]) -> LinearSegments:
        """The weights bound for segmented calls (LinearSegments)."""
        return LinearSegments(self, weights, biases)

    def address(self, fmt: str) -> int:
        """The C entry point for weights in format `fmt`, for native callers (decoder_stack.c)."""
        return ctypes.cast(self._fns[fmt], ctypes.c_void_p).value

    def segments_address(self) -> int:
        """linear_segments' C entry point, for native callers (moe.c)."""
        return ctypes.cast(self.segmented, ctypes.c_void_p).value

    def bind(self, w: PackedWeight, bias: torch.Tensor | None) -> LinearCall:
        """`w` (and its bias) for calls from C; the caller keeps both alive."""
        return LinearCall(self.address(w.format), w.panels.data_ptr(), pointer(w.group_scales),
                          w.group_size, pointer(w.column_scales), pointer(bias), w.out_features,
                          w.in_features)

    @staticmethod
    def pack(weight_t: torch.Tensor, fmt: WeightFormat = WeightFormat()) -> PackedWeight:
        """(in, out) weight -> the kernel's panels in `fmt` (weight_pack.pack)."""
        return pack(weight_t, fmt)

    def __call__(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., in) float32 -> (..., out). bias: (out,) float32 contiguous or None. Called
        ~50 times per decode step: checks stay minimal."""
        k, n = w.in_features, w.out_features
        if x.dim() != 2 or not x.is_contiguous():
            return self(x.reshape(-1, k).contiguous(), w, bias).view(*x.shape[:-1], n)
        m = x.shape[0]
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if x.shape[1] != k or x.dtype != torch.float32:
            raise ValueError(f"native linear: input {tuple(x.shape)} {x.dtype}, weight in_features {k}")
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._fns[w.format](x.data_ptr(), k, w.panels.data_ptr(), pointer(w.group_scales),
                                w.group_size, pointer(w.column_scales), pointer(bias), y.data_ptr(),
                                n, m, n, k)
        return y


class LinearCall(ctypes.Structure):
    """A packed weight bound for calls from C (linear_call.h's Linear): its format's entry and
    that entry's arguments after x. Holds pointers only: the tensors must outlive it."""
    _fields_ = [("fn", ctypes.c_void_p), ("panels", ctypes.c_void_p), ("gscales", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("cscales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class LinearSegments:
    """Weights of one shape bound once (pointers; the tensors kept alive), so that one native
    call runs consecutive segments of rows each through its own weight (linear_segments): a
    mixture of experts' products over rows grouped by expert, with the bits of one call per
    expert."""

    def __init__(self, kernel: NativeLinearKernel, weights: list[PackedWeight],
                 biases: list[torch.Tensor | None]):
        shapes = {(w.in_features, w.out_features) for w in weights}
        if len(shapes) != 1 or len(biases) != len(weights):
            raise ValueError(f"linear segments need weights of one shape and a bias (or None) each; "
                             f"got shapes {sorted(shapes)}, {len(weights)} weights, {len(biases)} biases")
        self.in_features, self.out_features = shapes.pop()
        self._kernel, self._refs = kernel, (list(weights), list(biases))
        self._array = (LinearCall * len(weights))(*(kernel.bind(w, b) for w, b in zip(weights, biases)))

    def __len__(self) -> int:
        return len(self._array)

    def address(self) -> int:
        """The bound weights (an array of linear_call.h's Linear, one per segment), for native
        callers (moe.c); valid while this object lives."""
        return ctypes.addressof(self._array)

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (R, in) float32 contiguous, its rows in segments of counts[e] rows (sum R) ->
        (R, out), segment e through weight e."""
        if (x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32
                or not x.is_contiguous() or len(counts) != len(self) or sum(counts) != x.shape[0]
                or min(counts, default=0) < 0):
            raise ValueError(f"linear segments: input {tuple(x.shape)} {x.dtype} for {len(self)} weights "
                             f"({self.in_features} -> {self.out_features}), counts {counts}")
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        off = (ctypes.c_int64 * len(offsets))(*offsets)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._kernel.segmented(self._array, off, len(self), x.data_ptr(), y.data_ptr())
        return y


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
