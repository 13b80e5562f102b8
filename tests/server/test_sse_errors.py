"""A stream cut short after its first bytes (a stage failed or refused the request mid-way)
ends with an OpenAI error event, not silently. The status line went out with the first event,
so the SSE framing is the only place to say it; this checks the framing of the chat and speech
streams (the stage-failure paths themselves are tested with real stages elsewhere)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from omnistage.errors import InvalidRequestError, StageFailedError
from omnistage.outputs import Delta
from omnistage.server.app import _sse
from omnistage.server.audio_routes import _speech_sse


async def _then_fail(exc: Exception):
    yield Delta("r", 0, " world", [2])
    raise exc


def _events(agen) -> list[str]:
    async def collect():
        return [e async for e in agen]
    return asyncio.run(collect())


@pytest.mark.parametrize("exc, kind, param", [
    (StageFailedError("the talker process died"), "internal_error", None),
    (InvalidRequestError("this image is too wide", param="image"), "invalid_request_error", "image"),
])
def test_chat_stream_ends_with_an_error_event(exc, kind, param):
    events = _events(_sse(None, Delta("r", 0, "hello", [1]), _then_fail(exc), "r", "m", True, False))
    bodies = [json.loads(e[len("data: "):]) for e in events]
    assert [b["choices"][0]["delta"]["content"] for b in bodies[:2]] == ["hello", " world"]
    assert bodies[-1] == {"error": {"message": str(exc), "type": kind, "param": param,
                                    "code": None if param else "generation_failed"}}
    assert "data: [DONE]\n\n" not in events          # not a normal end


def test_speech_stream_ends_with_an_error_event():
    first = Delta("r", 0, "", [], audio=np.zeros(240, np.float32), sample_rate=24000)
    events = _events(_speech_sse(first, _then_fail(StageFailedError("token2wav failed"))))
    bodies = [json.loads(e[len("data: "):]) for e in events]
    assert bodies[0]["type"] == "speech.audio.delta"
    assert bodies[-1]["error"]["message"] == "token2wav failed"
    assert all(b.get("type") != "speech.audio.done" for b in bodies)
