"""Decode request audio to float32 mono at the model's rate.

The container is named from the data's leading bytes (`omnistage.media.container`) and must be
one of WAV, FLAC, MP3, Ogg (Vorbis, Opus), WebM/Matroska, M4A/MP4 (the audio track of a video
too) or AIFF; anything else is refused before any decoder sees it. Those libsndfile reads (WAV,
FLAC, Ogg, AIFF) go through soundfile; the rest, and what libsndfile cannot open, through FFmpeg
(PyAV) with that container's demuxer pinned: FFmpeg never probes request bytes, so its playlist
and list demuxers (hls, concat, ...), which open the files or URLs the data names, are never
used. Raw PCM16, what the OpenAI Realtime API sends (base64, 24 kHz), has its own entry point.

The duration limit is enforced while decoding: reading stops, and InvalidRequestError is
raised, as soon as one sample more than `max_seconds` has been decoded, so an hour-long upload
costs no more than `max_seconds` of decoding. Channels are averaged to mono (the convention of
librosa's `to_mono`, which HF processors rely on), then the mono signal is resampled with
libswresample's windowed-sinc filter.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import BinaryIO

import av
import numpy as np
import soundfile as sf

from omnistage.errors import InvalidRequestError
from omnistage.media.container import AUDIO_DEMUXERS, SNIFF_BYTES, open_pinned, reason, sniff

# The containers (FFmpeg demuxer names) libsndfile decodes; the rest goes to FFmpeg.
_SNDFILE_FORMATS = ("wav", "flac", "ogg", "aiff")
_FORMATS_HINT = "wav, flac, ogg/opus, mp3, m4a or webm"
_READ_BLOCK = 1 << 16          # frames per soundfile read
_RESAMPLE_BLOCK = 1 << 16      # samples per frame handed to libswresample

AudioSource = bytes | bytearray | memoryview | BinaryIO


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray        # (N,) float32 mono, nominally in [-1, 1]
    sample_rate: int           # Hz

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return len(self.samples) / self.sample_rate


def decode_audio(data: AudioSource, *, sample_rate: int = 16000, max_seconds: float | None = None,
                 param: str = "audio") -> DecodedAudio:
    """Decode an audio file's bytes (or a seekable binary file holding just the audio) to mono
    at `sample_rate`.

    Raises InvalidRequestError (with `param`) for empty, corrupt, unsupported or too long input.
    """
    _check_rate(sample_rate)
    src = _as_file(data)
    head = src.read(SNIFF_BYTES)
    src.seek(-len(head), io.SEEK_CUR)
    if not head:
        raise InvalidRequestError(f"{param} is empty; send the bytes of an audio file "
                                  f"({_FORMATS_HINT})", param=param)
    fmt = sniff(head)
    if fmt not in AUDIO_DEMUXERS:
        raise InvalidRequestError(f"{param} could not be decoded as audio (not a supported "
                                  f"container); send {_FORMATS_HINT} data", param=param)
    decoded = _read_sndfile(src, max_seconds, param) if fmt in _SNDFILE_FORMATS else None
    if decoded is None:
        decoded = _read_ffmpeg(src, fmt, max_seconds, param)
    mono, rate = decoded
    return _finish(mono, rate, sample_rate, param)


def decode_pcm16(data: bytes, *, input_rate: int = 24000, channels: int = 1,
                 sample_rate: int = 16000, max_seconds: float | None = None,
                 param: str = "audio") -> DecodedAudio:
    """Raw little-endian signed 16-bit PCM (interleaved if `channels` > 1) to mono at
    `sample_rate`. The OpenAI Realtime API's `pcm16` is 24 kHz mono."""
    _check_rate(input_rate)
    _check_rate(sample_rate)
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    frame_bytes = 2 * channels
    if not data:
        raise InvalidRequestError(f"{param} is empty; send pcm16 audio bytes", param=param)
    if len(data) % frame_bytes:
        raise InvalidRequestError(
            f"{param} has {len(data)} bytes, not a multiple of {frame_bytes} "
            f"(16-bit samples x {channels} channel(s)); send whole pcm16 samples", param=param)
    n = len(data) // frame_bytes
    # The length is known before any conversion: reject at once.
    _check_limit(n, input_rate, max_seconds, param)
    return _finish(pcm16_mono(data, channels), input_rate, sample_rate, param)


