"""Qwen3-Omni's code predictor: the small dense decoder that, for each frame the talker starts
with codebook 0, predicts the frame's other G - 1 codebooks (G = num_code_groups, 16).

One frame, as transformers' talker does it (prepare_inputs_for_generation): a fresh sequence
of two input vectors, [the talker's final-normed hidden state at the position that sampled
code 0, the talker's codec embedding of code 0], then G - 2 more inputs, one per predicted code:
code j (j = 1..G-1) comes from lm_head[j - 1] at the sequence's last position, and its input
embedding is codec_embedding[j - 1](code j). The frame's residual embedding, which the talker
adds into its next input, is the sum of codec_embedding[j - 1](code j) over j = 1..G-1.

Here every frame of a step, across requests, runs as one batch: B frames of the same length
share every product (G - 1 forwards of a (B, 1 or 2, H) batch with a dense KV cache of G
positions per frame), instead of one `generate()` of G - 1 small forwards per frame.

Checkpoint names: `talker.code_predictor.model.{layers.N.*, norm.weight, codec_embedding.J.weight}`,
`talker.code_predictor.lm_head.J.weight` (the module's own state names under that prefix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.rotary import RotaryEmbedding
from omnistage.layers.weights import load_prefixed, materialize, meta_embedding, require_complete
from omnistage.models.qwen3_omni.predictor_stack import PredictorStack

CHECKPOINT_PREFIX = "talker.code_predictor."


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, c: dict, dtype, device):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.hq, self.hkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        kw = {"bias": c.get("attention_bias", False), "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(h, self.hq * d, **kw)
        self.k_proj = nn.Linear(h, self.hkv * d, **kw)
        self.v_proj = nn.Linear(h, self.hkv * d, **kw)
        self.o_proj = nn.Linear(self.hq * d, h, **kw)
        self.q_norm = _Norm(d, c["rms_norm_eps"], dtype, device)
        self.k_norm = _Norm(d, c["rms_norm_eps"], dtype, device)

    def fuse(self) -> None:
        """After loading: q|k|v as one product, and both head norms as one (their weights
        stacked per head): fewer, larger calls, the same arithmetic per element."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        self.qkv = _stacked([q, k, v])
        self.eps = self.q_norm.eps
        self.q_weight, self.k_weight = self.q_norm.weight.detach(), self.k_norm.weight.detach()   # (D,)
        self.register_buffer("qk_weight", torch.cat([self.q_norm.weight.expand(self.hq, -1),
                                                     self.k_norm.weight.expand(self.hkv, -1)]), persistent=False)
        del self.q_proj, self.k_proj, self.v_proj, self.q_norm, self.k_norm

    def forward(self, x, cos_sin, kv: torch.Tensor, at: int) -> torch.Tensor:
        """x (B, n, H) at positions at..at+n-1; kv (2, B, Hkv, G, D) the frame's cache."""
        b, n, _ = x.shape
        hq, hkv, d = self.hq, self.hkv, self.d
        qkv = self.qkv(x)                                                 # (B, n, (Hq + 2 Hkv) D)
        qk = F.rms_norm(qkv[..., :(hq + hkv) * d].view(b, n, hq + hkv, d), (d,), None, self.eps)
        qk = RotaryEmbedding.apply(qk * self.qk_weight, cos_sin)          # (B, n, Hq + Hkv, D)
        kv[0, :, :, at:at + n] = qk[:, :, hq:].transpose(1, 2)
        kv[1, :, :, at:at + n] = qkv[..., (hq + hkv) * d:].view(b, n, hkv, d).transpose(1, 2)
        keys, values = kv[0, :, :, :at + n], kv[1, :, :, :at + n]          # (B, Hkv, L, D)
        o = F.scaled_dot_product_attention(qk[:, :, :hq].transpose(1, 2), keys, values, is_causal=n > 1,
                                           enable_gqa=hq != hkv, scale=d ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, hq * d))


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given ones' outputs side by side."""
    w = torch.cat([m.weight for m in linears])
    out = nn.Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, dtype=w.dtype, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return out


class _Layer(nn.Module):
    def __init__(self, c: dict, dtype, device):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.input_layernorm = _Norm(h, c["rms_norm_eps"], dtype, device)
        self.self_attn = _Attention(c, dtype, device)
        self.post_attention_layernorm = _Norm(h, c["rms_norm_eps"], dtype, device)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.mlp.up_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.mlp.down_proj = nn.Linear(i, h, bias=False, dtype=dtype, device=device)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.gate_up = _stacked([self.mlp.gate_proj, self.mlp.up_proj])
        del self.mlp.gate_proj, self.mlp.up_proj

    def forward(self, x, cos_sin, kv, at: int) -> torch.Tensor:
        x = x + self.self_attn(_rms(x, self.input_layernorm), cos_sin, kv, at)
        gate, up = self.mlp.gate_up(_rms(x, self.post_attention_layernorm)).chunk(2, dim=-1)
        return x + self.mlp.down_proj(F.silu(gate) * up)


