"""encode_mp4: MP4 bytes that decode back (with PyAV) to the frames given: count, size, rate,
pixel values within the codec's loss; odd sizes padded; both encoders (libx264 and the
mpeg4 fallback); bad input refused."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from omnistage.media import video_encode
from omnistage.media.video_encode import encode_mp4, video_codec


def _decode(mp4: bytes) -> tuple[np.ndarray, av.video.stream.VideoStream, str]:
    with av.open(io.BytesIO(mp4)) as box:
        stream = box.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in box.decode(video=0)])
        return frames, stream.average_rate, stream.codec_context.name


def _smooth(f: int, h: int, w: int) -> np.ndarray:
    """A moving colour gradient: content a lossy codec keeps closely."""
    y, x = np.mgrid[0:h, 0:w]
    frames = [np.stack([64 + x * 128 // w + 4 * t, 64 + y * 128 // h, np.full_like(x, 40 + 12 * t)],
                       axis=-1) for t in range(f)]
    return np.stack(frames).astype(np.uint8)


@pytest.fixture(params=["default", "mpeg4"])
def codec(request, monkeypatch) -> str:
    """Each test runs with this build's encoder and with the mpeg4 fallback."""
    if request.param == "mpeg4":
        monkeypatch.setattr(video_encode, "video_codec", lambda: "mpeg4")
        return "mpeg4"
    return {"libx264": "h264"}.get(video_codec(), video_codec())


@pytest.mark.parametrize("f, h, w", [(9, 32, 48), (1, 16, 16), (17, 64, 32)])
def test_decodes_to_the_frames_given(codec, f, h, w):
    frames = _smooth(f, h, w)
    got, rate, name = _decode(encode_mp4(frames, fps=8))
    assert name == codec and rate == 8
    assert got.shape == (f, h, w, 3)
    assert np.abs(got.astype(int) - frames).mean() < 4      # lossy, but close
    # and in order: each decoded frame is nearest to the frame encoded at its place
    dist = np.abs(got[:, None].astype(int) - frames[None]).mean(axis=(2, 3, 4))    # (F, F)
    assert (dist.argmin(axis=1) == np.arange(f)).all()


def test_odd_sizes_are_padded_to_even(codec):
    frames = _smooth(3, 33, 17)
    got, _, _ = _decode(encode_mp4(frames, fps=16))
    assert got.shape == (3, 34, 18, 3)
    assert np.abs(got[:, :33, :17].astype(int) - frames).mean() < 4


def test_same_frames_same_bytes_and_faststart(codec):
    frames = _smooth(5, 32, 32)
    mp4 = encode_mp4(frames, fps=16)
    assert mp4 == encode_mp4(frames, fps=16)
    assert mp4[4:8] == b"ftyp" and mp4.index(b"moov") < mp4.index(b"mdat")   # index first


@pytest.mark.parametrize("frames, fps", [
    (np.zeros((0, 16, 16, 3), np.uint8), 16),           # no frames
    (np.zeros((2, 16, 16, 3), np.float32), 16),         # not uint8
    (np.zeros((16, 16, 3), np.uint8), 16),              # one image, not a video
    (np.zeros((2, 16, 16, 3), np.uint8), 0),
])
def test_bad_input_is_refused(frames, fps):
    with pytest.raises(ValueError):
        encode_mp4(frames, fps)
