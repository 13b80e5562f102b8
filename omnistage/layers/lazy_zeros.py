"""Zero-filled tensors whose host memory is taken only where it is written.

Why: a KV pool is sized for every seat at full context (up to `kv_cache_memory_gb` per engine),
and `torch.zeros` writes every byte of it before the first request: the small Qwen3-Omni's
thinker and talker pools (4 GiB) took 13 s of a 30 s start on 2 busy cores (page
faults and the fill), and stayed resident though a few requests touch a few MiB. An anonymous
private mapping is zero-filled by the kernel (POSIX `MAP_ANONYMOUS`) page by page on first
touch, so the pool costs nothing until blocks are used, and a block never written reads as
zeros, as `torch.zeros` gives. The price: memory the pool will need is committed when it is
used, not at start (with Linux's default overcommit, a machine short of memory fails then,
not at start); `kv_cache_memory_gb` still bounds it. Under prefix caching the block manager
hands out never-written blocks before it evicts cached prefixes, so a serving process's pools
become resident block by block over many requests (tiny Qwen2.5-Omni, chat with speech at 4
concurrent: ~24 KB a request) until they are whole, then stop growing.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of zeros; on the CPU backed by an anonymous mapping (page aligned,
    kept alive by the tensor), elsewhere `torch.zeros` (device memory has no such pages)."""
    device = torch.device(device)
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
