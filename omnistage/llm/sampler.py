"""Turn one step's logits into token ids, row by row, each row with its own SamplingParams.

Pipeline for a batch (each stage is skipped when no row needs it):

  raw logits ──► logprobs: log_softmax of the RAW logits (before bans, penalties, temperature)
      │
      ├─ 1. banned ids → -inf          (the engine bans EOS/stop ids until min_tokens is reached)
      ├─ 2. penalties                  (repetition: HF; presence/frequency: OpenAI)
      ├─ 3. greedy rows: argmax of the penalised logits
      └─ 4. other rows: temperature → top_k → top_p → min_p → one exponential-race draw

Determinism: a row is *seeded* iff its generator is not None. A seeded row draws its noise from
its own generator only, exactly V values per step, so its tokens do not depend on which rows
share the batch or where it sits. Unseeded rows share one batched draw from the Sampler's own
generator (one per device).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from omnistage.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (dividing by ~0 would overflow to inf/NaN).
GREEDY_TEMPERATURE_EPS = 1e-5
# top_k/top_p first look at this many largest logits per row (topk), then 8x as many, and sort
# the whole row only when some row's top_p nucleus is longer still. All routes give the same cut.
SORT_HEAD = 1024


class RowArgmax(Protocol):
    """(B, V) float32 -> (B,) int64, as `x.argmax(dim=-1)`: the first index of each row's
    largest value (of its first NaN where it has one). kernels.argmax.ArgmaxKernel is one."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class GreedyChooser(Protocol):
    """Greedy rows with bans and HF's repetition penalty applied on the way, without editing
    the logits: the token mask_banned, apply_penalties (repetition only) and the argmax give.
    kernels.argmax.ArgmaxKernel is one."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def greedy(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
               penalties: list[float]) -> torch.Tensor: ...


class TopKRace(Protocol):
    """Sampled rows that all use top_k (with top_p, bans and HF's repetition penalty, nothing
    else) in one call, from the uniforms the sampler draws (the same generators, V values a
    row), the noise computed for the kept tokens only: the token its torch path gives, but
    where two kept tokens' noisy scores, or a cumulative probability and top_p, lie within a
    few ulps (libm's and SLEEF's roundings). kernels.argmax.ArgmaxKernel is one."""

    def supports(self, x: torch.Tensor) -> bool: ...

    def race(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
             penalties: list[float], temperatures: list[float], top_k: list[int],
             top_p: list[float], u: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SamplingBatch:
    """Per-row settings for one engine step; row i matches logits[i]."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per-request seeded generator (logits' device) or None
    prompt_token_ids: list[list[int]]         # repetition_penalty: prompt + output count as "seen"
    output_token_ids: list[list[int]]         # generated so far; presence/frequency count these
    # masked to -inf this step (suppressed ids; EOS/stop before min_tokens); a list or a 1-D
    # int64 tensor per row
    banned_token_ids: list[list[int] | torch.Tensor]

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("generators", "prompt_token_ids", "output_token_ids", "banned_token_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SamplingBatch.{name} has {len(getattr(self, name))} rows, "
                                 f"params has {n}")

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    """Rows that did not ask for logprobs still get values in the logprob tensors: ignore them."""

    token_ids: torch.Tensor             # (B,) int64 sampled ids
    logprobs: torch.Tensor | None       # (B,) float32 raw logprob of the sampled token; None: none asked
    top_logprobs: torch.Tensor | None   # (B, K) float32 descending; K = max requested (may be 0)
    top_token_ids: torch.Tensor | None  # (B, K) int64; a row that asked k < K uses the first k columns


