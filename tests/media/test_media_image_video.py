"""Image and video decoding: formats, sampling and timing, audio tracks, limits, bad input."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import av
import numpy as np
import pytest
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.media.image import decode_image, parse_data_url
from omnistage.media.video import (VideoLimits, VideoSampling, decode_video,
                                   sample_frame_indices)

PARAM = "messages[0].content[1]"


# --- images -----------------------------------------------------------------------------------

def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("WEBP", {"lossless": True})])
def test_lossless_formats_roundtrip(fmt, kw):
    pixels = _noise(17, 23)
    img = decode_image(_encode(Image.fromarray(pixels), fmt, **kw))
    assert img.mode == "RGB" and img.size == (23, 17)
    np.testing.assert_array_equal(np.asarray(img), pixels)


def test_jpeg_and_grayscale():
    smooth = np.tile(np.linspace(0, 255, 40, dtype=np.uint8), (30, 1))
    rgb = np.stack([smooth, smooth[::-1], np.full_like(smooth, 90)], -1)
    img = decode_image(_encode(Image.fromarray(rgb), "JPEG", quality=95))
    assert img.mode == "RGB" and img.size == (40, 30)
    assert np.abs(np.asarray(img).astype(int) - rgb).mean() < 3
    gray = decode_image(_encode(Image.fromarray(smooth, mode="L"), "PNG"))
    np.testing.assert_array_equal(np.asarray(gray), np.stack([smooth] * 3, -1))


def test_gif_gives_first_frame():
    red, blue = (Image.new("RGB", (8, 6), c) for c in ((255, 0, 0), (0, 0, 255)))
    buf = io.BytesIO()
    red.save(buf, format="GIF", save_all=True, append_images=[blue], duration=100)
    img = decode_image(buf.getvalue())
    assert img.mode == "RGB"
    assert tuple(np.asarray(img)[0, 0]) == (255, 0, 0)


def test_transparency_is_composited_on_white():
    rgba = np.zeros((4, 4, 4), np.uint8)                  # transparent black
    rgba[0, 0] = (0, 0, 0, 255)                           # opaque black
    rgba[0, 1] = (255, 0, 0, 128)                         # half red
    img = np.asarray(decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG")))
    assert tuple(img[1, 1]) == (255, 255, 255)
    assert tuple(img[0, 0]) == (0, 0, 0)
    assert tuple(img[0, 1]) == (255, 127, 127)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, followed by a tiny, truncated IDAT."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def test_max_pixels_is_checked_from_the_header():
    data = _png_header_only(8000, 8000)                  # 64 MP claimed, almost no data
    with pytest.raises(InvalidRequestError, match="over the limit") as e:
        decode_image(data, max_pixels=50_000_000, param=PARAM)
    assert e.value.param == PARAM
    # Within the limit the same bytes get as far as decoding, and fail there as truncated.
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        decode_image(data, max_pixels=100_000_000)
    with pytest.raises(InvalidRequestError, match="over the limit"):
        decode_image(_encode(Image.new("RGB", (100, 100)), "PNG"), max_pixels=9_999)


def test_decompression_bomb_is_rejected():
    with pytest.raises(InvalidRequestError, match="over the limit"):
        decode_image(_png_header_only(60_000, 60_000), max_pixels=10**12)


@pytest.mark.parametrize("data", [
    b"", b"not an image at all", _encode(Image.new("RGB", (4, 4)), "BMP"),
    _encode(Image.fromarray(_noise(64, 64)), "JPEG")[:300],
    _encode(Image.fromarray(_noise(64, 64)), "PNG")[:200],
])
def test_bad_images_raise_invalid_request(data):
    with pytest.raises(InvalidRequestError) as e:
        decode_image(data, param=PARAM)
    assert e.value.param == PARAM


def test_data_urls():
    png = _encode(Image.new("RGB", (3, 2), (1, 2, 3)), "PNG")
    b64 = base64.b64encode(png).decode()
    url = parse_data_url(f"data:image/png;base64,{b64}", param=PARAM)
    assert url.mime_type == "image/png" and url.data == png
    wrapped = "\n".join(b64[i:i + 20] for i in range(0, len(b64), 20))
    assert parse_data_url(f"DATA:Image/PNG;BASE64,{wrapped}", param=PARAM).data == png
    plain = parse_data_url("data:,hello%20world", param=PARAM)
    assert plain.mime_type == "text/plain" and plain.data == b"hello world"
    assert np.asarray(decode_image(url.data))[0, 0].tolist() == [1, 2, 3]


@pytest.mark.parametrize("url,match", [
    ("https://example.com/a.png", "must be a data: URL"),
    ("data:image/png;base64", "without a ','"),
    ("data:image/png;base64,@@@@", "invalid base64"),
    ("data:png;base64,AAAA", "invalid media type"),
    ("data:image/png;base64," + "A" * 4000, "more than 1,000 bytes"),
])
def test_bad_data_urls(url, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        parse_data_url(url, param=PARAM, max_bytes=1000)
    assert e.value.param == PARAM


# --- videos -----------------------------------------------------------------------------------

def _write_video(fmt: str, vcodec: str, acodec: str | None = None, frames: int = 30,
                 fps: int = 10, size: tuple[int, int] = (64, 48), tone: float = 440.0,
                 audio_seconds: float | None = None, live: bool = False) -> bytes:
    """Frame i is a flat grey of level 8*i; the audio (stereo, both channels equal) a sine
    lasting as long as the video unless `audio_seconds`. `live` (matroska only) writes no
    duration and no frame count into the header."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt, options={"live": "1"} if live else {}) as out:
        video = out.add_stream(vcodec, rate=fps)
        video.width, video.height = size
        video.pix_fmt = "yuv420p"
        audio = None
        if acodec:
            audio = out.add_stream(acodec, rate=48000 if acodec == "libopus" else 44100)
            audio.layout = "stereo"
        for i in range(frames):
            grey = np.full((size[1], size[0], 3), 8 * i % 256, np.uint8)
            out.mux(video.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")))
        out.mux(video.encode())
        if audio:
            rate = audio.rate
            t = np.arange(int((audio_seconds or frames / fps) * rate)) / rate
            wave = (0.5 * np.sin(2 * np.pi * tone * t)).astype(np.float32)
            step = audio.codec_context.frame_size or 1024
            for s in range(0, len(wave), step):
                block = wave[s:s + step]
                frame = av.AudioFrame.from_ndarray(np.stack([block, block]), format="fltp",
                                                   layout="stereo")
                frame.sample_rate, frame.pts = rate, s
                out.mux(audio.encode(frame))
            out.mux(audio.encode())
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4_with_audio() -> bytes:
    return _write_video("mp4", "mpeg4", "aac")


def _levels(frames: np.ndarray) -> np.ndarray:
    return frames.reshape(len(frames), -1).mean(axis=1)


def test_sample_frame_indices():
    s = VideoSampling()
    assert sample_frame_indices(30, 10.0, s) == [0, 5, 10, 15, 20, 25]      # 3 s -> 6 frames
    assert sample_frame_indices(30, 30.0, s) == [0, 7, 15, 22]              # 1 s: min_frames 4
    assert sample_frame_indices(31, 10.0, s) == [0, 5, 10, 15, 20, 25]      # 6.2 -> 6
    assert sample_frame_indices(3, 30.0, s) == [0, 1]                       # even, <= total
    assert sample_frame_indices(1, 30.0, s) == [0]
    long = sample_frame_indices(30 * 3600, 30.0, VideoSampling(max_frames=100))
    assert len(long) == 100 and long[1] == 1080
    assert len(sample_frame_indices(25 * 7, 25.0, VideoSampling(fps=1.0))) == 6  # 7 -> floor even


def test_mp4_frames_timing_and_audio(mp4_with_audio):
    v = decode_video(mp4_with_audio, with_audio=True)
    assert v.frames.shape == (6, 48, 64, 3) and v.frames.dtype == np.uint8
    np.testing.assert_allclose(v.frame_times, [0, 0.5, 1, 1.5, 2, 2.5], atol=1e-6)
    assert (v.fps, v.duration, v.source_fps, v.source_frames) == (2.0, 3.0, 10.0, 30)
    # Sampled source frames 0, 5, ..., 25 have grey levels 0, 40, ..., 200 (lossy codec).
    np.testing.assert_allclose(_levels(v.frames), [0, 40, 80, 120, 160, 200], atol=4)
    a = v.audio
    assert a.dtype == np.float32 and a.ndim == 1 and v.audio_sample_rate == 16000
    assert abs(len(a) - 48000) < 1000                   # 3 s (+ AAC priming/padding)
    peak_hz = np.argmax(np.abs(np.fft.rfft(a))) * 16000 / len(a)
    assert abs(peak_hz - 440) < 2
    assert 0.45 < np.abs(a[4000:-4000]).max() < 0.55    # mean of two equal channels


def test_audio_is_only_decoded_when_asked(mp4_with_audio):
    assert decode_video(mp4_with_audio).audio is None


@pytest.mark.parametrize("fmt,vcodec,acodec", [("webm", "libvpx", "libopus"),
                                               ("matroska", "libx264", "flac")])
def test_webm_and_mkv_without_frame_count_in_header(fmt, vcodec, acodec):
    data = _write_video(fmt, vcodec, acodec, frames=25, fps=10)
    v = decode_video(data, with_audio=True, audio_sample_rate=8000)
    assert v.source_frames == 25 and len(v.frames) == 4      # 2.5 s -> 5 -> 4 frames
    np.testing.assert_allclose(_levels(v.frames), [0, 48, 96, 144], atol=4)  # frames 0, 6, 12, 18
    assert abs(len(v.audio) - 20000) < 1000 and v.audio_sample_rate == 8000


def test_video_without_audio_track():
    v = decode_video(_write_video("mp4", "mpeg4", frames=9, fps=3), with_audio=True)
    assert v.audio is None and v.source_frames == 9
    assert len(v.frames) == 6                                # 3 s at 2 fps


def test_sampling_settings_are_used(mp4_with_audio):
    v = decode_video(mp4_with_audio, sampling=VideoSampling(fps=1.0, min_frames=2))
    # 3 s at 1 fps -> 3 frames, floored to 2, spread evenly: source frames 0 and 15
    np.testing.assert_allclose(v.frame_times, [0, 1.5], atol=1e-6)
    assert v.fps == pytest.approx(2 / 3)


@pytest.mark.parametrize("limits,match", [
    (VideoLimits(max_frames=20), "over the limit of 20 frames"),
    (VideoLimits(max_seconds=2.0), "over the limit of 2 s"),
    (VideoLimits(max_pixels=64 * 48 - 1), "pixels per frame"),
    (VideoLimits(max_sampled_bytes=5 * 64 * 48 * 3), "for its sampled frames"),   # 6 kept
])
def test_limits(mp4_with_audio, limits, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        decode_video(mp4_with_audio, limits=limits, param=PARAM)
    assert e.value.param == PARAM


@pytest.mark.parametrize("limits,match", [
    (VideoLimits(max_frames=20), "more than 20 frames"),
    (VideoLimits(max_seconds=2.0), "lasts more than 2 s"),
])
def test_limits_without_header_counts(limits, match):
    # A live stream's header has neither duration nor frame count: the limits stop the
    # demuxing that counts frames.
    data = _write_video("matroska", "libx264", frames=30, fps=10, live=True)
    assert decode_video(data).source_frames == 30
    with pytest.raises(InvalidRequestError, match=match):
        decode_video(data, limits=limits)


def test_audio_track_longer_than_the_limit_stops_decoding():
    # 2 s of video, 12 s of audio, no durations in the header: the video passes the limit, and
    # the audio is cut off while decoding.
    data = _write_video("matroska", "libx264", "flac", frames=20, fps=10, audio_seconds=12,
                        live=True)
    with pytest.raises(InvalidRequestError, match="more than 3 s of audio"):
        decode_video(data, with_audio=True, limits=VideoLimits(max_seconds=3))
    assert decode_video(data, limits=VideoLimits(max_seconds=3)).audio is None
    v = decode_video(data, with_audio=True, limits=VideoLimits(max_seconds=13))
    assert abs(len(v.audio) - 12 * 16000) < 1000


def test_long_audio_track_only_counts_when_asked_for():
    # MP4 headers give each stream's duration: 2 s of video pass a 3 s limit although the
    # (unwanted) audio lasts 12 s; asking for the audio hits the limit while decoding it.
    data = _write_video("mp4", "mpeg4", "aac", frames=20, fps=10, audio_seconds=12)
    limits = VideoLimits(max_seconds=3)
    assert len(decode_video(data, limits=limits).frames) == 4
    with pytest.raises(InvalidRequestError, match="more than 3 s of audio"):
        decode_video(data, with_audio=True, limits=limits)


@pytest.mark.parametrize("make", [
    lambda d: b"",
    lambda d: b"\x00" * 64,
    lambda d: d[:len(d) // 2],                              # moov atom (at the end) cut off
    lambda d: d[:32] + bytes(len(d) - 32),                  # ftyp, then zeros
    lambda d: b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n",  # a playlist is never opened
])
def test_corrupt_or_unsupported_videos(mp4_with_audio, make):
    with pytest.raises(InvalidRequestError) as e:
        decode_video(make(mp4_with_audio), param=PARAM)
    assert e.value.param == PARAM


def test_audio_only_file_is_not_a_video():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        out.mux(s.encode(frame))
        out.mux(s.encode())
    with pytest.raises(InvalidRequestError, match="no video stream"):
        decode_video(buf.getvalue())
