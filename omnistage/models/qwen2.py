"""Qwen2ForCausalLM (and Qwen2.5 text models) over paged KV caches.

Reads HF checkpoints by name: model.layers.{i}.self_attn.{q,k,v}_proj -> one merged q|k|v
projection, mlp.{gate,up}_proj -> one merged gate|up projection, all stored transposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from omnistage.kernels.decoder_stack import DenseLayer, NativeDecoderStack, Product
from omnistage.kernels.paged_attention import PagedAttentionKernel
from omnistage.layers.attention import AttentionMetadata, KVCache, attend_projections
from omnistage.layers.linear import TransposedLinear
from omnistage.layers.mlp import SwiGLU
from omnistage.layers.norm import RMSNorm
from omnistage.models.paged_lm import PagedDecoderLM


@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    mrope_section: tuple[int, ...] | None = None   # multimodal RoPE sections (t, h, w)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen2Config":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported yet (only 'default')")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported yet")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            mrope_section=tuple(rope["mrope_section"]) if rope.get("mrope_section") else None,
        )


class Qwen2Attention(nn.Module):
    def __init__(self, c: Qwen2Config, dtype: torch.dtype):
        super().__init__()
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.d ** -0.5
        self.qkv = TransposedLinear(c.hidden_size, [self.hq * self.d, self.hkv * self.d,
                                                    self.hkv * self.d], bias=True, dtype=dtype)
        self.o = TransposedLinear(self.hq * self.d, [c.hidden_size], bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or (R, hidden) for the rows `out_rows` only: every
        row's K and V still enter the cache."""
        qkv = self.qkv(x)                                   # (T, (Hq + 2 Hkv) D)
        o = attend_projections(qkv, cos_sin, cache, meta, self.hq, self.scale)   # (T, Hq D)
        return self.o(o if out_rows is None else o[out_rows])


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c: Qwen2Config, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Qwen2Attention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype)

    def forward(self, h, cos_sin, cache, meta, out_rows: torch.Tensor | None = None):
        a = self.self_attn(self.input_layernorm(h), cos_sin, cache, meta, out_rows)
        h = (h if out_rows is None else h[out_rows]) + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2ForCausalLM(PagedDecoderLM):
    config_class = Qwen2Config

    def __init__(self, c: Qwen2Config, dtype: torch.dtype, device: torch.device):
        super().__init__(c, nn.ModuleList(Qwen2DecoderLayer(c, dtype) for _ in range(c.num_hidden_layers)),
                         dtype, device)
        # The layers as one native call per step, once bound (use_native_stack).
        self.native_stack: NativeDecoderStack | None = None
        self._stack_caches: list[KVCache] | None = None

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                caches: list[KVCache], meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) input embeddings -> (T, hidden) final-normed hidden states, or only
        those of `out_rows` (R,): the last layer then runs its output projection and MLP
        for those rows alone (the rest of a prompt chunk only fills the KV cache)."""
        h = inputs_embeds
        cos_sin = self.rope.lookup(positions, h.dtype)
        if self.native_stack is not None and meta.native is not None:
            assert caches is self._stack_caches
            return self.native_stack(h, *cos_sin, meta.slot_mapping, meta.native, out_rows)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, cos_sin, cache, meta, out_rows if i == last else None)
        return self.norm(h)

    def use_native_stack(self, attention: PagedAttentionKernel, caches: list[KVCache]) -> bool:
        layers = list(self.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv, layer.self_attn.o,
                                                  layer.mlp.gate_up, layer.mlp.down)]
        if any(m.native is None for m in linears) or len(caches) != len(layers):
            return False

        def product(m: TransposedLinear) -> Product:
            return Product(m.panels, m.bias)

        dense = [DenseLayer(x.input_layernorm.weight, x.post_attention_layernorm.weight, cache.kv,
                            product(x.self_attn.qkv), product(x.self_attn.o),
                            product(x.mlp.gate_up), product(x.mlp.down))
                 for x, cache in zip(layers, caches)]
        eps = layers[0].input_layernorm.eps
        norms = [self.norm, *(n for x in layers for n in (x.input_layernorm, x.post_attention_layernorm))]
        if any(n.eps != eps for n in norms):
            return False                                  # the C stack takes one epsilon
        self.native_stack = NativeDecoderStack(linears[0].native, attention, dense, eps,
                                               layers[0].self_attn.scale, self.norm.weight)
        self._stack_caches = caches
        return True

    # ---- loading --------------------------------------------------------------------------
    _SHARDS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
               "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
               "down_proj": ("down", 0)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; returns the names of our parameters that were filled."""
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        for name, w in weights:
            name = self._local_name(name)
            if name == "model.embed_tokens.weight":
                self._copy(self.embed_tokens, w)
                loaded.add("embed_tokens")
                if self.config.tie_word_embeddings:
                    self.lm_head.load_weight(w)
                    loaded.add("lm_head.weight_t")
            elif name == "lm_head.weight":
                self.lm_head.load_weight(w)
                loaded.add("lm_head.weight_t")
            elif name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in self._SHARDS:
                # e.g. "model.layers.3.self_attn", "q_proj", "weight"
                prefix, proj, kind = name.rsplit(".", 2)
                ours, shard = self._SHARDS[proj]
                path = f"{prefix[len('model.'):]}.{ours}"
                linear = self.get_submodule(path)
                if kind == "weight":
                    linear.load_weight(w, shard)
                    loaded.add(f"{path}.weight_t#{shard}")
                else:
                    linear.load_bias(w, shard)
                    loaded.add(f"{path}.bias#{shard}")
            elif name.startswith("model.") and name[len("model."):] in params:
                self._copy(params[name[len("model."):]], w)
                loaded.add(name[len("model."):])
            else:
                raise KeyError(name)
        return loaded

    def expected_loads(self) -> set[str]:
        """What load_weights must fill for the model to be complete."""
        out = {"embed_tokens", "lm_head.weight_t", "norm.weight"}
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}"
            out |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
                    f"{p}.self_attn.o.weight_t#0", f"{p}.mlp.down.weight_t#0"}
            out |= {f"{p}.self_attn.qkv.{k}#{s}" for k in ("weight_t", "bias") for s in range(3)}
            out |= {f"{p}.mlp.gate_up.weight_t#{s}" for s in range(2)}
        return out
