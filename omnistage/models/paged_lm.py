"""What every decoder the AR engine serves shares: the embedding table, the decoder layers, the
final norm, the head, the RoPE tables, and the engine-facing interface (kv_shape, input_size,
embed, compute_logits) plus the name handling of checkpoint loading. A model file subclasses it
and writes its layers, forward and load_weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.paged_attention import PagedAttentionKernel
from omnistage.layers.attention import KVCache
from omnistage.layers.linear import TransposedLinear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding


class PagedDecoderLM(nn.Module):
    """Parameters start on the meta device; the loader materialises and fills them."""

    # Checkpoint names: "<weight_prefix>model.layers..." and "<lm_head_name>.weight".
    weight_prefix = ""
    lm_head_name = "lm_head"

    def __init__(self, c, layers: nn.ModuleList, dtype: torch.dtype, device: torch.device,
                 mrope_interleaved: bool = False):
        """`c` has vocab_size, hidden_size, num_hidden_layers, num_key_value_heads, head_dim,
        max_position_embeddings, rms_norm_eps, rope_theta, mrope_section."""
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, dtype=dtype, device="meta"), requires_grad=False)
        self.layers = layers
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        # Tied models keep a transposed copy of the embedding: the lm_head matmul is the
        # largest single read of a decode step and wants the fast layout.
        self.lm_head = TransposedLinear(c.hidden_size, [c.vocab_size], bias=False, dtype=dtype,
                                        output_head=True)
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, device,
                                    c.mrope_section, mrope_interleaved)
        # 3: positions are (3, T) multimodal RoPE rows (t, h, w); 1: plain (T,) positions.
        self.position_dims = 3 if c.mrope_section else 1

    def use_native_stack(self, attention: PagedAttentionKernel, caches: list[KVCache]) -> bool:
        """Run the decoder layers as one native call per step (kernels/decoder_stack.c) over
        `caches`, where this model's layers allow it and its linear layers are packed for the
        native kernel; returns whether it does. Models without such a stack keep their
        per-op forward."""
        return False

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache this model needs."""
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @property
    def input_size(self) -> int:
        """Width of the vectors forward() takes (prompt embeddings must match it)."""
        return self.config.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden)."""
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) float32."""
        return self.lm_head(hidden).float()

    def _local_name(self, name: str) -> str:
        """Checkpoint name -> the model's own name ("model.…" / "lm_head.weight"); names
        outside this model raise KeyError."""
        if name == f"{self.lm_head_name}.weight":
            return "lm_head.weight"
        if self.weight_prefix:
            if not name.startswith(self.weight_prefix):
                raise KeyError(name)
            return name[len(self.weight_prefix):]
        return name

    @staticmethod
    def _copy(param: torch.Tensor, w: torch.Tensor) -> None:
        if param.shape != w.shape:
            raise ValueError(f"shape {tuple(w.shape)} does not match the config's {tuple(param.shape)}")
        param.copy_(w)