@dataclass
class _Plan:
    """What this batch needs, decided on the host from the params alone (no device syncs)."""

    greedy: list[bool]                  # per row: argmax instead of sampling
    penalty_rows: list[int]             # rows with any non-neutral penalty
    any_banned: bool
    logprobs_k: int | None              # max requested logprobs, None if no row asked
    sample_rows: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.sample_rows = [i for i, g in enumerate(self.greedy) if not g]

    @classmethod
    def of(cls, batch: SamplingBatch) -> _Plan:
        ks = [p.logprobs for p in batch.params if p.logprobs is not None]
        return cls(
            greedy=[p.temperature < GREEDY_TEMPERATURE_EPS for p in batch.params],
            penalty_rows=[i for i, p in enumerate(batch.params) if p.uses_penalties],
            any_banned=any(len(b) > 0 for b in batch.banned_token_ids),
            logprobs_k=max(ks) if ks else None,
        )

    @property
    def pure_greedy(self) -> bool:
        return (not self.sample_rows and not self.penalty_rows and not self.any_banned
                and self.logprobs_k is None)

    def greedy_with_repetition(self, params: list[SamplingParams]) -> bool:
        """Every row greedy, no logprobs, and no penalty but the repetition penalty."""
        return (not self.sample_rows and self.logprobs_k is None
                and all(_repetition_only(params[i]) for i in self.penalty_rows))

    def top_k_race(self, params: list[SamplingParams], vocab: int) -> bool:
        """Every row sampled with a top_k (a small candidate set: a talker's step), no min_p,
        no logprobs, and no penalty but the repetition penalty."""
        return (len(self.sample_rows) == len(params) and self.logprobs_k is None
                and all(0 < p.top_k < vocab and p.min_p == 0.0 and _repetition_only(p) for p in params))


def _repetition_only(p: SamplingParams) -> bool:
    """No penalty but HF's repetition penalty (what the native choosers apply)."""
    return p.presence_penalty == 0.0 and p.frequency_penalty == 0.0


