"""Typed messages on the cascade's edges.

client -> asr: HearJob (the prompt's audio parts)      asr -> router: Transcripts
router -> llm: ARRequest (the chat, audio replaced by its transcript)
llm -> tts: SpeakText (the reply's text as it is written)   tts -> client: AudioChunk
"""

from __future__ import annotations

import msgspec
import torch

from omnistage.sampling_params import SamplingParams


class CascadeRequest(msgspec.Struct):
    """A request after preparation: the chat with each audio part's index in `audio`."""

    request_id: str
    messages: list[dict]                 # chat messages; an audio part is {"type": "audio_ref", "index": i}
    audio: list[torch.Tensor]            # float32 mono at 16 kHz, in order of appearance
    params: SamplingParams
    speak: bool                          # the reply is spoken too
    voice: str = ""
    tools: list[dict] | None = None      # function definitions for the chat template
    transcribe_only: bool = False        # the answer is the transcript itself (no LLM)
    prefill_only: bool = False           # a Realtime turn still being spoken (OutputOptions.prefill_only)


class HearJob(msgspec.Struct):
    request_id: str
    audio: list[torch.Tensor]            # float32 mono at 16 kHz
    # the last part is an utterance still arriving: hear what came so far and keep listening
    # (its transcript comes back empty); a later job with the whole part finishes it
    partial: bool = False


class Transcripts(msgspec.Struct):
    request_id: str
    texts: list[str]                     # one per audio part, lower-case words


class SpeakText(msgspec.Struct):
    """More of the reply for the TTS; `finished`: nothing follows (speak what is left)."""

    request_id: str
    text: str = ""
    voice: str = ""
    finished: bool = False
