"""The native RMSNorm calls (kernels/norms.py) against torch's, and RMSNorm's use of them."""

import pytest
import torch
import torch.nn.functional as F

from omnistage.kernels.build import NativeBuildError
from omnistage.kernels.norms import NormKernel
from omnistage.layers.norm import RMSNorm


@pytest.fixture(scope="module")
def kernel():
    try:
        return NormKernel()
    except NativeBuildError as e:
        pytest.skip(f"no native build here: {e}")


@pytest.mark.parametrize("rows", [1, 3, 27, 300])      # 300 x 512: the threaded path
def test_rows_match_torch(kernel, rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 512, generator=g) * 3, torch.randn(512, generator=g)
    ref = F.rms_norm(x, w.shape, w, 1e-6)
    out = kernel.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, torch.zeros_like(out))


def test_head_norms_in_place_leave_v(kernel):
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 9, 8, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 16, generator=g)[:, : (hq + 2 * hkv) * d]  # strided rows
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    ref = qkv.clone()
    q_end, k_end = hq * d, (hq + hkv) * d
    ref[:, :q_end] = F.rms_norm(ref[:, :q_end].view(t, hq, d), qw.shape, qw, 1e-6).view(t, q_end)
    ref[:, q_end:k_end] = F.rms_norm(ref[:, q_end:k_end].view(t, hkv, d), kw.shape, kw, 1e-6).view(t, -1)
    assert kernel.head_norms(qkv, hq, hkv, qw, kw, 1e-6)
    torch.testing.assert_close(qkv, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, k_end:], ref[:, k_end:])          # V untouched, bit for bit


def test_layouts_it_does_not_take_are_refused(kernel):
    w = torch.randn(64)
    assert not kernel.head_norms(torch.randn(4, 768).t(), 8, 2, w, w, 1e-6)       # columns strided
    assert not kernel.head_norms(torch.randn(4, 768, dtype=torch.bfloat16), 8, 2, w, w, 1e-6)
    assert not kernel.head_norms(torch.randn(4, 100), 8, 2, w, w, 1e-6)           # too narrow
    assert not NormKernel.supports(torch.randn(4, 128)[:, :64], w)                # rows strided
    assert not NormKernel.supports(torch.randn(4, 32), w)                          # wrong width


def test_rmsnorm_module_uses_the_kernel_for_float32_only(kernel):
    norm = RMSNorm(64, 1e-6, torch.float32, device="cpu")
    norm.weight.data.normal_()
    x = torch.randn(5, 64)
    plain = norm(x)
    norm.kernel = kernel
    torch.testing.assert_close(norm(x), plain, rtol=1e-5, atol=1e-5)
    half = RMSNorm(64, 1e-6, torch.bfloat16, device="cpu")
    half.weight.data.normal_()
    xb = x.to(torch.bfloat16)
    ref = half(xb)
    half.kernel = kernel                           # bf16 rows: torch's ops as before
    assert torch.equal(half(xb), ref)
    strided = torch.randn(5, 128)[:, :64]          # not contiguous: torch's ops
    assert torch.equal(norm(strided), F.rms_norm(strided, (64,), norm.weight, 1e-6))
