"""Qwen3-Omni (Qwen3OmniMoeForConditionalGeneration): encoders, MoE thinker and talker with its
code predictor, the code2wav vocoder, and the stage graph that serves them."""
