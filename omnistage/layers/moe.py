"""Mixture-of-experts MLP (Qwen2/Qwen3-MoE style): a softmax router picks the top-k experts
of each row; each expert is a SwiGLU MLP; an optional shared expert, scaled by a sigmoid gate,
is added for every row.

The work is grouped by expert, not by row: the rows of a step that chose expert e form one
(n_e, hidden) batch and go through e's two products once, so a step runs one gate|up and one
down product per *active* expert, whatever the number of rows (a decode step of B sequences
with top-k routing touches at most min(E, B * k) experts). The experts are TransposedLinear
layers, so they take whatever CPU kernel the engine packs its linears with; with the native
kernel a row's result does not depend on the other rows of its expert's batch, and the grouping,
the products and the weighted sums run as two native calls (kernels/moe.py) with the bits of
the tensor ops they stand for.

Summation order, kept equal to the reference's: a row's output starts at zero and receives its
experts' weighted outputs in ascending expert order, then (shared expert) + gate * shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.moe import MoeKernel, NativeMoe
from omnistage.layers.linear import TransposedLinear
from omnistage.layers.mlp import SwiGLU, swiglu_activation


@dataclass(frozen=True)
class MoeShape:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool            # renormalise the top-k probabilities to sum to 1
    shared_expert_size: int = 0     # 0: no shared expert


class MoeMLP(nn.Module):
    def __init__(self, s: MoeShape, dtype: torch.dtype):
        super().__init__()
        self.shape = s
        self.router = TransposedLinear(s.hidden_size, [s.num_experts], bias=False, dtype=dtype)
        self.experts = nn.ModuleList(SwiGLU(s.hidden_size, s.moe_intermediate_size, dtype)
                                     for _ in range(s.num_experts))
        self.shared_expert = (SwiGLU(s.hidden_size, s.shared_expert_size, dtype)
                              if s.shared_expert_size else None)
        self.shared_expert_gate = (TransposedLinear(s.hidden_size, [1], bias=False, dtype=dtype)
                                   if s.shared_expert_size else None)
        self.kernel: MoeKernel | None = None       # set by attach_kernel (runner_builder)
        self._native: NativeMoe | None = None      # use_native

    def _experts(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's SwiGLU over its contiguous slice of `grouped` (counts[e] rows, experts
        in order) -> (rows, H)."""
        outs, start = [], 0
        for e, n in enumerate(counts):          # each active expert on its contiguous slice
            if n:
                outs.append(self.experts[e](grouped[start:start + n]))
                start += n
        return torch.cat(outs)

    @property
    def runs_native(self) -> bool:
        """Whether the experts run as native calls (use_native took)."""
        return self._native is not None

    def use_native(self) -> bool:
        """Run the experts as native calls from now on (kernels/moe.py: the grouping, both
        products for every expert and the weighted sums, with SwiGLU's activation between),
        where `kernel` is set (attach_kernel) and every expert's products are on the native
        kernel; returns whether they do. Call after packing: a packed weight is never packed
        again (TransposedLinear refuses a second load), so the binding stays valid. Why: 8
        experts cost 16 kernel calls and ~15 small ops from Python per layer and step."""
        layers = [(e.gate_up, e.down) for e in self.experts]
        if self.kernel is None or any(m.native is None for pair in layers for m in pair):
            return False
        linear = layers[0][0].native
        self._native = NativeMoe(self.kernel, linear,
                                 linear.segments([g.panels for g, _ in layers], [g.bias for g, _ in layers]),
                                 linear.segments([d.panels for _, d in layers], [d.bias for _, d in layers]))
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (weights (T, k) in x's dtype, expert ids (T, k)), as the reference
        router: softmax in float32 over all experts, top-k, optional renormalisation."""
        probs = F.softmax(self.router(x).float(), dim=-1)                 # (T, E)
        weights, experts = torch.topk(probs, self.shape.top_k, dim=-1)    # (T, k)
        if self.shape.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H)."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        weights, experts = self.route(x)
        if self._native is not None and x.dtype == torch.float32:
            out = self._native(x, weights, experts, swiglu_activation)
        else:
            out = self._grouped(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts over x's rows grouped by expert, each row's weighted outputs summed
        (the native path's arithmetic as tensor ops) -> (T, H)."""
        t, k = experts.shape
        flat = experts.flatten()                                          # (T * k,) row-major
        order = torch.argsort(flat, stable=True)                          # grouped by expert
        counts = torch.bincount(flat, minlength=self.shape.num_experts).tolist()
        # index_select, not x[...]: the same gather at half the dispatch cost of advanced
        # indexing (three per layer and step; 8-16 rows of 384: 3-6 against 8-10 us each, quiet)
        grouped = x.index_select(0, order // k)                           # (T * k, H): one gather
        contrib = self._experts(grouped, counts) * weights.flatten().index_select(0, order).unsqueeze(1)
        # Back to (T, k) slots, each row's slots in ascending expert order, summed from zero in
        # that order: the same additions as adding each expert's batch into its rows in turn,
        # in k vectorized adds (index_add_ on CPU dispatches one add per row: ~20% of a prefill).
        # slot[flat slot] = its grouped row
        slot = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=order.device))
        ascending = experts.argsort(dim=1, stable=True)                   # (T, k)
        slot = slot.view(t, k).gather(1, ascending)                       # (T, k) grouped rows
        out = torch.zeros_like(x)
        for j in range(k):
            out += contrib.index_select(0, slot[:, j])
        return out
