"""Which FFmpeg demuxer may read request media: named from the data's leading bytes, never probed.

Left to probe, FFmpeg picks any demuxer it has, among them playlist and list demuxers (hls,
dash, concat, ...) that open the files or URLs the data names: a request could make the server
read its local files, or fetch URLs past the media-fetch policy. So every decoder of request
bytes sniffs the container here, checks it against the formats it accepts, and opens the data
with that one demuxer (`open_pinned`); none of the accepted demuxers opens anything else.
"""

from __future__ import annotations

from typing import BinaryIO

import av

SNIFF_BYTES = 16                 # leading bytes `sniff` looks at

# FFmpeg demuxer names each decoder accepts.
AUDIO_DEMUXERS = ("wav", "flac", "mp3", "ogg", "aiff", "matroska", "mov")
VIDEO_DEMUXERS = ("mov", "matroska", "avi")

_MOV_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")
_RIFF = (b"RIFF", b"RIFX", b"RF64", b"BW64")
_RIFF_KINDS = {b"WAVE": "wav", b"AVI ": "avi"}
_EBML = b"\x1a\x45\xdf\xa3"
# The mov demuxer's defaults, stated: never follow a file's references to other files.
_MOV_OPTIONS = {"enable_drefs": "0", "use_absolute_path": "0"}


def sniff(head: bytes) -> str | None:
    """The FFmpeg demuxer for data that starts with `head` (its first SNIFF_BYTES bytes), or
    None when it is none of the containers above."""
    if head[4:8] in _MOV_BOXES:
        return "mov"                      # MP4, M4A, MOV, 3GP
    if head[:4] == _EBML:
        return "matroska"                 # MKV, WebM
    if head[:4] in _RIFF:
        return _RIFF_KINDS.get(head[8:12])
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"                      # Vorbis, Opus, FLAC in Ogg
    if head[:3] == b"ID3" or _mpeg_audio_frame(head):
        return "mp3"                      # MPEG audio layers I-III, ID3-tagged or not
    return None


def _mpeg_audio_frame(head: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, then a defined version and layer (ADTS AAC,
    layer bits 00, is not one)."""
    if len(head) < 2 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    return (head[1] >> 3) & 3 != 1 and (head[1] >> 1) & 3 != 0


def open_pinned(src: BinaryIO, fmt: str) -> av.container.InputContainer:
    """`src` opened for reading with the demuxer `fmt` alone (a name `sniff` returned).
    av.FFmpegError propagates: the caller words it for its field."""
    if fmt not in AUDIO_DEMUXERS + VIDEO_DEMUXERS:
        raise ValueError(f"demuxer {fmt!r} is not one request media may use")
    return av.open(src, mode="r", format=fmt,
                   container_options=_MOV_OPTIONS if fmt == "mov" else None)


def reason(e: Exception) -> str:
    """A short cause for an error message: FFmpeg's own text where it has one."""
    text = e.strerror if isinstance(e, av.FFmpegError) else None
    return text or str(e) or type(e).__name__
