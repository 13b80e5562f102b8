"""The Qwen3-Omni talker's sampled code predictor: each codebook of a sampled frame is drawn
from its top-k 50 / top-p 0.8 set with the request's own generator, the sampled rows of a
codebook pass in one call of the engine's sampler (its exponential race; greedy rows take the
argmax). A sampled request's speech is the same alone and beside other requests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnistage import Omni, OutputOptions, SamplingParams
from omnistage.llm.sampler import Sampler, SamplingBatch
from omnistage.models.qwen3_omni.talker_stage import PREDICTOR_SAMPLING

FRAMES = 10


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from omnistage.tiny import build_tiny

    folder = build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3-sampling"), seed=2)
    with Omni(str(folder), num_threads=1) as o:
        yield o


def test_a_pass_draws_the_sampled_rows_in_one_call_from_the_top_k_top_p_set(omni):
    talker = omni.engine.graph.stages["talker"]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g) * 3
    speech = [SimpleNamespace(generator=torch.Generator().manual_seed(s)) if s is not None
              else SimpleNamespace(generator=None) for s in (1, None, 2)]
    reference = [torch.Generator().manual_seed(s) for s in (1, 2)]
    pick = talker._picker(speech)
    for j in range(1, 6):                            # codebook passes: the generators carry on
        got = pick(logits, j)
        batch = SamplingBatch([PREDICTOR_SAMPLING] * 2, reference, [[], []], [[], []], [[], []])
        want = Sampler()(logits[[0, 2]], batch).token_ids
        assert got[1] == logits[1].argmax() and torch.equal(got[[0, 2]], want)
        for row in (0, 2):
            order = logits[row].softmax(-1).sort(descending=True)
            rank = (order.indices == got[row]).nonzero().item()
            assert rank < 50 and order.values[:50][:rank].sum() / order.values[:50].sum() < 0.8


def _speech(omni, prompts: list[str], temperature: float) -> list[np.ndarray]:
    params = SamplingParams(temperature=temperature, top_k=50, seed=11, max_tokens=FRAMES, min_tokens=FRAMES)
    chats = [[{"role": "user", "content": text}] for text in prompts]
    outs = omni.generate(chats, SamplingParams(temperature=0, max_tokens=6),
                         output=OutputOptions(talker_params=params))
    return [o.audio for o in outs]


def test_a_sampled_request_speaks_the_same_alone_and_beside_others(omni):
    [alone] = _speech(omni, ["Tell me about the sea."], 0.9)
    together = _speech(omni, ["Tell me about the sea.", "Hello there!", "What is two plus two?"], 0.9)
    assert alone.shape == together[0].shape and np.allclose(alone, together[0], atol=1e-5)
    [greedy] = _speech(omni, ["Tell me about the sea."], 0.0)
    assert greedy.shape != alone.shape or not np.allclose(greedy, alone, atol=1e-3)   # it samples
