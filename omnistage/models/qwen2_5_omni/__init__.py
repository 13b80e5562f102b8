"""Qwen2.5-Omni: audio and vision encoders, thinker and talker (served by the AR engine),
token2wav (DiT flow matching + BigVGAN), and the recipe that wires them as stages."""
