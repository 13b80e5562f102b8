"""Scheduler with a real BlockManager and hand-made sequences (no model). `Sim` plays the
engine: schedule -> update -> append one token to every sampling chunk's sequence and its forks
-> finish sequences that reached max_tokens."""

from __future__ import annotations

import itertools

import pytest

from omnistage.cli import build_parser
from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.llm.block_manager import BlockManager
from omnistage.llm.scheduler import Scheduler, SchedulerPlan
from omnistage.llm.sequence import Sequence, SequenceStatus
from omnistage.sampling_params import SamplingParams


class Sim:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 32, prefix_caching: bool = True,
                 max_background_tokens: int | None = None):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_background_tokens)
        self.ids = itertools.count()
        self.seqs: list[Sequence] = []
        self.plans: list[SchedulerPlan] = []
        self.max_running = 0

    def add(self, prompt_len: int, max_tokens: int = 4, n: int = 1, base: int | None = None,
            background: bool = False) -> Sequence:
        base = next(self.ids) * 1000 if base is None else base
        params = SamplingParams(n=n, max_tokens=max_tokens)
        samples = []
        for i in range(n):
            sid = next(self.ids)
            samples.append(Sequence(sid, f"req-{samples[0].seq_id if samples else sid}", i,
                                    [base + t for t in range(prompt_len)], prompt_len, params,
                                    arrival=sid, background=background))
        samples[0].fork_children = samples[1:]
        self.seqs += samples
        self.sched.add(samples[0])
        return samples[0]

    def step(self) -> SchedulerPlan:
        plan = self.sched.schedule()
        # -- the plan is consistent -----------------------------------------------------------
        total = sum(c.num_new_tokens for c in plan.chunks)
        assert total == plan.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len({id(c.seq) for c in plan.chunks}) == len(plan.chunks)
        for c in plan.chunks:
            s = c.seq
            assert s.status is SequenceStatus.RUNNING
            assert c.num_new_tokens >= 1
            assert c.start == s.num_computed_tokens
            assert c.start + c.num_new_tokens <= s.num_tokens
            assert c.sample == (c.start + c.num_new_tokens == s.num_tokens)
            assert len(s.block_table) * self.bm.block_size >= c.start + c.num_new_tokens
            assert c.forks == [] or c.sample
        for s in plan.preempted:
            assert s.status is SequenceStatus.WAITING and s.block_table == []
            assert s.num_computed_tokens == 0
        self.sched.update(plan)
        for c in plan.chunks:
            assert c.seq.num_computed_tokens == c.start + c.num_new_tokens
        # -- the engine's part ----------------------------------------------------------------
        for c in plan.chunks:
            if c.sample:
                for s in [c.seq, *c.forks]:
                    s.token_ids.append(7 + s.index)   # samples diverge after the fork
        for c in plan.chunks:
            for s in [c.seq, *c.forks]:
                if c.sample and s.num_output_tokens >= s.params.max_tokens:
                    self.sched.finish(s, "length")
        self.max_running = max(self.max_running, len(self.sched.running))
        self.plans.append(plan)
        self.check_blocks()
        return plan

    def check_blocks(self) -> None:
        counts = [0] * self.bm.num_blocks
        for s in self.seqs:
            for b in s.block_table:
                counts[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts
        assert set(self.bm._free) == {i for i, c in enumerate(counts) if c == 0}

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the scheduler made no progress")


def chunk_of(plan: SchedulerPlan, seq: Sequence):
    found = [c for c in plan.chunks if c.seq is seq]
    return found[0] if found else None


# ---- the token budget -------------------------------------------------------------------

def test_token_budget_is_never_exceeded_and_everything_finishes():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=16)
    lens = [1, 3, 4, 5, 15, 16, 17, 33, 2, 40]
    seqs = [sim.add(n, max_tokens=3 + i) for i, n in enumerate(lens)]
    sim.run()
    assert all(p.num_batched_tokens <= 16 for p in sim.plans)
    assert max(p.num_batched_tokens for p in sim.plans) == 16   # the budget gets used
    for s, n in zip(seqs, lens):
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "length"
        assert s.num_output_tokens == s.params.max_tokens and s.num_prompt_tokens == n
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    assert sim.sched.running == [] and not sim.sched.waiting


