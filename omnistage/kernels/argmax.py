"""A step's token choices over its logits in one native call each (argmax.c): the row argmax
as torch.argmax answers it (greedy decoding), greedy rows with bans and a repetition penalty,
and sampled rows' top-k / top-p exponential race."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("argmax.c")


class ArgmaxKernel:
    """The compiled kernel (raises NativeBuildError where it does not build). Called on what it
    does not take (see supports), it answers with torch.argmax: callers need not check."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.argmax_rows
        self._fn.argtypes = [p, i64, i64, i64, p]
        self._fn.restype = None
        self._penalized = lib.penalized_argmax_rows
        self._penalized.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, i64, p]
        self._penalized.restype = None
        self._race = lib.topk_race_rows
        self._race.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p, p, p, i64, p, i64, p, p]
        self._race.restype = None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """float32 (B, V) on the CPU with V >= 1 and unit stride along V."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
                and x.shape[1] >= 1 and x.stride(1) == 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, V) -> (B,) int64: each row's first index of its largest value (of its first NaN
        where it has one), as x.argmax(dim=-1)."""
        if not self.supports(x):
            return x.argmax(dim=-1)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out

    def greedy(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
               penalties: list[float]) -> torch.Tensor:
        """x (B, V) float32 (see supports; not modified) -> (B,) int64: each row's argmax after
        its banned ids (int64, 1-D) are set to -inf and HF's repetition penalty penalties[i]
        is applied to the ids it has seen (int64, 1-D, repeats allowed), as the sampler's torch
        path computes them (argmax.c's penalized_argmax_rows: the same token)."""
        rows, n = x.shape
        self._check(x, banned, seen, penalties, "penalized argmax")
        width = n + max((t.numel() for t in seen), default=0)
        work = torch.empty(rows * width)
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._penalized(x.data_ptr(), rows, n, x.stride(0), *_ids(banned), *_ids(seen),
                            _floats(penalties), work.data_ptr(), width, out.data_ptr())
        return out

    def race(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
             penalties: list[float], temperatures: list[float], top_k: list[int],
             top_p: list[float], u: torch.Tensor) -> torch.Tensor:
        """Sampled rows: x (B, V) float32 as for greedy (bans, then the repetition penalty),
        divided by temperatures[i]; the tokens at or above the row's top_k[i]-th largest
        value (1 <= top_k[i] <= V), cut by top_p[i] as the sampler's filter_threshold does;
        of those, the argmax of x - log E with E = -log u (u (B, V) float32: the row's
        uniforms). The sampler's torch path's token but where libm and SLEEF round apart
        (argmax.c's topk_race_rows)."""
        rows, n = x.shape
        self._check(x, banned, seen, penalties, "top-k race")
        if not (len(temperatures) == len(top_k) == len(top_p) == rows and all(1 <= k <= n for k in top_k)
                and self.supports(u) and u.shape == x.shape):
            raise ValueError("top-k race: a temperature, a top_k in [1, V] and a top_p per row, "
                             "and uniforms shaped as x (float32 on the CPU)")
        width = n + max(max((t.numel() for t in seen), default=0), max(top_k, default=0) + n)
        work = torch.empty(rows * width)
        cand = torch.empty(rows * n, dtype=torch.int64)
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._race(x.data_ptr(), rows, n, x.stride(0), *_ids(banned), *_ids(seen), _floats(penalties),
                       _floats(temperatures), (ctypes.c_int64 * rows)(*top_k), _floats(top_p),
                       u.data_ptr(), u.stride(0), work.data_ptr(), width, cand.data_ptr(),
                       out.data_ptr())
        return out

    def _check(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
               penalties: list[float], what: str) -> None:
        rows = x.shape[0] if x.dim() == 2 else -1
        if not (self.supports(x) and len(banned) == len(seen) == len(penalties) == rows
                and all(t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous() for t in (*banned, *seen))):
            raise ValueError(f"{what}: x (B, V) float32 on the CPU and, per row, 1-D int64 "
                             "banned and seen ids and a penalty")


def _ids(rows: list[torch.Tensor]) -> tuple:
    """Per-row id tensors as C's (pointers, counts) arrays."""
    return ((ctypes.c_void_p * len(rows))(*(t.data_ptr() for t in rows)),
            (ctypes.c_int64 * len(rows))(*(t.numel() for t in rows)))


def _floats(values: list[float]):
    return (ctypes.c_float * len(values))(*values)
