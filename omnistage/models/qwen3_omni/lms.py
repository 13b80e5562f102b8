"""Qwen3-Omni's two language models on the AR engine (omnistage.models.qwen3_moe):

- the thinker: `thinker.model.*`, `thinker.lm_head.weight`; interleaved multimodal RoPE. When
  the model speaks, the engine hands out the output of layer `talker_config.accept_hidden_layer`
  as its hidden states (the talker reads it at the prompt's audio/image/video positions);
- the talker: `talker.model.*` with a shared expert per MoE layer, `talker.model.codec_embedding`
  as its input embedding, `talker.codec_head` as its head (codebook 0 of each frame). Its inputs
  arrive as vectors in its own width (projected thinker vectors + codec embeddings; see
  talker_stage.py); the engine hands out its final-normed states (the code predictor's input).
"""

from __future__ import annotations

from omnistage.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM


class Qwen3OmniThinkerLM(Qwen3MoeForCausalLM):
    weight_prefix = "thinker."
    lm_head_name = "thinker.lm_head"

    @classmethod
    def config_from_omni(cls, cfg: dict) -> Qwen3MoeConfig:
        th = cfg["thinker_config"]
        # transformers' thinker applies interleaved mrope whatever the flags say
        return Qwen3MoeConfig.from_hf({**th["text_config"], "tie_word_embeddings": th.get("tie_word_embeddings", False)},
                                      interleaved=True)


class Qwen3OmniTalkerLM(Qwen3MoeForCausalLM):
    weight_prefix = "talker."
    embed_name = "model.codec_embedding"
    lm_head_name = "talker.codec_head"

    @classmethod
    def config_from_omni(cls, cfg: dict) -> Qwen3MoeConfig:
        text = cfg["talker_config"]["text_config"]
        return Qwen3MoeConfig.from_hf({**text, "tie_word_embeddings": False}, shared_expert=True, interleaved=True)
