"""Audio output encoding: every OpenAI response_format round-trips, streaming equals whole,
speed changes, bad formats/speeds."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile as sf

from omnistage.errors import InvalidRequestError
from omnistage.media.audio import resample
from omnistage.media.encode import (AUDIO_FORMATS, AudioStreamEncoder, _CodecPlan, _find_encoder,
                                    change_speed, content_type, encode_audio)

RATE = 24000                               # Qwen2.5-Omni's output rate
LOSSLESS = ("wav", "pcm", "pcm16", "flac")
LOSSY = ("mp3", "opus", "aac")
# Samples per codec frame at the decoded rate (Opus decodes at 48 kHz: 20 ms = 960).
CODEC_FRAME = {"mp3": 576, "opus": 960, "aac": 1024}


def _speech_like(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """Voiced harmonics (~150 Hz) under a syllable-rate envelope, plus a little noise."""
    t = np.arange(int(rate * seconds)) / rate
    f0 = 150 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    noise = np.random.default_rng(seed).normal(0, 0.02, len(t))
    return (0.3 * envelope * voiced + noise).astype(np.float32)


def _decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """(samples float32 (N,), rate) with the decoder a client would use."""
    if fmt in ("pcm", "pcm16"):
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, RATE
    if fmt in ("wav", "flac"):
        y, rate = sf.read(io.BytesIO(data), dtype="float32")
        return y, rate
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        rate = container.streams.audio[0].codec_context.sample_rate
    return np.concatenate(frames).astype(np.float32), rate


def _best_correlation(ref: np.ndarray, y: np.ndarray, max_lag: int) -> float:
    """Max over lags 0..max_lag of the normalised correlation of ref with y[lag:]: lossy
    decoders put the encoder's priming samples in front."""
    y = np.pad(y, (0, max(0, len(ref) + max_lag - len(y))))[:len(ref) + max_lag]
    dots = np.correlate(y, ref, mode="valid")                          # (max_lag + 1,)
    power = np.concatenate([[0.0], np.cumsum(y.astype(np.float64) ** 2)])
    energy = np.sqrt(np.maximum(power[len(ref):] - power[:-len(ref)], 0))   # (max_lag + 1,)
    return float(np.max(dots / (np.linalg.norm(ref) * np.maximum(energy, 1e-9))))


def _stream(fmt: str, x: np.ndarray, chunks: list[int], rate: int = RATE) -> tuple[bytes, int]:
    """Push x in pieces of the given sizes (0 = empty push); return (all bytes, bytes emitted
    before finish())."""
    encoder = AudioStreamEncoder(fmt, rate)
    out, start = [], 0
    for n in chunks:
        out.append(encoder.push(x[start:start + n]))
        start += n
    assert start == len(x)
    early = sum(map(len, out))
    return b"".join(out) + encoder.finish(), early


@pytest.mark.parametrize("fmt", LOSSLESS)
def test_lossless_round_trip_is_exact(fmt):
    x = _speech_like(0.5)
    y, rate = _decode(encode_audio(x, RATE, fmt), fmt)
    assert rate == RATE and y.shape == x.shape
    # Exactly the 16-bit quantisation of x: the only error is rounding to 1/32768.
    expected = np.clip(np.rint(x * 32768), -32768, 32767) / 32768
    np.testing.assert_array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize("fmt", LOSSY)
def test_lossy_round_trip_keeps_duration_and_waveform(fmt):
    x = _speech_like(1.0)
    y, rate = _decode(encode_audio(x, RATE, fmt), fmt)
    if fmt == "opus":                      # Ogg Opus always decodes at 48 kHz
        assert rate == 48000 and len(y) == 2 * len(x)     # pre-skip and end trim are signalled
        y = resample(y, rate, RATE)
    else:
        assert rate == RATE
        # Priming samples in front and last-frame padding: less than 3 codec frames more.
        assert 0 <= len(y) - len(x) < 3 * CODEC_FRAME[fmt]
    assert _best_correlation(x, y, max_lag=2048) > 0.9


@pytest.mark.parametrize("fmt", LOSSY)
@pytest.mark.parametrize("rate", [16000, 22050])
def test_lossy_at_other_source_rates(fmt, rate):
    x = _speech_like(0.5, rate)
    y, out_rate = _decode(encode_audio(x, rate, fmt), fmt)
    assert out_rate == (48000 if fmt == "opus" else rate)
    assert len(y) / out_rate == pytest.approx(0.5, abs=0.15)
    assert _best_correlation(x, resample(y, out_rate, rate), max_lag=2048) > 0.9


def _chunkings(n: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1)
    sizes: list[int] = []
    while sum(sizes) < n:                  # ragged sizes, with empty pushes in between
        sizes += [int(rng.integers(1, 3000)), 0]
    sizes[-2] -= sum(sizes) - n
    return {"whole": [n], "ragged": [0] + sizes, "one_sample": [1] * n}


