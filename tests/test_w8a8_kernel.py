"""The int8 product (kernels/linear_w8a8.c): exact integer sums against a reference computed
here, the AMX, VNNI (AVX-512 and AVX-VNNI) and plain C paths equal, a row's result independent
of its batch, the fused GELU, norm and gated residual, and its error against the float32
product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.kernels import build
from omnistage.kernels.linear_w8a8 import GatedResidual, RowNorm, W8A8Kernel, pack_w8a8


@pytest.fixture(scope="module")
def fast():
    return W8A8Kernel()


@pytest.fixture(scope="module")
def plain():
    return W8A8Kernel(narrow=True, vnni=False)


@pytest.fixture(scope="module")
def narrow():
    """The 8-lane build: AVX-VNNI's 256-bit dot products where this CPU has them (else plain C)."""
    kernel = W8A8Kernel(narrow=True)
    assert kernel.vnni == (" avx_vnni" in build._cpu_flags())   # the path this CPU can test
    return kernel


@pytest.fixture(scope="module")
def vnni():
    return W8A8Kernel(amx=False)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in torch: the same float steps for the scales and codes, the
    integer sums in int64, fma(isum, sx * sw, bias) in float64 then rounded (exact: isum and
    the float32 scale product are exact in float64, one rounding left)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(x * inv).clamp(-127, 127).to(torch.int64)
    sx = amax / 127
    sw = w.abs().amax(dim=1) / 127
    qw = torch.where(sw[:, None] > 0, torch.round(w / torch.where(sw > 0, sw, 1.0)[:, None]),
                     torch.zeros_like(w)).clamp(-127, 127).to(torch.int64)
    isum = qx @ qw.T
    scale = (sx * sw[None, :]).double()
    y = isum.double() * scale + (0 if bias is None else bias.double())
    return y.float()


@pytest.mark.parametrize("m,k,n", [(1, 4, 1), (5, 250, 70), (37, 256, 768), (13, 512, 129), (100, 7, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_both_paths_equal_the_integer_reference(fast, plain, narrow, m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) if with_bias else None
    packed = pack_w8a8(w)
    want = reference(x, w, bias)
    got = fast(x, packed, bias)
    assert torch.equal(got, want)
    assert torch.equal(plain(x, packed, bias), want)
    assert torch.equal(narrow(x, packed, bias), want)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (31, 256, 70), (32, 250, 129), (70, 1000, 200),
                                   (129, 512, 64), (3, 7, 5)])
def test_the_amx_tiles_give_the_vnni_bits(fast, vnni, m, k, n):
    """AMX (where the CPU and OS have it): 32-row tiles over whole 64-input steps, the inputs
    past them and short last tiles included, equal to VNNI's sums bit for bit."""
    if not fast.amx:
        pytest.skip("no AMX on this CPU (or the OS refused the tiles)")
    assert not vnni.amx
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * 0.05
    packed, bias = pack_w8a8(w), torch.randn(n, generator=g)
    assert torch.equal(fast(x, packed, bias), reference(x, w, bias))
    assert torch.equal(fast(x, packed, bias, "gelu_tanh"), vnni(x, packed, bias, "gelu_tanh"))
    r = min(5, m - 1)                        # one row alone: a tile of padding rows around it
    assert torch.equal(fast(x[r:r + 1], packed, bias), fast(x, packed, bias)[r:r + 1])


def test_a_row_gets_the_same_bits_alone_as_in_any_batch(fast):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(61, 256, generator=g)
    packed = pack_w8a8(torch.randn(200, 256, generator=g))
    bias = torch.randn(200, generator=g)
    batch = fast(x, packed, bias)
    for r in (0, 5, 6, 47, 48, 60):          # tile and row-block edges
        assert torch.equal(fast(x[r:r + 1], packed, bias), batch[r:r + 1])
    strided = torch.randn(61, 300, generator=g)
    strided[:, 20:276] = x                   # the same rows at a row stride of 300
    assert torch.equal(fast(strided[:, 20:276], packed, bias), batch)
    assert torch.equal(fast(x.view(61, 1, 256), packed, bias).view(61, 200), batch)


def test_gelu_follows_in_the_same_pass(fast, plain):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 256, generator=g) * 4
    packed = pack_w8a8(torch.randn(512, 256, generator=g) * 0.05)
    bias = torch.randn(512, generator=g)
    y = fast(x, packed, bias)
    got = fast(x, packed, bias, "gelu_tanh")
    assert torch.equal(got, plain(x, packed, bias, "gelu_tanh"))
    want = F.gelu(y, approximate="tanh")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    extremes = torch.tensor([[-1e4, -100.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 100.0, 1e4]])
    eye = pack_w8a8(torch.eye(9))
    lin = fast(extremes, eye, None)
    torch.testing.assert_close(fast(extremes, eye, None, "gelu_tanh"), F.gelu(lin, approximate="tanh"),
                               atol=1e-6, rtol=1e-6)


