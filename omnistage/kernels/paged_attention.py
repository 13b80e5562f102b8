"""Attention over the paged KV cache as native calls, one per layer for all decodes and one
for all prefill chunks of a step (paged_attention.c). The C kernels read K and V where they
lie in their blocks, instead of gathering contexts into buffers first as the PyTorch path
does: ~3x faster on CPU for decodes, ~2x for prefill (causal tiles are skipped, not masked).
Queries and outputs are float32; the cache float32 or bfloat16 (`kv_cache_dtype`)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("paged_attention.c")


CACHE_DTYPES = (torch.float32, torch.bfloat16)


def unsupported_reason(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int) -> str | None:
    """Why the kernels cannot serve a model computing in `dtype` over a `kv_dtype` cache
    (None: they can)."""
    if device.type != "cpu":
        return f"they run on CPUs (the cache is on {device})"
    if dtype != torch.float32:
        return f"they compute in float32 (this model in {str(dtype).removeprefix('torch.')})"
    if kv_dtype not in CACHE_DTYPES:
        return f"they read float32 or bfloat16 caches (this one is {str(kv_dtype).removeprefix('torch.')})"
    if head_dim % 16 or block_size % 16:
        return f"head_dim ({head_dim}) and block_size ({block_size}) must be multiples of 16"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads"
    return None


class PagedAttentionKernel:
    """The kernels compiled for one model's attention shape (see paged_attention.c)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 kv_dtype: torch.dtype = torch.float32):
        assert kv_dtype in CACHE_DTYPES
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.kv_dtype = block_size, kv_dtype
        defines = {"HEAD_DIM": head_dim, "GROUP": num_heads // num_kv_heads, "BLOCK": block_size}
        if kv_dtype == torch.bfloat16:
            defines["KV_BF16"] = 1
        lib = ctypes.CDLL(str(build_library(SOURCE, defines)))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._decode = lib.paged_decode_f32
        self._decode.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64, ctypes.c_float]
        self._prefill = lib.paged_prefill_f32
        self._prefill.argtypes = [p, i64, p, p, p, p, p, p, i64, i64, i64, i64, ctypes.c_float]
        self._decode.restype = self._prefill.restype = ctypes.c_int
        self._rope_write = lib.rope_write_f32
        self._rope_write.argtypes = [p, i64, p, p, i64, p, p, i64, i64, i64]
        self._rope_write.restype = None

    def addresses(self) -> tuple[int, int, int]:
        """The C entry points (rope_write, decode, prefill), for native callers
        (decoder_stack.c)."""
        return tuple(ctypes.cast(f, ctypes.c_void_p).value
                     for f in (self._rope_write, self._decode, self._prefill))

    def decode(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Row b of q (B, Hq, D) attends to the lens[b] keys in the blocks of tables[b];
        kv: the layer's (2, Hkv, NB, bs, D) cache; out: (B, Hq, D) contiguous, written."""
        q = self._check(q, kv, out)
        rc = self._decode(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(),
                          lens.data_ptr(), out.data_ptr(), q.shape[0], self.num_kv_heads,
                          kv.shape[2], tables.shape[1], scale)
        if rc != 0:
            raise MemoryError("paged decode attention: a thread could not allocate its scratch")

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                out: torch.Tensor, scale: float) -> None:
        """Chunk i: rows q_starts[i] .. + q_lens[i] of q (T, Hq, D), whose last row sees
        ctx_lens[i] keys (causal within the chunk) in the blocks of tables[i]; the same rows
        of out (T, Hq, D, contiguous) are written."""
        q = self._check(q, kv, out)
        rc = self._prefill(q.data_ptr(), q.stride(0), kv.data_ptr(), tables.data_ptr(),
                           q_starts.data_ptr(), q_lens.data_ptr(), ctx_lens.data_ptr(),
                           out.data_ptr(), tables.shape[0], self.num_kv_heads, kv.shape[2],
                           tables.shape[1], scale)
        if rc != 0:
            raise MemoryError("paged prefill attention: could not allocate its work list or scratch")

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, kv: torch.Tensor) -> None:
        """qkv (T, (Hq + 2 Hkv) D), unit-stride rows: RoPE on its q and k heads in place, then
        its K and V heads into the cache kv at flat slots (T,) int64 (block * bs + offset).
        cos, sin: (T, 1, D) or (T, D), unit-stride rows."""
        t = qkv.shape[0]
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        assert qkv.shape[1] == width and qkv.stride(1) == 1 and qkv.dtype == torch.float32
        assert cos.shape[0] == sin.shape[0] == t and cos.shape[-1] == self.head_dim
        assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and cos.dtype == torch.float32
        assert slots.dtype == torch.int64 and slots.shape == (t,) and slots.is_contiguous()
        self._check_cache(kv)
        self._rope_write(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                         cos.stride(0), slots.data_ptr(), kv.data_ptr(), t, self.num_kv_heads,
                         kv.shape[2])

    def check_index(self, *index: torch.Tensor) -> None:
        """Block tables and per-sequence lengths as the C code reads them (a wrong layout reads
        out of bounds rather than raising). Done once per step, when they are built."""
        for t in index:
            assert t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == index[0].shape[0]

    def _check(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """q, kv and out as the C code reads them (index tensors: `check_index`); returns q
        with unit-stride heads."""
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        assert q.shape[1:] == (self.num_heads, self.head_dim) and out.shape == q.shape
        assert out.is_contiguous() and q.dtype == out.dtype == torch.float32
        self._check_cache(kv)
        return q

    def _check_cache(self, kv: torch.Tensor) -> None:
        assert kv.is_contiguous() and kv.dtype == self.kv_dtype
        assert kv.shape[1] == self.num_kv_heads and kv.shape[3:] == (self.block_size, self.head_dim)
