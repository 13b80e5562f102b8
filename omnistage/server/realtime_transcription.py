"""Input audio transcription for Realtime sessions (`audio.input.transcription`): a committed
user audio item transcribed by the served model, beside any response, as
conversation.item.input_audio_transcription.delta / .completed (or .failed) events."""

from __future__ import annotations

import logging

from omnistage.errors import InvalidRequestError
from omnistage.server.admission import Admission
from omnistage.server.realtime_events import InputTranscription, Item, RealtimeError, usage_json
from omnistage.server.realtime_response import ClientGone, Send
from omnistage.server.transcribe import transcribe

log = logging.getLogger(__name__)


async def transcribe_item(engine, admission: Admission, send: Send, item: Item,
                          how: InputTranscription) -> None:
    """Transcribes the audio item with its own engine request and admission ticket; the
    transcript is kept in the item. A failure is a .failed event, never an exception."""
    where = {"item_id": item.id, "content_index": 0}
    ticket = admission.try_acquire()
    try:
        if ticket is None:
            raise RealtimeError("the server is at its request bound; the audio was not "
                                "transcribed", None, "rate_limit_exceeded")
        deltas = transcribe(engine, item.parts[0].audio, f"realtime-{item.id}-asr",
                            how.language, how.prompt)
        text, prompt_tokens, output_tokens = "", 0, 0
        try:
            async for d in deltas:
                prompt_tokens = max(prompt_tokens, d.num_prompt_tokens)
                output_tokens += len(d.token_ids)
                if d.text:
                    text += d.text
                    await send({"type": "conversation.item.input_audio_transcription.delta",
                                **where, "delta": d.text})
        finally:
            await deltas.aclose()
        item.parts[0].text = text.strip()
        await send({"type": "conversation.item.input_audio_transcription.completed",
                    **where, "transcript": item.parts[0].text,
                    "usage": {"type": "tokens", **usage_json(prompt_tokens, output_tokens)}})
    except ClientGone:
        pass
    except Exception as e:  # noqa: BLE001 - a failed transcript is an event, not a crash
        if not isinstance(e, InvalidRequestError):
            log.error("realtime transcription of %s failed", item.id, exc_info=e)
        code = e.code if isinstance(e, RealtimeError) else None
        message = str(e) if isinstance(e, InvalidRequestError) else "internal error"
        await send({"type": "conversation.item.input_audio_transcription.failed",
                    **where, "error": {"type": "transcription_error", "code": code,
                                       "message": message, "param": None}})
    finally:
        if ticket is not None:
            ticket.release()
