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
from typing import Callable

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


def cached_stack(h0: torch.Tensor, h1: torch.Tensor, jobs: list, owners: list[int],
                 teacache_signal: Callable[[int], torch.Tensor],
                 run_rest: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The block stack after its first block, per job: h0 (R, L, D) is the first block's input,
    h1 its output; owners[r] = index into jobs of row r. A job whose cache says skip gets
    h1 + its residual; the others run `run_rest(row_index, h1_rows) -> output rows` together,
    and a cached job stores the residual that run added. -> (R, L, D)."""
    rows_of = [[r for r, o in enumerate(owners) if o == j] for j in range(len(jobs))]
    run: list[int] = []
    for job, rows in zip(jobs, rows_of):
        c = job.cache
        if c is None:
            run += rows
            continue
        r0 = rows[0]     # the job's conditional row decides for all its rows
        signal = teacache_signal(r0) if c.kind == "teacache" else h1[r0:r0 + 1] - h0[r0:r0 + 1]
        if c.skip(job.step, signal):
            h1[rows] = h1[rows] + c.residual
        else:
            run += rows
    if run:
        idx = torch.tensor(run, device=h1.device)
        start = h1[idx]
        out = run_rest(idx, start)
        h1[idx] = out
        at = {r: i for i, r in enumerate(run)}
        for job, rows in zip(jobs, rows_of):
            if job.cache is not None and rows[0] in at:
                sel = [at[r] for r in rows]
                job.cache.residual = out[sel] - start[sel]
    return h1
