"""Speech to text with the served model itself: its thinker hears the audio and is asked for
the transcript (greedy unless asked otherwise). One path for /v1/audio/transcriptions and the
Realtime API's input audio transcription (whatever transcription model a client names: this
is what serves it)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from omnistage.engine_api import OutputOptions
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams

TRANSCRIBE = "Transcribe the speech in this audio into text. Reply with the transcript only."
MAX_TRANSCRIPT_TOKENS = 448       # Whisper's bound on one transcript


def transcription_messages(audio: np.ndarray, language: str | None = None,
                           prompt: str | None = None) -> list[dict]:
    """The chat that asks for the transcript of `audio` (float32 at the model's rate);
    `language` and `prompt` (earlier words, names, spellings) go into the ask."""
    ask = TRANSCRIBE + (f" The language is {language}." if language else "") + \
        (f" Context: {prompt}" if prompt else "")
    return [{"role": "user", "content": [{"type": "audio", "audio": audio},
                                         {"type": "text", "text": ask}]}]


def transcribe(engine, audio: np.ndarray, request_id: str, language: str | None = None,
               prompt: str | None = None, temperature: float = 0.0) -> AsyncIterator[Delta]:
    """The transcript's deltas (text only); leaving the iterator aborts the request."""
    return engine.generate(transcription_messages(audio, language, prompt),
                           SamplingParams(temperature=temperature, max_tokens=MAX_TRANSCRIPT_TOKENS),
                           request_id=request_id,
                           output=OutputOptions(modalities=["text"], transcribe=True))
