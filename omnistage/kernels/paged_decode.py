"""Decode attention over the paged KV cache as one native call per layer (paged_decode.c):
the C kernel reads K and V where they lie in their blocks, instead of gathering every context
into a buffer first as the PyTorch path does (~3x faster on CPU for the decode part)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("paged_decode.c")


def unsupported_reason(device: torch.device, dtype: torch.dtype, num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """Why the kernel cannot serve this cache (None: it can)."""
    if device.type != "cpu":
        return f"it runs on CPUs (the cache is on {device})"
    if dtype != torch.float32:
        return f"it reads float32 caches (this one is {str(dtype).removeprefix('torch.')})"
    if head_dim % 16 or block_size % 16:
        return f"head_dim ({head_dim}) and block_size ({block_size}) must be multiples of 16"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads"
    return None


class PagedDecodeKernel:
    """The kernel compiled for one model's attention shape (see paged_decode.c)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        path = build_library(SOURCE, {"HEAD_DIM": head_dim, "GROUP": num_heads // num_kv_heads,
                                      "BLOCK": block_size})
        fn = ctypes.CDLL(str(path)).paged_decode_f32
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64, ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """q: (B, Hq, D), rows may be strided; kv: the layer's (2, Hkv, NB, bs, D) cache;
        tables: (B, W) int64 padded block tables; lens: (B,) int64 context lengths; out:
        contiguous (B, Hq, D), written."""
        b = q.shape[0]
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        # The C code trusts these: a wrong layout would read out of bounds, not raise.
        assert q.shape[1:] == (self.num_heads, self.head_dim) and out.is_contiguous()
        assert kv.is_contiguous() and kv.dtype == q.dtype == out.dtype == torch.float32
        assert kv.shape[1] == self.num_kv_heads and kv.shape[3:] == (self.block_size, self.head_dim)
        assert tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous()
        assert tables.shape[0] == lens.shape[0] == b and lens.is_contiguous()
        rc = self._fn(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                      out.data_ptr(), b, self.num_kv_heads, kv.shape[2], tables.shape[1], scale)
        if rc != 0:
            raise MemoryError("paged decode attention: a thread could not allocate its score buffer")
