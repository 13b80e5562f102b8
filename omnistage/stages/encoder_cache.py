"""Encoder outputs remembered by their input: an LRU keyed by a digest of the input tensor's
bytes (and shape, dtype), for towers whose input splits into pieces encoded independently
(Qwen2.5-Omni's audio tower: 2 s chunks). A piece seen before is not encoded again: the audio
of a Realtime turn warmed while the user spoke (OutputOptions.prefill_only), or of an earlier
turn a conversation sends again. A hit returns the very tensor computed the first time, so a
request's rows do not depend on whether it hit (the piece is always computed alone)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor],
            tag: str = "") -> torch.Tensor:
        """compute(x), or what it gave for the same bytes (and `tag`: how compute treats
        them, when that varies) before."""
        if self.max_entries == 0:
            self.misses += 1
            return compute(x)
        key = _digest(x, tag)
        out = self._entries.get(key)
        if out is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return out
        self.misses += 1
        out = compute(x)
        self._entries[key] = out
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out

    def pieces(self, x: torch.Tensor, size: int, compute: Callable[[torch.Tensor], torch.Tensor],
               tag: str = "") -> torch.Tensor:
        """(..., T) -> compute() of each `size`-long piece along the last axis (the last one
        shorter), through the cache, joined along the first axis of the outputs."""
        return torch.cat([self.get(x[..., s:s + size], compute, tag)
                          for s in range(0, x.shape[-1], size)])


def _digest(x: torch.Tensor, tag: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(x.shape), str(x.dtype), tag)).encode())
    h.update(x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()
