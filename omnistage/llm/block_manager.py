"""Paged KV memory: fixed-size blocks, reference counts, prefix caching, copy-on-write forks.

Block ids index the KV cache tensors (see kv_cache.py). Invariants:
- a block is in `_free` iff its ref_count is 0; free blocks keep their cached content (and stay
  findable in `_cached`) until they are handed out again, least recently freed first;
- a block that holds a registered hash is full and is never written again;
- a block shared by forked samples is copied before one of them writes into it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from omnistage.llm.sequence import Sequence

# A full block's identity: the parent block's key hash and its own content (token ids, plus a
# digest of non-token inputs: see Sequence.block_content). Used as a dict key, so a hit
# compares the token ids exactly; only a 64-bit collision of the parent chain (or a 128-bit
# one of a digest) could alias two prefixes.
BlockKey = tuple[int, tuple]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None   # set once full and computed (prefix caching on)
    # (hidden, input embeds) rows of its positions, kept when a sequence that returns hidden
    # states computed it: a later such sequence can take the block only with them.
    rows: tuple[torch.Tensor, torch.Tensor] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, int] = {}
        # Hidden-state rows live outside the KV pool (per block about half of a large model's
        # K/V at fp32): at most a quarter of the blocks keep them.
        self.max_blocks_with_rows = num_blocks // 4
        self.num_blocks_with_rows = 0
        self.num_prefix_hit_tokens = 0      # statistics
        self.num_prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    # ---- content keys ---------------------------------------------------------------------
    def _keys(self, seq: Sequence, first: int, last: int) -> list[BlockKey]:
        """Keys of full blocks [first, last) of seq's tokens, up to the first block that cannot
        be shared; computed once per block (digests included) and kept in seq.block_keys."""
        keys = seq.block_keys
        while len(keys) < last:
            content = seq.block_content(len(keys), self.block_size)
            if content is None:        # not shareable, nor is anything after it
                break
            keys.append((hash(keys[-1]) if keys else 0, content))
        return keys[first:last]

    # ---- admission ------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens. At least one token is left to
        compute, since the last position's logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._keys(seq, 0, (seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(key)
            if block_id is None or (seq.return_hidden_states and self.blocks[block_id].rows is None):
                break
            hits.append(block_id)
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += len(hits) * self.block_size
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 hits: list[int] = ()) -> list[tuple[int, int]] | None:
        """Give seq blocks for its next `num_new_tokens` tokens (after taking the prefix
        `hits` if it has no blocks yet). Returns the (src, dst) block copies the runner must
        do first (copy-on-write of a shared partial block), or None if memory is short; then
        nothing changed."""
        bs = self.block_size
        start = seq.num_computed_tokens + len(hits) * bs
        end = start + num_new_tokens
        have = len(seq.block_table) + len(hits)
        need_new = max(0, -(-end // bs) - have)
        # Copy-on-write: the first written slot lies inside a block someone else also holds.
        cow = start % bs != 0 and start // bs < len(seq.block_table) and \
            self.blocks[seq.block_table[start // bs]].ref_count > 1
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if need_new + int(cow) + revived > len(self._free):
            return None
        for b in hits:
            self._acquire(b)
        seq.block_table.extend(hits)
        if hits:
            seq.num_computed_tokens = seq.num_cached_tokens = start
            if seq.return_hidden_states:   # the outputs of the positions it will not compute
                rows = [self.blocks[b].rows for b in seq.block_table[:start // bs]]
                seq.cached_rows = (torch.cat([h for h, _ in rows]), torch.cat([e for _, e in rows]))
        copies = []
        if cow:
            i = start // bs
            src = seq.block_table[i]
            dst = self._take_free()
            self.blocks[src].ref_count -= 1
            seq.block_table[i] = dst
            copies.append((src, dst))
        for _ in range(need_new):
            seq.block_table.append(self._take_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of parent (its prompt); copy-on-write happens later."""
        for b in parent.block_table:
            self.blocks[b].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    # ---- after a step ---------------------------------------------------------------------
    def register_computed(self, seq: Sequence, num_before: int) -> None:
        """Make blocks that became full during the last step findable by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = num_before // bs, seq.num_computed_tokens // bs
        if first == last:
            return
        for i, key in enumerate(self._keys(seq, first, last), start=first):
            rows = seq.take_rows(i * bs, (i + 1) * bs) if seq.return_hidden_states else None
            block = self.blocks[seq.block_table[i]]
            if block.key is None and key not in self._cached:
                block.key = key
                self._cached[key] = block.block_id
                if rows is not None and self.num_blocks_with_rows < self.max_blocks_with_rows:
                    block.rows = rows
                    self.num_blocks_with_rows += 1

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks are freed first so they are evicted first."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self._free[b] = None
                if block.key is None:  # nothing worth keeping: reuse it before cached ones
                    self._free.move_to_end(b, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- internals ------------------------------------------------------------------------
    def _acquire(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self._free[b]
        block.ref_count += 1

    def _take_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        block = self.blocks[b]
        if block.key is not None:  # evict its cached content
            if self._cached.get(block.key) == b:
                del self._cached[block.key]
            if block.rows is not None:
                self.num_blocks_with_rows -= 1
            block.key = block.rows = None
        block.ref_count = 1
        return b
