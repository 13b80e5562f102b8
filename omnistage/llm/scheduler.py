"""The one scheduling rule: each step, every running sequence's computed tokens catch up
towards its total, under a per-step token budget.

Decodes are running sequences one token behind; prefills are sequences many tokens behind.
So chunked prefill and mixed prefill/decode steps fall out of the same rule. Background
sequences (a Realtime turn prefilled while still spoken: no one waits for it yet) share a
smaller budget of their own within the step's: a step never runs long for them, so a request
arriving meanwhile (the turn's response) waits at most one short step. When blocks run
out, the youngest running sequence is preempted: its blocks are freed and it is recomputed
later (its generated tokens are kept and prefilled again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omnistage.llm.block_manager import BlockManager
from omnistage.llm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int              # first position computed this step (== seq.num_computed_tokens)
    num_new_tokens: int     # positions [start, start + num_new_tokens) are computed
    # True when the chunk reaches the end of seq's known tokens, so the last position's
    # logits pick the next token (for seq and any samples forking off it at this step).
    sample: bool
    forks: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerPlan:
    chunks: list[ScheduledChunk]                 # in admission order
    block_copies: list[tuple[int, int]]          # (src, dst) KV block copies to do first
    preempted: list[Sequence]                    # lost their blocks this step
    num_batched_tokens: int

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_background_tokens: int | None = None):
        """max_background_tokens: the most a step gives background sequences (None: no limit
        beyond max_num_batched_tokens)."""
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_background_tokens = max_background_tokens or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order: oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (sample 0 of its request; others ride in seq.fork_children)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_ready_work(self) -> bool:
        """Whether a step would compute something (sequences whose embed feed lags behind
        its producer sit out until it catches up)."""
        return any(s.ready for s in self.running) or bool(self.waiting and self.waiting[0].ready)

    def has_lagging_feed(self) -> bool:
        """Whether a running sequence sits out for its embed feed's next input."""
        return any(not s.ready for s in self.running)

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        budget, background = self.max_num_batched_tokens, self.max_background_tokens
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not seq.ready:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget,
                    background if seq.background else budget)
            if n == 0:                        # a background prefill past this step's share
                i += 1
                continue
            got = self.bm.allocate(seq, n)
            while got is None:  # out of blocks: preempt the youngest, maybe seq itself
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                got = self.bm.allocate(seq, n)
            if got is None:
                break
            copies += got
            chunks.append(self._chunk(seq, n))
            budget -= n
            background -= n if seq.background else 0
            i += 1

        # Admit waiting sequences only when memory was not just short, in order; a background
        # one past this step's share keeps its place for a later step, and the ones behind it
        # may pass (a response is not held up by warm prefills of other sessions).
        passed: list[Sequence] = []
        while (not preempted and self.waiting and budget > 0 and self.waiting[0].ready
               and self._seat_for(self.waiting[0])):
            seq = self.waiting[0]
            if seq.background and background == 0:
                passed.append(self.waiting.popleft())
                continue
            hits = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget,
                    background if seq.background else budget)
            got = self.bm.allocate(seq, n, hits)
            if got is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            copies += got
            chunks.append(self._chunk(seq, n))
            budget -= n
            background -= n if seq.background else 0
        self.waiting.extendleft(reversed(passed))

        return SchedulerPlan(chunks, copies, preempted, self.max_num_batched_tokens - budget)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        sample = seq.num_computed_tokens + n == seq.num_tokens
        forks = seq.fork_children if sample else []
        return ScheduledChunk(seq, seq.num_computed_tokens, n, sample, forks)

    def _seat_for(self, seq: Sequence) -> bool:
        # A running parent still holds seats for the children that fork off its last chunk.
        taken = sum(1 + len(s.fork_children) for s in self.running)
        return taken + 1 + len(seq.fork_children) <= self.max_num_seqs

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # victims go youngest first, so the oldest ends in front
        self.num_preemptions += 1

    # ---- after the step -------------------------------------------------------------------
    def update(self, plan: SchedulerPlan) -> None:
        """Advance computed counts, register full blocks, and fork samples off their parent.
        (Appending sampled tokens and finishing is the engine's job.)"""
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_new_tokens
            self.bm.register_computed(seq, chunk.start)
            for child in chunk.forks:
                self.bm.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            if chunk.forks:
                seq.fork_children = []

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop seq (done or aborted) and free its blocks. Safe to call in any state."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for child in seq.fork_children:  # samples that never forked off
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
        seq.fork_children = []
