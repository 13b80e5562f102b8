"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def random_prompts():
    """make(n, seed, first, step): n token-id prompts of lengths first, first + step, ..."""
    def make(n: int, seed: int, first: int, step: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"prompt_token_ids": torch.randint(0, 500, (first + step * i,), generator=g).tolist()}
                for i in range(n)]
    return make
