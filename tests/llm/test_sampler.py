"""Sampler tests: greedy, bans, penalties, exact distributions, seeding, logprobs.

Distribution tests compare empirical frequencies (many rows of the same logits, one call) with
the target distribution computed here from the definitions, in plain Python.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from omnistage.llm.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    filter_threshold,
)
from omnistage.sampling_params import SamplingParams


def make_batch(params: list[SamplingParams], *, prompts=None, outputs=None, banned=None,
               gens=None) -> SamplingBatch:
    B = len(params)
    return SamplingBatch(
        params=params,
        generators=gens if gens is not None else [None] * B,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(B)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(B)],
        banned_token_ids=banned if banned is not None else [[] for _ in range(B)],
    )


# ---------------------------------------------------------------- greedy, bans, penalties


def test_greedy_is_argmax_and_needs_no_logprobs():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None
    bf16 = logits.bfloat16()
    out = Sampler()(bf16, make_batch([SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(out.token_ids, bf16.float().argmax(-1))


def test_banned_ids_never_sampled():
    V, B = 12, 3000
    logits = torch.linspace(4.0, 0.0, V).repeat(B, 1)  # the banned ids are the most likely ones
    banned = [0, 1, 5]
    kinds = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=3),
             SamplingParams(top_p=0.5), SamplingParams(min_p=0.5, temperature=2.0)]
    params = [kinds[i % len(kinds)] for i in range(B)]
    before = logits.clone()
    out = Sampler(seed=1)(logits, make_batch(params, banned=[banned] * B))
    assert torch.equal(logits, before), "the caller's logits must not be edited"
    assert not torch.isin(out.token_ids, torch.tensor(banned)).any()
    greedy_rows = out.token_ids[:: len(kinds)]
    assert (greedy_rows == 2).all()  # the best id that is not banned
    assert set(out.token_ids.tolist()) > {2, 3}  # sampling rows still spread over the rest


def reference_penalties(logits: list[float], p: SamplingParams, prompt: list[int],
                        output: list[int]) -> list[float]:
    x = list(logits)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


PENALTY_CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.5),
    SamplingParams(),  # no penalty: must be left alone
]


def _penalty_inputs(V: int = 30):
    g = torch.Generator().manual_seed(3)
    B = len(PENALTY_CASES)
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 0, 9, 3, 7, 4)]
    outputs = [torch.randint(0, V // 2, (n,), generator=g).tolist() for n in (6, 8, 0, 12, 10, 5)]
    return logits, prompts, outputs


def test_penalties_match_reference():
    logits, prompts, outputs = _penalty_inputs()
    batch = make_batch(PENALTY_CASES, prompts=prompts, outputs=outputs)
    got = logits.clone()
    apply_penalties(got, [i for i, p in enumerate(PENALTY_CASES) if p.uses_penalties], batch)
    for i, p in enumerate(PENALTY_CASES):
        want = reference_penalties(logits[i].tolist(), p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[-1], logits[-1])


def test_penalties_are_float32_arithmetic_on_the_touched_logits_only():
    """Bit for bit: each seen logit once divided / multiplied by r in float32, each output id's
    logit then (l - f * count) - p in float32; every other logit (other rows, unseen ids, rows
    without penalties) unchanged; ids outside [0, V) ignored; rows named by batch index."""
    V = 50
    g = torch.Generator().manual_seed(7)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3, presence_penalty=0.4,
                                               frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8), SamplingParams(frequency_penalty=1.1)]
    prompts = [[1, 2], [3, 3, 3, -1, V + 4, 7], [0, V - 1, 9, 9], [5]]
    outputs = [[4], [7, 7, 8, V, 3], [9, 10, 10], [11, 11, 11, 12, -2]]
    logits = torch.randn(len(params), V, generator=g) * 2
    logits[1, 3], logits[2, 9] = -0.0, 0.0                    # signed zeros stay what r makes them
    got = logits.clone()
    apply_penalties(got, [1, 2, 3], make_batch(params, prompts=prompts, outputs=outputs))
    want = logits.numpy().copy()
    for i in (1, 2, 3):
        p = params[i]
        r, pres, freq = np.float32(p.repetition_penalty), np.float32(p.presence_penalty), np.float32(p.frequency_penalty)
        if p.repetition_penalty != 1.0:
            for t in {t for t in prompts[i] + outputs[i] if 0 <= t < V}:
                want[i, t] = want[i, t] / r if want[i, t] > 0 else want[i, t] * r
        if p.presence_penalty or p.frequency_penalty:
            for t in {t for t in outputs[i] if 0 <= t < V}:
                want[i, t] = (want[i, t] - freq * np.float32(outputs[i].count(t))) - pres
    assert torch.equal(got, torch.from_numpy(want))
    assert torch.equal(got[0], logits[0])


def test_greedy_rows_take_argmax_of_penalised_logits():
    logits, prompts, outputs = _penalty_inputs()
    # Make a seen token the raw favourite in every row, so the penalties have to flip the argmax.
    for i, seen in enumerate(o or p for o, p in zip(outputs, prompts)):
        logits[i, seen[0]] = logits[i].max() + 0.1
    params = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty)
              for p in PENALTY_CASES]
    out = Sampler()(logits, make_batch(params, prompts=prompts, outputs=outputs))
    want = [max(range(logits.shape[1]), key=reference_penalties(logits[i].tolist(), p, prompts[i],
                                                                outputs[i]).__getitem__)
            for i, p in enumerate(params)]
    assert out.token_ids.tolist() == want
    assert want != logits.argmax(-1).tolist()  # the test really exercises the penalties


# ---------------------------------------------------------------- distributions


def target_distribution(logits: list[float], temperature: float = 1.0, top_k: int = -1,
                        top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """The documented definitions, one after the other; ties are all-in or all-out."""
    V = len(logits)
    z = [v / temperature for v in logits]
    w = [math.exp(v - max(z)) for v in z]  # unnormalised probabilities
    keep = set(range(V))
    if 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    if top_p < 1.0:
        total = sum(w[i] for i in keep)
        mass, last = 0.0, None
        for i in sorted(keep, key=lambda i: -z[i]):
            mass, last = mass + w[i] / total, z[i]
            if mass >= top_p:
                break
        keep = {i for i in keep if z[i] >= last}
    if min_p > 0.0:
        top = max(w[i] for i in keep)
        keep = {i for i in keep if w[i] >= min_p * top}
    total = sum(w[i] for i in keep)
    return [w[i] / total if i in keep else 0.0 for i in range(V)]


# Probabilities at temperature 1, deliberately not in index order.
BASE = [math.log(p) for p in (0.06, 0.30, 0.015, 0.12, 0.20, 0.005, 0.15, 0.03, 0.08, 0.04)]
TIED = [2.0, 0.5, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0, 0.5, -2.0]

DIST_CASES = [  # (logits, temperature, top_k, top_p, min_p)
    (BASE, 1.0, -1, 1.0, 0.0),
    (BASE, 0.5, -1, 1.0, 0.0),
    (BASE, 2.0, 0, 1.0, 0.0),
    (BASE, 1.0, 3, 1.0, 0.0),
    (BASE, 1.0, -1, 0.6, 0.0),   # cumulative .30 .50 .65: three tokens, not two
    (BASE, 0.7, -1, 0.8, 0.0),
    (BASE, 2.0, -1, 1.0, 0.35),  # after temperature: seven tokens stay, not four
    (BASE, 1.3, 6, 0.9, 0.1),
    (TIED, 1.0, 1, 1.0, 0.0),    # top_k=1 keeps both tied maxima
    (TIED, 1.0, 4, 0.95, 0.0),   # the 4th largest is tied three ways: five tokens stay
    (TIED, 1.0, -1, 0.7, 0.0),   # the prefix ends inside a tie: the whole tie stays
]


def test_empirical_distributions_match_definitions():
    n = 20_000  # per case; sampling std <= 0.0036 per probability
    C, V = len(DIST_CASES), len(BASE)
    rows = torch.arange(C * n) % C  # cases interleaved, so per-row settings must line up
    table = torch.tensor([case[0] for case in DIST_CASES])
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for _, t, k, p, m in DIST_CASES]
    out = Sampler(seed=7)(table[rows], make_batch([params[c] for c in rows.tolist()]))
    targets = [target_distribution(*case) for case in DIST_CASES]
    # A wrong definition (off-by-one prefix, ties split, min_p on the wrong scale, temperature
    # after filtering, ...) moves some probability by >= 0.05 in these cases.
    for c, target in enumerate(targets):
        counts = torch.bincount(out.token_ids[rows == c], minlength=V)
        freq = counts.double() / n
        for t in range(V):
            if target[t] == 0.0:
                assert counts[t] == 0, f"case {c}: excluded token {t} sampled {counts[t]} times"
        err = (freq - torch.tensor(target, dtype=torch.float64)).abs().max().item()
        assert err < 0.02, f"case {DIST_CASES[c][1:]}: max |freq - target| = {err:.4f}"


def test_seeded_rows_follow_the_distribution():
    n, V = 3000, len(BASE)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(n)]
    out = Sampler()(torch.tensor([BASE] * n), make_batch(params, gens=gens))
    freq = torch.bincount(out.token_ids, minlength=V).double() / n
    target = torch.tensor(target_distribution(BASE, 0.8, -1, 0.9), dtype=torch.float64)
    assert (freq[target == 0] == 0).all()
    assert (freq - target).abs().max() < 0.05  # std <= 0.009 at n=3000


def test_head_and_full_sort_give_the_same_cut(monkeypatch):
    route: list[int | str] = []  # topk sizes and full sorts, in call order
    real_sort, real_topk = torch.Tensor.sort, torch.Tensor.topk

    def sort(self, *args, **kwargs):
        route.append("sort")
        return real_sort(self, *args, **kwargs)

    def topk(self, k, *args, **kwargs):
        route.append(k)
        return real_topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", sort)
    monkeypatch.setattr(torch.Tensor, "topk", topk)
    g = torch.Generator().manual_seed(4)
    R, V = 64, 1000
    x = (torch.randn(R, V, generator=g) * 2).round(decimals=1)  # rounding makes plenty of ties
    x[::5, :7] = -math.inf  # banned ids
    top_k = torch.randint(1, 40, (R,), generator=g)
    top_k[::3] = V  # off
    k_max = int(top_k[top_k < V].max())
    top_p = torch.rand(R, generator=g) * 0.9 + 0.05
    top_p[::4] = 1.0
    cuts, routes = [], []
    for head in (1, 100, 300, V):
        route.clear()
        cuts.append(filter_threshold(x, top_k, top_p, torch.zeros(R), k_max=k_max,
                                     use_top_p=True, use_min_p=False, head=head))
        routes.append(list(route))
    # head too short, retried 8x longer | retried with the full sort | long enough | whole row
    assert routes == [[k_max, 8 * k_max], [100, "sort"], [300], ["sort"]]
    for cut in cuts[1:]:
        assert torch.equal(cut, cuts[0])
    # Against the definitions: the kept set's size in every row.
    for r in range(R):
        want = target_distribution(x[r].tolist(), 1.0, int(top_k[r]) if top_k[r] < V else -1,
                                   float(top_p[r]))
        kept = (x[r] >= cuts[0][r]) & x[r].isfinite()
        assert int(kept.sum()) == sum(w > 0 for w in want), r


def test_a_nucleus_within_top_k_is_cut_from_the_k_largest():
    """Every top_p row also has a top_k (a talker's sampling): the sampler looks at the k_max
    largest logits only, and cuts where the whole sorted row does, ties included."""
    g = torch.Generator().manual_seed(5)
    R, V = 64, 1000
    x = (torch.randn(R, V, generator=g) * 2).round(decimals=1)   # plenty of ties, also at the k-th
    top_k = torch.randint(1, 40, (R,), generator=g)
    k_max = int(top_k.max())
    top_p = torch.rand(R, generator=g) * 0.9 + 0.05
    top_p[::4] = 1.0
    args = (x, top_k, top_p, torch.zeros(R))
    head = filter_threshold(*args, k_max=k_max, use_top_p=True, use_min_p=False, head=k_max)
    whole = filter_threshold(*args, k_max=k_max, use_top_p=True, use_min_p=False, head=V)
    assert torch.equal(head, whole)
    params = [SamplingParams(temperature=1.0, top_k=int(k), top_p=float(p), seed=i)
              for i, (k, p) in enumerate(zip(top_k, top_p))]
    gens = [torch.Generator().manual_seed(i) for i in range(R)]
    ids = Sampler()(x, make_batch(params, gens=gens)).token_ids
    assert bool((x.gather(1, ids[:, None]) >= whole).all())       # every pick inside the cut


# ---------------------------------------------------------------- seeding


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.1,
                        presence_penalty=0.3, seed=1234, max_tokens=64)
OTHERS = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=0.0),
    SamplingParams(min_p=0.1, logprobs=2),
    SamplingParams(temperature=1.2, frequency_penalty=0.5, seed=99),
    SamplingParams(top_p=0.99),  # a long nucleus: the batch needs the full sort, SEEDED alone not
]
SORT_HEAD = 8  # small, so both the head (topk) and the full-sort route run


def step_logits(step: int, V: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(1000 + step)) * 2


def run_alone(seed: int, steps: int = 50, V: int = 1000) -> list[int]:
    sampler, tokens = Sampler(seed=0, sort_head=SORT_HEAD), []
    gen = torch.Generator().manual_seed(seed)
    prompt = list(range(10))
    for step in range(steps):
        batch = make_batch([SEEDED], prompts=[prompt], outputs=[list(tokens)], gens=[gen])
        tokens.append(int(sampler(step_logits(step, V)[None], batch).token_ids[0]))
    return tokens


def run_in_batch(seed: int, steps: int = 50, V: int = 1000, others: int = 16) -> list[int]:
    sampler, noise = Sampler(seed=5, sort_head=SORT_HEAD), torch.Generator().manual_seed(42)
    gens = [torch.Generator().manual_seed(seed)] + [
        torch.Generator().manual_seed(OTHERS[j % len(OTHERS)].seed) if OTHERS[j % len(OTHERS)].seed
        is not None else None for j in range(others)]
    params = [SEEDED] + [OTHERS[j % len(OTHERS)] for j in range(others)]
    outputs: list[list[int]] = [[] for _ in params]
    prompts = [list(range(10))] + [[j] * 3 for j in range(others)]
    for step in range(steps):
        order = torch.randperm(len(params), generator=noise).tolist()  # row r holds request order[r]
        logits = torch.randn(len(params), V, generator=noise) * 2
        logits[order.index(0)] = step_logits(step, V)
        batch = make_batch([params[i] for i in order], gens=[gens[i] for i in order],
                           prompts=[prompts[i] for i in order],
                           outputs=[list(outputs[i]) for i in order])
        ids = sampler(logits, batch).token_ids.tolist()
        for r, i in enumerate(order):
            outputs[i].append(ids[r])
    return outputs[0]


def test_seeded_row_is_independent_of_its_batch(monkeypatch):
    full_sorts: list[int] = []
    real_sort = torch.Tensor.sort

    def counting_sort(self, *args, **kwargs):
        full_sorts.append(self.shape[0])
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    alone = run_alone(1234)
    assert not full_sorts  # alone, SEEDED's top_k=200 nucleus always fits the head
    assert run_in_batch(1234) == alone
    assert full_sorts  # ...inside the batch, the top_p=0.99 row forced the full sort
    assert run_alone(1234) == alone
    assert len(set(alone)) > 10  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens():
    assert run_alone(1234) != run_alone(1235)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_distribution():
    V = 40
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(11)) * 2
    params = [SamplingParams(logprobs=None), SamplingParams(logprobs=0, temperature=0.5),
              SamplingParams(logprobs=3, repetition_penalty=1.5, top_k=5),
              SamplingParams(logprobs=5, temperature=0.0), SamplingParams(logprobs=1, min_p=0.2)]
    batch = make_batch(params, outputs=[[1, 2, 3]] * 5, banned=[[0], [], [4], [], [7]])
    out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs.shape == (5, 5) and out.top_token_ids.shape == (5, 5)
    assert out.top_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_token_ids))
    torch.testing.assert_close(out.top_logprobs, raw.sort(dim=-1, descending=True).values[:, :5])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_logprobs_absent_unless_asked_and_k_zero_allowed():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = Sampler()(logits, make_batch([SamplingParams(top_p=0.5)] * 3))
    assert out.logprobs is None and out.top_logprobs is None
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=0)] * 3))
    assert out.top_logprobs.shape == (3, 0)
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


def test_batch_rows_must_match():
    with pytest.raises(ValueError):
        SamplingBatch([SamplingParams()], [], [[]], [[]], [[]])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), make_batch([SamplingParams()]))


@pytest.fixture
def argmax_kernel():
    from omnistage.kernels.argmax import ArgmaxKernel
    from omnistage.kernels.build import NativeBuildError

    try:
        return ArgmaxKernel()
    except NativeBuildError as e:
        pytest.skip(f"the argmax kernel does not build here: {e}")


class Counting:
    """The native kernel's greedy and race calls, counted."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def supports(self, x):
        return self.kernel.supports(x)

    def greedy(self, *args):
        self.calls += 1
        return self.kernel.greedy(*args)

    def race(self, *args):
        self.calls += 1
        return self.kernel.race(*args)


def test_native_greedy_chooser_gives_the_torch_paths_tokens(argmax_kernel):
    """Greedy rows with bans and repetition penalties through one native call
    (ArgmaxKernel.greedy) choose what the torch path (mask, penalties, argmax) chooses: seen
    ids made the favourites (the penalty decides), repeated ids (penalised once), ids outside
    [0, V), bans as tensors and lists, a banned seen id, a NaN row, an all -inf row but one,
    signed zeros, bf16-free float32 rows; presence / frequency penalties and logprobs go the
    torch way (the chooser is not called)."""
    V, B = 300, 9
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [[int(t) for t in torch.randint(-3, V + 3, (40,), generator=g)] for _ in range(B)]
    outputs = [[int(t) for t in torch.randint(0, V, (25,), generator=g)] * 2 for _ in range(B)]
    for i in range(B):                                 # a seen id the raw favourite
        logits[i, outputs[i][0]] = logits[i].max() + 0.05
    logits[1, 5], logits[1, 6] = -0.0, 0.0
    outputs[1] += [5, 6]
    logits[2, 17] = float("nan")
    logits[3] = -float("inf")
    logits[3, 40] = -5.0
    banned = [torch.tensor([outputs[0][0], 3, V + 9, -1]), [], [0, 1], [], torch.tensor([outputs[4][0]]),
              [], [], [V - 1], torch.tensor([], dtype=torch.int64)]
    reps = [1.3, 0.7, 1.1, 1.0, 1.5, 2.0, 1.05, 1.2, 1.0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in reps]
    batch = make_batch(params, prompts=prompts, outputs=outputs, banned=banned)
    want = Sampler()(logits, batch).token_ids
    kernel = argmax_kernel
    chooser = Counting(kernel)
    got = Sampler(argmax=kernel, greedy=chooser)(logits, batch).token_ids
    assert chooser.calls == 1 and torch.equal(got, want)
    assert want.tolist() != logits.nan_to_num(nan=-1e9).argmax(-1).tolist()   # the penalties decide
    for other in (SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5),
                  SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2)):
        mixed = make_batch(params[:-1] + [other], prompts=prompts, outputs=outputs, banned=banned)
        assert torch.equal(Sampler(argmax=kernel, greedy=chooser)(logits, mixed).token_ids,
                           Sampler()(logits, mixed).token_ids)
    assert chooser.calls == 1