def pcm16_mono(data: bytes, channels: int = 1) -> np.ndarray:
    """Little-endian signed 16-bit PCM of whole frames -> mono float32 (N,) in [-1, 1), the
    channels averaged (what decode_pcm16 resamples; audio streamed in pieces converts each
    piece alike)."""
    pcm = np.frombuffer(data, dtype="<i2").reshape(-1, channels)         # (N, C)
    return (pcm.astype(np.float32).mean(axis=1) / 32768.0).astype(np.float32)


def decode_base64(text: str, *, param: str = "audio") -> bytes:
    """Strict base64 (as OpenAI's `input_audio.data` and Realtime `audio` fields carry)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{param} is not valid base64; send the audio bytes "
                                  "base64-encoded without line breaks or a data: prefix",
                                  param=param) from None


def resample(samples: np.ndarray, input_rate: int, output_rate: int) -> np.ndarray:
    """Resample mono float32 `samples` (N,) with libswresample's windowed-sinc filter.

    The output is time-aligned with the input (no filter delay) and has about
    N * output_rate / input_rate samples.
    """
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if input_rate == output_rate or len(samples) == 0:
        _check_rate(input_rate)
        _check_rate(output_rate)
        return samples
    stream = StreamResampler(input_rate, output_rate)
    out = [stream.feed(samples[s:s + _RESAMPLE_BLOCK])
           for s in range(0, len(samples), _RESAMPLE_BLOCK)]
    out.append(stream.drain())
    return np.concatenate(out)


class StreamResampler:
    """`resample` for a signal that arrives in pieces: the outputs of `feed`s (and a final
    `drain`) joined are exactly `resample` of the joined inputs, whatever the pieces. Output
    sample i is at input time i * input_rate / output_rate; `feed` answers what the filter can
    compute so far (it trails the input by a few samples: its half-length)."""

    def __init__(self, input_rate: int, output_rate: int):
        _check_rate(input_rate)
        _check_rate(output_rate)
        self.input_rate = input_rate
        self._av = av.AudioResampler(format="flt", layout="mono", rate=output_rate)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Mono float32 (N,) in; the output samples it completed (M,) out."""
        if len(samples) == 0:
            return np.zeros(0, np.float32)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples, dtype=np.float32)[None], format="flt", layout="mono")
        frame.sample_rate = self.input_rate
        return self._join(self._av.resample(frame))

    def drain(self) -> np.ndarray:
        """The filter's tail: the output samples still owed at the end of the signal."""
        return self._join(self._av.resample(None))

    @staticmethod
    def _join(frames) -> np.ndarray:
        out = [f.to_ndarray()[0] for f in frames]
        return np.concatenate(out) if out else np.zeros(0, np.float32)


# ---------------------------------------------------------------------------------------------

def _as_file(data: AudioSource) -> BinaryIO:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return io.BytesIO(data)
    if not data.seekable():
        raise ValueError("decode_audio needs bytes or a seekable binary file")
    return data


def _check_rate(rate: int) -> None:
    if rate <= 0:
        raise ValueError(f"sample rates must be positive, got {rate}")


def _limit_samples(max_seconds: float | None, rate: int) -> int | None:
    return None if max_seconds is None else int(max_seconds * rate)


def _check_limit(num_samples: int, rate: int, max_seconds: float | None, param: str) -> None:
    limit = _limit_samples(max_seconds, rate)
    if limit is not None and num_samples > limit:
        raise InvalidRequestError(f"{param} is longer than the {max_seconds:g} s limit; "
                                  "send a shorter clip or split it", param=param)


