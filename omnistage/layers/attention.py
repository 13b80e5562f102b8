"""Attention over paged KV caches: native CPU kernels, or plain PyTorch (CPU and CUDA alike).

Cache layout per layer: (2, num_kv_heads, num_blocks, block_size, head_dim) for K and V, so
one gather of a batch of block tables yields (2, Hkv, B, L, D) contiguously, ready for batched
matmuls with no transpose copy. New keys/values are written through `slot_mapping` (block * block_size +
offset) before attention reads them.

One step's tokens are ordered: decodes (one generated position each) first, then prefill
chunks (prompt positions, or several positions recomputed after preemption). With a
`PagedAttentionKernel` (CPU float32, omnistage/kernels/paged_attention.c) the decodes are one
native call per layer and the prefill chunks another, both reading the blocks in place
(`NativeBatches`). Otherwise decodes run in PyTorch, gathered per `DecodeGroup`, and each
prefill chunk through SDPA (`PrefillSpan`).

The cache may hold a narrower dtype than the model computes in (`kv_cache_dtype`, e.g.
bfloat16 under a float32 model): K and V are rounded to it as they are written and widened as
they are read, and a chunk attending to its own new keys uses the rounded values too, so a
token's attention is the same whether its keys came from this step or from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnistage.kernels.paged_attention import PagedAttentionKernel
from omnistage.layers.lazy_zeros import lazy_zeros
from omnistage.layers.rotary import RotaryEmbedding


@dataclass
class PrefillSpan:
    q_start: int                    # row of the first query token in the flat batch
    q_len: int                      # query tokens of this chunk
    ctx_len: int                    # keys visible to the last query (cached + new)
    block_table: torch.Tensor | None  # (num_blocks,) int64; None when ctx_len == q_len


@dataclass
class DecodeGroup:
    """Single-token decodes of similar context length, attended to in one batched call."""
    row_start: int                  # rows [row_start, row_start + B) of the flat batch
    block_tables: torch.Tensor      # (B * max_blocks,) int64 flattened tables, padded with block 0
    bias: torch.Tensor              # (Hkv * B, 1, L) additive mask: 0, or -inf past the context
    size: int                       # B


@dataclass
class NativeBatches:
    """A step's attention work for the native kernels. Index tensors are int64."""
    kernel: PagedAttentionKernel
    decode_tables: torch.Tensor     # (B, W) block tables of the decodes (rows [0, B)), padded
    decode_lens: torch.Tensor       # (B,) context lengths, the new token included
    prefill_tables: torch.Tensor    # (N, W') block tables of the prefill chunks, padded
    prefill_starts: torch.Tensor    # (N,) first row of each chunk
    prefill_lens: torch.Tensor      # (N,) query tokens of each chunk
    prefill_ctx: torch.Tensor       # (N,) keys visible to each chunk's last token

    def __post_init__(self) -> None:
        # Checked once per step, not in each layer's calls: the C code trusts them.
        self.kernel.check_index(self.decode_tables, self.decode_lens)
        self.kernel.check_index(self.prefill_tables, self.prefill_starts, self.prefill_lens,
                                self.prefill_ctx)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # (T,) int64 cache slot of each new token
    # The PyTorch path's work (both empty when `native` is set): decodes, rows
    # [0, num_decode), shortest contexts first; then prefill chunks.
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # Flat scratch buffer, large enough for this step's largest gather. Gathers land here
    # instead of in fresh tensors: a fresh multi-MB tensor per layer costs its page faults
    # every time (5x the copy itself, measured).
    workspace: torch.Tensor | None = None
    native: NativeBatches | None = None