def test_decodes_are_scheduled_before_new_prefills():
    sim = Sim(max_num_batched_tokens=10)
    a = sim.add(5, max_tokens=10)
    b = sim.add(3, max_tokens=10)
    plan = sim.step()                       # both prefill (5 + 3 <= 10)
    assert [c.seq for c in plan.chunks] == [a, b]
    c = sim.add(30, max_tokens=2)
    plan = sim.step()
    # The two decodes come first and are not squeezed out by the long waiting prompt.
    assert [(ch.seq, ch.num_new_tokens) for ch in plan.chunks] == [(a, 1), (b, 1), (c, 8)]
    for _ in range(3):
        plan = sim.step()
        assert [ch.seq for ch in plan.chunks][:2] == [a, b]
        assert chunk_of(plan, a).num_new_tokens == chunk_of(plan, b).num_new_tokens == 1
        assert plan.num_batched_tokens <= 10


def test_background_prefills_share_a_budget_of_their_own():
    """Warm prefills (background) take at most max_background_tokens of a step between them,
    running or admitted; a request that arrives meanwhile gets the rest of the step at once."""
    sim = Sim(num_blocks=128, max_num_batched_tokens=64, max_background_tokens=8)
    a = sim.add(30, max_tokens=1, background=True)
    b = sim.add(30, max_tokens=1, background=True)
    plan = sim.step()
    assert [(c.seq, c.num_new_tokens) for c in plan.chunks] == [(a, 8)]      # b waits its turn
    plan = sim.step()
    assert [(c.seq, c.num_new_tokens) for c in plan.chunks] == [(a, 8)]
    r = sim.add(40, max_tokens=2)                  # the response arrives
    plan = sim.step()
    assert [(c.seq, c.num_new_tokens) for c in plan.chunks] == [(a, 8), (r, 40)]
    plan = sim.step()
    # a finishes its prompt (6 left), r decodes, b starts with the share's last 2 tokens
    assert [(c.seq, c.num_new_tokens) for c in plan.chunks] == [(a, 6), (r, 1), (b, 2)]
    sim.run()
    assert all(sum(c.num_new_tokens for c in p.chunks if c.seq.background) <= 8 for p in sim.plans)
    assert a.status is b.status is r.status is SequenceStatus.FINISHED
    assert b.num_output_tokens == 1 and r.num_output_tokens == 2


@pytest.mark.parametrize("value", [0, -64, 1.5])
def test_the_background_budget_is_a_positive_integer(value):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(model="m", max_background_tokens=value)
    assert e.value.param == "max_background_tokens" and "positive integer" in str(e.value)


def test_the_background_budget_is_a_serve_flag():
    args = build_parser().parse_args(["serve", "m", "--max-background-tokens", "32"])
    assert args.max_background_tokens == 32
    assert build_parser().parse_args(["serve", "m"]).max_background_tokens == EngineConfig.max_background_tokens


def test_decodes_keep_running_when_the_budget_is_tight():
    sim = Sim(max_num_batched_tokens=2, max_num_seqs=4)
    a = sim.add(2, max_tokens=20)
    b = sim.add(2, max_tokens=20)
    sim.step()                              # a prefills: the whole budget
    plan = sim.step()                       # a decodes; b gets the one token left
    assert [(c.seq, c.num_new_tokens) for c in plan.chunks] == [(a, 1), (b, 1)]
    c = sim.add(9, max_tokens=20)
    for _ in range(6):
        plan = sim.step()
        assert [(ch.seq, ch.num_new_tokens) for ch in plan.chunks] == [(a, 1), (b, 1)]
    # The two running sequences used the budget every step; c never got a token in.
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0


def test_long_prompt_is_chunked_and_samples_only_on_the_last_chunk():
    sim = Sim(max_num_batched_tokens=8)
    s = sim.add(21, max_tokens=2)
    chunks = []
    while s.num_output_tokens == 0:
        chunks.append(chunk_of(sim.step(), s))
    assert [(c.start, c.num_new_tokens, c.sample) for c in chunks] == \
        [(0, 8, False), (8, 8, False), (16, 5, True)]
    assert s.num_computed_tokens == 21 and s.num_tokens == 22
    plan = sim.step()
    assert [(c.start, c.num_new_tokens, c.sample) for c in plan.chunks] == [(21, 1, True)]
    assert s.status is SequenceStatus.FINISHED


def test_chunked_prefill_shares_the_step_with_a_later_prompt():
    sim = Sim(max_num_batched_tokens=8)
    a = sim.add(11, max_tokens=1)
    b = sim.add(6, max_tokens=1)
    p1 = sim.step()
    assert [(c.seq, c.num_new_tokens) for c in p1.chunks] == [(a, 8)]
    p2 = sim.step()                         # a's last 3 tokens, then 5 of b's
    assert [(c.seq, c.start, c.num_new_tokens, c.sample) for c in p2.chunks] == \
        [(a, 8, 3, True), (b, 0, 5, False)]


