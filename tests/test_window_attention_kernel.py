"""The token2wav DiT's block-window attention as one native call (kernels/window_attention.c)
against attention written out from its definition (a dense float64 mask over all frames) and
against the PyTorch path it replaces (window_mask + key windows + SDPA)."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.linear_w8a8 import GatedResidual, RowNorm
from omnistage.kernels.window_attention import MAX_SLOTS, WindowAttentionKernel, unsupported_reason
from omnistage.layers.onednn import onednn_bf16_available
from omnistage.models.qwen2_5_omni.token2wav_dit import (Attention, AttentionWindow, BatchLayout,
                                                         _rotate_head0, add_gated, apply_norm,
                                                         window_mask)


@pytest.fixture(scope="module")
def kernels():
    return {}


def kernel_for(kernels, head_dim: int, block: int, march: str = "native") -> WindowAttentionKernel:
    """The kernel of this shape, built for `march` (the kernel_march fixture sets it)."""
    if (head_dim, block, march) not in kernels:
        kernels[head_dim, block, march] = WindowAttentionKernel(head_dim, block)
    return kernels[head_dim, block, march]


def dense_reference(qkv: torch.Tensor, lengths: list[int], block: int, back: int, ahead: int) -> torch.Tensor:
    """Float64, from the definition: query frame t of row b sees key frame s when s's block is
    within [block(t) - back, block(t) + ahead] and s < lengths[b]."""
    b, t, _, h, d = qkv.shape
    q, k, v = qkv.double().unbind(2)                                     # (B, T, H, D)
    blk = torch.arange(t) // block
    near = (blk[None, :] >= blk[:, None] - back) & (blk[None, :] <= blk[:, None] + ahead)   # (T, T)
    out = torch.empty(b, t, h, d, dtype=torch.float64)
    for i in range(b):
        seen = near & (torch.arange(t)[None, :] < lengths[i])
        scores = torch.einsum("qhd,khd->hqk", q[i], k[i]) / d ** 0.5
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[i] = torch.einsum("hqk,khd->qhd", weights.nan_to_num(0.0), v[i])
    return out.reshape(b, t, h * d)


CASES = [  # (rows, blocks, heads, head_dim, block, back, ahead, lengths)
    (1, 1, 1, 16, 4, 0, 0, [4]),
    (2, 5, 4, 64, 24, 1, 0, [120, 77]),
    (3, 5, 4, 64, 24, 0, 1, [120, 100, 7]),
    (4, 4, 2, 16, 8, 1, 1, [32, 31, 9, 1]),
    (2, 6, 3, 32, 12, 2, 3, [72, 40]),
    (1, 9, 1, 16, 4, 3, 4, [35]),        # the widest window (8 blocks)
    (2, 3, 6, 48, 16, 0, 0, [48, 17]),
]


def angles(rows: int, frames: int, head_dim: int, seed: int) -> torch.Tensor:
    """(rows, frames, 1, head_dim/2) complex64 cos + i sin, as DiTModel.rope_angles gives."""
    theta = torch.rand(rows, frames, 1, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.polar(torch.ones_like(theta), theta)


@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize("rows,blocks,heads,head_dim,block,back,ahead,lengths", CASES)
def test_equals_attention_by_definition(kernels, rows, blocks, heads, head_dim, block, back, ahead, lengths,
                                        with_rope, kernel_march):
    """Valid frames within 1e-5 of the float64 result (inputs ~N(0, 4): sharp softmaxes);
    padding frames (never used by the DiT) only finite. with_rope: the kernel rotates head 0 of
    q and k as it reads them; the reference rotates them first (torch's complex multiply).
    Both builds (kernel_march: this CPU's, and AVX2's where it can run it)."""
    qkv = torch.randn(rows, blocks * block, 3, heads, head_dim, generator=torch.Generator().manual_seed(blocks)) * 2
    rope = angles(rows, blocks * block, head_dim, seed=rows) if with_rope else None
    before = qkv.clone()
    got = kernel_for(kernels, head_dim, block, kernel_march)(qkv, torch.tensor(lengths), back, ahead,
                                                             head_dim ** -0.5, rope)
    assert torch.equal(qkv, before)                                   # read, never written
    if with_rope:
        _rotate_head0(qkv, rope)
    want = dense_reference(qkv, lengths, block, back, ahead)
    valid = torch.arange(blocks * block)[None, :] < torch.tensor(lengths)[:, None]
    assert got.shape == (rows, blocks * block, heads * head_dim) and got.is_contiguous()
    torch.testing.assert_close(got[valid].double(), want[valid], atol=1e-5, rtol=1e-5)
    assert got.isfinite().all()


@pytest.mark.parametrize("rows,blocks,heads,head_dim,block,back,ahead,lengths", CASES)
def test_bf16_build_is_the_float32_one_widened_and_rounded(kernels, rows, blocks, heads, head_dim, block,
                                                          back, ahead, lengths, kernel_march):
    """qkv in bf16 (as the DiT's bf16 GEMMs write it): bit for bit the float32 kernel on the
    widened qkv, its output rounded to bf16 as torch rounds (the copies it saves change no bit),
    padding frames included."""
    qkv = torch.randn(rows, blocks * block, 3, heads, head_dim, generator=torch.Generator().manual_seed(7)) * 2
    qkv = qkv.bfloat16()
    k, rope = kernel_for(kernels, head_dim, block, kernel_march), angles(rows, blocks * block, head_dim, seed=3)
    got = k(qkv, torch.tensor(lengths), back, ahead, head_dim ** -0.5, rope)
    want = k(qkv.float(), torch.tensor(lengths), back, ahead, head_dim ** -0.5, rope).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(not onednn_bf16_available(), reason="oneDNN has no bf16 GEMMs on this CPU")
def test_bf16_gemms_feed_the_kernel_without_float32_copies(kernels):
    """With packed bf16 GEMMs, Attention hands q|k|v to the kernel in bf16 and its bf16 output
    to the output GEMM: the same bits as going through float32 copies of both."""
    block, head_dim, heads = 8, 16, 4
    attn = Attention(type("C", (), dict(num_attention_heads=heads, head_dim=head_dim, hidden_size=64))())
    attn.pack_for_onednn(torch.bfloat16)
    attn.kernel = kernel = kernel_for(kernels, head_dim, block)
    lengths = torch.tensor([40, 23])
    window = AttentionWindow(None, lengths)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 40, 64, generator=g)
    norm, gate = RowNorm(torch.randn(64, generator=g), torch.randn(64, generator=g), 1e-6), torch.randn(1, 64, generator=g)
    rope = angles(2, 40, head_dim, seed=6)
    with torch.no_grad():
        got = attn(x, norm, gate, rope, block, 1, 1, window)
        qkv = attn.qkv.packed_call(apply_norm(x, norm)).view(2, 40, 3, heads, head_dim)   # float32 copy
        a = attn.to_out[0].packed_call(kernel(qkv, lengths, 1, 1, head_dim ** -0.5, rope))
        want = add_gated(GatedResidual(x, gate), a)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("back,ahead", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_equals_the_torch_path_padding_rows_too(kernels, back, ahead):
    """Against the PyTorch path the kernel replaces (Attention.forward without a kernel), every
    frame, padding included (a padding query sees its whole window, zeros outside the row):
    atol 1e-5."""
    block, head_dim, heads = 8, 16, 4
    attn = Attention(type("C", (), dict(num_attention_heads=heads, head_dim=head_dim, hidden_size=32))())
    with torch.no_grad():
        for lin in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]):
            lin.reset_parameters()
    attn.pack_for_onednn()
    lengths = [40, 23, 8]
    layout = BatchLayout(lengths, [0, 16, 8], 40)
    window = AttentionWindow(window_mask(layout, block, back, ahead, torch.device("cpu")), torch.tensor(lengths))
    g = torch.Generator().manual_seed(back + 2 * ahead)
    x = torch.randn(3, 40, 32, generator=g) * 3
    norm, gate = RowNorm(torch.randn(32, generator=g), torch.randn(32, generator=g), 1e-6), torch.randn(1, 32, generator=g)
    rope = torch.polar(torch.ones(3, 40, 1, head_dim // 2), torch.rand(3, 40, 1, head_dim // 2) * 6)
    with torch.no_grad():
        want = attn(x, norm, gate, rope, block, back, ahead, window)
        attn.kernel = kernel_for(kernels, head_dim, block)
        got = attn(x, norm, gate, rope, block, back, ahead, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_results_do_not_depend_on_threads(kernels):
    """Each (row, block, head) is one task whatever the thread count: bit-equal results."""
    qkv = torch.randn(3, 48, 3, 4, 16, generator=torch.Generator().manual_seed(1))
    k, lengths, rope = kernel_for(kernels, 16, 8), torch.tensor([48, 30, 5]), angles(3, 48, 16, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k(qkv, lengths, 1, 1, 0.25, rope)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, k(qkv, lengths, 1, 1, 0.25, rope))


def test_calls_it_does_not_take(kernels):
    k = kernel_for(kernels, 16, 8)
    qkv = torch.randn(1, 16, 3, 2, 16)
    assert k.supports(qkv, 1, 1)
    assert k.supports(qkv.bfloat16(), 1, 1) and not k.supports(qkv.half(), 1, 1)
    assert not k.supports(torch.randn(1, 12, 3, 2, 16), 0, 0)          # not whole blocks
    assert not k.supports(torch.randn(1, 16, 3, 2, 32), 0, 0)          # another head size
    assert not k.supports(qkv, MAX_SLOTS, 0)                           # a window too wide
    with pytest.raises(ValueError, match="window attention kernel"):
        k(qkv, torch.tensor([16, 16]), 0, 0, 0.25)                     # lengths of another batch
    with pytest.raises(ValueError, match="window attention kernel"):
        k(qkv, torch.tensor([16]), 0, 0, 0.25, angles(1, 8, 16, seed=0))   # angles of other frames
    assert unsupported_reason(24, 8) and unsupported_reason(16, 6) and unsupported_reason(64, 24) is None
