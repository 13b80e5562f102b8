"""One Realtime response as the client sees it: its state (`Response`) and the events that
render it: the assistant item opened at the first output, text / transcript / audio deltas, the
done events of that item, and the function calls the answer made, handed out as function_call
items. The session (server/realtime.py) decides when a response starts, is cancelled and ends;
`ResponseEvents` only says so, in OpenAI's GA event order."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from omnistage.chat_tools import ToolCall, ToolCallStream
from omnistage.engine_api import OutputOptions
from omnistage.media.encode import encode_audio
from omnistage.outputs import Delta
from omnistage.server.realtime_events import PCM_RATE, Item, Part, SessionConfig, new_id
from omnistage.server.realtime_items import Conversation

Send = Callable[[dict], Awaitable[None]]     # one server event to the client


class ClientGone(Exception):
    """The client is gone; nothing more can be sent."""


def output_options(cfg: SessionConfig, prefill_only: bool = False) -> OutputOptions:
    """A response's engine output (a warm-up asks for the same: the same prompt)."""
    return OutputOptions(modalities=["text", "audio"] if cfg.speaks else ["text"], voice=cfg.voice,
                         prefill_only=prefill_only)


@dataclass
class Response:
    id: str
    cfg: SessionConfig                    # the session's config with this response's overrides
    metadata: dict | None = None          # response.create's, echoed in response.created / done
    task: asyncio.Task | None = None
    cancel_reason: str | None = None      # "client_cancelled" | "turn_detected" | "disconnect"
    item: Item | None = None              # the assistant item, once output began
    first_audio_at: float | None = None   # loop time of the first audio delta
    audio_seconds: float = 0.0            # audio sent so far
    by_idle: bool = False                 # made by idle_timeout_ms (which it does not re-arm)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    closing: bool = False                 # the stream ended; only the done events remain
    calls: ToolCallStream | None = None   # with tools offered: text held while a call may start
    found: list[ToolCall] = field(default_factory=list)   # the calls the answer made

    @property
    def speaks(self) -> bool:
        return self.cfg.speaks

    def where(self) -> dict:
        """The content's address in the events about it."""
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}


class ResponseEvents:
    """Renders responses into `send`, keeping their items in `conv`."""

    def __init__(self, send: Send, conv: Conversation):
        self.send, self.conv = send, conv

    async def stream(self, r: Response, deltas: AsyncIterator[Delta]) -> None:
        """The engine's deltas as the item's events, opening the item at the first output."""
        async for d in deltas:
            if r.calls is not None:        # text that may be a call waits; calls come at the end
                text = r.calls.push(d.text)
                if d.finished:
                    rest, r.found = r.calls.finish()
                    text += rest
                d = dataclasses.replace(d, text=text)
            if r.item is None and (r.calls is None or d.text or d.audio is not None):
                await self._open_item(r)
            await self._send_delta(r, d)

    async def _open_item(self, r: Response) -> None:
        part = Part("output_audio", pcm=bytearray()) if r.speaks else Part("output_text")
        r.item = Item(new_id("item"), "assistant", [part], status="in_progress")
        shown = {**r.item.to_json(), "content": []}
        await self.send({"type": "response.output_item.added", "response_id": r.id,
                         "output_index": 0, "item": shown})
        previous = self.conv.last_id()
        self.conv.items.append(r.item)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous,
                         "item": shown})
        part = {"type": "audio", "transcript": ""} if r.speaks else {"type": "text", "text": ""}
        await self.send({"type": "response.content_part.added", **r.where(), "part": part})

    async def _send_delta(self, r: Response, d: Delta) -> None:
        r.prompt_tokens = max(r.prompt_tokens, d.num_prompt_tokens)
        r.output_tokens += len(d.token_ids)
        if d.finished:
            r.finish_reason = d.finish_reason
        if d.text and r.item is not None:
            r.item.parts[0].text += d.text
            kind = "response.output_audio_transcript.delta" if r.speaks else "response.output_text.delta"
            await self.send({"type": kind, **r.where(), "delta": d.text})
        if d.audio is not None and r.speaks and r.item is not None:
            pcm = encode_audio(d.audio, d.sample_rate, "pcm")   # 16-bit little-endian at 24 kHz
            if r.first_audio_at is None:
                r.first_audio_at = asyncio.get_running_loop().time()
            r.audio_seconds += len(pcm) / 2 / PCM_RATE
            self.conv.keep_audio(r.item, pcm)
            await self.send({"type": "response.output_audio.delta", **r.where(),
                             "delta": base64.b64encode(pcm).decode()})

    async def close_output(self, r: Response, status: str) -> list[Item]:
        """The done events of the response's item and, when it completed, its calls handed
        out: the response's output items (response.done is the session's to send)."""
        output = []
        if r.item is not None:
            text, where = r.item.parts[0].text, r.where()
            if r.speaks:
                await self.send({"type": "response.output_audio.done", **where})
                await self.send({"type": "response.output_audio_transcript.done", **where,
                                 "transcript": text})
                part = {"type": "audio", "transcript": text}
            else:
                await self.send({"type": "response.output_text.done", **where, "text": text})
                part = {"type": "text", "text": text}
            await self.send({"type": "response.content_part.done", **where, "part": part})
            r.item.status = "completed" if status == "completed" else "incomplete"
            await self.send({"type": "response.output_item.done", "response_id": r.id,
                             "output_index": 0, "item": r.item.to_json()})
            await self.send({"type": "conversation.item.done", "item": r.item.to_json(),
                             "previous_item_id": self.conv.previous_id(r.item.id)})
            output = [r.item]
        for call in r.found if status == "completed" else []:
            output.append(await self._hand_out_call(r, call, len(output)))
        return output

    async def _hand_out_call(self, r: Response, call: ToolCall, index: int) -> Item:
        """A call the answer made, as a function_call item and its events (the arguments whole
        in one delta); the client runs it and answers with a function_call_output item."""
        item = Item(new_id("item"), "", type="function_call", call_id=call.id, name=call.name,
                    arguments=call.arguments)
        shown = {**item.to_json(), "status": "in_progress", "arguments": ""}
        where = {"response_id": r.id, "item_id": item.id, "output_index": index, "call_id": call.id}
        await self.send({"type": "response.output_item.added", "response_id": r.id,
                         "output_index": index, "item": shown})
        previous = self.conv.last_id()
        self.conv.items.append(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": shown})
        await self.send({"type": "response.function_call_arguments.delta", **where, "delta": call.arguments})
        await self.send({"type": "response.function_call_arguments.done", **where, "name": call.name,
                         "arguments": call.arguments})
        await self.send({"type": "response.output_item.done", "response_id": r.id,
                         "output_index": index, "item": item.to_json()})
        await self.send({"type": "conversation.item.done", "item": item.to_json(),
                         "previous_item_id": previous})
        return item
