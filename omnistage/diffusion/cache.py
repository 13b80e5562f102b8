"""Step caches: skip most of the transformer on steps where its input barely changed.

Both kinds always run the first transformer block, then decide per job (the cond and uncond
rows of one job decide together) whether to run the other blocks or to add the residual they
produced the last time they ran:

- "teacache" (TeaCache-style): the signal is the first block's modulated image input (it moves
  with the timestep embedding); the relative L1 change from the previous step is accumulated,
  and the blocks are skipped while the sum stays below the threshold (it resets when they run).
- "fbcache" (first-block / DBCache-style): the signal is the first block's residual; the blocks
  are skipped when it differs from the one of the last computed step by less than the threshold
  (relative L1).

The first step and the last step always run in full. Every job owns its state, so a request's
caching does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_THRESHOLDS = {"teacache": 0.4, "fbcache": 0.12}


@dataclass
class StepCache:
    kind: str                       # "teacache" | "fbcache"
    threshold: float
    num_steps: int
    accumulated: float = 0.0        # teacache: summed relative change since the last full run
    prev_signal: torch.Tensor | None = None
    residual: torch.Tensor | None = None   # (rows, L, D): what the skipped blocks add
    hits: int = 0                   # steps served from the cache
    misses: int = 0

    @classmethod
    def for_request(cls, kind: str | None, threshold: float | None, num_steps: int) -> "StepCache | None":
        if kind in (None, "none"):
            return None
        return cls(kind, DEFAULT_THRESHOLDS[kind] if threshold is None else threshold, num_steps)

    def skip(self, step: int, signal: torch.Tensor) -> bool:
        """Whether this step may reuse `residual`; updates the state for the next step."""
        edge = step == 0 or step == self.num_steps - 1 or self.residual is None
        prev = self.prev_signal
        change = float("inf") if prev is None else float(
            (signal - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12))
        if self.kind == "teacache":
            self.prev_signal = signal
            self.accumulated += change if prev is not None else 0.0
            if not edge and self.accumulated < self.threshold:
                self.hits += 1
                return True
            self.accumulated = 0.0
            self.misses += 1
            return False
        # fbcache: compare with the signal of the last step that ran in full
        if not edge and change < self.threshold:
            self.hits += 1
            return True
        self.prev_signal = signal
        self.misses += 1
        return False
