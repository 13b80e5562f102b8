"""BlockManager on hand-made sequences (no model): allocation, prefix caching, eviction order,
copy-on-write forks, all-or-nothing allocation."""

from __future__ import annotations

import itertools

import pytest
import torch

from omnistage.llm.block_manager import BlockManager
from omnistage.llm.sequence import Sequence
from omnistage.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(tokens, prompt_embeds=None) -> Sequence:
    i = next(_ids)
    return Sequence(i, f"req-{i}", 0, list(tokens), len(tokens), SamplingParams(),
                    prompt_embeds=prompt_embeds, arrival=i)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None, hits=()) -> list:
    """What scheduler + runner do for one chunk: allocate, 'compute', register full blocks."""
    start = seq.num_computed_tokens + len(hits) * bm.block_size
    n = seq.num_tokens - start if n is None else n
    copies = bm.allocate(seq, n, hits)
    assert copies is not None
    assert seq.num_computed_tokens == start
    seq.num_computed_tokens = start + n
    bm.register_computed(seq, start)
    return copies


def snapshot(bm: BlockManager) -> tuple:
    return ([(b.ref_count, b.key) for b in bm.blocks], list(bm._free), dict(bm._cached))


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """ref counts equal the number of live block tables holding each block; free iff 0."""
    counts = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            counts[b] += 1
    assert [b.ref_count for b in bm.blocks] == counts
    assert set(bm._free) == {i for i, c in enumerate(counts) if c == 0}
    for key, b in bm._cached.items():
        assert bm.blocks[b].key == key


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


# ---- allocate / free ------------------------------------------------------------------------

def test_allocate_and_free_return_the_pool_to_full():
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [make_seq(toks(n, 100 * k)) for k, n in enumerate([1, 4, 5, 9])]
    for s in seqs:
        assert bm.allocate(s, s.num_tokens) == []
        assert len(s.block_table) == -(-s.num_tokens // 4)
    tables = [b for s in seqs for b in s.block_table]
    assert len(tables) == len(set(tables)) == 1 + 1 + 2 + 3
    assert bm.num_free_blocks == 10 - 7
    check_invariants(bm, seqs)
    for s in seqs:
        bm.free(s)
        assert s.block_table == [] and s.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_allocate_grows_a_table_block_by_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = make_seq(toks(3))
    compute(bm, s)                          # 3 tokens: 1 block
    assert len(s.block_table) == 1
    for expected_blocks in [1, 2, 2, 2, 2, 3]:  # decode one token at a time
        s.token_ids.append(7)
        compute(bm, s, 1)
        assert len(s.block_table) == expected_blocks
    assert s.num_computed_tokens == 9
    bm.free(s)
    assert bm.num_free_blocks == 4


def test_allocate_returns_none_and_changes_nothing_when_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(toks(8))
    compute(bm, a)                          # 2 blocks, both cached
    b = make_seq(toks(9, 50))               # needs 3 blocks, 1 is free
    before = snapshot(bm)
    assert bm.allocate(b, 9) is None
    assert snapshot(bm) == before
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0

    # With prefix hits: a's blocks are freed (cached, reusable), c hits both of them but also
    # needs 2 new blocks; only 1 is left over after reviving the hits -> None, nothing moved.
    bm.free(a)
    c = make_seq(toks(8) + toks(8, 50))
    hits = bm.match_prefix(c)
    assert len(hits) == 2
    before = snapshot(bm)
    assert bm.allocate(c, 8, hits) is None
    assert snapshot(bm) == before
    assert c.block_table == [] and c.num_computed_tokens == 0
    # The same hits with a chunk that fits do work.
    assert bm.allocate(c, 4, hits) == []
    assert c.block_table[:2] == hits and c.num_computed_tokens == c.num_cached_tokens == 8
    assert bm.num_free_blocks == 0
    check_invariants(bm, [c])


# ---- prefix caching -------------------------------------------------------------------------

def test_prefix_hits_are_full_blocks_only_and_never_the_whole_prompt():
    bm = BlockManager(num_blocks=32, block_size=4)
    a = make_seq(toks(10))                  # blocks: [0..3] [4..7] [8, 9]
    compute(bm, a)
    full = a.block_table[:2]

    assert bm.match_prefix(make_seq(toks(10))) == full            # partial 3rd never hits
    assert bm.match_prefix(make_seq(toks(9))) == full
    assert bm.match_prefix(make_seq(toks(8))) == full[:1]         # one token must be left
    assert bm.match_prefix(make_seq(toks(5))) == full[:1]
    assert bm.match_prefix(make_seq(toks(4))) == []
    assert bm.match_prefix(make_seq(toks(8) + [99, 98])) == full
    assert bm.match_prefix(make_seq([1000] + toks(9)[1:])) == []  # differs in block 0
    assert bm.match_prefix(make_seq(toks(4) + [99] + toks(9)[5:])) == full[:1]

    b = make_seq(toks(8) + [99, 98, 97])
    hits = bm.match_prefix(b)
    assert bm.allocate(b, b.num_tokens - 8, hits) == []
    assert b.block_table[:2] == full and b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[x].ref_count for x in full] == [2, 2]
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_identical_prompt_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(toks(8))
    compute(bm, a)
    b = make_seq(toks(8))
    hits = bm.match_prefix(b)
    assert len(hits) * 4 < b.num_tokens
    assert bm.allocate(b, b.num_tokens - len(hits) * 4, hits) == []
    assert b.num_computed_tokens == 4 < b.num_tokens


