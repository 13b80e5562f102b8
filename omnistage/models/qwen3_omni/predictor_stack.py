"""The code predictor's layers as one native call per codebook (kernels/decoder_stack.c).

Why: a frame's 15 codebook passes through 3 small layers are ~900 tensor ops from Python,
20-30 us of dispatch each around microseconds of arithmetic; measured on the small checkpoint
(hidden 384) one frame took 19 ms, most of the talker's 23 ms step. The stack runs each pass's
layers, RMSNorms (the per-head q/k norms too), RoPE, attention and final norm in C.

The frames' caches as the stack reads them: a paged cache of one block per frame row
(BLOCK >= G positions: the frame's hidden state, code 0's embedding, then codes 1..G-2),
row b in block b. The first pass is one 2-token prefill chunk per row, each later pass one
decode per row. The caches grow with the largest batch seen and are reused: one predictor
serves one stage's steps, never two calls at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.kernels.decoder_stack import DenseLayer, NativeDecoderStack, Product
from omnistage.kernels.paged_attention import PagedAttentionKernel, unsupported_reason
from omnistage.layers.attention import NativeBatches
from omnistage.layers.linear import NativeLinear
from omnistage.layers.rotary import RotaryEmbedding

_I64 = torch.int64
MAX_PLANS = 64          # batch sizes whose index tensors are kept


class PredictorStack:
    """Bound to one predictor's fused layers (see code_predictor._Layer.fuse)."""

    def __init__(self, layers: Sequence, final_norm: torch.Tensor, eps: float, rope: RotaryEmbedding,
                 shape: tuple[int, int, int], positions: int, rows: int = 1):
        heads, self.kv_heads, self.head_dim = shape
        self.block = _block(positions)
        self.attention = PagedAttentionKernel(heads, self.kv_heads, self.head_dim, self.block)
        self.layers, self.final_norm, self.eps, self.rope = list(layers), final_norm, eps, rope
        self.groups = positions
        self.stack: NativeDecoderStack | None = None
        self.capacity = 0
        self._plans: dict[int, list[_Pass]] = {}
        # Bound now for `rows` frames: growing later builds a new stack (the library looked up
        # again, ~0.1 s) in the middle of a step, which the first busy moment would pay.
        self._bind(rows)

    @staticmethod
    def serves(layers: Sequence, shape: tuple[int, int, int], positions: int) -> bool:
        """Whether every product is on the native kernel and the attention kernels take the shape."""
        linears = [m for x in layers for m in (x.self_attn.qkv, x.self_attn.o_proj, x.mlp.gate_up, x.mlp.down_proj)]
        if not all(isinstance(m, NativeLinear) for m in linears):
            return False
        heads, kv_heads, head_dim = shape
        return unsupported_reason(torch.device("cpu"), torch.float32, torch.float32, heads, kv_heads,
                                  head_dim, _block(positions)) is None

    def _bind(self, rows: int) -> NativeDecoderStack:
        """The stack over caches for at least `rows` frames (grown by doubling, never shrunk)."""
        if rows > self.capacity:
            self.capacity = max(rows, 2 * self.capacity)
            dense = []
            for x in self.layers:
                a, mlp = x.self_attn, x.mlp
                kv = torch.zeros(2, self.kv_heads, self.capacity, self.block, self.head_dim)
                dense.append(DenseLayer(x.input_layernorm.weight, x.post_attention_layernorm.weight, kv,
                                        _product(a.qkv), _product(a.o_proj), _product(mlp.gate_up),
                                        _product(mlp.down_proj), a.q_weight, a.k_weight))
            kernel = self.layers[0].self_attn.qkv.kernel
            self.stack = NativeDecoderStack(kernel, self.attention, dense, self.eps, self.head_dim ** -0.5,
                                            self.final_norm)
        return self.stack

    def run(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Pass j (1..G-1) of B frames: x (B, 2, H) for j = 1 (positions 0, 1), else (B, H) at
        position j -> (B, H) the final-normed output at the pass's last position."""
        b = x.shape[0]
        stack = self._bind(b)
        p = self._passes(b)[j - 1]
        return stack(x.reshape(p.slots.shape[0], -1), p.cos, p.sin, p.slots, p.batches, p.out_rows)

    def _passes(self, b: int) -> list[_Pass]:
        """The index tensors of every pass of B frames, made once per B (a decode batch's size
        changes rarely: the same few are used step after step)."""
        plan = self._plans.get(b)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[b] = [self._pass(b, j) for j in range(1, self.groups)]
        return plan

    def _pass(self, b: int, j: int) -> _Pass:
        rows, empty = torch.arange(b, dtype=_I64), torch.zeros(0, dtype=_I64)
        if j == 1:          # one chunk of 2 tokens per frame: positions 0, 1
            positions = torch.arange(2, dtype=_I64).repeat(b)
            slots = rows.repeat_interleave(2) * self.block + positions
            two = torch.full((b,), 2, dtype=_I64)
            batches = NativeBatches(self.attention, empty, empty, rows.unsqueeze(1), rows * 2, two, two)
            out_rows = rows * 2 + 1
        else:               # one decode per frame at position j
            positions = torch.full((b,), j, dtype=_I64)
            slots = rows * self.block + j
            batches = NativeBatches(self.attention, rows.unsqueeze(1), torch.full((b,), j + 1, dtype=_I64),
                                    empty, empty, empty, empty)
            out_rows = None
        cos, sin = self.rope.lookup(positions, torch.float32)
        return _Pass(cos, sin, slots, batches, out_rows)


@dataclass(frozen=True)
class _Pass:
    cos: torch.Tensor                  # (T, 1, D) of the pass's rows (T = 2B for the first, else B)
    sin: torch.Tensor
    slots: torch.Tensor                # (T,) cache slots: frame b's block is b
    batches: NativeBatches
    out_rows: torch.Tensor | None      # the first pass keeps each frame's second row


def _block(positions: int) -> int:
    """One block holds a frame's positions; the kernels' blocks are multiples of 16."""
    return -(-positions // 16) * 16


def _product(m: NativeLinear) -> Product:
    return Product(m.panels, m.bias)
