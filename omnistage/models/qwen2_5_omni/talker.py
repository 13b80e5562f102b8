"""The Qwen2.5-Omni talker: a Qwen2-style decoder with multimodal RoPE that reads the
thinker's embeddings + hidden states and emits audio codec tokens.

Input at each position is a vector in the thinker's width (`embedding_size`): the codec
token's embedding plus the thinker's contribution for that position (prompt embeddings
replace it; the reply stream is added through the sequence's embed feed). It is projected to
the talker's own width before the layers. Checkpoint tensors: `talker.model.*`,
`talker.thinker_to_talker_proj.*`, `talker.codec_head.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.layers.attention import AttentionMetadata, KVCache
from omnistage.layers.linear import TransposedLinear
from omnistage.models.qwen2 import Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True)
class TalkerTokens:
    """Special ids of the talker's codec vocabulary and the thinker text ids it uses."""

    codec_bos: int      # first codec input, never sampled
    codec_eos: int
    codec_pad: int
    codec_mask: int     # placeholder id standing at every prompt position
    text_bos: int       # thinker ids whose embeddings frame the reply stream
    text_eos: int
    text_pad: int

    @property
    def stop_ids(self) -> list[int]:
        """transformers stops the talker on [codec_pad, codec_eos] (8292, 8294 for the real model)."""
        return [self.codec_pad, self.codec_eos]

    @classmethod
    def from_talker_config(cls, t: dict) -> "TalkerTokens":
        return cls(codec_bos=t["tts_codec_start_token_id"], codec_eos=t["tts_codec_end_token_id"],
                   codec_pad=t["tts_codec_pad_token_id"], codec_mask=t["tts_codec_mask_token_id"],
                   text_bos=t["tts_text_start_token_id"], text_eos=t["tts_text_end_token_id"],
                   text_pad=t["tts_text_pad_token_id"])


@dataclass
class TalkerConfig(Qwen2Config):
    embedding_size: int = 0   # the thinker's hidden size: width of the talker's inputs

    @classmethod
    def from_omni(cls, cfg: dict) -> "TalkerConfig":
        t = cfg["talker_config"]
        base = Qwen2Config.from_hf({**t, "tie_word_embeddings": False})
        return cls(**{**base.__dict__, "embedding_size": t["embedding_size"]})


class Qwen2_5OmniTalkerLM(Qwen2ForCausalLM):
    weight_prefix = "talker."
    lm_head_name = "talker.codec_head"

    def __init__(self, c: TalkerConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(c, dtype, device)
        # Codec embeddings live in the thinker's width; the projection maps to the talker's.
        self.embed_tokens = nn.Parameter(
            torch.empty(c.vocab_size, c.embedding_size, dtype=dtype, device="meta"), requires_grad=False)
        self.proj = TransposedLinear(c.embedding_size, [c.hidden_size], bias=True, dtype=dtype)

    @property
    def input_size(self) -> int:
        return self.config.embedding_size

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                caches: list[KVCache], meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, embedding_size) inputs -> final-normed hidden states (see Qwen2ForCausalLM)."""
        return super().forward(self.proj(inputs_embeds), positions, caches, meta, out_rows)

    def load_weights(self, weights) -> set[str]:
        loaded: set[str] = set()
        rest = []
        for name, w in weights:
            if name.startswith("talker.thinker_to_talker_proj."):
                if name.endswith(".weight"):
                    self.proj.load_weight(w)
                    loaded.add("proj.weight_t#0")
                else:
                    self.proj.load_bias(w)
                    loaded.add("proj.bias#0")
            else:
                rest.append((name, w))
        return loaded | super().load_weights(rest)

    def expected_loads(self) -> set[str]:
        return super().expected_loads() | {"proj.weight_t#0", "proj.bias#0"}