def test_freed_cached_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(toks(9))
    compute(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = make_seq(toks(9))
    hits = bm.match_prefix(b)
    assert hits == cached
    compute(bm, b, hits=hits)               # revives them: ref 0 -> 1, out of the free list
    assert b.block_table[:2] == cached and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6 - 3
    check_invariants(bm, [b])


def test_eviction_order_uncached_first_then_least_recently_freed():
    bm = BlockManager(num_blocks=6, block_size=4)
    x = make_seq(toks(9, 0))                # 2 cached full blocks + 1 uncached partial
    y = make_seq(toks(9, 100))
    compute(bm, x)
    x_cached = x.block_table[:2]
    bm.free(x)                              # x freed first ...
    compute(bm, y)
    y_cached, y_tail = y.block_table[:2], y.block_table[2]
    bm.free(y)                              # ... y second
    assert bm.num_free_blocks == 6

    def hits_of(tokens):
        return bm.match_prefix(make_seq(tokens))

    assert hits_of(toks(9, 0)) == x_cached and hits_of(toks(9, 100)) == y_cached
    # New blocks come from uncached ones first (y's partial tail and the never-used one;
    # x's partial tail was reused by y already).
    z = make_seq(toks(8, 500))
    assert bm.allocate(z, 8) == []
    assert y_tail in z.block_table and not set(z.block_table) & set(x_cached + y_cached)
    assert hits_of(toks(9, 0)) == x_cached and hits_of(toks(9, 100)) == y_cached
    # Then cached ones, least recently freed first: x's before y's.
    w = make_seq(toks(8, 700))
    assert bm.allocate(w, 8) == []
    assert sorted(w.block_table) == sorted(x_cached)
    assert hits_of(toks(9, 0)) == [] and hits_of(toks(9, 100)) == y_cached
    check_invariants(bm, [z, w])


def test_reused_cached_block_drops_its_old_key():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq(toks(5))
    compute(bm, a)
    bm.free(a)
    b = make_seq(toks(8, 100))             # takes both blocks, evicting a's cached block
    compute(bm, b)
    assert bm.match_prefix(make_seq(toks(5))) == []
    assert bm.match_prefix(make_seq(toks(8, 100) + [1])) == b.block_table
    check_invariants(bm, [b])


def test_prefix_caching_off_gives_no_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(toks(10))
    compute(bm, a)
    assert all(b.key is None for b in bm.blocks)
    assert bm.match_prefix(make_seq(toks(10))) == []
    bm.free(a)
    assert bm.match_prefix(make_seq(toks(10))) == []


def test_embedding_prompts_are_cached_by_content():
    bm = BlockManager(num_blocks=8, block_size=4)
    emb = torch.randn(10, 4)
    a = make_seq(toks(10), prompt_embeds=emb)
    compute(bm, a)
    # Same ids without the embeddings, or other embeddings: other content, no hit.
    assert bm.match_prefix(make_seq(toks(10))) == []
    other = emb.clone()
    other[5, 0] += 1e-6                     # block 1 differs in one element
    assert bm.match_prefix(make_seq(toks(10), prompt_embeds=other)) == a.block_table[:1]
    assert bm.match_prefix(make_seq(toks(10), prompt_embeds=emb.clone())) == a.block_table[:2]


def test_multimodal_positions_are_part_of_the_content():
    bm = BlockManager(num_blocks=8, block_size=4)
    pos = torch.arange(10).repeat(3, 1)
    a = make_seq(toks(10))
    a.mrope_positions = pos
    compute(bm, a)
    b = make_seq(toks(10))
    b.mrope_positions = pos.clone()
    assert bm.match_prefix(b) == a.block_table[:2]
    c = make_seq(toks(10))
    c.mrope_positions = pos.clone()
    c.mrope_positions[1, 6] = 0             # another layout from block 1 on
    assert bm.match_prefix(c) == a.block_table[:1]


def test_hidden_state_sequences_hit_only_blocks_with_their_rows():
    bm = BlockManager(num_blocks=8, block_size=4)
    plain = make_seq(toks(10))
    compute(bm, plain)                      # KV only: no rows
    wants = make_seq(toks(10))
    wants.return_hidden_states = True
    assert bm.match_prefix(wants) == []
    assert bm.match_prefix(make_seq(toks(10))) == plain.block_table[:2]
    bm.free(plain)

    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(toks(10))
    a.return_hidden_states = True
    hidden, embeds = torch.randn(10, 3), torch.randn(10, 3)
    assert bm.allocate(a, 10) == []
    a.keep_rows(0, hidden, embeds)
    a.num_computed_tokens = 10
    bm.register_computed(a, 0)
    b = make_seq(toks(10) + [7])
    b.return_hidden_states = True
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 3, hits) == []
    torch.testing.assert_close(b.cached_rows[0], hidden[:8], rtol=0, atol=0)
    torch.testing.assert_close(b.cached_rows[1], embeds[:8], rtol=0, atol=0)
    assert bm.num_blocks_with_rows == 2 == bm.max_blocks_with_rows   # 8 blocks // 4


