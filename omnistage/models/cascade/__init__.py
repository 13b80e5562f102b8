"""The cascade baseline: ASR -> LLM -> TTS as a graph of stages (pocketsphinx, our AR engine on
any local text model, espeak-ng or flite)."""
