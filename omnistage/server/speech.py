"""Speech in the chat API: what a request asks to hear back, how audio rides in responses
(`message.audio` whole, `delta.audio` streamed as base64 PCM16), and media URLs turned into
inline bytes under the server's fetch policy."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

import numpy as np

from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.media.encode import encode_audio
from omnistage.media.fetch import MediaFetchPolicy, fetch_media
from omnistage.outputs import Delta
from omnistage.server.voices import resolve_voice

AUDIO_TTL_S = 3600      # message.audio.expires_at: how long the id stays meaningful


@dataclass
class SpeechRequest:
    options: OutputOptions
    speaks: bool
    format: str = "wav"


def output_options(engine, body) -> SpeechRequest:
    """The chat request's modalities/audio/talker fields, checked against the model."""
    mods = body.modalities or ["text"]
    speaks = "audio" in mods
    can = engine.abilities
    if speaks and not can.audio_output:
        raise InvalidRequestError("this model produces text only; drop 'audio' from modalities",
                                  param="modalities")
    if body.audio is not None and not speaks:
        raise InvalidRequestError("'audio' was given but modalities lacks 'audio'", param="audio")
    fmt = body.audio.format if body.audio is not None else "wav"
    if speaks and body.stream and fmt != "pcm16":
        raise InvalidRequestError("streamed audio is sent as pcm16; set audio.format to 'pcm16' "
                                  "or stream=false", param="audio.format")
    talker = None
    if body.talker is not None:
        if not speaks:
            raise InvalidRequestError("'talker' applies to audio output only", param="talker")
        talker = body.talker.merged(can.talker_defaults)
    # (omni models check the modalities; a text model makes text whatever the list says)
    opts = OutputOptions(modalities=list(mods) if can.audio_input else ["text"],
                         voice=resolve_voice(body.audio.voice if body.audio is not None else None,
                                             can.speakers),
                         talker_params=talker, use_audio_in_video=body.use_audio_in_video)
    return SpeechRequest(opts, speaks, fmt)


class AudioCollector:
    """Gathers a request's PCM chunks for a whole (non-streamed) answer."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.sample_rate = 24000

    def add(self, d: Delta) -> None:
        if d.audio is not None:
            self.chunks.append(d.audio)
            self.sample_rate = d.sample_rate

    def message_audio(self, fmt: str, transcript: str) -> dict:
        samples = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        data = encode_audio(samples, self.sample_rate, fmt)
        return {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(data).decode(),
                "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": transcript}


def stream_audio_delta(audio_id: str, d: Delta) -> dict:
    out: dict = {"id": audio_id}
    if d.audio is not None:
        out["data"] = base64.b64encode(encode_audio(d.audio, d.sample_rate, "pcm")).decode()
    if d.text:
        out["transcript"] = d.text
    return out


_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


async def resolve_media_urls(messages: list, policy: MediaFetchPolicy) -> list:
    """http(s) media URLs -> inline bytes parts, fetched under `policy` (refused when no
    domain is allowed). data: URLs and other parts pass through untouched."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            url = _url_of(part, kind)
            if url is None or url.startswith("data:"):
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}]"
            if not policy.allowed_domains:
                raise InvalidRequestError(f"{param}: media URLs are not fetched by this server; send "
                                          f"the media inline as a data: URL, or start the server with "
                                          f"--allowed-media-domains", param=param)
            fetched = await fetch_media(url, policy, param=param)
            parts.append({"type": _URL_PARTS[kind], _URL_PARTS[kind]: fetched.data})
        out.append({**m, "content": parts})
    return out


def _url_of(part, kind) -> str | None:
    if kind not in _URL_PARTS:
        return None
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None
