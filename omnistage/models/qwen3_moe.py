"""Qwen3-MoE decoders over paged KV caches: Qwen3MoeForCausalLM text models, and the thinker and
talker of Qwen3-Omni (subclasses in omnistage/models/qwen3_omni/).

A layer: RMSNorm -> attention (q|k|v merged; per-head RMSNorm on q and k before RoPE; no bias)
-> residual -> RMSNorm -> MoE MLP (omnistage.layers.moe; a shared expert where the config has
one) or a dense SwiGLU (mlp_only_layers / decoder_sparse_step) -> residual.

Reads HF checkpoints by name (experts one by one, as `save_pretrained` writes them):
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight,
    model.layers.{i}.mlp.gate.weight (router), mlp.experts.{e}.{gate,up,down}_proj.weight,
    mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight,
    model.layers.{i}.mlp.{gate,up,down}_proj.weight (dense layers), *_layernorm.weight,
    model.embed_tokens.weight, model.norm.weight, lm_head.weight
under the subclass's `weight_prefix`; `embed_name` / `lm_head_name` rename the two tables.

Forward extras a subclass switches on (both off for text models):
- `export_layer` k: the output of decoder layer k - 1 (k = 0: the input embeddings; k = L: the
  final-normed state) is what the engine hands out as the positions' hidden states, instead
  of the final state; it is taken before any DeepStack addition to that layer's output (the
  reference's recorded hidden states are the layers' own outputs).
- DeepStack: `deepstack` (rows (V,) of the flat batch, (K, V, hidden) vectors) are added to
  those rows after each of the first K layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from omnistage.layers.attention import AttentionMetadata, KVCache, attend_projections
from omnistage.layers.linear import TransposedLinear
from omnistage.layers.mlp import SwiGLU
from omnistage.layers.moe import MoeMLP, MoeShape
from omnistage.layers.norm import RMSNorm
from omnistage.llm.model_output import LMOutput
from omnistage.models.paged_lm import PagedDecoderLM


@dataclass
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    intermediate_size: int                      # dense layers' MLP width
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0    # 0: no shared expert
    attention_bias: bool = False
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @classmethod
    def from_hf(cls, cfg: dict, *, shared_expert: bool = False, interleaved: bool | None = None) -> "Qwen3MoeConfig":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported yet (only 'default')")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        heads = cfg["num_attention_heads"]
        section = tuple(rope["mrope_section"]) if rope.get("mrope_section") else None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_experts=cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"], norm_topk_prob=cfg.get("norm_topk_prob", True),
            intermediate_size=cfg.get("intermediate_size", 0),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"] if shared_expert else 0,
            attention_bias=cfg.get("attention_bias", False), mrope_section=section,
            mrope_interleaved=bool(rope.get("mrope_interleaved", rope.get("interleaved", False)))
            if interleaved is None else interleaved)

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class Qwen3Attention(nn.Module):
    def __init__(self, c: Qwen3MoeConfig, dtype: torch.dtype):
        super().__init__()
        self.hq, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.d ** -0.5
        self.qkv = TransposedLinear(c.hidden_size, [self.hq * self.d, self.hkv * self.d, self.hkv * self.d],
                                    bias=c.attention_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps, dtype)
        self.o = TransposedLinear(self.hq * self.d, [c.hidden_size], bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin, cache: KVCache, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden) (or the `out_rows` rows)."""
        qkv = self.qkv(x)                                   # (T, (Hq + 2 Hkv) D)
        t, q_end, k_end = qkv.shape[0], self.hq * self.d, (self.hq + self.hkv) * self.d
        # Per-head norms, written back into the fused row (attend_projections ropes q|k in place).
        kernel = self.q_norm.kernel      # native: both heads' norms in place, one eps for both
        if kernel is None or self.k_norm.eps != self.q_norm.eps or not kernel.head_norms(
                qkv, self.hq, self.hkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps):
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end].view(t, self.hq, self.d)).view(t, q_end)
            qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end].view(t, self.hkv, self.d)).view(t, k_end - q_end)
        o = attend_projections(qkv, cos_sin, cache, meta, self.hq, self.scale)
        return self.o(o if out_rows is None else o[out_rows])


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, c: Qwen3MoeConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Qwen3Attention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.is_sparse(layer):
            self.mlp = MoeMLP(MoeShape(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                       c.num_experts_per_tok, c.norm_topk_prob,
                                       c.shared_expert_intermediate_size), dtype)
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype)

    def forward(self, h, cos_sin, cache, meta, out_rows: torch.Tensor | None = None):
        a = self.self_attn(self.input_layernorm(h), cos_sin, cache, meta, out_rows)
        h = (h if out_rows is None else h[out_rows]) + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeForCausalLM(PagedDecoderLM):
    config_class = Qwen3MoeConfig
    embed_name = "model.embed_tokens"  # (after the prefix)
    export_layer: int | None = None    # see the module docstring

    def __init__(self, c: Qwen3MoeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(c, nn.ModuleList(Qwen3MoeDecoderLayer(c, i, dtype) for i in range(c.num_hidden_layers)),
                         dtype, device, c.mrope_interleaved)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | LMOutput:
        """(T, hidden) inputs -> (T, hidden) final-normed states (only `out_rows` rows when
        given: the last layer runs its projection and MLP for those alone), or, with an
        `export_layer`, LMOutput(final, exported (T, hidden))."""
        h = inputs_embeds
        cos_sin = self.rope.lookup(positions, h.dtype)
        exported = h if self.export_layer == 0 else None
        last = len(self.layers) - 1
        # DeepStack rows are added after the last layer too on a model as deep as its DeepStack:
        # then every row goes through it, and `out_rows` are picked at the end.
        late = out_rows is not None and deepstack is not None and deepstack[1].shape[0] > last
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, cos_sin, cache, meta, out_rows if i == last and not late else None)
            if self.export_layer == i + 1 and i < last:
                exported = h
            if deepstack is not None and i < deepstack[1].shape[0]:
                h = h.index_add(0, deepstack[0], deepstack[1][i].to(h.dtype))
        h = self.norm(h[out_rows] if late else h)
        if self.export_layer is None:
            return h
        return LMOutput(h, h if exported is None else exported)

    # ---- loading --------------------------------------------------------------------------
    _SHARDS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
               "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
    _RENAMES = {"q_norm": "q_norm", "k_norm": "k_norm", "gate": "router", "shared_expert_gate":
                "shared_expert_gate"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; returns our names of what was filled (`expected_loads`
        form: "path.weight_t#shard", "path.bias#shard", "path.weight")."""
        loaded: set[str] = set()
        for name, w in weights:
            local = self._local_name(name)
            if local == f"{self.embed_name}.weight":
                self._copy(self.embed_tokens, w)
                loaded.add("embed_tokens")
                if self.config.tie_word_embeddings:
                    self.lm_head.load_weight(w)
                    loaded.add("lm_head.weight_t#0")
            elif local == "lm_head.weight":
                self.lm_head.load_weight(w)
                loaded.add("lm_head.weight_t#0")
            elif local == "model.norm.weight":
                self._copy(self.norm.weight, w)
                loaded.add("norm.weight")
            elif local.startswith("model.layers."):
                loaded.add(self._load_layer_tensor(local[len("model."):], w))
            else:
                raise KeyError(name)
        return loaded

    def _load_layer_tensor(self, name: str, w: torch.Tensor) -> str:
        """`layers.3.self_attn.q_proj.weight` etc. -> the tensor copied in; returns its key."""
        path, kind = name.rsplit(".", 1)
        parent, _, leaf = path.rpartition(".")
        if leaf in self._SHARDS:
            ours, shard = self._SHARDS[leaf]
            target = self._submodule(f"{parent}.{ours}", name)
            if kind == "weight":
                target.load_weight(w, shard)
                return f"{parent}.{ours}.weight_t#{shard}"
            target.load_bias(w, shard)
            return f"{parent}.{ours}.bias#{shard}"
        if leaf in ("gate", "shared_expert_gate") and kind == "weight":
            self._submodule(f"{parent}.{self._RENAMES[leaf]}", name).load_weight(w)
            return f"{parent}.{self._RENAMES[leaf]}.weight_t#0"
        if kind == "weight" and (leaf.endswith("norm") or leaf.endswith("layernorm")):
            self._copy(self._submodule(path, name).weight, w)
            return f"{path}.weight"
        raise KeyError(name)

    def _submodule(self, path: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise KeyError(name) from None

    def expected_loads(self) -> set[str]:
        """Every shard of every TransposedLinear, every norm weight, the embedding."""
        out = {"embed_tokens"}
        for path, m in self.named_modules():
            if isinstance(m, TransposedLinear):
                out |= {f"{path}.weight_t#{s}" for s in range(len(m.shard_sizes))}
                if m.bias is not None:
                    out |= {f"{path}.bias#{s}" for s in range(len(m.shard_sizes))}
            elif isinstance(m, RMSNorm):
                out.add(f"{path}.weight")
        return out
