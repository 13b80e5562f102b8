"""The MoE MLP (layers/moe.py) against its definition: each row's output starts at zero and
receives its top-k experts' weighted outputs in ascending expert order (then the gated shared
expert), with every expert run once on the batch of rows that chose it. The reference below
is that definition written out with one index_add_ per expert; the layer must give the same
bits, with the torch products and with the native kernel."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.moe import MoeKernel
from omnistage.layers.moe import MoeMLP, MoeShape


def _moe(shape: MoeShape, seed: int) -> MoeMLP:
    g = torch.Generator().manual_seed(seed)
    moe = MoeMLP(shape, torch.float32).to_empty(device="cpu")
    for lin in [moe.router, *(m for e in moe.experts for m in (e.gate_up, e.down)),
                *((moe.shared_expert.gate_up, moe.shared_expert.down, moe.shared_expert_gate)
                  if moe.shared_expert is not None else ())]:
        for shard, size in enumerate(lin.shard_sizes):
            lin.load_weight(torch.randn(size, lin.in_features, generator=g) * 0.1, shard)
    return moe


def _reference(moe: MoeMLP, x: torch.Tensor) -> torch.Tensor:
    weights, experts = moe.route(x)
    k = moe.shape.top_k
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    rows, scale = order // k, weights.flatten()[order].unsqueeze(1)
    out, start = torch.zeros_like(x), 0
    for e, n in enumerate(torch.bincount(flat, minlength=moe.shape.num_experts).tolist()):
        if n:
            sel = rows[start:start + n]
            out.index_add_(0, sel, moe.experts[e](x[sel]) * scale[start:start + n])
            start += n
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out


@pytest.mark.parametrize("shared", [0, 48])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("inter", [32, 20])     # 20: rows of SiLU not whole vectors
def test_moe_equals_its_definition(shared, top_k, native, inter, c_compiler):
    """With the native kernel the grouping, the experts' products (one segmented call per
    product for all experts) and the weighted sums are native calls (kernels/moe.py) and the
    SiLU runs over all rows at once: the bits of one call per expert. 700 rows: the copies and
    sums in parallel regions."""
    shape = MoeShape(hidden_size=64, moe_intermediate_size=inter, num_experts=6, top_k=top_k,
                     norm_topk_prob=True, shared_expert_size=shared)
    moe = _moe(shape, seed=top_k + shared)
    if native:
        from omnistage.kernels.linear import NativeLinearKernel
        from omnistage.layers.linear import pack_linears

        pack_linears(moe, NativeLinearKernel())
    assert not moe.use_native() and not moe.runs_native          # no MoE kernel attached yet
    moe.kernel = MoeKernel()
    if native:
        assert moe.use_native() and moe.runs_native
    else:
        assert not moe.use_native() and not moe.runs_native      # torch products: nothing to bind
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 5, 37, 700):
        x = torch.randn(rows, 64, generator=g)
        got, want = moe(x), _reference(moe, x)
        assert torch.equal(got, want), (rows, (got - want).abs().max())
    assert moe(torch.empty(0, 64)).shape == (0, 64)


def test_linear_segments_equal_one_call_per_weight(c_compiler):
    """kernels.linear.LinearSegments: each segment of rows through its own weight (formats may
    differ), the bits of a call per weight; empty segments; shapes checked."""
    from omnistage.kernels.linear import NativeLinearKernel
    from omnistage.kernels.weight_pack import WeightFormat

    kernel = NativeLinearKernel()
    g = torch.Generator().manual_seed(3)
    fmts = [WeightFormat("float32"), WeightFormat("int8"), WeightFormat("float32"), WeightFormat("int4", 8)]
    weights = [kernel.pack(torch.randn(40, 72, generator=g), f) for f in fmts]
    biases = [torch.randn(72, generator=g), None, None, torch.randn(72, generator=g)]
    seg = kernel.segments(weights, biases)
    counts = [3, 0, 9, 1]
    x = torch.randn(sum(counts), 40, generator=g)
    got, start = seg(x, counts), 0
    for w, b, n in zip(weights, biases, counts):
        assert torch.equal(got[start:start + n], kernel(x[start:start + n], w, b))
        start += n
    with pytest.raises(ValueError, match="counts"):
        seg(x, [3, 0, 9])
    with pytest.raises(ValueError, match="one shape"):
        kernel.segments([weights[0], kernel.pack(torch.randn(40, 8))], [None, None])


def test_native_moe_checks_its_inputs(c_compiler):
    """kernels.moe.NativeMoe: an expert id out of range, a wrong dtype or an activation of the
    wrong width is a ValueError, never a read out of bounds; experts that do not make one
    SwiGLU each are refused at binding."""
    from omnistage.kernels.linear import NativeLinearKernel
    from omnistage.kernels.moe import NativeMoe

    kernel, moe_kernel = NativeLinearKernel(), MoeKernel()
    g = torch.Generator().manual_seed(5)
    gate_up = kernel.segments([kernel.pack(torch.randn(16, 24, generator=g)) for _ in range(3)], [None] * 3)
    down = kernel.segments([kernel.pack(torch.randn(12, 16, generator=g)) for _ in range(3)], [None] * 3)
    moe = NativeMoe(moe_kernel, kernel, gate_up, down)
    x, weights = torch.randn(2, 16, generator=g), torch.full((2, 2), 0.5)
    act = lambda gu: gu[:, :12] * gu[:, 12:]                                   # noqa: E731
    assert moe(x, weights, torch.tensor([[0, 2], [1, 2]]), act).shape == (2, 16)
    with pytest.raises(ValueError, match="expert id"):
        moe(x, weights, torch.tensor([[0, 3], [1, 2]]), act)
    with pytest.raises(ValueError, match="expert id"):
        moe(x, weights, torch.tensor([[0, -1], [1, 2]]), act)
    with pytest.raises(ValueError, match="weights"):
        moe(x, weights.double(), torch.tensor([[0, 2], [1, 2]]), act)
    with pytest.raises(ValueError, match="activation"):
        moe(x, weights, torch.tensor([[0, 2], [1, 2]]), lambda gu: gu)
    with pytest.raises(ValueError, match="SwiGLU"):
        NativeMoe(moe_kernel, kernel, gate_up, gate_up)
