"""Decode a request video (MP4/MOV, WebM/MKV, AVI) into sampled RGB frames, plus its audio.

Frame sampling follows transformers' Qwen2-VL video processor, which Qwen2.5-Omni's processor
uses: about `fps` (2) frames per second of video, clamped to [min_frames, max_frames] and to
the frame count, floored to a multiple of the temporal patch size (2); frame i of n is source
frame floor(i * total / n). The source frame count comes from the container header (MP4) or,
where the header lacks it (WebM/MKV), from a demux pass that counts packets without decoding.

Safety: the container is identified from its leading bytes and opened with that demuxer only
(`omnistage.media.container`; no probing: FFmpeg's playlist/concat demuxers would otherwise
open files or URLs named in the data). `VideoLimits` are checked against the header first,
then again on every decoded frame and audio block, so decoding stops at the first frame over
a limit with InvalidRequestError. Decoding stops after the last sampled frame unless the audio
track is wanted.

The audio track (for use_audio_in_video) is averaged to mono, then resampled with libswresample,
the same conventions as `omnistage.media.audio`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from omnistage.errors import InvalidRequestError
from omnistage.media.audio import resample
from omnistage.media.container import SNIFF_BYTES, VIDEO_DEMUXERS, open_pinned, reason, sniff


@dataclass(frozen=True)
class VideoSampling:
    """Which frames to keep (transformers' Qwen2-VL video processor defaults)."""
    fps: float = 2.0            # sampled frames per second of video
    min_frames: int = 4
    max_frames: int = 768       # sampled frames at most
    frame_factor: int = 2       # the count is a multiple of this (temporal_patch_size)

    def __post_init__(self):
        if self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.frame_factor < 1 or self.min_frames < 1:
            raise ValueError("frame_factor and min_frames must be >= 1")
        if self.max_frames < max(self.min_frames, self.frame_factor):
            raise ValueError(f"max_frames ({self.max_frames}) must be >= min_frames "
                             f"({self.min_frames}) and frame_factor ({self.frame_factor})")


@dataclass(frozen=True)
class VideoLimits:
    """What one request may cost to decode; exceeding any is the client's error."""
    max_frames: int = 36_000            # source frames decoded (20 min at 30 fps)
    max_seconds: float = 600.0          # of video (and of its audio track)
    max_pixels: int = 3840 * 2160       # per frame
    max_sampled_bytes: int = 2 << 30    # RGB of the kept frames (1080p: ~340 frames)

    def __post_init__(self):
        positive = (self.max_frames, self.max_pixels, self.max_sampled_bytes, self.max_seconds)
        if min(positive) <= 0:
            raise ValueError(f"video limits must be positive, got {self}")


@dataclass
class DecodedVideo:
    frames: np.ndarray          # (T, H, W, 3) uint8 RGB, the sampled frames in order
    frame_times: np.ndarray     # (T,) float64 seconds of each frame from the first frame
    fps: float                  # sampled frames per second of source video (uniform spacing)
    duration: float             # seconds of video (source frames / source fps)
    source_fps: float
    source_frames: int
    audio: np.ndarray | None    # (S,) float32 mono at audio_sample_rate; None: not asked or absent
    audio_sample_rate: int


def sample_frame_indices(total_frames: int, source_fps: float,
                         sampling: VideoSampling) -> list[int]:
    """Source frame indices to keep, ascending (HF Qwen2-VL `sample_frames` with `fps`)."""
    if total_frames < 1:
        return []
    f = sampling.frame_factor
    cap = min(sampling.max_frames, total_frames) // f * f
    if cap == 0:                        # fewer frames than one temporal patch: keep them all
        return list(range(total_frames))
    want = total_frames / source_fps * sampling.fps
    n = int(min(max(want, sampling.min_frames), cap, total_frames) // f * f)
    # Exact integer form of HF's arange(0, total, total / n).int() (no float-step surprises).
    return [i * total_frames // n for i in range(n)]


def decode_video(data: bytes | bytearray | memoryview, *, sampling: VideoSampling = VideoSampling(),
                 limits: VideoLimits = VideoLimits(), with_audio: bool = False,
                 audio_sample_rate: int = 16000, param: str = "video") -> DecodedVideo:
    """Decode sampled RGB frames (and, if `with_audio`, the mono audio track) of a video file.

    Raises InvalidRequestError(param=param) for empty, unsupported or corrupt data, a video
    without a video stream, and anything over `limits`.
    """
    data = bytes(data)
    fmt = sniff(data[:SNIFF_BYTES])
    if fmt not in VIDEO_DEMUXERS:
        raise InvalidRequestError(f"{param} is {'empty' if not data else 'not a supported video'}"
                                  "; send an mp4, mov, webm, mkv or avi file", param=param)
    with _open(data, fmt, param) as container:
        stream = _video_stream(container, param)
        _check_header(container, stream, limits, param)
        source_fps = _source_fps(stream, param)
        frame_bytes = stream.codec_context.width * stream.codec_context.height * 3
        total = stream.frames if stream.frames > 0 else None
    if total is None:
        with _open(data, fmt, param) as container:
            total = _count_frames(container, _video_stream(container, param), limits, param)
    if total > limits.max_frames:
        raise _over(param, f"has {total} frames", f"{limits.max_frames} frames")
    if total / source_fps > limits.max_seconds:
        raise _over(param, f"lasts {total / source_fps:.1f} s", f"{limits.max_seconds:g} s")
    indices = sample_frame_indices(total, source_fps, sampling)
    if not indices:
        raise InvalidRequestError(f"{param} has no video frames; send a non-empty video",
                                  param=param)
    _check_sampled_bytes(len(indices) * frame_bytes, limits, param)
    with _open(data, fmt, param) as container:
        decoder = _Decoder(container, limits, with_audio, source_fps, param)
        frames, times = decoder.run(indices)
        audio = decoder.audio(audio_sample_rate)
    n = len(frames)
    if n < len(indices) and n >= sampling.frame_factor:
        n -= n % sampling.frame_factor       # the stream ended early: keep whole temporal patches
    return DecodedVideo(frames=np.stack(frames[:n]), frame_times=np.asarray(times[:n]),
                        fps=len(indices) / total * source_fps, duration=total / source_fps,
                        source_fps=source_fps, source_frames=total, audio=audio,
                        audio_sample_rate=audio_sample_rate)


class _Decoder:
    """One demux pass: keeps the sampled video frames, collects mono audio, checks limits."""

    def __init__(self, container: av.container.InputContainer, limits: VideoLimits,
                 with_audio: bool, source_fps: float, param: str):
        self.container, self.limits, self.param = container, limits, param
        self.source_fps = source_fps
        self.video = container.streams.video[0]
        self.video.thread_type = "AUTO"          # frame threads: same pixels, faster
        audio = container.streams.audio
        self.audio_stream = audio[0] if with_audio and audio else None
        self.audio_parts: list[np.ndarray] = []        # (n,) float32 mono blocks
        self.to_float = av.AudioResampler(format="fltp")
        self.audio_rate = 0
        self.audio_samples = 0
        self.decoded = 0                          # video frames decoded so far
        self.t0: float | None = None

    def run(self, indices: list[int]) -> tuple[list[np.ndarray], list[float]]:
        wanted, last = set(indices), indices[-1]
        frames: list[np.ndarray] = []
        times: list[float] = []
        streams = [self.video] + ([self.audio_stream] if self.audio_stream else [])
        try:
            for packet in self.container.demux(*streams):
                if packet.stream.type == "audio":
                    for frame in packet.decode():
                        self._take_audio(frame)
                    continue
                if self.decoded > last:          # every sampled frame is in hand
                    if self.audio_stream is None:
                        break
                    continue                     # keep demuxing for the audio only
                for frame in packet.decode():
                    t = self._check_frame(frame)
                    if self.decoded in wanted:
                        rgb = frame.to_ndarray(format="rgb24")            # (H, W, 3) uint8
                        if frames and rgb.shape != frames[0].shape:
                            raise InvalidRequestError(
                                f"{self.param} changes resolution mid-stream; re-encode it at "
                                "one frame size", param=self.param)
                        frames.append(rgb)
                        times.append(t)
                        _check_sampled_bytes(len(frames) * rgb.nbytes, self.limits, self.param)
                    self.decoded += 1
        except av.FFmpegError as e:
            raise InvalidRequestError(f"{self.param} is corrupt: decoding failed after "
                                      f"{self.decoded} frames ({reason(e)}); re-encode the file",
                                      param=self.param) from None
        if not frames:
            raise InvalidRequestError(f"{self.param} has no decodable video frames; re-encode "
                                      "the file", param=self.param)
        return frames, times

    def audio(self, sample_rate: int) -> np.ndarray | None:
        if not self.audio_parts:
            return None
        return resample(np.concatenate(self.audio_parts), self.audio_rate, sample_rate)

    def _check_frame(self, frame: av.VideoFrame) -> float:
        """Seconds since the first frame, after checking every limit."""
        lim, p = self.limits, self.param
        if self.decoded >= lim.max_frames:
            raise _over(p, f"has more than {lim.max_frames} frames", f"{lim.max_frames} frames")
        if frame.width * frame.height > lim.max_pixels:
            raise _over(p, f"has {frame.width}x{frame.height} frames", f"{lim.max_pixels:,} pixels "
                        "per frame")
        t = frame.time if frame.time is not None else self.decoded / self.source_fps
        self.t0 = t if self.t0 is None else self.t0
        if t - self.t0 > lim.max_seconds:
            raise _over(p, f"lasts more than {lim.max_seconds:g} s", f"{lim.max_seconds:g} s")
        return t - self.t0

    def _take_audio(self, frame: av.AudioFrame) -> None:
        if self.audio_rate and frame.sample_rate != self.audio_rate:
            raise InvalidRequestError(f"{self.param}'s audio changes sample rate mid-stream "
                                      f"({self.audio_rate} -> {frame.sample_rate} Hz); re-encode "
                                      "it at one rate", param=self.param)
        self.audio_rate = frame.sample_rate
        self.audio_samples += frame.samples
        if self.audio_samples > self.limits.max_seconds * self.audio_rate:
            raise _over(self.param, f"has more than {self.limits.max_seconds:g} s of audio",
                        f"{self.limits.max_seconds:g} s")
        # Any sample format -> float planar (C, n) at the same rate and layout, then the
        # channel mean (librosa's to_mono convention, as omnistage.media.audio).
        for planar in self.to_float.resample(frame):
            self.audio_parts.append(planar.to_ndarray().mean(axis=0, dtype=np.float32))


def _open(data: bytes, fmt: str, param: str) -> av.container.InputContainer:
    try:
        return open_pinned(io.BytesIO(data), fmt)
    except av.FFmpegError as e:
        raise InvalidRequestError(f"{param} could not be opened as a video ({reason(e)}); send a "
                                  "complete mp4, mov, webm, mkv or avi file", param=param) from None


def _video_stream(container: av.container.InputContainer, param: str) -> av.VideoStream:
    if not container.streams.video:
        raise InvalidRequestError(f"{param} has no video stream; send a video file (audio goes "
                                  "in an audio part)", param=param)
    return container.streams.video[0]


def _check_header(container, stream: av.VideoStream, limits: VideoLimits, param: str) -> None:
    """Reject what the header already shows to be over a limit, before decoding anything."""
    ctx = stream.codec_context
    if ctx.width * ctx.height > limits.max_pixels:
        raise _over(param, f"has {ctx.width}x{ctx.height} frames",
                    f"{limits.max_pixels:,} pixels per frame")
    # The video stream's own duration where the header has it: an unwanted long audio track
    # must not reject the video. The container's (longest stream) otherwise.
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1e6
    else:
        return
    if seconds > limits.max_seconds:
        raise _over(param, f"lasts {seconds:.1f} s", f"{limits.max_seconds:g} s")


def _check_sampled_bytes(nbytes: int, limits: VideoLimits, param: str) -> None:
    if nbytes > limits.max_sampled_bytes:
        raise _over(param, f"needs {nbytes / 2**20:,.0f} MiB for its sampled frames",
                    f"{limits.max_sampled_bytes / 2**20:,.0f} MiB")


def _source_fps(stream: av.VideoStream, param: str) -> float:
    rate = stream.average_rate or stream.guessed_rate
    if not rate or float(rate) <= 0:
        raise InvalidRequestError(f"{param} declares no frame rate; re-encode it with a constant "
                                  "frame rate", param=param)
    return float(rate)


def _count_frames(container, stream: av.VideoStream, limits: VideoLimits, param: str) -> int:
    """Frames in a stream whose header lacks the count: one packet per frame, nothing decoded."""
    n = 0
    start = None
    try:
        for packet in container.demux(stream):
            if packet.size == 0:              # the demuxer's end-of-stream marker
                continue
            n += 1
            if n > limits.max_frames:
                raise _over(param, f"has more than {limits.max_frames} frames",
                            f"{limits.max_frames} frames")
            if packet.pts is not None and packet.time_base is not None:
                t = float(packet.pts * packet.time_base)
                start = t if start is None else min(start, t)
                if t - start > limits.max_seconds:
                    raise _over(param, f"lasts more than {limits.max_seconds:g} s",
                                f"{limits.max_seconds:g} s")
    except av.FFmpegError as e:
        raise InvalidRequestError(f"{param} is corrupt ({reason(e)}); re-encode the file",
                                  param=param) from None
    return n


def _over(param: str, what: str, limit: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {what}, over the limit of {limit}; send a shorter or "
                               "smaller video", param=param)
