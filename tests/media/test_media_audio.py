"""Audio decoding: formats, downmix, resampling, limits enforced while decoding, bad input."""

from __future__ import annotations

import base64
import io
import time

import av
import numpy as np
import pytest
import soundfile as sf

from omnistage.errors import InvalidRequestError
from omnistage.media.audio import decode_audio, decode_base64, decode_pcm16, resample


def _sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def _soundfile_bytes(x: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _ffmpeg_bytes(x: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """Encode (N,) mono or (N, 2) stereo float32 with PyAV."""
    planar = np.ascontiguousarray(x.T if x.ndim == 2 else x[None])            # (C, N)
    layout = "stereo" if planar.shape[0] == 2 else "mono"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        step = 1152 * 8
        for start in range(0, planar.shape[1], step):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planar[:, start:start + step]),
                                               format="fltp", layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


class _CountingReader(io.BytesIO):
    """Counts the bytes a decoder pulls out of it."""
    bytes_read = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        self.bytes_read += n
        return n


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("WAV", "FLOAT")])
def test_lossless_round_trip_is_exact(fmt, subtype):
    x = _sine(440, 16000, 1.0)
    out = decode_audio(_soundfile_bytes(x, 16000, fmt, subtype))
    assert out.sample_rate == 16000 and out.samples.dtype == np.float32
    assert out.samples.shape == x.shape and out.duration == pytest.approx(1.0)
    tol = 1e-7 if subtype == "FLOAT" else 1 / 32768
    np.testing.assert_allclose(out.samples, x, atol=tol)


@pytest.mark.parametrize("kind", ["ogg", "mp3", "m4a"])
def test_lossy_formats_keep_the_tone(kind):
    x = _sine(1000, 16000, 2.0)
    if kind == "ogg":
        data = _soundfile_bytes(x, 16000, "OGG")
    elif kind == "mp3":
        data = _ffmpeg_bytes(x, 16000, "mp3", "libmp3lame")
    else:
        data = _ffmpeg_bytes(x, 16000, "ipod", "aac")
    out = decode_audio(data)
    assert out.duration == pytest.approx(2.0, abs=0.15)     # codecs add priming/padding
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=2)
    assert np.sqrt(np.mean(out.samples ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


def test_stereo_is_averaged_to_mono():
    left = _sine(440, 16000, 0.5)
    stereo = np.stack([left, 0.5 * left], axis=1)                               # (N, 2)
    out = decode_audio(_soundfile_bytes(stereo, 16000, "WAV", "FLOAT"))
    np.testing.assert_allclose(out.samples, 0.75 * left, atol=1e-7)
    mp3 = decode_audio(_ffmpeg_bytes(stereo, 16000, "mp3", "libmp3lame"))     # FFmpeg path
    assert np.sqrt(np.mean(mp3.samples ** 2)) == pytest.approx(0.75 * 0.5 / np.sqrt(2), rel=0.1)


@pytest.mark.parametrize("rate", [44100, 24000, 8000])
def test_resampling_to_16k_preserves_the_sine(rate):
    x = _sine(1000, rate, 1.0)
    out = decode_audio(_soundfile_bytes(x, rate, "WAV", "FLOAT"), sample_rate=16000)
    assert out.sample_rate == 16000
    assert abs(len(out.samples) - 16000) <= 2
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=1)
    # Sample by sample against the ideal 16 kHz sine: right frequency, amplitude and no delay.
    ideal = _sine(1000, 16000, 1.0)
    n = min(len(ideal), len(out.samples))
    np.testing.assert_allclose(out.samples[100:n - 100], ideal[100:n - 100], atol=2e-3)


def test_resampler_filters_frequencies_above_the_new_nyquist():
    # 12 kHz at 44.1 kHz would alias to 4 kHz in a naive resampler; a real one removes it.
    x = _sine(12000, 44100, 1.0)
    y = resample(x, 44100, 16000)
    assert np.sqrt(np.mean(y[200:-200] ** 2)) < 1e-2 * np.sqrt(np.mean(x ** 2))


def test_pcm16_realtime_input():
    ideal = _sine(1000, 24000, 1.0)
    pcm = np.round(ideal * 32767).astype("<i2").tobytes()
    out = decode_pcm16(pcm, input_rate=24000, sample_rate=16000)
    assert out.sample_rate == 16000 and abs(len(out.samples) - 16000) <= 2
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=1)
    same_rate = decode_pcm16(np.array([0, 16384, -32768], "<i2").tobytes(), input_rate=16000)
    np.testing.assert_array_equal(same_rate.samples, np.array([0, 0.5, -1], np.float32))
    stereo = np.array([[1000, 3000], [-2000, 0]], "<i2").tobytes()
    np.testing.assert_allclose(decode_pcm16(stereo, input_rate=16000, channels=2).samples,
                               np.array([2000, -1000]) / 32768)
    with pytest.raises(InvalidRequestError, match="multiple of 2") as e:
        decode_pcm16(b"\x00\x01\x02", param="audio_chunk")
    assert e.value.param == "audio_chunk"
    with pytest.raises(InvalidRequestError, match="longer than the 0.5 s limit"):
        decode_pcm16(pcm, max_seconds=0.5)
    with pytest.raises(InvalidRequestError, match="empty"):
        decode_pcm16(b"")