def test_error_against_the_float_product_is_the_quantization(fast):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 512, generator=g), torch.randn(384, 512, generator=g) * 0.04
    y, want = fast(x, pack_w8a8(w), None), x @ w.T
    rel = ((y - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.012, rel          # both sides rounded to 1/254 of their largest value


def test_zero_rows_columns_and_empty_batches(fast):
    w = torch.randn(70, 16)
    w[3] = 0
    x = torch.randn(4, 16)
    x[1] = 0
    bias = torch.randn(70)
    y = fast(x, pack_w8a8(w), bias)
    assert torch.equal(y[1], bias) and torch.equal(y[:, 3], bias[3].expand(4))
    assert fast(torch.zeros(0, 16), pack_w8a8(w), bias).shape == (0, 70)


def test_bad_shapes_and_activations_are_refused(fast):
    packed = pack_w8a8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="w8a8"):
        fast(torch.randn(2, 15), packed, None)
    with pytest.raises(ValueError, match="bias"):
        fast(torch.randn(2, 16), packed, torch.randn(7))
    with pytest.raises(ValueError, match="activation"):
        fast(torch.randn(2, 16), packed, None, "relu")
    with pytest.raises(ValueError, match="int32"):
        pack_w8a8(torch.zeros(1, 70000))


@pytest.mark.parametrize("m,k,n", [(1, 256, 64), (70, 256, 200), (37, 1000, 70), (5, 7, 3), (130, 64, 129)])
def test_norm_before_and_gated_residual_after_in_the_same_call(fast, plain, vnni, narrow, m, k, n):
    """A LayerNorm (weight and bias) on each row as it is quantized, and res + gate * y after
    (the DiT's modulated norm and gated residual): what the separate torch steps give, within
    float rounding of the norm (an input one ulp away may round to the next int8 step); the
    same bits on every path and for a row alone."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * 2 + 0.7
    packed, bias = pack_w8a8(torch.randn(n, k, generator=g) * 0.05), torch.randn(n, generator=g)
    norm = RowNorm(torch.randn(k, generator=g) * 0.2 + 1, torch.randn(k, generator=g) * 0.1, 1e-6)
    res, gate = torch.randn(m, n, generator=g), torch.randn(1, n, generator=g)
    got = fast(x, packed, bias, "gelu_tanh", norm=norm, residual=GatedResidual(res, gate))
    h = F.layer_norm(x, (k,), norm.weight, norm.bias, eps=norm.eps)
    want = torch.addcmul(res, gate.view(-1), fast(h, packed, bias, "gelu_tanh"))
    step = (h.abs().amax() / 127 * packed.scales.abs().max() * 127 * gate.abs().max()).item()
    assert (got - want).abs().max().item() <= 3 * step
    assert (got - want).abs().le(1e-5 * (1 + want.abs())).float().mean() > 0.95
    for other in (plain, vnni, narrow):
        assert torch.equal(other(x, packed, bias, "gelu_tanh", norm=norm, residual=GatedResidual(res, gate)), got)
    r = m // 2
    alone = fast(x[r:r + 1], packed, bias, "gelu_tanh", norm=norm, residual=GatedResidual(res[r:r + 1], gate))
    assert torch.equal(alone, got[r:r + 1])
    with pytest.raises(ValueError, match="residual"):
        fast(x, packed, bias, residual=GatedResidual(res[:-1] if m > 1 else torch.randn(2, n), gate))
    with pytest.raises(ValueError, match="norm weight"):
        fast(x, packed, bias, norm=RowNorm(norm.weight[:-1], norm.bias, 1e-6))


# rows: fewer blocks than two a thread (the two calls), then whole and partial row blocks
@pytest.mark.parametrize("m", [3, 240, 601])
def test_feed_forward_in_one_call_is_the_two_calls(fast, plain, vnni, narrow, m):
    """linear_w8a8_ffn (norm, up, GELU, down, gated residual, row block by row block) gives
    the bits of the two calls it replaces, on every path."""
    g = torch.Generator().manual_seed(m)
    k, f = 96, 200                              # f not a multiple of the 64-column panels
    x = torch.randn(m, k, generator=g) * 2
    up, down = pack_w8a8(torch.randn(f, k, generator=g) * 0.1), pack_w8a8(torch.randn(k, f, generator=g) * 0.1)
    ub, db = torch.randn(f, generator=g), torch.randn(k, generator=g)
    norm = RowNorm(torch.randn(k, generator=g) * 0.2 + 1, torch.randn(k, generator=g) * 0.1, 1e-6)
    res = GatedResidual(torch.randn(m, k, generator=g), torch.randn(k, generator=g))
    for kernel in (fast, plain, vnni, narrow):
        want = kernel(kernel(x, up, ub, "gelu_tanh", norm=norm), down, db, residual=res)
        assert torch.equal(kernel.feed_forward(x, up, ub, down, db, norm, res), want)
        assert torch.equal(kernel.feed_forward(x, up, None, down, None),
                           kernel(kernel(x, up, None, "gelu_tanh"), down, None))
    with pytest.raises(ValueError, match="feed-forward"):
        fast.feed_forward(x, up, ub, up, db)      # up's outputs are not down's inputs
