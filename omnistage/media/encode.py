"""Encode generated speech (float32 mono PCM) into the audio formats the OpenAI API names:
`wav`, `pcm` (alias `pcm16`), `flac`, `mp3`, `opus` and `aac`, whole or streamed.

Samples are clipped to [-1, 1]. Lossless formats carry 16-bit PCM, quantised as
clip(round(x * 32768), -32768, 32767): the inverse of the `int16 / 32768` that libsndfile,
FFmpeg and `omnistage.media.audio` decode with.

Per format:
- pcm: raw signed 16-bit little-endian mono, no header (the rate is the caller's to announce).
- wav: a 44-byte PCM16 header, then the samples. Streamed, the RIFF and data sizes are
  0xFFFFFFFF ("unknown length", as streaming servers write them; libsndfile and FFmpeg read
  such files to their end).
- flac: written by libsndfile (soundfile). Not streamed: a FLAC stream written before its
  length is known has total_samples = 0 in STREAMINFO, which the spec allows but libsndfile
  cannot read (it fails with "Internal psf_fseek() failed"), so the stream encoder keeps the
  samples and emits the whole file from `finish()`.
- mp3 / opus / aac: FFmpeg encoders through PyAV (libmp3lame in raw MP3, libopus in Ogg,
  FFmpeg's native AAC in ADTS), muxed into memory and handed out as soon as the muxer writes.
  Opus is encoded at 48 kHz, the rate Ogg Opus decoders output. The muxer sees a
  non-seekable output in both the whole and the streamed case, so both produce the same
  bytes: MP3 gets no Xing/LAME header and, like ADTS AAC, decodes with the encoder's priming
  samples in front (~1105 samples for MP3, 1024 for AAC) and the last frame padded; Ogg Opus
  signals its pre-skip and end trim, so it decodes to the exact length. Resampling (Opus,
  or a rate the codec lacks) is libswresample's, as in `omnistage.media.audio.resample`, but
  kept as one stateful resampler across pushes, so chunk edges add no artefacts.

No samples at all give a bare header for wav and flac (FFmpeg reads the FLAC as 0 samples;
libsndfile cannot), no bytes for pcm and aac, and only container headers for mp3 and opus,
which decoders may reject as holding no audio.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral, Real

import av
import numpy as np
import soundfile as sf
from av.codec.codec import UnknownCodecError

from omnistage.errors import InvalidRequestError
from omnistage.media.audio import resample

AUDIO_FORMATS = ("wav", "pcm", "pcm16", "flac", "mp3", "opus", "aac")
MIN_SPEED, MAX_SPEED = 0.25, 4.0           # OpenAI's range for /v1/audio/speech `speed`

_CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm16": "audio/pcm",
                  "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
                  "aac": "audio/aac"}
_UNKNOWN_SIZE = 0xFFFFFFFF                 # RIFF/data size of a WAV of unknown length


@dataclass(frozen=True)
class _CodecPlan:
    """How one lossy format is made with FFmpeg."""
    encoders: tuple[str, ...]              # candidate encoder names, first available wins
    muxer: str                             # FFmpeg output format
    bit_rate: int                          # bits per second
    sample_rate: int | None = None         # forced codec rate; None: the source's if allowed
    muxer_options: tuple[tuple[str, str], ...] = ()


# flush_packets: the muxer hands each packet's bytes to the sink at once, not per 32 KiB
# buffer. fflags=+bitexact: no random Ogg serial number or FFmpeg version tag, so equal input
# gives equal bytes. Ogg collects packets into pages of up to `page_duration` us (default
# 1 s); 100 ms pages bound the added latency at ~2.5% size overhead.
_MUXER_OPTIONS = (("flush_packets", "1"), ("fflags", "+bitexact"))
_CODEC_PLANS = {
    "mp3": _CodecPlan(("libmp3lame", "libshine"), "mp3", 64_000,
                      muxer_options=_MUXER_OPTIONS),
    "opus": _CodecPlan(("libopus", "opus"), "ogg", 32_000, sample_rate=48_000,
                       muxer_options=_MUXER_OPTIONS + (("page_duration", "100000"),)),
    "aac": _CodecPlan(("aac", "libfdk_aac"), "adts", 64_000, muxer_options=_MUXER_OPTIONS),
}


def content_type(fmt: str) -> str:
    """MIME type of a response in `fmt` (e.g. "mp3" -> "audio/mpeg")."""
    return _CONTENT_TYPES[_check_format(fmt)]


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode float32 mono `samples` (N,) at `sample_rate` Hz as a complete file in `fmt`.

    Raises InvalidRequestError(param="response_format") for an unknown format or one this
    FFmpeg build has no encoder for.
    """
    fmt = _check_format(fmt)
    _check_rate(sample_rate)
    x = _as_mono(samples)
    if fmt == "wav":                       # whole file: the real sizes
        pcm = _to_pcm16(x)
        return _wav_header(sample_rate, pcm.nbytes) + pcm.tobytes()
    encoder = AudioStreamEncoder(fmt, sample_rate)
    try:
        return encoder.push(x) + encoder.finish()
    finally:
        encoder.close()                    # no-op after finish(); frees FFmpeg on errors


