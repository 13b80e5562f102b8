"""One generation stream: its tokens, its KV block table and its progress.

A request with `n` samples owns `n` sequences; they share the prompt's KV blocks (see
BlockManager.fork). Invariant: tokens [0, num_computed_tokens) have their K/V in the blocks of
`block_table`; the scheduler's only job is to move num_computed_tokens up to num_tokens.
"""

from __future__ import annotations

import enum
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
    generator: torch.Generator | None = None  # per-request seeded generator
    return_hidden_states: bool = False
    num_hidden_emitted: int = 0              # positions whose hidden states went out (once each)
    arrival: int = 0                         # admission order; lower = older = higher priority
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache
    # Hashes of this sequence's full blocks, in order (filled lazily by the BlockManager).
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None     # the stop token id or string that ended it
    # Samples 1..n-1 of a request wait here until sample 0 has prefilled the prompt, then
    # fork from it (sharing its blocks) instead of computing the prompt again.
    fork_children: list["Sequence"] = field(default_factory=list)

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

    @property
    def cacheable(self) -> bool:
        """Prefix caching keys blocks by token ids, which embedding prompts do not have; and a
        cache hit would skip positions whose hidden states were asked for."""
        return self.prompt_embeds is None and not self.return_hidden_states


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