def test_native_top_k_race_gives_the_torch_paths_tokens(argmax_kernel):
    """Rows that all sample with a top_k (a talker's step) go through one native call
    (ArgmaxKernel.race) after the same noise draws, and choose what the torch path chooses:
    random batches of 1-8 rows over 7-8448 ids with top_k from 1 to 200, top_p from 0.01 to
    1, temperatures, repetition penalties (ids outside [0, V) too), bans, seeded and unseeded
    rows, values tied across the top-k cut, rows with fewer finite values than top_k, and
    seeded rows step after step. Batches it does not take go the torch way."""
    kernel = argmax_kernel
    rng, chooser, rows = random.Random(3), Counting(kernel), 0
    for trial in range(150):
        V, B = rng.choice([7, 64, 1000, 8448]), rng.randint(1, 8)
        g = torch.Generator().manual_seed(trial)
        params = [SamplingParams(temperature=rng.choice([0.3, 0.9, 1.7]), top_k=rng.randint(1, min(V - 1, 200)),
                                 top_p=rng.choice([1.0, 0.95, 0.8, 0.5, 0.01]),
                                 repetition_penalty=rng.choice([1.0, 1.05, 1.3])) for _ in range(B)]
        seeds = [rng.randint(0, 10**6) if rng.random() < 0.7 else None for _ in range(B)]
        logits = torch.randn(B, V, generator=g) * rng.choice([0.1, 1.0, 3.0, 10.0])
        if trial % 3 == 0:                           # ties, across the top-k cut too
            logits = (logits * 2).round() / 2
        if trial % 7 == 0:                           # fewer finite values than top_k
            logits[0, 3:] = -float("inf")
        batch = make_batch(params, prompts=[torch.randint(-2, V + 2, (rng.randint(0, 300),), generator=g).tolist()
                                            for _ in range(B)],
                           outputs=[torch.randint(0, V, (rng.randint(0, 50),), generator=g).tolist() for _ in range(B)],
                           banned=[torch.randint(0, V, (rng.randint(0, V // 3),), generator=g).tolist()
                                   for _ in range(B)])
        samplers = Sampler(seed=trial), Sampler(seed=trial, argmax=kernel, race=chooser)
        for step in range(2):                        # the generators carry on
            batch.generators = [None if s is None else torch.Generator().manual_seed(s + step) for s in seeds]
            want = samplers[0](logits, batch).token_ids
            batch.generators = [None if s is None else torch.Generator().manual_seed(s + step) for s in seeds]
            got = samplers[1](logits, batch).token_ids
            assert torch.equal(got, want), (trial, step)
        rows += B
    assert chooser.calls == 300 and rows > 500
    V, g = 500, torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)
    race = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)
    for other in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
                  SamplingParams(temperature=0.9, top_k=40, min_p=0.1),
                  SamplingParams(temperature=0.9, top_k=40, presence_penalty=0.5),
                  SamplingParams(temperature=0.9, top_k=40, logprobs=2)):
        params = [race, race, other]
        batch = make_batch(params)
        batch.generators = [torch.Generator().manual_seed(i) for i in range(3)]
        got = Sampler(argmax=kernel, race=chooser)(logits, batch).token_ids
        batch.generators = [torch.Generator().manual_seed(i) for i in range(3)]
        assert torch.equal(got, Sampler()(logits, batch).token_ids), other
    assert chooser.calls == 300
