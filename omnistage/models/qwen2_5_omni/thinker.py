"""The Qwen2.5-Omni thinker's language model: Qwen2 layers with multimodal RoPE, served by the
AR engine. Audio and vision features reach it as prompt embeddings (see the encoder stage);
its checkpoint tensors live under `thinker.model.*` and `thinker.lm_head.weight`."""

from __future__ import annotations

from omnistage.models.qwen2 import Qwen2Config, Qwen2ForCausalLM


class Qwen2_5OmniThinkerLM(Qwen2ForCausalLM):
    weight_prefix = "thinker."
    lm_head_name = "thinker.lm_head"

    @staticmethod
    def config_from_omni(cfg: dict) -> Qwen2Config:
        """The text model's config out of the whole model's config.json. Tying follows the
        thinker's own flag (as transformers' thinker does), not its text_config's."""
        th = cfg["thinker_config"]
        return Qwen2Config.from_hf({**th["text_config"],
                                    "tie_word_embeddings": th.get("tie_word_embeddings", False)})