# ---- seats ----------------------------------------------------------------------------------

def test_max_num_seqs_is_respected():
    sim = Sim(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [sim.add(3, max_tokens=3 + i) for i in range(5)]
    plan = sim.step()
    assert [c.seq for c in plan.chunks] == seqs[:2]
    assert list(sim.sched.waiting) == seqs[2:]
    sim.run()
    assert sim.max_running == 2
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    # The third is admitted only in the step after the first one finished.
    first_c = next(i for i, p in enumerate(sim.plans) if chunk_of(p, seqs[2]))
    assert seqs[0].num_output_tokens == 3
    assert first_c == 3                     # a finishes at the end of step 2 (prefill + 2 decodes)


def test_fork_children_count_against_max_num_seqs():
    """A request with n=3 holds three seats from admission on: its n-1 children join
    `running` at its last prefill chunk, so no other request may take those seats meanwhile
    (neither in the same step nor while the parent's prefill is chunked)."""
    sim = Sim(max_num_seqs=3, max_num_batched_tokens=64)
    a = sim.add(5, max_tokens=4, n=3)
    b = sim.add(5, max_tokens=4)
    plan = sim.step()
    assert sim.max_running <= 3, f"{len(sim.sched.running)} running with max_num_seqs=3"
    assert [c.seq for c in plan.chunks] == [a]
    assert list(sim.sched.waiting) == [b]
    sim.run()
    assert sim.max_running == 3
    assert b.status is SequenceStatus.FINISHED


def test_seats_reserved_for_unforked_children_during_chunked_prefill():
    sim = Sim(max_num_seqs=3, max_num_batched_tokens=8)
    a = sim.add(12, max_tokens=3, n=3)      # prefill over two steps, then forks 2 children
    b = sim.add(2, max_tokens=3)
    sim.run()
    assert a.status is SequenceStatus.FINISHED and b.status is SequenceStatus.FINISHED
    assert sim.max_running <= 3


# ---- preemption -----------------------------------------------------------------------------

def test_youngest_running_sequence_is_preempted_and_recomputed():
    # 3 sequences of 8-token prompts = 2 blocks each; 7 blocks total. The first decode that
    # needs a third block for everyone runs out.
    sim = Sim(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
              prefix_caching=False)
    a, b, c = (sim.add(8, max_tokens=6) for _ in range(3))
    plan = sim.step()
    assert [ch.seq for ch in plan.chunks] == [a, b, c] and sim.bm.num_free_blocks == 1
    plan = sim.step()                       # a and b take one block each: c must go
    assert plan.preempted == [c]
    assert [ch.seq for ch in plan.chunks] == [a, b]
    assert c.status is SequenceStatus.WAITING and c.block_table == []
    assert c.num_computed_tokens == 0 and sim.sched.waiting[0] is c
    assert sim.sched.running == [a, b]
    assert sim.sched.num_preemptions == 1
    c_tokens = list(c.token_ids)
    assert len(c_tokens) == 9               # its sampled token is kept
    sim.run()
    # c came back, recomputed prompt + its generated token in one chunk, sampled and went on.
    idx = next(i for i, p in enumerate(sim.plans) if i > 1 and chunk_of(p, c))
    back = chunk_of(sim.plans[idx], c)
    assert (back.start, back.num_new_tokens, back.sample) == (0, 9, True)
    assert c.token_ids[:9] == c_tokens
    for s in (a, b, c):
        assert s.status is SequenceStatus.FINISHED and s.num_output_tokens == 6
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_preempted_sequences_go_to_the_front_oldest_first():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              prefix_caching=False)
    a = sim.add(4, max_tokens=20)           # 1 block each after prefill
    b = sim.add(4, max_tokens=20)
    c = sim.add(4, max_tokens=20)
    d = sim.add(4, max_tokens=20)
    sim.step()
    late = sim.add(3, max_tokens=2)         # waiting while the others grow
    sim.sched.max_num_seqs = 4              # keep `late` out until seats free up
    for _ in range(20):
        plan = sim.step()
        if plan.preempted:
            break
    assert plan.preempted, "the pool was meant to run out"
    victims = plan.preempted
    # Youngest first, and the oldest victim ends up at the very front, before `late`.
    assert victims == sorted(victims, key=lambda s: -s.arrival)
    assert list(sim.sched.waiting)[:len(victims)] == sorted(victims, key=lambda s: s.arrival)
    assert sim.sched.waiting[-1] is late
    assert a in sim.sched.running           # the oldest keeps going
    sim.run()
    assert all(s.status is SequenceStatus.FINISHED for s in (a, b, c, d, late))
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_preempted_sequence_recomputes_with_prefix_hits_to_the_same_length():
    sim = Sim(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = sim.add(8, max_tokens=6, base=0)
    sim.add(8, max_tokens=6)
    c = sim.add(8, max_tokens=6, base=0)    # a's prompt: its blocks stay cached by a
    sim.step()
    plan = sim.step()
    assert plan.preempted == [c]
    n = c.num_tokens
    assert n == 9
    plan = sim.step()                       # room for c again, thanks to a's cached blocks
    back = chunk_of(plan, c)
    assert (back.start, back.num_new_tokens, back.sample) == (8, 1, True)
    assert c.block_table[:2] == a.block_table[:2] and c.num_cached_tokens == 8
    assert c.num_computed_tokens == n
    sim.run()
    assert c.status is SequenceStatus.FINISHED and c.num_output_tokens == 6
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


# ---- finish ---------------------------------------------------------------------------------

def test_finish_frees_blocks_in_any_state():
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    running = sim.add(3, max_tokens=50)
    mid_prefill = sim.add(10, max_tokens=50)
    waiting = sim.add(4, max_tokens=50)
    sim.step()                              # running: 3 tokens; mid_prefill: 3 of 10
    assert mid_prefill.status is SequenceStatus.RUNNING and 0 < mid_prefill.num_computed_tokens < 10
    assert waiting.status is SequenceStatus.WAITING
    for s in (running, mid_prefill, waiting):
        sim.sched.finish(s, "abort")
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "abort"
        assert s.block_table == []
        sim.check_blocks()
    sim.sched.finish(running, "stop")        # twice: no-op
    assert running.finish_reason == "abort"
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    assert not sim.sched.has_work()


def test_finish_a_preempted_sequence():
    sim = Sim(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
              prefix_caching=False)
    _a, _b, c = (sim.add(8, max_tokens=6) for _ in range(3))
    sim.step()
    assert sim.step().preempted == [c]
    sim.sched.finish(c, "abort")
    assert c not in sim.sched.waiting and c.status is SequenceStatus.FINISHED
    sim.run()
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_finish_a_parent_before_it_forks_finishes_its_children():
    sim = Sim(max_num_batched_tokens=4)
    a = sim.add(10, max_tokens=3, n=3)
    children = list(a.fork_children)
    sim.step()
    sim.sched.finish(a, "abort")
    for s in [a, *children]:
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "abort"
    assert a.fork_children == [] and not sim.sched.has_work()
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


# ---- n > 1: forks ---------------------------------------------------------------------------

def test_fork_children_join_running_after_the_parents_last_prefill_chunk():
    sim = Sim(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    a = sim.add(10, max_tokens=3, n=3)
    children = list(a.fork_children)
    for _ in range(2):                      # chunks [0, 4), [4, 8): no fork yet
        plan = sim.step()
        assert chunk_of(plan, a).forks == [] and not chunk_of(plan, a).sample
        assert sim.sched.running == [a]
        assert all(ch.status is SequenceStatus.WAITING and ch.block_table == [] for ch in children)
    plan = sim.step()                       # [8, 10): last chunk, samples for all three
    last = chunk_of(plan, a)
    assert last.sample and last.forks == children
    assert sim.sched.running == [a, *children] and a.fork_children == []
    for ch in children:
        assert ch.status is SequenceStatus.RUNNING
        assert ch.num_computed_tokens == 10 and ch.num_tokens == 11
        assert ch.block_table == children[0].block_table
    assert [sim.bm.blocks[b].ref_count for b in a.block_table] == [3, 3, 3]
    # The next step decodes all three; the shared partial block [8, 10) is copied for the
    # first two writers, the third keeps the original.
    plan = sim.step()
    assert [c.seq for c in plan.chunks] == [a, *children]
    assert len(plan.block_copies) == 2
    shared = children[1].block_table[2]
    assert {src for src, _ in plan.block_copies} == {shared}
    assert {dst for _, dst in plan.block_copies} == {a.block_table[2], children[0].block_table[2]}
    assert sim.bm.blocks[a.block_table[0]].ref_count == 3   # full blocks stay shared
    sim.run()
    for s in [a, *children]:
        assert s.status is SequenceStatus.FINISHED and s.num_output_tokens == 3
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
