"""A mixture-of-experts layer's grouping and combination as native calls (moe.c), around its
experts' segmented products: the rows grouped by expert and sent through every expert's gate|up
product in one call, SiLU(gate) * up in torch, then the down products and each row's weighted
sum in another. The same bits as layers/moe.py's tensor ops (see moe.c)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from omnistage.kernels.build import build_library
from omnistage.kernels.linear import LinearSegments, NativeLinearKernel

SOURCE = Path(__file__).with_name("moe.c")
# torch rounds each weighted output before adding it: no fused multiply-adds here (moe.c)
FLAGS = ("-ffp-contract=off",)
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class MoeKernel:
    """The compiled grouping and combination (moe.c), shape-free: one serves every MoE layer
    (layers.native_kernel.attach_kernel hands it out); raises NativeBuildError where it does
    not build."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {}, FLAGS)))
        self.group, self.combine = lib.moe_group_f32, lib.moe_combine_f32
        self.group.argtypes = [_p, _p, _i64, _p, _i64, _i64, _p, _i64, _p, _p, _p, _p, _p]
        self.group.restype = ctypes.c_int
        self.combine.argtypes = [_p, _p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _p, _p]
        self.combine.restype = None


class NativeMoe:
    """One layer's experts bound once: gate_up and down, segment e holding expert e's weight,
    on `linear`'s segmented entry."""

    def __init__(self, kernel: MoeKernel, linear: NativeLinearKernel, gate_up: LinearSegments,
                 down: LinearSegments):
        if len(gate_up) != len(down) or gate_up.out_features != 2 * down.in_features \
                or gate_up.in_features != down.out_features:
            raise ValueError(f"moe: gate|up {gate_up.in_features} -> {gate_up.out_features} and down "
                             f"{down.in_features} -> {down.out_features} over {len(gate_up)} / {len(down)} "
                             "experts do not make one SwiGLU per expert")
        self._group, self._combine = kernel.group, kernel.combine
        self._segments = linear.segments_address()
        self.gate_up, self.down = gate_up, down         # kept alive: their arrays are read from C
        self.num_experts, self.hidden = len(gate_up), down.out_features

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x (T, hidden) float32; weights (T, k) float32 and experts (T, k) int64, each row's
        routing (distinct experts); activation: (T * k, 2 * intermediate) gate|up rows ->
        (T * k, intermediate) -> (T, hidden) sum over each row's experts of weight * expert(x)."""
        t, k = experts.shape
        h, e = self.hidden, self.num_experts
        if (x.dtype != torch.float32 or x.shape != (t, h) or weights.shape != (t, k)
                or weights.dtype != torch.float32 or experts.dtype != torch.int64):
            raise ValueError(f"moe: input {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)} "
                             f"{weights.dtype}, experts {tuple(experts.shape)} {experts.dtype}")
        x, weights, experts = x.contiguous(), weights.contiguous(), experts.contiguous()
        picks = t * k
        off = torch.empty(e + 1, dtype=torch.int64)
        order, pos = torch.empty(picks, dtype=torch.int64), torch.empty(picks, dtype=torch.int64)
        grouped = torch.empty(picks, h)
        gu = torch.empty(picks, self.gate_up.out_features)
        if self._group(self._segments, self.gate_up.address(), e, x.data_ptr(), t, h, experts.data_ptr(), k,
                       off.data_ptr(), order.data_ptr(), pos.data_ptr(), grouped.data_ptr(), gu.data_ptr()):
            bad = experts[(experts < 0) | (experts >= e)].unique().tolist()
            raise ValueError(f"moe: expert ids {bad} outside [0, {e})")
        act = activation(gu).contiguous()
        if act.shape != (picks, self.down.in_features) or act.dtype != torch.float32:
            raise ValueError(f"moe: the activation gave {tuple(act.shape)} {act.dtype}")
        eo, out = torch.empty(picks, h), torch.empty(t, h)
        self._combine(self._segments, self.down.address(), e, act.data_ptr(), off.data_ptr(), pos.data_ptr(),
                      weights.data_ptr(), t, k, h, eo.data_ptr(), out.data_ptr())
        return out
