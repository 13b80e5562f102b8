"""One generation stream: its tokens, its KV block table and its progress.

A request with `n` samples owns `n` sequences; they share the prompt's KV blocks (see
BlockManager.fork). Invariant: tokens [0, num_computed_tokens) have their K/V in the blocks of
`block_table`; the scheduler's only job is to move num_computed_tokens up to num_tokens.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field

import torch

from omnistage.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not yet admitted, or preempted (blocks freed, will recompute)
    RUNNING = "running"      # holds blocks; computed tokens catch up step by step
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int                               # which of the request's n samples
    token_ids: list[int]                     # prompt + generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    # (P, hidden) embeddings standing in for the prompt's token ids, or None.
    prompt_embeds: torch.Tensor | None = None
    # Multimodal RoPE (Qwen2-VL / Qwen2.5-Omni): (3, P) positions of the prompt, and the
    # offset that places generated position p (>= P) at p + position_delta on all 3 axes.
    mrope_positions: torch.Tensor | None = None
    position_delta: int = 0
    # Vectors added to the token embedding of generated positions, arriving while the
    # sequence runs (the talker's view of the thinker's reply); None for plain models.
    embed_feed: "EmbedFeed | None" = None
    # DeepStack (Qwen3-VL / Qwen3-Omni): ((V,) prompt positions, (K, V, hidden) vectors); vector
    # [k, i] is added to position i's hidden state after decoder layer k. None for plain prompts.
    deepstack: tuple[torch.Tensor, torch.Tensor] | None = None
    generator: torch.Generator | None = None  # per-request seeded generator
    return_hidden_states: bool = False
    num_hidden_emitted: int = 0              # positions whose hidden states went out (once each)
    arrival: int = 0                         # admission order; lower = older = higher priority
    # Background work (a Realtime turn prefilled while still spoken): its prefill takes at most
    # the scheduler's background budget per step.
    background: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache
    # Prefix-cache keys of this sequence's full blocks, in order (filled lazily by the
    # BlockManager): (hash of the previous key, block content).
    block_keys: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None     # the stop token id or string that ended it
    # Samples 1..n-1 of a request wait here until sample 0 has prefilled the prompt, then
    # fork from it (sharing its blocks) instead of computing the prompt again.
    fork_children: list["Sequence"] = field(default_factory=list)
    # With return_hidden_states and prefix caching: (hidden, input embeds) rows of the
    # positions [0, num_cached_tokens) the prefix cache served (their outputs were computed by
    # an earlier request), and the rows of prompt positions [row_start, num_computed_tokens)
    # not yet stored with a full block (see BlockManager.register_computed).
    cached_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    row_start: int = 0
    pending_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def ready(self) -> bool:
        """Whether every input of the positions still to compute is known (an embed feed may
        lag behind: then the sequence sits out steps until its producer catches up)."""
        if self.embed_feed is None:
            return True
        return self.embed_feed.available(self.num_tokens - 1 - self.num_prompt_tokens)

    def block_content(self, i: int, block_size: int) -> tuple | None:
        """What determines the KV of block i given its parent blocks, for prefix caching: its
        token ids, plus a digest of the inputs that are not token ids (prompt embeddings,
        multimodal positions). None: not knowable from the sequence (generated positions of
        a fed sequence add vectors that are not kept), so the block is never shared."""
        a, b = i * block_size, (i + 1) * block_size
        ids = tuple(self.token_ids[a:b])
        if b > self.num_prompt_tokens:
            return None if self.embed_feed is not None else ids
        if self.prompt_embeds is None and self.mrope_positions is None:
            return ids
        h = hashlib.blake2b(digest_size=16)
        for t in (self.prompt_embeds[a:b] if self.prompt_embeds is not None else None,
                  self.mrope_positions[:, a:b] if self.mrope_positions is not None else None):
            if t is not None:
                h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return ids + (h.digest(),)

    def keep_rows(self, start: int, hidden: torch.Tensor, embeds: torch.Tensor) -> None:
        """Rows of positions [start, start + n) just computed; only prompt positions are kept
        (they are what later requests can share), until their block is full and stored."""
        end = min(start + hidden.shape[0], self.num_prompt_tokens)
        if end <= start:
            return
        if start != self.row_start + sum(h.shape[0] for h, _ in self.pending_rows):
            self.pending_rows, self.row_start = [], start      # recomputed after preemption
        self.pending_rows.append((hidden[:end - start], embeds[:end - start]))

    def take_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept rows of positions [start, end) (a full block), dropping those before end;
        None when they were not kept."""
        have = self.row_start + sum(h.shape[0] for h, _ in self.pending_rows)
        if not self.pending_rows or start < self.row_start or end > have:
            return None
        if len(self.pending_rows) > 1:   # a block spans chunks: join them once
            self.pending_rows = [(torch.cat([h for h, _ in self.pending_rows]),
                                  torch.cat([e for _, e in self.pending_rows]))]
        h, e = self.pending_rows[0]
        a, b = start - self.row_start, end - self.row_start
        out = (h[a:b].clone(), e[a:b].clone())     # own storage: not a view of a whole chunk
        self.pending_rows = [(h[b:], e[b:])] if b < h.shape[0] else []
        self.row_start = end
        return out


class EmbedFeed:
    """A stream of (hidden,) vectors for generated positions: vector k is added to the input
    embedding at position num_prompt_tokens + k. Once `fill` is set, indices past the pushed
    vectors read it (e.g. a padding embedding repeated after the producer finished)."""

    def __init__(self) -> None:
        self._vectors: list[torch.Tensor] = []
        self.fill: torch.Tensor | None = None

    def push(self, vectors: torch.Tensor) -> None:
        """Append (n, hidden) vectors."""
        self._vectors.extend(vectors.unbind(0))

    def available(self, k: int) -> bool:
        return k < 0 or k < len(self._vectors) or self.fill is not None

    def __getitem__(self, k: int) -> torch.Tensor:
        return self._vectors[k] if k < len(self._vectors) else self.fill

    def __len__(self) -> int:
        return len(self._vectors)


class SeqIdCounter:
    """Monotonic ids; one per engine (no module globals)."""

    def __init__(self) -> None:
        self._it = itertools.count()

    def __next__(self) -> int:
        return next(self._it)
