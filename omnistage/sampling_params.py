"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Defaults give plain sampling at temperature 1.

    temperature == 0 means greedy. top_k == -1 (or 0) disables top-k; top_p == 1 disables
    top-p; min_p == 0 disables min-p. `seed` makes this request's samples reproducible
    whatever else shares the batch. `n` independent completions share the prompt's KV blocks.
    """

    n: int = 1
    max_tokens: int | None = 16        # None: up to the model's context window
    min_tokens: int = 0                # EOS / stop ids are ignored until this many tokens
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0    # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0      # OpenAI semantics, on output tokens
    frequency_penalty: float = 0.0     # OpenAI semantics, on output tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    suppress_token_ids: list[int] = field(default_factory=list)  # never sampled
    # Teacher forcing: the sample's tokens are these, in order, whatever the model prefers
    # (e.g. text a speech model must say verbatim); it stops after the last one.
    forced_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None        # None: none; k >= 0: sampled token's logprob + top-k
    prompt_logprobs: int | None = None  # reserved; not supported yet (raises if set)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.suppress_token_ids = list(self.suppress_token_ids)
        self.forced_token_ids = list(self.forced_token_ids)
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise bad("max_tokens", f"must be a positive integer (or None for no limit), got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad("temperature", f"must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63):
            raise bad("seed", f"must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            raise bad("prompt_logprobs", "is not supported yet; leave it unset")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if any(not isinstance(t, int) or t < 0 for t in self.suppress_token_ids):
            raise bad("suppress_token_ids", "must be a list of non-negative token ids")
        if any(not isinstance(t, int) or t < 0 for t in self.forced_token_ids):
            raise bad("forced_token_ids", "must be a list of non-negative token ids")
        if self.forced_token_ids and self.n != 1:
            raise bad("forced_token_ids", "needs n == 1 (every sample would be the same)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