def test_rows_are_bounded_and_released_with_their_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)             # rows for at most 2 blocks
    a = make_seq(toks(13))
    a.return_hidden_states = True
    assert bm.allocate(a, 13) == []
    a.keep_rows(0, torch.randn(13, 3), torch.randn(13, 3))
    a.num_computed_tokens = 13
    bm.register_computed(a, 0)                               # 3 full blocks, 2 keep rows
    assert [bm.blocks[b].rows is not None for b in a.block_table[:3]] == [True, True, False]
    bm.free(a)
    for n in range(4):                                       # reuse every block: evictions
        s = make_seq(toks(8, 200 + 20 * n))
        compute(bm, s)
        bm.free(s)
    assert bm.num_blocks_with_rows == sum(b.rows is not None for b in bm.blocks) == 0


def test_register_computed_only_registers_fully_computed_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(toks(10))
    assert bm.allocate(a, 10) == []         # all 3 blocks allocated up front
    probe = toks(10) + [1]
    a.num_computed_tokens = 6               # first chunk computed 6 tokens
    bm.register_computed(a, 0)
    assert bm.match_prefix(make_seq(probe)) == a.block_table[:1]
    assert [b.key is not None for b in (bm.blocks[x] for x in a.block_table)] == [True, False, False]
    a.num_computed_tokens = 7               # still inside block 1
    bm.register_computed(a, 6)
    assert bm.match_prefix(make_seq(probe)) == a.block_table[:1]
    a.num_computed_tokens = 10              # block 1 now full; block 2 holds 2 tokens
    bm.register_computed(a, 7)
    assert bm.match_prefix(make_seq(probe)) == a.block_table[:2]
    assert bm.blocks[a.block_table[2]].key is None
    # Growing into block 2 and filling it registers it too.
    a.token_ids += [10, 11]
    assert bm.allocate(a, 2) == []
    a.num_computed_tokens = 12
    bm.register_computed(a, 10)
    assert bm.match_prefix(make_seq(a.token_ids + [1])) == a.block_table[:3]


# ---- fork / copy-on-write -------------------------------------------------------------------

def test_fork_shares_blocks_and_copy_on_write_leaves_the_original_to_the_other():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(toks(6))              # blocks: full [0..3], partial [4, 5]
    compute(bm, parent)
    child = make_seq(toks(6))
    free_before = bm.num_free_blocks
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == parent.num_computed_tokens == 6
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    assert bm.num_free_blocks == free_before
    check_invariants(bm, [parent, child])

    full, shared = parent.block_table
    parent.token_ids.append(40)
    child.token_ids.append(41)
    copies = bm.allocate(parent, 1)         # writes slot 6, inside the shared partial block
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared and dst not in (full, shared)
    assert parent.block_table == [full, dst]
    assert child.block_table == [full, shared]          # the original stays with the child
    assert bm.blocks[shared].ref_count == 1 and bm.blocks[dst].ref_count == 1
    assert bm.blocks[full].ref_count == 2
    parent.num_computed_tokens = 7
    assert bm.allocate(child, 1) == []      # sole holder now: no second copy
    assert child.block_table == [full, shared]
    child.num_computed_tokens = 7
    check_invariants(bm, [parent, child])
    bm.free(parent)
    assert bm.blocks[full].ref_count == 1
    bm.free(child)
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(toks(8))
    compute(bm, parent)
    child = make_seq(toks(8))
    bm.fork(parent, child)
    for s, t in ((parent, 1), (child, 2)):
        s.token_ids.append(t)
        assert bm.allocate(s, 1) == []
        s.num_computed_tokens += 1
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    check_invariants(bm, [parent, child])


def test_copy_on_write_when_short_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = make_seq(toks(6))
    compute(bm, parent)                     # takes both blocks
    child = make_seq(toks(6))
    bm.fork(parent, child)
    parent.token_ids.append(1)
    before = snapshot(bm)
    assert bm.allocate(parent, 1) is None   # the copy needs a free block
    assert snapshot(bm) == before
    assert parent.block_table == child.block_table
    bm.free(child)
    assert bm.allocate(parent, 1) == []     # sole holder: writes in place
    check_invariants(bm, [parent])


def test_free_twice_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq(toks(3))
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)
