"""/v1/audio/speech (text in, speech out) and /v1/audio/transcriptions (speech in, text out),
served by an omni model: its thinker reads or transcribes, its talker and token2wav speak."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Literal

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError, OmniStageError
from omnistage.media.audio import decode_audio
from omnistage.media.encode import AudioStreamEncoder, change_speed, content_type, encode_audio
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams
from omnistage.server.access_log import AccessRecord
from omnistage.server.errors import error_event
from omnistage.server.streams import DeltaStreamingResponse, chain
from omnistage.server.transcribe import transcribe
from omnistage.server.voices import resolve_voice

READ_ALOUD = "Read the following text aloud, exactly as written, and say nothing else:\n\n"


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str = Field(min_length=1, max_length=4096)        # OpenAI's limit
    voice: str | None = None
    instructions: str | None = Field(None, max_length=4096)
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    stream_format: Literal["sse", "audio"] | None = None     # None: the whole file at once


def add_audio_routes(app: FastAPI, engine, stats, model_name: str, check_model) -> None:
    @app.post("/v1/audio/speech")
    async def speech(body: SpeechBody, request: Request):
        check_model(body.model)
        return await _speech(engine, stats, body, f"speech-{request.state.request_id}",
                             request.state.access)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request, file: UploadFile = File(...), model: str = Form(...),
                             language: str | None = Form(None), prompt: str | None = Form(None),
                             response_format: str = Form("json"), temperature: float = Form(0.0)):
        check_model(model)
        if not engine.abilities.audio_input:
            raise InvalidRequestError("this model does not take audio", param="model")
        if response_format not in ("json", "text", "verbose_json"):
            raise InvalidRequestError("response_format must be json, text or verbose_json",
                                      param="response_format")
        if not 0.0 <= temperature <= 1.0:
            raise InvalidRequestError("temperature must be in [0, 1]", param="temperature")
        data = await file.read()
        if not data:
            raise InvalidRequestError("file is empty", param="file")
        return await _transcribe(engine, data, prompt, temperature, language, response_format,
                                 f"transcribe-{request.state.request_id}", request.state.access)


async def _speech(engine, stats, body: SpeechBody, rid: str, record: AccessRecord):
    can = engine.abilities
    if not can.audio_output:
        raise InvalidRequestError("this model does not produce speech", param="model")
    if body.stream_format is not None and body.speed != 1.0:
        raise InvalidRequestError("speed applies to whole files; drop it or stream_format",
                                  param="speed")
    text = (body.instructions.strip() + "\n\n" if body.instructions else "") + READ_ALOUD + body.input
    # The thinker's answer is forced to be the input, verbatim, then its end-of-turn token:
    # the talker speaks from the thinker's hidden states over exactly those tokens.
    forced = engine.tokenizer.encode(body.input, add_special_tokens=False) + [can.end_of_turn_id]
    if len(forced) >= can.max_model_len // 2:
        raise InvalidRequestError("input is too long for this model's context window", param="input")
    deltas = engine.generate([{"role": "user", "content": text}],
                             SamplingParams(temperature=0, max_tokens=len(forced), forced_token_ids=forced),
                             request_id=rid,
                             output=OutputOptions(modalities=["text", "audio"],
                                                  voice=resolve_voice(body.voice, can.speakers)))
    first = await anext(deltas)     # request errors surface before any byte is sent
    record.audio_seconds = 0.0

    def counted(d) -> None:        # a streamed chunk: into the metrics and the access log
        stats.audio_seconds += d.audio.size / d.sample_rate
        record.audio_seconds += d.audio.size / d.sample_rate

    if body.stream_format == "sse":
        return DeltaStreamingResponse(_speech_sse(first, deltas, counted), deltas,
                                      media_type="text/event-stream")
    if body.stream_format == "audio":
        return DeltaStreamingResponse(_speech_chunks(first, deltas, body.response_format, can.sample_rate,
                                                     counted), deltas,
                                      media_type=content_type(body.response_format))
    chunks, rate = [], can.sample_rate
    async for d in chain(first, deltas):
        if d.audio is not None:
            chunks.append(d.audio)
            rate = d.sample_rate
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if body.speed != 1.0:
        samples = change_speed(samples, rate, body.speed)
    stats.audio_seconds += samples.size / rate
    record.audio_seconds = samples.size / rate
    return Response(encode_audio(samples, rate, body.response_format),
                    media_type=content_type(body.response_format))


async def _transcribe(engine, data: bytes, prompt: str | None, temperature: float,
                      language: str | None, response_format: str, rid: str, record: AccessRecord):
    # decoded here (off the event loop), so the reply knows the audio's duration
    audio = await asyncio.to_thread(decode_audio, data, param="file",
                                    max_seconds=engine.abilities.max_audio_seconds)
    t0 = time.monotonic()
    text, duration = "", round(audio.duration, 3)
    record.audio_seconds, record.completion_tokens = audio.duration, 0    # the audio heard
    try:
        async for d in transcribe(engine, audio.samples, rid, language, prompt, temperature):
            text += d.text
            record.prompt_tokens = max(record.prompt_tokens or 0, d.num_prompt_tokens)
            record.completion_tokens += len(d.token_ids)
    except InvalidRequestError as e:
        if e.param == "messages[0].content":    # the uploaded file failed to decode
            raise InvalidRequestError(str(e).replace("messages[0].content", "file"), param="file") from e
        raise
    text = text.strip()
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "verbose_json":
        return JSONResponse({"task": "transcribe", "language": language or "unknown",
                             "duration": duration, "text": text,
                             "processing_seconds": round(time.monotonic() - t0, 3)})
    return JSONResponse({"text": text})


def _uncounted(d) -> None:
    pass


async def _speech_sse(first, deltas, counted: Callable[[Delta], None] = _uncounted):
    try:
        async for d in chain(first, deltas):
            if d.audio is not None:
                counted(d)
                pcm = encode_audio(d.audio, d.sample_rate, "pcm")
                yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': base64.b64encode(pcm).decode()})}\n\n"
    except OmniStageError as e:   # a stage failed mid-stream: say so instead of a silent end
        yield error_event(e)
        return
    yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n"


async def _speech_chunks(first, deltas, fmt: str, sample_rate: int,
                         counted: Callable[[Delta], None] = _uncounted):
    enc, done = AudioStreamEncoder(fmt, sample_rate), False
    try:
        async for d in chain(first, deltas):
            if d.audio is not None:
                counted(d)
                out = enc.push(d.audio)
                if out:
                    yield out
        tail, done = enc.finish(), True
        if tail:
            yield tail
    finally:
        if not done:
            enc.close()        # the client went away mid-stream
