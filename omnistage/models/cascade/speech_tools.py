"""The cascade's offline speech tools: pocketsphinx hears (16 kHz), espeak-ng or flite speak.

Each is a small object with one call; a missing package or program is a clear error naming
what to install, raised when the cascade is built (not at the first request)."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnistage.errors import InvalidRequestError

ASR_RATE = 16000
TTS_TIMEOUT_S = 60            # one sentence; espeak-ng speaks ~150x real time here
# en-us+f2 first: of espeak-ng's voices, the one pocketsphinx hears best (a cascade that hears
# its own answers back, as the tests do, needs intelligible speech)
ESPEAK_VOICES = ("en-us+f2", "en-us", "en-gb", "en-us+m3")
FLITE_VOICES = ("slt", "rms", "awb", "kal")


class MissingSpeechTool(InvalidRequestError):
    """A cascade part whose package or program is not installed."""


class Listener:
    """One utterance heard as it arrives: `feed` the samples in order (decoded at once), then
    `finish` for the words. `fed` and `matches` say which audio it has heard."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.restart()

    def restart(self) -> None:
        self._decoder.start_utt()
        self.fed, self._hash = 0, hashlib.blake2b(digest_size=16)

    def matches(self, samples: np.ndarray) -> bool:
        """Whether `samples` begins with exactly what this listener has heard."""
        return self.fed <= samples.size and self._hash.digest() == \
            hashlib.blake2b(samples[:self.fed].tobytes(), digest_size=16).digest()

    def feed(self, samples: np.ndarray) -> None:
        self._decoder.process_raw(pcm16(samples), full_utt=False)
        self._hash.update(samples.tobytes())
        self.fed += samples.size

    def finish(self) -> str:
        self._decoder.end_utt()
        return heard_words(self._decoder)


class PocketsphinxASR:
    """Speech (float32 mono at 16 kHz) -> lower-case words, with pocketsphinx's US English
    model (shipped inside its wheel). Used by one thread (the ASR stage's)."""

    name = "pocketsphinx"

    def __init__(self):
        try:
            from pocketsphinx import Decoder
        except ImportError as e:
            raise MissingSpeechTool("the cascade's ASR needs pocketsphinx: pip install pocketsphinx",
                                    param="model") from e
        self._new_decoder = lambda: Decoder(samprate=ASR_RATE, loglevel="FATAL")
        self._decoder = self._new_decoder()

    def recognize(self, samples: np.ndarray) -> str:
        """A whole utterance at once."""
        d = self._decoder
        d.start_utt()
        d.process_raw(pcm16(samples), full_utt=True)
        d.end_utt()
        return heard_words(d)

    def listener(self) -> Listener:
        """A decoder of its own for one utterance heard as it arrives (~0.5 s to load)."""
        return Listener(self._new_decoder())


def heard_words(decoder) -> str:
    """A pocketsphinx decoder's words for the utterance it ended ("" when it heard none)."""
    hyp = decoder.hyp()
    return hyp.hypstr.strip() if hyp is not None else ""


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype(np.int16).tobytes()


@dataclass(frozen=True)
class Speech:
    samples: np.ndarray          # float32 mono in [-1, 1]
    sample_rate: int


class _ProgramTTS:
    program: str
    voices: tuple[str, ...]
    package: str

    def __init__(self):
        path = shutil.which(self.program)
        if path is None:
            raise MissingSpeechTool(f"the cascade's TTS {self.name!r} needs the {self.program} program: "
                                    f"apt-get install {self.package}", param="model")
        self._path = path

    def check_voice(self, voice: str) -> str:
        if voice not in self.voices:
            raise InvalidRequestError(f"unknown voice {voice!r}; choose one of {list(self.voices)}",
                                      param="voice")
        return voice

    def _run(self, args: list[str], text: str | None = None) -> bytes:
        try:
            done = subprocess.run([self._path, *args], input=text.encode() if text is not None else None,
                                  capture_output=True, timeout=TTS_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{self.program} took over {TTS_TIMEOUT_S} s for one sentence") from e
        if done.returncode != 0:
            raise RuntimeError(f"{self.program} failed ({done.returncode}): {done.stderr.decode()[-300:]}")
        return done.stdout


class EspeakTTS(_ProgramTTS):
    """espeak-ng: formant synthesis, 22.05 kHz. The text goes in on stdin (never as an
    argument: a sentence starting with '-' is not an option)."""

    name, program, package, voices = "espeak", "espeak-ng", "espeak-ng", ESPEAK_VOICES

    def speak(self, text: str, voice: str) -> Speech:
        return _wav(self._run(["--stdout", "-v", self.check_voice(voice)], text))


class FliteTTS(_ProgramTTS):
    """flite: diphone / cluster-unit synthesis, 16 kHz for its built-in voices. It writes a
    WAV file (a seekable header), so each sentence goes through a private temporary file."""

    name, program, package, voices = "flite", "flite", "flite", FLITE_VOICES

    def speak(self, text: str, voice: str) -> Speech:
        with tempfile.TemporaryDirectory(prefix="omnistage-flite-") as d:
            out = Path(d) / "speech.wav"
            self._run(["-voice", self.check_voice(voice), "-t", text, "-o", str(out)])
            return _wav(out.read_bytes())


def _wav(data: bytes) -> Speech:
    """16-bit PCM WAV bytes -> float32 mono."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2:
            raise RuntimeError(f"the TTS wrote {8 * w.getsampwidth()}-bit audio, not 16-bit")
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).reshape(-1, w.getnchannels())
        return Speech(pcm.mean(axis=1).astype(np.float32) / 32768.0, w.getframerate())


ASR_TOOLS = {"pocketsphinx": PocketsphinxASR}
TTS_TOOLS = {"espeak": EspeakTTS, "flite": FliteTTS}