def _read_sndfile(src: BinaryIO, max_seconds: float | None,
                  param: str) -> tuple[np.ndarray, int] | None:
    """(mono (N,), rate), or None when libsndfile cannot open the data (FFmpeg may)."""
    start = src.tell()
    try:
        f = sf.SoundFile(src)
    except RuntimeError:                    # LibsndfileError: format not recognised / unsupported
        src.seek(start)
        return None
    with f:
        rate = f.samplerate
        limit = _limit_samples(max_seconds, rate)
        parts: list[np.ndarray] = []
        total = 0
        try:
            while True:
                # Never read more than one sample past the limit.
                want = _READ_BLOCK if limit is None else min(_READ_BLOCK, limit + 1 - total)
                block = f.read(want, dtype="float32", always_2d=True)       # (n, C)
                if len(block) == 0:
                    break
                total += len(block)
                _check_limit(total, rate, max_seconds, param)
                parts.append(block.mean(axis=1) if block.shape[1] > 1 else block[:, 0])
        except RuntimeError as e:
            raise _corrupt(param, total / rate, e) from None
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), rate


def _read_ffmpeg(src: BinaryIO, fmt: str, max_seconds: float | None,
                 param: str) -> tuple[np.ndarray, int]:
    """(mono (N,), rate) through FFmpeg's demuxer `fmt` (sniffed; never probed)."""
    try:
        container = open_pinned(src, fmt)
    except av.FFmpegError as e:
        raise InvalidRequestError(f"{param} could not be decoded as audio ({reason(e)}); "
                                  f"send {_FORMATS_HINT} data", param=param) from None
    with container:
        if not container.streams.audio:
            raise InvalidRequestError(f"{param} has no audio stream; send an audio file",
                                      param=param)
        stream = container.streams.audio[0]
        parts: list[np.ndarray] = []
        total, rate = 0, 0
        try:
            for frame in container.decode(stream):
                if frame.sample_rate <= 0:
                    raise InvalidRequestError(f"{param} has no valid sample rate; re-encode it",
                                              param=param)
                if rate and frame.sample_rate != rate:
                    raise InvalidRequestError(f"{param} changes sample rate mid-stream "
                                              f"({rate} -> {frame.sample_rate} Hz); re-encode it "
                                              "at one rate", param=param)
                rate = frame.sample_rate
                total += frame.samples
                _check_limit(total, rate, max_seconds, param)
                parts.append(_frame_to_mono(frame))
        except av.FFmpegError as e:
            raise _corrupt(param, total / max(rate, 1), e) from None
    if not parts:
        raise _no_samples(param)
    return np.concatenate(parts), rate


def _frame_to_mono(frame: av.AudioFrame) -> np.ndarray:
    """Any FFmpeg sample format -> (n,) float32, channels averaged."""
    arr = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:          # interleaved: (1, n * C)
        arr = arr.reshape(-1, channels).T
    # arr: (C, n)
    if arr.dtype.kind == "u":               # u8: offset binary
        arr = (arr.astype(np.float32) - 128.0) / 128.0
    elif arr.dtype.kind == "i":
        arr = arr.astype(np.float32) / float(2 ** (8 * arr.dtype.itemsize - 1))
    return arr.astype(np.float32, copy=False).mean(axis=0)


def _finish(mono: np.ndarray, rate: int, target_rate: int, param: str) -> DecodedAudio:
    if len(mono) == 0:
        raise _no_samples(param)
    if not np.isfinite(mono).all():
        raise InvalidRequestError(f"{param} contains NaN or infinite samples; send finite "
                                  "audio", param=param)
    return DecodedAudio(samples=resample(mono, rate, target_rate), sample_rate=target_rate)


def _no_samples(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} contains no audio samples; send a non-empty clip",
                               param=param)


def _corrupt(param: str, seconds: float, e: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"{param} is corrupt: decoding failed after {seconds:.2f} s "
                               f"({reason(e)}); re-encode the file", param=param)