class CodePredictor(nn.Module):
    def __init__(self, c: dict, dtype: torch.dtype, device: torch.device | str):
        """`c`: config.json's talker_config.code_predictor_config."""
        super().__init__()
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"code predictor hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
        h, groups, v = c["hidden_size"], c["num_code_groups"], c["vocab_size"]
        self.num_code_groups, self.vocab_size = groups, v
        meta = torch.device("meta")            # built empty: the checkpoint fills every tensor
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer(c, dtype, meta) for _ in range(c["num_hidden_layers"]))
        self.model.norm = _Norm(h, c["rms_norm_eps"], dtype, meta)
        self.model.codec_embedding = nn.ModuleList(
            meta_embedding(v, h, dtype) for _ in range(groups - 1))
        self.lm_head = nn.ModuleList(nn.Linear(h, v, bias=False, dtype=dtype, device=meta)
                                     for _ in range(groups - 1))
        materialize(self, device)
        self.requires_grad_(False)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        self.rope = RotaryEmbedding(c["head_dim"], groups + 1, rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                                    device)
        self.attention_shape = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        self.native: PredictorStack | None = None     # use_native_stack

    def load_weights(self, weights) -> None:
        """Fill every tensor from `talker.code_predictor.*` (CheckpointError if one is missing or
        misfits), then fuse each layer's products (see _Attention.fuse)."""
        require_complete(self, load_prefixed(self, weights, CHECKPOINT_PREFIX), "talker.code_predictor")
        for layer in self.model.layers:
            layer.fuse()

    def use_native_stack(self, rows: int = 1) -> bool:
        """After the products moved to the native kernel (layers.linear.native_linears_for):
        run each codebook pass's layers as one native call (predictor_stack.py), where the
        attention kernels take this shape, with caches for `rows` frames at once to start with
        (grown when a step has more); returns whether it does."""
        layers = self.model.layers
        eps = {layer.input_layernorm.eps for layer in layers} | {self.model.norm.eps}
        eps |= {layer.post_attention_layernorm.eps for layer in layers} | {layer.self_attn.eps for layer in layers}
        if len(eps) != 1 or not PredictorStack.serves(layers, self.attention_shape, self.num_code_groups):
            return False
        self.native = PredictorStack(layers, self.model.norm.weight.detach(), eps.pop(), self.rope,
                                     self.attention_shape, self.num_code_groups, rows)
        return True

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor, code0_embed: torch.Tensor,
                pick: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per row. hidden, code0_embed: (B, H); `pick(logits (B, V) float32, j)`
        chooses code j (B,) for every row. -> (codes (B, G - 1), residual embedding (B, H))."""
        b, groups = hidden.shape[0], self.num_code_groups
        x = torch.stack([hidden, code0_embed], dim=1)                 # (B, 2, H)
        run = self.native.run if self.native is not None else self._torch_pass(b, hidden)
        codes, embeds = [], []
        for j in range(1, groups):
            out = run(x, j)                                           # (B, H) final-normed, last position
            code = pick(self.lm_head[j - 1](out).float(), j)          # logits (B, V)
            codes.append(code)
            x = self.model.codec_embedding[j - 1](code)               # (B, H)
            embeds.append(x)
        # Summed as the reference sums a frame's embeddings: stacked in codebook order
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(1)

    def _torch_pass(self, b: int, like: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The per-op path's pass j over dense caches of the frames, (2, B, Hkv, G, D) per layer."""
        _, kv_heads, head_dim = self.attention_shape
        kv = [like.new_empty(2, b, kv_heads, self.num_code_groups, head_dim)
              for _ in self.model.layers]

        def run(x: torch.Tensor, j: int) -> torch.Tensor:
            x = x if j == 1 else x.unsqueeze(1)                       # (B, n, H)
            at = 0 if j == 1 else j
            positions = torch.arange(at, at + x.shape[1], device=x.device)
            cos_sin = tuple(t.unsqueeze(0) for t in self.rope.lookup(positions, x.dtype))
            for layer, cache in zip(self.model.layers, kv):
                x = layer(x, cos_sin, cache, at)
            return _rms(x[:, -1], self.model.norm)
        return run