def test_base64():
    assert decode_base64(base64.b64encode(b"abc").decode()) == b"abc"
    with pytest.raises(InvalidRequestError, match="not valid base64") as e:
        decode_base64("not base64!!", param="input_audio.data")
    assert e.value.param == "input_audio.data"


def test_limit_passes_audio_at_the_limit_and_rejects_one_sample_more():
    x = _sine(440, 16000, 1.0)
    assert decode_audio(_soundfile_bytes(x, 16000, "WAV"), max_seconds=1.0).duration == 1.0
    longer = np.concatenate([x, x[:1]])
    with pytest.raises(InvalidRequestError, match="longer than the 1 s limit"):
        decode_audio(_soundfile_bytes(longer, 16000, "WAV"), max_seconds=1.0)


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3"])
def test_limit_stops_decoding_early(kind):
    """A long file over the limit is rejected after reading a small part of it."""
    seconds = 600 if kind == "wav" else 60
    noise = (0.1 * np.random.default_rng(0).standard_normal(16000 * seconds)).astype(np.float32)
    data = (_ffmpeg_bytes(noise, 16000, "mp3", "libmp3lame") if kind == "mp3"
            else _soundfile_bytes(noise, 16000, kind.upper(), "PCM_16"))
    reader = _CountingReader(data)
    with pytest.raises(InvalidRequestError, match="limit") as e:
        decode_audio(reader, max_seconds=1.0, param="messages[0].content[1].input_audio")
    assert e.value.param == "messages[0].content[1].input_audio"
    assert reader.bytes_read < 0.3 * len(data)        # mp3: FFmpeg probes a few seconds first
    if kind == "wav":                                 # 10 minutes: also measure the time
        started = time.perf_counter()
        decode_audio(data)
        full = time.perf_counter() - started
        limited = []
        for _ in range(3):
            started = time.perf_counter()
            with pytest.raises(InvalidRequestError):
                decode_audio(data, max_seconds=1.0)
            limited.append(time.perf_counter() - started)
        assert min(limited) < full / 10, (limited, full)


