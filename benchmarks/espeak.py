"""Real speech for tests and benchmarks: espeak-ng (apt) sentences as 24 kHz float32, with where
the speech in them is (the truth a speech detector is measured against)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

from omnistage.media.audio import decode_audio

RATE = 24000
SENTENCES = [
    "Hello there, how are you doing today?",
    "Could you tell me what the weather will be like tomorrow morning?",
    "I would like to book a table for two people at seven.",
    "Please remind me to call my sister after lunch.",
    "What is the capital city of France?",
    "The quick brown fox jumps over the lazy dog.",
]


@dataclass
class Speech:
    audio: np.ndarray        # (N,) float32 at RATE, silence before and after included
    onset: int               # first sample of speech
    end: int                 # one past the last sample of speech


def espeak(text: str, words_per_minute: int = 160, voice: str = "en") -> Speech:
    """One utterance from espeak-ng; onset and end are where its signal is audible (10 ms
    frames over -50 dBFS), espeak's own leading and trailing silence excluded."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng); the speech "
                           "tests and the realtime benchmark need it")
    wav = subprocess.run([exe, "--stdout", "-s", str(words_per_minute), "-v", voice, text],
                         check=True, capture_output=True, timeout=60).stdout
    audio = decode_audio(wav, sample_rate=RATE).samples
    frame = RATE // 100
    n = audio.size // frame
    level = 10 * np.log10(np.mean(audio[:n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    loud = np.flatnonzero(level > -50)
    return Speech(audio, int(loud[0]) * frame, (int(loud[-1]) + 1) * frame)


def utterance(seconds: float, first: int = 0) -> Speech:
    """About `seconds` of speech: SENTENCES from `first` on, joined with 150 ms pauses (a
    speaker's breath, shorter than any turn-ending silence) and cut at a sentence's end."""
    parts, total = [], 0
    k = first
    while total < seconds * RATE or not parts:
        s = espeak(SENTENCES[k % len(SENTENCES)])
        piece = s.audio[s.onset:s.end]
        parts += [piece, np.zeros(int(0.15 * RATE), np.float32)]
        total += piece.size + int(0.15 * RATE)
        k += 1
    audio = np.concatenate(parts[:-1])
    return Speech(audio, 0, audio.size)


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
