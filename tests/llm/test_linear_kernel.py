"""The native linear kernel (omnistage/kernels/linear.c) against a float64 product, its batch
invariance, and its selection by `linear_kernel`."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from omnistage import Omni, SamplingParams
from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.kernels.linear import NativeLinearKernel, unsupported_reason
from omnistage.layers.linear import use_native_linears

needs_cc = pytest.mark.usefixtures("c_compiler")


@pytest.fixture(scope="module")
def kernel(c_compiler) -> NativeLinearKernel:
    return NativeLinearKernel()


# (rows, out, in): one row (the decode path), every tile height 1-6 and their mixes, partial
# last panels (out not a multiple of 64), odd inner sizes.
SHAPES = [(1, 64, 16), (1, 5, 3), (2, 130, 33), (3, 64, 7), (4, 192, 512), (5, 100, 64),
          (6, 64, 96), (7, 250, 40), (13, 65, 17), (64, 768, 512), (200, 300, 129)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_product(kernel, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w_t = torch.randn(k, n, generator=g)                 # (in, out), as TransposedLinear keeps it
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    panels = kernel.pack(w_t)
    assert panels.shape == (-(-n // 64), k, 64)
    got = kernel(x, panels, b, n)
    ref = x.double() @ w_t.double() + (b.double() if bias else 0)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * k ** 0.5, rtol=1e-5)


def test_inputs_of_other_layouts(kernel):
    """Leading dimensions are kept; strided inputs are made contiguous first."""
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(40, 70, generator=g)
    panels = kernel.pack(w_t)
    x = torch.randn(3, 5, 80, generator=g)[..., ::2]           # (3, 5, 40), stride 2
    got = kernel(x, panels, None, 70)
    assert got.shape == (3, 5, 70)
    torch.testing.assert_close(got, x @ w_t, atol=1e-4, rtol=1e-5)
    assert kernel(torch.empty(0, 40), panels, None, 70).shape == (0, 70)
    with pytest.raises(ValueError, match="in_features"):
        kernel(torch.randn(2, 41), panels, None, 70)


def test_rows_are_batch_invariant(kernel):
    """A row's result is the same bits alone, in any batch, and at any position of it."""
    g = torch.Generator().manual_seed(2)
    w_t, b = torch.randn(300, 200, generator=g), torch.randn(200, generator=g)
    panels = kernel.pack(w_t)
    x = torch.randn(37, 300, generator=g)
    whole = kernel(x, panels, b, 200)
    for i in range(37):
        assert torch.equal(kernel(x[i:i + 1], panels, b, 200)[0], whole[i])
    for lo, hi in [(0, 2), (5, 11), (3, 37), (30, 37)]:
        assert torch.equal(kernel(x[lo:hi], panels, b, 200), whole[lo:hi])
    # ...and with other rows around it.
    mixed = torch.cat([torch.randn(4, 300, generator=g), x[7:8], torch.randn(20, 300, generator=g)])
    assert torch.equal(kernel(mixed, panels, b, 200)[4], whole[7])


def test_unsupported_reasons():
    assert unsupported_reason(torch.device("cpu"), torch.float32) is None
    assert "float32" in unsupported_reason(torch.device("cpu"), torch.bfloat16)
    assert "CPUs" in unsupported_reason(torch.device("meta"), torch.float32)



@needs_cc
def test_engine_kernels_agree(tiny_model, random_prompts):
    """Greedy tokens of concurrent requests are the same with every linear kernel."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(9, 11, 3, 29)
    runs = {}
    for name in ("native", "onednn", "matmul"):
        omni = Omni(tiny_model, linear_kernel=name)
        assert omni.engine.llm.linear_kernel == name
        runs[name] = [o.token_ids for o in omni.generate(prompts, params)]
    assert runs["native"] == runs["onednn"] == runs["matmul"]


@needs_cc
def test_request_alone_equals_request_in_batch(tiny_qwen2, random_prompts):
    """With the native kernels (linear and attention), a request's logprobs are the same bits
    alone as among 16 others that prefill and decode in the same steps."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    omni = Omni(tiny_qwen2, linear_kernel="native", attention_kernel="native",
                enable_prefix_caching=False)
    prompts = random_prompts(17, 11, 3, 29)
    [alone] = omni.generate(prompts[5:6], params)
    batch = omni.generate(prompts, params)
    assert batch[5].token_ids == alone.token_ids

    def values(out):
        return [(t.token_id, t.logprob, t.top) for t in out.outputs[0].logprobs]

    assert values(batch[5]) == values(alone)


def test_linear_kernel_option(tiny_qwen2, tmp_path, monkeypatch, caplog):
    with pytest.raises(InvalidRequestError, match="linear_kernel"):
        EngineConfig(model=str(tiny_qwen2), linear_kernel="fast")
    assert Omni(tiny_qwen2, linear_kernel="matmul").engine.llm.linear_kernel == "matmul"
    # A compiler that fails: auto falls back to oneDNN (and logs why); native says why.
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.INFO, logger="omnistage"):
        assert Omni(tiny_qwen2).engine.llm.linear_kernel in ("onednn", "matmul")
    assert "without the native kernel" in caplog.text
    with pytest.raises(InvalidRequestError, match="linear_kernel=native.*(could not compile|does not run)"):
        Omni(tiny_qwen2, linear_kernel="native")


def test_native_linear_module_swap(kernel):
    """use_native_linears swaps every fp32 nn.Linear (bias or not) for the same product."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 70), nn.GELU(), nn.Linear(70, 9, bias=False))
    x = torch.randn(5, 3, 40)
    with torch.inference_mode():
        ref = model(x)
        assert use_native_linears(model, kernel) == 2
        assert all(type(m) is not nn.Linear for m in model.modules())
        assert model[0].weight.dtype == torch.float32
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
