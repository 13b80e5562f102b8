"""The cascade's TTS stage: the reply's text in as the LLM writes it, speech out sentence by
sentence.

A sentence is spoken as soon as it is complete (it ends in . ! ? or a line break followed by
more text, or the reply ended), so the first audio follows the first sentence, not the whole
reply. The TTS program's rate (espeak-ng 22.05 kHz, flite 16 kHz) is resampled to the
engine's 24 kHz. One sentence of one request per step, the request that waited longest first."""

from __future__ import annotations

import logging
import re
import unicodedata
from dataclasses import dataclass

import torch

from omnistage.media.audio import resample
from omnistage.models.cascade.messages import SpeakText
from omnistage.models.qwen2_5_omni.messages import AudioChunk
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage

log = logging.getLogger(__name__)
SAMPLE_RATE = 24000
# a sentence end: terminal punctuation (closing quotes / brackets kept with it) and a space,
# or a line break
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n+")


@dataclass
class _Reply:
    voice: str
    text: str = ""
    finished: bool = False
    done: bool = False


def speakable(text: str) -> str:
    """The text a TTS program is given: control characters dropped (a NUL cannot even be
    passed as an argument; a model's reply may hold any character), spaces trimmed."""
    return "".join(c for c in text if c in "\n\t" or unicodedata.category(c)[0] != "C").strip()


def next_sentence(text: str, finished: bool) -> tuple[str, str] | None:
    """(the first complete sentence, the rest), or None while it is incomplete."""
    m = _SENTENCE_END.search(text)
    if m is not None:
        return text[:m.end()], text[m.end():]
    return (text, "") if finished else None


class TTSStage(Stage):
    def __init__(self, name: str, tts, default_voice: str):
        """`tts`: an EspeakTTS / FliteTTS (speech_tools.py)."""
        self.name, self.tts, self.default_voice = name, tts, default_voice
        self.dead: str | None = None
        self._replies: dict[str, _Reply] = {}

    def add(self, message: SpeakText) -> None:
        r = self._replies.setdefault(message.request_id, _Reply(message.voice or self.default_voice))
        r.text += message.text
        r.finished = r.finished or message.finished

    def _ready(self) -> str | None:
        for rid, r in self._replies.items():          # insertion order: oldest first
            if next_sentence(r.text, r.finished) is not None:
                return rid
        return None

    def step(self) -> list[StageOutput]:
        rid = self._ready()
        if rid is None:
            return []
        r = self._replies[rid]
        sentence, r.text = next_sentence(r.text, r.finished)
        samples = torch.zeros(0)
        words = speakable(sentence)
        if words:
            try:
                speech = self.tts.speak(words, r.voice)
            except Exception as e:     # whatever the program did: this request only, never the engine
                log.exception("tts: request %s failed", rid)
                del self._replies[rid]
                return [StageOutput(self.name, rid, StageFailure(rid, f"the TTS failed: {e}"), final=True)]
            samples = torch.from_numpy(resample(speech.samples, speech.sample_rate, SAMPLE_RATE))
        last = r.finished and not r.text
        if last:
            del self._replies[rid]
        return [StageOutput(self.name, rid, AudioChunk(rid, samples, SAMPLE_RATE, last), final=last)]

    def abort(self, request_id: str) -> None:
        self._replies.pop(request_id, None)

    def has_work(self) -> bool:
        return self._ready() is not None

    def num_requests(self) -> int:
        return len(self._replies)

    def close(self) -> None:
        """Nothing outside this process to release."""
