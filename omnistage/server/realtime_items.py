"""A Realtime session's conversation: its items in order, the assistant audio they keep, and
the client's conversation.item.delete / truncate / retrieve on them.

Assistant audio is kept as the 24 kHz pcm16 the client was sent, so that truncate can cut it
where the client's playback stopped and retrieve can return it. What a session keeps is
bounded by the model's max_audio_seconds (the input audio's bound too): a response whose audio
would pass it makes room by dropping the audio of the oldest assistant items (their transcript
stays; they can no longer be truncated), and a single response longer than the bound keeps
only its first max_audio_seconds.

Truncation follows OpenAI's documented behaviour: the audio is cut at audio_end_ms and the
whole server-side transcript is deleted, so the context holds no text the user did not hear.
The models served here read assistant turns as text, so a truncated turn is an empty one.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field, replace

from omnistage.errors import InvalidRequestError
from omnistage.media.audio import resample
from omnistage.media.encode import encode_audio
from omnistage.server.realtime_events import (MODEL_RATE, PCM_RATE, Item, ModelAbilities, RealtimeError,
                                              check_room)


@dataclass
class Conversation:
    model: ModelAbilities
    items: list[Item] = field(default_factory=list)
    # assistant items the server truncated at a barge-in (by its clock): a client truncate
    # there may name a later point (what its own playback counted), which cuts nothing more
    cut_by_server: set[str] = field(default_factory=set)

    # ---- order ------------------------------------------------------------------------------
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def previous_id(self, item_id: str) -> str | None:
        """The id of the item before `item_id` (None: it is first, or no longer here)."""
        at = self._position(item_id)
        return self.items[at - 1].id if at is not None and at > 0 else None

    def insert(self, item: Item, at: int) -> str | None:
        """Puts `item` at index `at` (refused when there is no room); returns the previous id."""
        check_room(self.items, item, self.model)
        self.items.insert(at, item)
        return self.items[at - 1].id if at > 0 else None

    def messages(self, instructions: str) -> list[dict]:
        """The conversation as chat messages for the engine."""
        system = [{"role": "system", "content": instructions}] if instructions else []
        return system + [i.message() for i in self.items]

    # ---- client events ----------------------------------------------------------------------
    async def answer(self, event: dict) -> dict:
        """The server event answering conversation.item.delete, .truncate or .retrieve."""
        kind, item_id = event["type"], event.get("item_id")
        if kind == "conversation.item.retrieve":
            item = await asyncio.to_thread(retrieved_json, self.retrieve(item_id))
            return {"type": "conversation.item.retrieved", "item": item}
        if kind == "conversation.item.delete":
            self.delete(item_id)
            return {"type": "conversation.item.deleted", "item_id": item_id}
        end_ms = self.truncate(item_id, event.get("content_index"), event.get("audio_end_ms"))
        return {"type": "conversation.item.truncated", "item_id": item_id,
                "content_index": event["content_index"], "audio_end_ms": end_ms}

    def delete(self, item_id) -> None:
        at = self._find(item_id, "delete")
        _check_settled(self.items[at], "deleted")
        del self.items[at]

    def truncate(self, item_id, content_index, audio_end_ms) -> int:
        """Cuts an assistant item's audio part at `audio_end_ms` and deletes its transcript;
        the cut point in ms (clamped to the audio when the server already cut the item)."""
        item = self.items[self._find(item_id, "truncate")]
        if item.role != "assistant":
            raise InvalidRequestError(f"item {item_id!r} is a {item.role} message; only "
                                      "assistant messages can be truncated", param="item_id")
        _check_settled(item, "truncated")
        if (isinstance(content_index, bool) or not isinstance(content_index, int)
                or not 0 <= content_index < len(item.parts)):
            raise InvalidRequestError(f"content_index must be an integer in [0, "
                                      f"{len(item.parts) - 1}] for item {item_id!r}; set it to 0",
                                      param="content_index")
        part = item.parts[content_index]
        if part.type != "output_audio":
            raise InvalidRequestError(f"content part {content_index} of item {item_id!r} is "
                                      f"{part.type}; only audio can be truncated",
                                      param="content_index")
        if part.pcm is None:
            raise InvalidRequestError(
                f"the audio of item {item_id!r} is no longer kept (a session keeps the latest "
                f"{self.model.max_audio_seconds:g} s of assistant audio)", param="item_id")
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise InvalidRequestError("audio_end_ms must be a non-negative integer (milliseconds "
                                      "of the item's audio the user heard)", param="audio_end_ms")
        duration_ms = len(part.pcm) // 2 * 1000 // PCM_RATE
        if item_id in self.cut_by_server:
            audio_end_ms = min(audio_end_ms, duration_ms)
        if audio_end_ms > duration_ms:
            raise InvalidRequestError(f"audio_end_ms {audio_end_ms} is beyond the item's audio "
                                      f"({duration_ms} ms); send at most {duration_ms}",
                                      param="audio_end_ms")
        del part.pcm[audio_end_ms * PCM_RATE // 1000 * 2:]
        part.text = ""                 # OpenAI deletes the whole server-side transcript
        return audio_end_ms

    def cut_heard(self, item_id: str, heard_ms: int) -> int | None:
        """A barge-in's truncation of an assistant item to the `heard_ms` the user can have
        heard (truncate's semantics: the transcript goes too); the cut point in ms, or None
        when the item or its audio is gone."""
        at = self._position(item_id)
        if at is None or self.items[at].parts[0].pcm is None:
            return None
        part = self.items[at].parts[0]
        end_ms = self.truncate(item_id, 0, min(heard_ms, len(part.pcm) // 2 * 1000 // PCM_RATE))
        self.cut_by_server.add(item_id)
        return end_ms

    def retrieve(self, item_id) -> Item:
        """A copy of the item that later deltas do not change (read it off the event loop)."""
        item = self.items[self._find(item_id, "retrieve")]
        parts = [replace(p, pcm=None if p.pcm is None else bytearray(p.pcm)) for p in item.parts]
        return replace(item, parts=parts)

    # ---- response audio ---------------------------------------------------------------------
    def keep_audio(self, item: Item, pcm: bytes) -> None:
        """Appends 24 kHz pcm16 `pcm` to `item`'s audio part, within the session's bound."""
        part = item.parts[0]
        if part.pcm is None:
            return
        limit = int(self.model.max_audio_seconds * PCM_RATE) * 2
        kept = sum(len(p.pcm) for i in self.items for p in i.parts if p.pcm is not None)
        for old in self.items:                              # oldest first
            if kept + len(pcm) <= limit:
                break
            for p in old.parts if old is not item else ():
                if p.pcm is not None:
                    kept -= len(p.pcm)
                    p.pcm = None
        room = max(0, limit - kept) // 2 * 2                # whole samples
        part.pcm.extend(pcm[:room])

    # ---- lookup -----------------------------------------------------------------------------
    def _position(self, item_id: str) -> int | None:
        return next((k for k, i in enumerate(self.items) if i.id == item_id), None)

    def _find(self, item_id, action: str) -> int:
        """The item's index; a missing one is OpenAI's item_{action}_invalid_item_id error."""
        at = self._position(item_id) if isinstance(item_id, str) else None
        if at is None:
            raise RealtimeError(f"item_id {item_id!r} is not in the conversation (send the id of "
                                "a conversation item)", "item_id", f"item_{action}_invalid_item_id")
        return at


def retrieved_json(item: Item) -> dict:
    """The item's JSON with its audio as base64 24 kHz pcm16 (input audio is resampled back
    from the model's rate; assistant audio is what the client was sent, as truncated)."""
    out = item.to_json()
    for part, shown in zip(item.parts, out["content"]):
        if part.type == "input_audio" and part.audio is not None:
            pcm = encode_audio(resample(part.audio, MODEL_RATE, PCM_RATE), PCM_RATE, "pcm")
            shown["audio"] = base64.b64encode(pcm).decode()
        elif part.type == "output_audio" and part.pcm is not None:
            shown["audio"] = base64.b64encode(bytes(part.pcm)).decode()
    return out


def _check_settled(item: Item, what: str) -> None:
    if item.status == "in_progress":
        raise InvalidRequestError(f"item {item.id!r} is still being written by a response; "
                                  f"send response.cancel or wait for response.done before it "
                                  f"can be {what}", param="item_id")