def change_speed(samples: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """Play `samples` (N,) `speed` times faster: about N / speed samples at the same rate.

    This is a resampling speed change, like playing a tape faster: the pitch moves with the
    speed (x2 is an octave up). 0.25 <= speed <= 4.0, else InvalidRequestError(param="speed").
    """
    speed = _check_speed(speed)
    _check_rate(sample_rate)
    x = _as_mono(samples)
    if speed == 1.0:
        return x
    # Read the samples as if recorded at rate * speed and convert back to `rate`.
    return resample(x, max(1, round(sample_rate * speed)), sample_rate)


class AudioStreamEncoder:
    """Encode speech chunk by chunk: `push()` returns the bytes ready so far, `finish()` the
    rest. The concatenation of everything returned is one file in `fmt` (see the module
    docstring for what each format emits when). Call `close()` to drop an unfinished stream.
    """

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt = _check_format(fmt)
        _check_rate(sample_rate)
        self.sample_rate = sample_rate
        self.content_type = _CONTENT_TYPES[self.fmt]
        self._done = False
        if self.fmt in _CODEC_PLANS:
            self._ffmpeg: _FFmpegStream | None = _FFmpegStream(_CODEC_PLANS[self.fmt],
                                                               sample_rate)
        else:
            self._ffmpeg = None
        self._pending = b"" if self.fmt != "wav" else _wav_header(sample_rate, None)
        self._flac_parts: list[np.ndarray] = []       # flac: int16 chunks until finish()

    def push(self, samples: np.ndarray) -> bytes:
        """Add float32 mono samples (n,) (n may be 0); return the encoded bytes now ready."""
        self._check_open()
        x = _as_mono(samples)
        out, self._pending = self._pending, b""
        if self._ffmpeg is not None:
            return out + self._ffmpeg.push(x)
        pcm = _to_pcm16(x)
        if self.fmt == "flac":
            self._flac_parts.append(pcm)
            return out
        return out + pcm.tobytes()

    def finish(self) -> bytes:
        """Flush the encoder and return the last bytes; the encoder is closed afterwards."""
        self._check_open()
        self._done = True
        out, self._pending = self._pending, b""
        if self._ffmpeg is not None:
            return out + self._ffmpeg.finish()
        if self.fmt == "flac":
            pcm = np.concatenate(self._flac_parts) if self._flac_parts else np.zeros(0, "<i2")
            self._flac_parts = []
            return _flac_bytes(pcm, self.sample_rate)
        return out

    def close(self) -> None:
        """Release the encoder without producing the rest (e.g. the client went away)."""
        if self._ffmpeg is not None:
            self._ffmpeg.close()
        self._done = True
        self._flac_parts = []

    def _check_open(self) -> None:
        if self._done:
            raise RuntimeError("this AudioStreamEncoder is finished or closed; "
                               "start a new one")


# ---------------------------------------------------------------------------------------------

class _ByteSink:
    """Write-only, non-seekable file for FFmpeg's muxer: having no seek(), it makes muxers
    write in streaming mode (no seeking back to patch headers)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class _FFmpegStream:
    """One encoder + muxer writing to memory. Input frames go through a stateful
    libswresample resampler, which converts to the codec's sample format and rate and cuts
    the stream into the codec's frame size, whatever the sizes pushed."""

    def __init__(self, plan: _CodecPlan, sample_rate: int):
        codec = _find_encoder(plan)
        self._in_rate = sample_rate
        self._codec_rate = plan.sample_rate or _codec_rate(codec, sample_rate)
        self._sink = _ByteSink()
        self._container = av.open(self._sink, mode="w", format=plan.muxer,
                                  container_options=dict(plan.muxer_options))
        self._stream = self._container.add_stream(codec.name, rate=self._codec_rate,
                                                  layout="mono")
        ctx = self._stream.codec_context
        ctx.format = _sample_format(codec)
        ctx.bit_rate = plan.bit_rate
        # Opens the codec (frame_size is known from here on) and writes the file header.
        self._container.start_encoding()
        self._resampler = av.AudioResampler(format=ctx.format, layout="mono",
                                            rate=self._codec_rate,
                                            frame_size=ctx.frame_size or None)
        self._time_base = Fraction(1, self._codec_rate)
        self._next_pts = 0                 # samples at the codec rate handed to the encoder
        self._closed = False

    def push(self, x: np.ndarray) -> bytes:
        """x: (n,) float32 in [-1, 1] at the input rate."""
        if len(x):
            frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
            frame.sample_rate = self._in_rate
            self._encode(self._resampler.resample(frame))
        return self._sink.take()

    def finish(self) -> bytes:
        self._encode(self._resampler.resample(None))     # the filter tail and the last frame
        for packet in self._stream.encode(None):          # the encoder's delayed packets
            self._container.mux(packet)
        self._close()
        return self._sink.take()

    def close(self) -> None:
        self._close()
        self._sink.take()

    def _encode(self, frames: list[av.AudioFrame]) -> None:
        for frame in frames:
            # Timestamps in samples, so the muxer's granule positions / durations are exact.
            frame.pts = self._next_pts
            frame.time_base = self._time_base
            self._next_pts += frame.samples
            for packet in self._stream.encode(frame):
                self._container.mux(packet)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()        # writes the trailer (Ogg: the last page)


def _find_encoder(plan: _CodecPlan) -> av.Codec:
    for name in plan.encoders:
        try:
            return av.Codec(name, "w")
        except UnknownCodecError:
            continue
    raise InvalidRequestError(
        f"this server's FFmpeg has no encoder for this format (tried {', '.join(plan.encoders)}); "
        "choose response_format wav, pcm or flac", param="response_format")


def _codec_rate(codec: av.Codec, rate: int) -> int:
    """The source rate if the codec takes it, else the lowest allowed rate above it (the
    highest allowed one if none is above)."""
    allowed = codec.audio_rates
    if not allowed or rate in allowed:
        return rate
    above = [r for r in allowed if r > rate]
    return min(above) if above else max(allowed)


def _sample_format(codec: av.Codec) -> str:
    """Prefer float input (no extra quantisation before the lossy coder)."""
    names = [f.name for f in codec.audio_formats or ()]
    for name in ("flt", "fltp"):
        if name in names:
            return name
    return names[0] if names else "s16"


def _wav_header(rate: int, data_bytes: int | None) -> bytes:
    """44-byte PCM16 mono WAV header; data_bytes None means "unknown length" (streaming)."""
    if data_bytes is None:
        riff_size = data_size = _UNKNOWN_SIZE
    else:                                  # sizes past 4 GiB: fall back to "unknown"
        data_size = min(data_bytes, _UNKNOWN_SIZE)
        riff_size = min(36 + data_bytes, _UNKNOWN_SIZE)
    fmt_chunk = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)   # PCM, mono, 16-bit
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
            + b"data" + struct.pack("<I", data_size))


