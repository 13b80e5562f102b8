"""The native row argmax (omnistage/kernels/argmax.c) gives torch.argmax's answer on every
row: ties (the first index), NaN (the first NaN), all -inf, signed zeros, tails past the
16-lane body, strided rows, the threaded path; and the sampler draws the same tokens with it."""

from __future__ import annotations

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.kernels.argmax import ArgmaxKernel
from omnistage.llm.sampler import Sampler, SamplingBatch, torch_argmax

needs_cc = pytest.mark.usefixtures("c_compiler")


def _rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cases = [torch.randn(r, n, generator=g) for r, n in ((1, 1), (1, 15), (1, 16), (3, 17), (2, 33),
                                                         (1, 32000), (7, 1000), (40, 4099))]
    ties = torch.randint(0, 4, (9, 301), generator=g).float()          # many equal maxima
    cases.append(ties)
    nan = torch.randn(6, 70, generator=g)
    for row, at in enumerate((0, 5, 15, 16, 63, 69)):                  # body lanes and the tail
        nan[row, at] = float("nan")
        nan[row, (at + 11) % 70] = float("nan")                        # and another, before or after
    cases.append(nan)
    special = torch.full((4, 37), float("-inf"))
    special[1, 20] = -0.0
    special[1, 30] = 0.0
    special[2, 36] = float("inf")
    special[3, :] = 0.0
    special[3, ::2] = -0.0
    cases.append(special)
    wide = torch.randn(5, 300, generator=g)
    cases.append(wide[:, 7:250])                                       # rows at stride 300
    return cases


@needs_cc
def test_matches_torch_argmax(kernel_march):
    """Both builds (kernel_march: this CPU's, and AVX2's where it can run it)."""
    kernel = ArgmaxKernel()
    for x in _rows(0):
        assert ArgmaxKernel.supports(x)
        assert torch.equal(kernel(x), x.argmax(dim=-1)), x.shape


@needs_cc
def test_what_it_does_not_take_goes_to_torch():
    kernel = ArgmaxKernel()
    x = torch.randn(3, 50)
    for other in (x.to(torch.bfloat16), x.t(), x[0], x.double()):
        assert not ArgmaxKernel.supports(other)
        assert torch.equal(kernel(other), other.argmax(dim=-1))
    empty = torch.empty(0, 50)
    assert kernel(empty).shape == (0,)


def _batch(gen_seed: int | None) -> SamplingBatch:
    """Greedy rows, seeded sampled rows (top-k / top-p / min-p), unseeded ones, a penalised one."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=1.2, min_p=0.05)]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed + gen_seed) for p in params]
    return SamplingBatch(params, gens, [[1, 2, 3]] * len(params), [[4, 5]] * len(params),
                         [[] for _ in params])


@needs_cc
def test_sampler_draws_the_same_tokens_with_it():
    """A Sampler with the native argmax picks what one with torch's does, greedy and sampled
    rows alike (the exponential race is an argmax too), step after step."""
    g = torch.Generator().manual_seed(7)
    native, reference = Sampler(seed=5, argmax=ArgmaxKernel()), Sampler(seed=5, argmax=torch_argmax)
    for step in range(20):
        logits = torch.randn(6, 3001, generator=g) * 3
        got = native(logits, _batch(step)).token_ids
        want = reference(logits, _batch(step)).token_ids
        assert torch.equal(got, want), step


@needs_cc
def test_the_native_engine_samples_with_it(tiny_qwen2):
    for kernel, native in (("native", True), ("matmul", False)):
        omni = Omni(tiny_qwen2, linear_kernel=kernel)
        try:
            sampler = omni.engine.llm.runner.sampler
            assert isinstance(sampler.argmax, ArgmaxKernel) == native
            assert isinstance(sampler.greedy, ArgmaxKernel) == native == isinstance(sampler.race, ArgmaxKernel)
        finally:
            omni.close()