class KVCache:
    """K and V of one layer in one tensor (2, Hkv, num_blocks, block_size, D), so a single
    gather serves both."""

    def __init__(self, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Pages taken as blocks are first written (lazy_zeros): the pool is sized for every seat.
        self.kv = lazy_zeros((2, num_kv_heads, num_blocks, block_size, head_dim), dtype, device)
        # First row of each (K or V, head) plane in the (2 Hkv NB, bs D) view used by gather.
        self._planes = torch.arange(2 * num_kv_heads, device=device).unsqueeze(1) * num_blocks

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (T, Hkv, D) written at flat slots (T,)."""
        _, hkv, nb, bs, d = self.kv.shape
        flat = self.kv.view(2, hkv, nb * bs, d)
        flat[0, :, slot_mapping] = k.transpose(0, 1).to(self.kv.dtype)
        flat[1, :, slot_mapping] = v.transpose(0, 1).to(self.kv.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        self.kv[:, :, dst] = self.kv[:, :, src]

    def gather(self, flat_tables: torch.Tensor, batch: int, workspace: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `batch` sequences whose padded block tables are concatenated in
        flat_tables: each (Hkv, batch, L, D), views into `workspace` when given."""
        _, hkv, nb, bs, d = self.kv.shape
        # Rows of a 2-D view: index_select along dim 0 copies whole contiguous rows, ~1.6x
        # faster on CPU than selecting along dim 2 of the 5-D cache (same result).
        rows = (self._planes + flat_tables.unsqueeze(0)).view(-1)
        flat = self.kv.view(2 * hkv * nb, bs * d)
        if workspace is None:
            kv = flat.index_select(0, rows)
        else:
            kv = torch.index_select(flat, 0, rows, out=workspace[:rows.numel() * bs * d].view(-1, bs * d))
        kv = kv.view(2, hkv, batch, -1, d)
        return kv[0], kv[1]

    def gather_numel(self, num_blocks: int) -> int:
        """Elements a gather of `num_blocks` blocks needs."""
        _, hkv, _, bs, d = self.kv.shape
        return 2 * hkv * num_blocks * bs * d


def attend_projections(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                       cache: KVCache, meta: AttentionMetadata, num_heads: int,
                       scale: float) -> torch.Tensor:
    """One layer's attention from its fused projection qkv (T, (Hq + 2 Hkv) D): RoPE on the
    query and key heads, the new K and V into the cache, then attention over each sequence's
    paged context. Returns (T, Hq * D). With native kernels, two calls: the RoPE and cache
    write (in place in qkv), then the attention."""
    t, hq = qkv.shape[0], num_heads
    hkv, d = cache.kv.shape[1], cache.kv.shape[4]
    nb = meta.native
    if nb is not None:
        nb.kernel.rope_write(qkv, *cos_sin, meta.slot_mapping, cache.kv)
        q = qkv[:, :hq * d].view(t, hq, d)
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        n = nb.decode_lens.shape[0]
        if n:
            nb.kernel.decode(q[:n], cache.kv, nb.decode_tables, nb.decode_lens, out[:n], scale)
        if nb.prefill_lens.shape[0]:
            nb.kernel.prefill(q, cache.kv, nb.prefill_tables, nb.prefill_starts, nb.prefill_lens,
                              nb.prefill_ctx, out, scale)
        return out.view(t, hq * d)
    # q and k sit side by side in each row: rotate them in one go.
    qk = RotaryEmbedding.apply(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos_sin)
    q, k = qk.split([hq, hkv], dim=1)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    return paged_attention(q, k, v, cache, meta, scale).reshape(t, hq * d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The PyTorch path. q: (T, Hq, D); k, v: (T, Hkv, D) for the new tokens, rotated.
    Returns (T, Hq, D)."""
    cache.write(k, v, meta.slot_mapping)
    if cache.kv.dtype != q.dtype:       # attend to the keys as stored (see the module doc)
        k, v = k.to(cache.kv.dtype).to(q.dtype), v.to(cache.kv.dtype).to(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in meta.decodes:
        rows = slice(group.row_start, group.row_start + group.size)
        out[rows] = _decode(q[rows], cache, group, scale, meta.workspace)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], cache, span, scale, meta.workspace)
    return out


def _decode(q: torch.Tensor, cache: KVCache, group: DecodeGroup, scale: float,
            workspace: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence against its whole padded context, the group's sequences at
    once. The gather copies every context: grouping by length keeps padding small."""
    bd, hq, d = q.shape
    hkv = cache.kv.shape[1]
    g = hq // hkv
    k, v = cache.gather(group.block_tables, bd, workspace)      # (Hkv, Bd, L, D) each
    k, v = k.to(q.dtype), v.to(q.dtype)                          # no copy unless narrower
    qh = q.view(bd, hkv, g, d).transpose(0, 1).reshape(hkv * bd, g, d)
    k = k.reshape(hkv * bd, -1, d)
    # scale * q.k + (0 | -inf): one fused call.
    scores = torch.baddbmm(group.bias, qh, k.transpose(1, 2), alpha=scale)  # (Hkv Bd, G, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.bmm(probs, v.reshape(hkv * bd, -1, d))            # (Hkv Bd, G, D)
    return o.view(hkv, bd, g, d).transpose(0, 1).reshape(bd, hq, d)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
             span: PrefillSpan, scale: float, workspace: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of a chunk's queries over the cached prefix plus the chunk itself."""
    if span.block_table is None:  # nothing cached before this chunk: attend to itself
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, q_len, D)
        mask, causal = None, True
    else:
        keys, values = cache.gather(span.block_table, 1, workspace)
        keys = keys[:, 0, :span.ctx_len].to(q.dtype)
        values = values[:, 0, :span.ctx_len].to(q.dtype)
        # Query i sits at absolute position ctx_len - q_len + i and sees keys j <= that.
        offset = span.ctx_len - span.q_len
        qpos = torch.arange(span.q_len, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(span.ctx_len, device=q.device).unsqueeze(0) <= qpos
        causal = False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)  # (1, Hq, q_len, D)
    return o[0].transpose(0, 1)