def _flac_bytes(pcm: np.ndarray, rate: int) -> bytes:
    """(n,) int16 -> FLAC file. libsndfile writes nothing at all for n = 0, so an empty input
    gets a bare STREAMINFO header (FFmpeg reads it as 0 samples)."""
    if len(pcm) == 0:
        return _empty_flac(rate)
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def _empty_flac(rate: int) -> bytes:
    # STREAMINFO bit fields: 16 min block, 16 max block, 24 min frame, 24 max frame (0 =
    # unknown), then 20 rate, 3 channels-1, 5 bits-1, 36 total samples, then a 128-bit MD5.
    packed = (rate << 44) | (0 << 41) | (15 << 36) | 0
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + packed.to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info   # 0x80: last block


def _to_pcm16(x: np.ndarray) -> np.ndarray:
    """(n,) float32 in [-1, 1] -> (n,) little-endian int16."""
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype("<i2")


def _as_mono(samples: np.ndarray) -> np.ndarray:
    """Validate and clip: (n,) float32 in [-1, 1], C-contiguous."""
    x = np.ascontiguousarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected mono samples of shape (N,), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("samples contain NaN or infinite values")
    return np.clip(x, -1.0, 1.0)


def _check_format(fmt: str) -> str:
    name = fmt.strip().lower() if isinstance(fmt, str) else None
    if name not in _CONTENT_TYPES:
        raise InvalidRequestError(f"response_format {fmt!r} is not supported; use one of "
                                  f"{', '.join(AUDIO_FORMATS)}", param="response_format")
    return name


def _check_speed(speed: float) -> float:
    ok = isinstance(speed, Real) and not isinstance(speed, bool) and math.isfinite(speed)
    if not ok or not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidRequestError(f"speed {speed!r} is out of range; send a number from "
                                  f"{MIN_SPEED} to {MAX_SPEED} (1.0 is normal speed)",
                                  param="speed")
    return float(speed)


def _check_rate(rate: int) -> None:
    if not isinstance(rate, Integral) or isinstance(rate, bool) or rate <= 0:
        raise ValueError(f"sample_rate must be a positive int, got {rate!r}")