class Sampler:
    """Stateless apart from the default generator(s) used for unseeded rows.

    sort_head: how many of a row's largest logits top_k/top_p examine before falling back to a
    full sort (a speed knob only; results do not depend on it).
    argmax: the row argmax of greedy rows and of the sampled rows' exponential race (torch's,
    or the native kernel on CPU, llm/runner_builder.py: the same answers, ~5x faster).
    greedy: where given, batches of greedy rows with bans and a repetition penalty only (a
    talker's every step) go through it in one call (the same tokens; a talker's row ~0.3 ->
    ~0.05 ms).
    race: where given, batches whose rows all sample with a top_k (a talker's sampled steps)
    go through it in one call after the uniforms are drawn (see TopKRace; six talker rows of
    8448 codes ~1.1 -> ~0.5 ms a step, most of it the draws).
    """

    def __init__(self, seed: int = 0, *, sort_head: int = SORT_HEAD, argmax: RowArgmax = torch_argmax,
                 greedy: GreedyChooser | None = None, race: TopKRace | None = None):
        self.seed = seed
        self.sort_head = sort_head
        self.argmax = argmax
        self.greedy = greedy
        self.race = race
        self._generators: dict[torch.device, torch.Generator] = {}  # lazily, one per device

    def default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: (B, V) float32 or bf16. Returns token ids (and logprobs if any row asked)."""
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits must be (B, V) with B={len(batch)}, got {tuple(logits.shape)}")
        plan = _Plan.of(batch)
        if plan.pure_greedy:  # fast path: one argmax (float(): bf16 argmax is slow on CPU)
            return SamplerOutput(self.argmax(logits.float()), None, None, None)
        if (self.greedy is not None and plan.greedy_with_repetition(batch.params)
                and self.greedy.supports(logits)):
            return SamplerOutput(self._greedy(logits, batch), None, None, None)
        raw = logits.float()  # (B, V); aliases `logits` when it is already float32: never edit in place
        if self.race is not None and plan.top_k_race(batch.params, raw.shape[1]) and self.race.supports(raw):
            return SamplerOutput(self._race(raw, batch), None, None, None)
        x = raw.clone() if (plan.any_banned or plan.penalty_rows) else raw
        if plan.any_banned:
            mask_banned(x, batch.banned_token_ids)
        if plan.penalty_rows:
            apply_penalties(x, plan.penalty_rows, batch)

        token_ids = self._choose(x, batch, plan)
        if plan.logprobs_k is None:
            return SamplerOutput(token_ids, None, None, None)
        return _with_logprobs(raw, token_ids, plan.logprobs_k)

    def _greedy(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Greedy rows with bans and repetition penalties in one GreedyChooser call."""
        return self.greedy.greedy(x, *_bans_and_penalties(batch))

    def _race(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sampled top_k rows in one TopKRace call, over the uniforms _sample would draw."""
        params = batch.params
        u = self._uniforms(x.shape[0], x.shape[1], batch.generators, x.device)
        return self.race.race(x, *_bans_and_penalties(batch), [p.temperature for p in params],
                              [p.top_k for p in params], [p.top_p for p in params], u)

    def _choose(self, x: torch.Tensor, batch: SamplingBatch, plan: _Plan) -> torch.Tensor:
        """x: (B, V) float32 processed logits -> (B,) int64 ids (argmax for greedy rows)."""
        rows = plan.sample_rows
        if not rows:
            return self.argmax(x)
        if len(rows) == x.shape[0]:
            return self._sample(x, batch.params, batch.generators)
        token_ids = self.argmax(x)  # (B,); sampled rows overwritten below
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        token_ids[idx] = self._sample(x[idx], [batch.params[i] for i in rows],
                                      [batch.generators[i] for i in rows])
        return token_ids

    def _sample(self, x: torch.Tensor, params: list[SamplingParams],
                gens: list[torch.Generator | None]) -> torch.Tensor:
        """x: (R, V) penalised logits of non-greedy rows -> (R,) int64 sampled ids."""
        R, V = x.shape
        # cfg: (R, 4) = temperature, top_k (V when off), top_p, min_p — one host->device copy.
        cfg = torch.tensor(
            [[p.temperature, p.top_k if 0 < p.top_k < V else V, p.top_p, p.min_p] for p in params],
            dtype=torch.float32, device=x.device)
        x = x / cfg[:, 0:1]  # new tensor: safe to edit in place from here on
        k_max = max((p.top_k for p in params if 0 < p.top_k < V), default=0)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        if k_max or use_top_p or use_min_p:
            # Where every top_p row also has a top_k, its nucleus lies within its top_k tokens:
            # the k_max largest logits hold it (ties past them: the retry), so top_p looks at no
            # more (a talker's top_k 40 of 8448 codes: topk 40 instead of SORT_HEAD).
            within_k = all(0 < p.top_k < V for p in params if p.top_p < 1.0)
            keep_from = filter_threshold(x, cfg[:, 1].long(), cfg[:, 2], cfg[:, 3], k_max=k_max,
                                         use_top_p=use_top_p, use_min_p=use_min_p,
                                         head=k_max if k_max and within_k else self.sort_head)
            x.masked_fill_(x < keep_from, -math.inf)
        # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) samples i with probability p_i.
        # In log space: argmax_i x_i - log E_i (softmax's normaliser is constant per row).
        log_e = self._log_exponential(R, V, gens, x.device)  # (R, V)
        return self.argmax(x.sub_(log_e))

    def _log_exponential(self, R: int, V: int, gens: list[torch.Generator | None],
                         device: torch.device) -> torch.Tensor:
        """(R, V) log E with E ~ Exp(1) i.i.d., from _uniforms: a seeded row transformed on its
        own (V,) row, so its noise is bit-identical whatever the batch (SIMD body/scalar tail
        splits depend on the length transformed); unseeded rows together."""
        u = self._uniforms(R, V, gens, device)
        free = [i for i, g in enumerate(gens) if g is None]
        if len(free) == R:
            return _log_exp_noise(u)
        if free:
            at = torch.tensor(free, dtype=torch.long, device=device)
            u[at] = _log_exp_noise(u[at])
        for i, g in enumerate(gens):
            if g is not None:
                _log_exp_noise(u[i])
        return u

    def _uniforms(self, R: int, V: int, gens: list[torch.Generator | None],
                  device: torch.device) -> torch.Tensor:
        """(R, V) U[0, 1): a seeded row's V values from its own generator only (exactly V a
        step, so its draws do not depend on the batch); the unseeded rows' in one draw from the
        Sampler's generator."""
        default = self.default_generator(device)
        if all(g is None for g in gens):
            return torch.empty(R, V, device=device).uniform_(generator=default)
        u = torch.empty(R, V, dtype=torch.float32, device=device)
        free = [i for i, g in enumerate(gens) if g is None]
        if free:
            u[torch.tensor(free, dtype=torch.long, device=device)] = torch.empty(
                len(free), V, device=device).uniform_(generator=default)
        for i, g in enumerate(gens):     # per-row loop only for the draw itself
            if g is not None:
                u[i].uniform_(generator=g)
        return u


