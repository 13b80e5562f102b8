"""The code predictor's native stack (one native call per codebook pass, predictor_stack.py)
against its per-op path on the same packed weights: the same codes, the residual embeddings
within float rounding, and every frame's result the same bits whatever batch it runs in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.config import EngineConfig
from omnistage.layers.checkpoint import iter_weights, safetensors_files
from omnistage.layers.linear import native_linears_for
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.tiny import build_tiny

SHAPES = {"tiny": ("tiny", {}),
          "two_layers": ("tiny", {"talker_config": {"code_predictor_config": {"num_hidden_layers": 2}}}),
          "small": ("small", {})}


@pytest.fixture(scope="module", params=list(SHAPES))
def predictors(request, tmp_path_factory):
    """(native-stack predictor, per-op predictor, native stack bound for 16 frames up front)
    with the same native-kernel weights."""
    size, overrides = SHAPES[request.param]
    folder = build_tiny("qwen3_omni", tmp_path_factory.mktemp(f"cp-{request.param}"), seed=3, size=size,
                        overrides=overrides)
    c = json.loads((Path(folder) / "config.json").read_text())["talker_config"]["code_predictor_config"]
    out = []
    for stack, rows in ((True, 1), (False, 1), (True, 16)):
        p = CodePredictor(c, torch.float32, "cpu")
        p.load_weights(iter_weights(safetensors_files(Path(folder))))
        if not native_linears_for(EngineConfig(model=str(folder)), torch.device("cpu"), torch.float32, p):
            pytest.skip("the native linear kernel does not build here")
        assert p.use_native_stack(rows) if stack else p.native is None
        out.append(p)
    return out


def _inputs(p: CodePredictor, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = p.model.norm.weight.shape[0]
    return torch.randn(b, h, generator=g), p.model.codec_embedding[0].weight[torch.randint(0, p.vocab_size, (b,),
                                                                                           generator=g)]


def _greedy(logits: torch.Tensor, j: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_stack_equals_per_op_path(predictors, batch):
    native, per_op, _ = predictors
    hidden, code0 = _inputs(native, batch, seed=batch)
    codes, residual = native.predict(hidden, code0, _greedy)
    ref_codes, ref_residual = per_op.predict(hidden, code0, _greedy)
    assert codes.shape == (batch, native.num_code_groups - 1)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(residual, ref_residual, atol=1e-5, rtol=1e-5)


def test_a_frame_is_the_same_bits_in_any_batch(predictors):
    native, _, _ = predictors
    hidden, code0 = _inputs(native, 9, seed=11)
    codes, residual = native.predict(hidden, code0, _greedy)                  # grows the caches
    for i in (0, 4, 8):
        alone = native.predict(hidden[i:i + 1], code0[i:i + 1], _greedy)
        assert torch.equal(alone[0][0], codes[i]) and torch.equal(alone[1][0], residual[i])
    again = native.predict(hidden[:5], code0[:5], _greedy)                    # a smaller batch after
    assert torch.equal(again[0], codes[:5]) and torch.equal(again[1], residual[:5])


def test_the_picker_sees_every_pass_in_order(predictors):
    """pick(logits, j) is called for j = 1..G-1 with (B, V) float32 logits; its choice feeds the
    next pass (a fixed choice gives the same codes on both paths)."""
    native, per_op, _ = predictors
    seen = []

    def fixed(logits: torch.Tensor, j: int) -> torch.Tensor:
        seen.append((j, logits.shape, logits.dtype))
        return torch.full((logits.shape[0],), j % native.vocab_size, dtype=torch.int64)
    hidden, code0 = _inputs(native, 2, seed=5)
    codes, residual = native.predict(hidden, code0, fixed)
    groups = native.num_code_groups
    assert seen == [(j, (2, native.vocab_size), torch.float32) for j in range(1, groups)]
    assert codes[0].tolist() == [j % native.vocab_size for j in range(1, groups)]
    torch.testing.assert_close(residual, per_op.predict(hidden, code0, fixed)[1], atol=1e-5, rtol=1e-5)


def test_caches_bound_up_front_give_the_same_bits(predictors):
    """The recipe binds the stack for a full talker batch at build (no rebinding mid-step);
    the results are those of a stack grown as batches came."""
    grown, _, bound = predictors
    for b in (1, 6, 16, 20):                                  # 20: grows the bound one too
        hidden, code0 = _inputs(grown, b, seed=b + 100)
        a, c = grown.predict(hidden, code0, _greedy), bound.predict(hidden, code0, _greedy)
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