@pytest.mark.parametrize("chunking", ["whole", "ragged", "one_sample"])
@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_streaming_decodes_like_whole(fmt, chunking):
    x = _speech_like(0.5 if chunking != "one_sample" else 0.2)
    whole = encode_audio(x, RATE, fmt)
    streamed, _ = _stream(fmt, x, _chunkings(len(x))[chunking])
    y_whole, rate_whole = _decode(whole, fmt)
    y_stream, rate_stream = _decode(streamed, fmt)
    assert rate_stream == rate_whole
    if fmt in LOSSY:
        assert abs(len(y_stream) - len(y_whole)) <= CODEC_FRAME[fmt]
        n = min(len(y_stream), len(y_whole))
        assert np.corrcoef(y_stream[:n], y_whole[:n])[0, 1] > 0.99
    else:
        np.testing.assert_array_equal(y_stream, y_whole)


def test_streamed_wav_has_unknown_length_header():
    x = _speech_like(0.1)
    whole = encode_audio(x, RATE, "wav")
    streamed, _ = _stream("wav", x, [100, 0, len(x) - 100])
    riff, data = struct.unpack_from("<I", whole, 4)[0], struct.unpack_from("<I", whole, 40)[0]
    assert (riff, data) == (36 + 2 * len(x), 2 * len(x))
    assert struct.unpack_from("<I", streamed, 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", streamed, 40)[0] == 0xFFFFFFFF
    assert streamed[44:] == whole[44:] and len(streamed) == len(whole)


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "aac"])
def test_stream_emits_bytes_before_finish(fmt):
    x = _speech_like(1.0)
    total, early = _stream(fmt, x, [len(x) // 10] * 10)
    assert early >= 0.7 * len(total)


def test_flac_stream_is_emitted_at_finish():
    x = _speech_like(0.3)
    total, early = _stream("flac", x, [1000, 0, len(x) - 1000])
    assert early == 0 and total == encode_audio(x, RATE, "flac")


def test_clipping_and_quantisation():
    x = np.array([2.0, -2.0, 1.0, -1.0, 0.5, 1 / 65536 + 1e-6], np.float32)
    pcm = np.frombuffer(encode_audio(x, RATE, "pcm"), "<i2")
    np.testing.assert_array_equal(pcm, [32767, -32768, 32767, -32768, 16384, 1])


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac"])
def test_empty_input_gives_an_empty_file(fmt):
    data = encode_audio(np.zeros(0, np.float32), RATE, fmt)
    if fmt == "pcm":
        assert data == b""
    elif fmt == "wav":
        assert len(_decode(data, fmt)[0]) == 0
    else:                                  # libsndfile cannot read a length-less FLAC; FFmpeg can
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.audio[0].rate == RATE
            assert list(container.decode(audio=0)) == []


def test_content_types():
    assert {f: content_type(f) for f in AUDIO_FORMATS} == {
        "wav": "audio/wav", "pcm": "audio/pcm", "pcm16": "audio/pcm", "flac": "audio/flac",
        "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}
    assert content_type("MP3") == "audio/mpeg"
    assert AudioStreamEncoder("opus", RATE).content_type == "audio/ogg"


@pytest.mark.parametrize("bad", ["ogg", "vorbis", "", None])
def test_unknown_format_is_rejected(bad):
    x = _speech_like(0.05)
    for call in (lambda: encode_audio(x, RATE, bad), lambda: AudioStreamEncoder(bad, RATE),
                 lambda: content_type(bad)):
        with pytest.raises(InvalidRequestError) as e:
            call()
        assert e.value.param == "response_format"
        assert all(f in str(e.value) for f in AUDIO_FORMATS)


def test_missing_encoder_is_a_request_error():
    with pytest.raises(InvalidRequestError) as e:
        _find_encoder(_CodecPlan(("no_such_encoder",), "mp3", 64000))
    assert e.value.param == "response_format" and "wav" in str(e.value)


def test_bad_samples_and_finished_stream():
    with pytest.raises(ValueError, match="shape"):
        encode_audio(np.zeros((10, 2), np.float32), RATE, "wav")
    with pytest.raises(ValueError, match="NaN"):
        encode_audio(np.array([0.0, np.nan], np.float32), RATE, "pcm")
    encoder = AudioStreamEncoder("mp3", RATE)
    encoder.push(_speech_like(0.05))
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.push(_speech_like(0.05))
    aborted = AudioStreamEncoder("opus", RATE)
    aborted.push(_speech_like(0.05))
    aborted.close()
    with pytest.raises(RuntimeError):
        aborted.finish()


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0])
def test_change_speed_scales_duration_and_pitch(speed):
    x = (0.5 * np.sin(2 * np.pi * 400 * np.arange(RATE) / RATE)).astype(np.float32)
    y = change_speed(x, RATE, speed)
    assert y.dtype == np.float32
    assert len(y) == pytest.approx(len(x) / speed, rel=0.01)
    assert _peak_hz(y, RATE) == pytest.approx(400 * speed, rel=0.02)   # pitch follows speed


def test_change_speed_one_is_identity():
    x = _speech_like(0.1)
    np.testing.assert_array_equal(change_speed(x, RATE, 1.0), x)


@pytest.mark.parametrize("bad", [0.2, 4.01, 0, -1, float("nan"), float("inf"), "2", True])
def test_change_speed_rejects_out_of_range(bad):
    with pytest.raises(InvalidRequestError) as e:
        change_speed(_speech_like(0.05), RATE, bad)
    assert e.value.param == "speed" and "0.25" in str(e.value)