def _bans_and_penalties(batch: SamplingBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Per row: banned ids, seen ids (prompt and output; none where the row's repetition
    penalty is 1.0: nothing seen is read) as 1-D int64 tensors, and the repetition penalty."""
    penalties = [p.repetition_penalty for p in batch.params]
    none = torch.empty(0, dtype=torch.int64)      # rows with nothing to read share it
    seen = [torch.from_numpy(np.fromiter(itertools.chain(prompt, out), dtype=np.int64)) if r != 1.0 else none
            for r, prompt, out in zip(penalties, batch.prompt_token_ids, batch.output_token_ids)]
    banned = [torch.as_tensor(b, dtype=torch.int64).contiguous() if len(b) else none
              for b in batch.banned_token_ids]
    return banned, seen, penalties


def _log_exp_noise(u: torch.Tensor) -> torch.Tensor:
    """In place: U ~ U[0, 1) -> log E, E = -log U ~ Exp(1) (inverse CDF; ~4x cheaper on CPU
    than exponential_()). U = 0 gives E = inf: that token loses (probability 2^-24). Clamping
    E > 0 keeps log E finite, so a -inf (filtered) logit never becomes NaN or +inf."""
    return u.log_().neg_().clamp_(min=torch.finfo(torch.float32).tiny).log_()


def mask_banned(x: torch.Tensor, banned: list[list[int] | torch.Tensor]) -> None:
    """In place: x[i, t] = -inf for every t in banned[i]. Out-of-vocab ids are ignored.

    At least one token per row must stay unbanned (else the row's distribution is empty).
    Rows go to the index whole (a talker bans ~1000 codec ids per row at every step).
    """
    counts = [len(ids) for ids in banned]
    if not any(counts):
        return
    if isinstance(banned[0], torch.Tensor) and all(ids is banned[0] for ids in banned):
        cols = banned[0].to(x.device)           # every row the same tensor: one column index
        x[:, cols[(cols >= 0) & (cols < x.shape[1])]] = -math.inf
        return
    cols = torch.cat([torch.as_tensor(ids, dtype=torch.long, device=x.device) for ids in banned])
    rows = torch.repeat_interleave(torch.arange(len(banned), device=x.device),
                                   torch.tensor(counts, device=x.device))
    inside = (cols >= 0) & (cols < x.shape[1])
    x[rows[inside], cols[inside]] = -math.inf


def apply_penalties(x: torch.Tensor, rows: list[int], batch: SamplingBatch) -> None:
    """In place on x (B, V) float32, only for `rows`.

    repetition_penalty r (HF): for every token seen in prompt or output, a logit l becomes
      l / r if l > 0 else l * r.
    presence p / frequency f (OpenAI), applied after: l -= f * count + p * (count > 0), where
      count is the token's number of occurrences in the OUTPUT so far.

    Only the logits of the ids concerned are read and written, at flat indices row * V + id (an
    id repeated reads the same logit and writes the same result, so repetitions need no
    dedup). Why: (rows, V) masks and counts built every step cost a talker (V 8448, a few
    hundred prompt and output ids) ~180 us of a ~1.3 ms step; the others' logits are left as
    the masked arithmetic left them (l * 1, l - 0), so the same bits.
    """
    V, dev = x.shape[1], x.device
    flat = x.view(-1)
    params = batch.params
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeat:
        seqs = [batch.prompt_token_ids[i] + batch.output_token_ids[i] for i in repeat]
        lengths = [len(seq) for seq in seqs]
        ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=sum(lengths))
        base = np.repeat(np.array(repeat, dtype=np.int64) * V, lengths)        # row * V
        r = np.repeat(np.array([params[i].repetition_penalty for i in repeat], dtype=np.float32), lengths)
        keep = (ids >= 0) & (ids < V)
        at, r_at = torch.from_numpy(ids[keep] + base[keep]).to(dev), torch.from_numpy(r[keep]).to(dev)
        vals = flat[at]
        flat[at] = torch.where(vals > 0, vals / r_at, vals * r_at)
    counted = [i for i in rows if params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0]
    if counted:
        at, counts = [], []
        for i in counted:          # each output id once, with its number of occurrences
            out = np.fromiter(batch.output_token_ids[i], dtype=np.int64)
            ids, c = np.unique(out[(out >= 0) & (out < V)], return_counts=True)
            at.append(ids + i * V)
            counts.append(c)
        lengths = [len(a) for a in at]
        pres = np.repeat(np.array([params[i].presence_penalty for i in counted], dtype=np.float32), lengths)
        freq = np.repeat(np.array([params[i].frequency_penalty for i in counted], dtype=np.float32), lengths)
        at = torch.from_numpy(np.concatenate(at)).to(dev)
        count = torch.from_numpy(np.concatenate(counts).astype(np.float32)).to(dev)
        flat[at] = flat[at] - torch.from_numpy(freq).to(dev) * count - torch.from_numpy(pres).to(dev)


def filter_threshold(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, *, k_max: int, use_top_p: bool, use_min_p: bool,
                     head: int = SORT_HEAD) -> torch.Tensor:
    """Per-row logit threshold (R, 1): tokens with x >= threshold stay, the rest are dropped.

    x: (R, V) tempered logits; top_k: (R,) int64 in [1, V] (V = off); top_p, min_p: (R,) float.
    k_max: the largest enabled top_k (0 if none). Definitions, applied in this order, each on
    the distribution left by the previous one:
      top_k: keep tokens whose logit >= the k-th largest logit (ties with it are all kept).
      top_p: sort the kept tokens by probability, descending; keep the shortest prefix whose
             cumulative probability >= top_p, plus every token tied with the prefix's last one.
             top_p == 1 keeps everything.
      min_p: keep tokens with p >= min_p * max p (a ratio, so renormalisation does not move it;
             in logits: x >= max x + log(min_p)). The top token always survives all three.
    Ties are thus always all-in or all-out, whatever order sort() puts them in.
    """
    R, V = x.shape
    threshold = torch.full((R, 1), -math.inf, dtype=x.dtype, device=x.device)
    if k_max or use_top_p:
        m = min(V, max(k_max, head if use_top_p else 1))  # top_k alone needs only k_max values
        threshold = _top_k_top_p_threshold(x, top_k, top_p, m=m, use_top_k=k_max > 0)
    if use_min_p:
        t_m = x.amax(dim=-1, keepdim=True) + min_p[:, None].log()  # log(0) = -inf: off
        threshold = torch.maximum(threshold, t_m)
    return threshold


def _top_k_top_p_threshold(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
                           m: int, use_top_k: bool) -> torch.Tensor:
    """(R, 1) cut for top_k then top_p, found in the m largest logits of each row (m >= k_max).

    If some row's top_p nucleus does not end within its m largest, retry with 8x as many
    (topk), then with the full sort.
    The cut is the same whichever route: the head's values are the sorted row's first m values, and
    the cumulative sum of a prefix does not depend on what follows it. (Only exp() may differ
    in the last bit between SIMD body and scalar tail, which matters only when a cumulative
    sum lands within one ulp of top_p.)
    """
    V = x.shape[1]
    ninf = torch.tensor(-math.inf, dtype=x.dtype, device=x.device)
    while True:
        full = 2 * m >= V  # a topk this large costs about as much as sorting
        s = x.sort(dim=-1, descending=True).values if full else x.topk(m, dim=-1).values  # (R, m)
        m = s.shape[1]
        k_on = (top_k < V)[:, None]                                   # (R, 1) rows using top_k
        t_k = torch.where(k_on, s.gather(1, (top_k.clamp(max=m) - 1)[:, None]), ninf)  # k-th largest
        kept = torch.where(x >= t_k, x, ninf) if use_top_k else x
        lse = kept.logsumexp(dim=-1, keepdim=True)                    # (R, 1) top-k set's normaliser
        cum = (s - lse).exp_().masked_fill_(s < t_k, 0.0).cumsum_(dim=-1)    # (R, m) cumulative probs
        if full or not bool(((cum[:, -1] < top_p) & (top_p < 1.0)).any()):  # one host sync
            break
        m = min(V, 8 * m)
    # Position j > 0 stays iff the mass strictly before it is < top_p; position 0 always.
    n_keep = (cum[:, :-1] < top_p[:, None]).sum(dim=-1, keepdim=True) + 1   # (R, 1) in [1, m]
    # Rounding can make the cumsum reach 1.0 early: top_p == 1 must keep everything.
    t_p = torch.where(top_p[:, None] < 1.0, s.gather(1, n_keep - 1), ninf)
    return torch.maximum(t_k, t_p)


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    """Logprobs of the RAW distribution (log_softmax of the unprocessed logits), as vLLM's default."""
    lp = torch.log_softmax(raw, dim=-1)  # (B, V) float32
    top = lp.topk(k, dim=-1, sorted=True)  # (B, K); k == 0 gives (B, 0)
    chosen = lp.gather(1, token_ids[:, None]).squeeze(1)
    return SamplerOutput(token_ids, chosen, top.values, top.indices)