@pytest.mark.parametrize("data,message", [
    (b"", "empty"),
    (b"this is not audio at all" * 20, "could not be decoded"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\xff" * 40, "could not be decoded"),
    (b"OggS" + bytes(range(256)) * 4, "could not be decoded"),
    (b"\xff\xfb\x90\x00" + b"\x00" * 10, "could not be decoded|no audio samples"),
])
def test_corrupt_or_unsupported_input_is_a_client_error(data, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        decode_audio(data, param="file")
    assert e.value.param == "file"


def test_non_finite_samples_are_rejected():
    x = _sine(440, 16000, 0.1)
    x[10] = np.nan
    with pytest.raises(InvalidRequestError, match="NaN"):
        decode_audio(_soundfile_bytes(x, 16000, "WAV", "FLOAT"))


def test_file_objects_are_accepted():
    x = _sine(440, 16000, 0.25)
    out = decode_audio(io.BytesIO(_soundfile_bytes(x, 16000, "FLAC")))
    np.testing.assert_allclose(out.samples, x, atol=1 / 32768)


# ---- the container is sniffed and its demuxer pinned: no FFmpeg probing ----------------------

@pytest.mark.parametrize("kind, container, codec", [
    ("wav", "wav", "pcm_s16le"),
    ("flac", "flac", "flac"),
    ("mp3", "mp3", "libmp3lame"),
    ("ogg/opus", "ogg", "libopus"),
    ("webm", "webm", "libopus"),
    ("mka", "matroska", "flac"),
    ("m4a", "ipod", "aac"),
    ("mp4", "mp4", "aac"),
])
def test_every_allowed_container_decodes_through_its_pinned_demuxer(kind, container, codec):
    """Each container of the allow-list, written by FFmpeg (PyAV), decodes: the ones libsndfile
    reads too (wav, flac, ogg) as well as those only FFmpeg reads."""
    x = _sine(1000, 16000, 1.0)
    out = decode_audio(_ffmpeg_bytes(x, 16000, container, codec), param="file")
    assert out.duration == pytest.approx(1.0, abs=0.1)              # codecs add priming/padding
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=2)
    assert np.sqrt(np.mean(out.samples ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


def test_ogg_vorbis_decodes():
    """Ogg/Vorbis, written by libsndfile (this PyAV build has no Vorbis encoder)."""
    import io

    import soundfile as sf

    x = _sine(1000, 16000, 1.0)
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="OGG", subtype="VORBIS")
    out = decode_audio(buf.getvalue(), param="file")
    assert out.duration == pytest.approx(1.0, abs=0.1)
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=2)


def test_the_ffmpeg_fallback_of_a_sniffed_wav_is_pinned_too():
    """A WAV libsndfile cannot decode (an MP3 stream in a RIFF/WAVE box) goes to FFmpeg, still
    read by the wav demuxer alone."""
    x = _sine(1000, 16000, 1.0)
    out = decode_audio(_ffmpeg_bytes(x, 16000, "wav", "libmp3lame"))
    assert _peak_hz(out.samples, 16000) == pytest.approx(1000, abs=2)


def _playlists(tmp_path) -> dict[str, bytes]:
    """Lists FFmpeg's probing would open as hls / concat, each naming a local file."""
    local = tmp_path / "local.wav"
    local.write_bytes(_soundfile_bytes(_sine(440, 16000, 1.0), 16000, "WAV"))
    return {
        "hls": (f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{local}\n"
                "#EXT-X-ENDLIST\n").encode(),
        "ffconcat": b"ffconcat version 1.0\nfile '/etc/hostname'\n",
        "ffconcat-wav": f"ffconcat version 1.0\nfile '{local}'\n".encode(),
    }


@pytest.mark.parametrize("kind", ["hls", "ffconcat", "ffconcat-wav"])
def test_playlists_and_concat_lists_are_refused(tmp_path, kind):
    data = _playlists(tmp_path)[kind]
    with pytest.raises(InvalidRequestError, match="not a supported container") as e:
        decode_audio(data, param="file")
    assert e.value.param == "file"
    with pytest.raises(InvalidRequestError, match="not a supported container"):
        decode_audio(io.BytesIO(data), param="file")                   # a file object too


def test_an_hls_playlist_would_have_opened_the_local_file(tmp_path):
    """What the pinning prevents: left to probe, FFmpeg reads the playlist as hls and decodes
    the file it names (skipped where this FFmpeg build refuses that by itself)."""
    data = _playlists(tmp_path)["hls"]
    try:
        with av.open(io.BytesIO(data), mode="r") as probed:
            fmt = probed.format.name
            decoded = sum(f.samples for f in probed.decode(audio=0))
    except (av.FFmpegError, IndexError):
        pytest.skip("this FFmpeg does not open the named file on its own")
    assert "hls" in fmt and decoded > 0
