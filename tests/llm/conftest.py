"""Fixtures shared by the native kernel tests."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.build import NativeBuildError, compiler


@pytest.fixture(scope="session")
def c_compiler() -> str:
    """The C compiler the native kernels build with; skips the test where there is none."""
    try:
        return compiler()
    except NativeBuildError as e:
        pytest.skip(f"no C compiler to build the native kernels: {e}")


@pytest.fixture(scope="session")
def random_prompts():
    """make(n, seed, first, step): n token-id prompts of lengths first, first + step, ..."""
    def make(n: int, seed: int, first: int, step: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"prompt_token_ids": torch.randint(0, 500, (first + step * i,), generator=g).tolist()}
                for i in range(n)]
    return make
