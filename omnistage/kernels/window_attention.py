"""Block-window attention of the token2wav DiT as one native call per layer
(window_attention.c): q, k and v read where the fused projection wrote them, the output written
in the layout the output projection takes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("window_attention.c")
MAX_SLOTS = 8                 # window_attention.c's MAX_SLOTS: back + 1 + ahead blocks at most


def unsupported_reason(head_dim: int, block: int) -> str | None:
    """Why the kernel cannot serve this attention shape (None: it can)."""
    if head_dim % 16 or block % 4:
        return f"head_dim ({head_dim}) must be a multiple of 16 and the block ({block}) of 4"
    return None


class WindowAttentionKernel:
    """The kernel compiled for one (head_dim, block), for qkv and outputs in float32 and in
    bf16 (raises NativeBuildError where either does not build: both are built here, so a
    failure falls back to torch ops when the kernel is attached, never in a forward)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, head_dim: int, block: int):
        self.head_dim, self.block = head_dim, block
        self._fns = {dtype: self._load(dtype) for dtype in self.DTYPES}

    def _load(self, dtype: torch.dtype) -> ctypes._CFuncPtr:
        defines = {"HEAD_DIM": self.head_dim, "BLOCK": self.block}
        if dtype == torch.bfloat16:
            defines["IO_BF16"] = 1
        fn = ctypes.CDLL(str(build_library(SOURCE, defines))).window_attention
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float]
        fn.restype = ctypes.c_int
        return fn

    def address(self, dtype: torch.dtype) -> int:
        """The entry for qkv and outputs in `dtype`, for calls from C (dit_stack.c)."""
        return ctypes.cast(self._fns[dtype], ctypes.c_void_p).value

    def supports(self, qkv: torch.Tensor, back: int, ahead: int) -> bool:
        """Whether the kernel takes this call: float32 or bf16 on the CPU, the compiled head
        size, whole blocks, a window of at most MAX_SLOTS blocks."""
        return (qkv.device.type == "cpu" and qkv.dtype in self.DTYPES and qkv.dim() == 5
                and qkv.shape[2] == 3 and qkv.shape[4] == self.head_dim and qkv.shape[1] % self.block == 0
                and back >= 0 and ahead >= 0 and back + 1 + ahead <= MAX_SLOTS)

    def __call__(self, qkv: torch.Tensor, lengths: torch.Tensor, back: int, ahead: int,
                 scale: float, rope: torch.Tensor | None = None) -> torch.Tensor:
        """qkv (B, T, 3, H, D), lengths (B,) int64 valid frames per row -> (B, T, H * D) in
        qkv's dtype (bf16: the float32 result on the widened qkv, rounded as torch rounds).
        rope: (B, T, 1, D/2) complex64 cos + i sin per frame and pair, applied to head 0 of q
        and k as they are read (token2wav_dit._rotate_head0's rotation; qkv is not written)."""
        b, t, _, h, d = qkv.shape
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if (not self.supports(qkv, back, ahead) or lengths.shape != (b,) or lengths.dtype != torch.int64
                or (rope is not None and (rope.shape != (b, t, 1, d // 2) or rope.dtype != torch.complex64))):
            raise ValueError(f"window attention kernel: qkv {tuple(qkv.shape)} {qkv.dtype}, lengths "
                             f"{tuple(lengths.shape)} {lengths.dtype}, rope "
                             f"{None if rope is None else (tuple(rope.shape), rope.dtype)}, window "
                             f"{back} + 1 + {ahead} (head_dim {self.head_dim}, block {self.block})")
        qkv, lengths = qkv.contiguous(), lengths.contiguous()
        angles = None if rope is None else torch.view_as_real(rope.contiguous())   # (B, T, 1, D/2, 2)
        out = torch.empty((b, t, h * d), dtype=qkv.dtype)
        if out.numel() and self._fns[qkv.dtype](qkv.data_ptr(), out.data_ptr(), lengths.data_ptr(),
                                                None if angles is None else angles.data_ptr(), b, t, h,
                                                back, ahead, scale) != 0:
            raise MemoryError("window attention kernel: a thread could not allocate its scratch")
        return out
