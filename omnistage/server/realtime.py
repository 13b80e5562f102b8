"""GET /v1/realtime: OpenAI's Realtime API (GA events) over a WebSocket, for omni and text models.

One `RealtimeSession` per connection keeps the conversation (realtime_items) and the input
audio buffer. Each response.create runs the whole conversation as a chat through
`engine.generate` in its own task, streaming text and speech as events; one response at a time.
response.cancel, and a disconnect, leave that stream, which aborts the request in every stage.
Turn detection is on by default, as OpenAI's (server_vad; server/turn_detection.py): the
Silero detector (server/vad.py) cuts appended audio into turns, and each turn is
speech_started, speech_stopped, the turn committed as a user item, and a response
(create_response). Speech that starts while a response runs is a barge-in
(interrupt_response): the response is cancelled (aborted in every stage) and its assistant
item truncated to the audio the user can have heard (sent since its first audio delta, by the
clock; the client's own conversation.item.truncate may cut further). `idle_timeout_ms`
answers a silent user. With turn detection off (null) the client commits and asks itself.

Client mistakes become `error` events (type invalid_request_error, with the offending event's
id) and the session carries on: an unknown session.update key (code unknown_parameter), or an
event over MAX_EVENT_BYTES (15 MiB; `omnistage serve` lets the WebSocket take messages up to
WS_MAX_MESSAGE_BYTES, so these reach us instead of closing with 1009); a refused handshake (key, model, draining, image models) is an
HTTP error in OpenAI's JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketState

from omnistage.chat_tools import ToolCallStream
from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.sampling_params import SamplingParams
from omnistage.server.errors import error_response
from omnistage.server.realtime_events import (PCM_RATE, Item, Part, RealtimeError, SessionConfig,
                                              appended_pcm, audio_part, check_event_size,
                                              check_metadata, check_room, default_config,
                                              error_json, insert_position, model_abilities,
                                              new_id, parse_item, response_config, response_json,
                                              update_config, usage_json)
from omnistage.server.realtime_items import Conversation
from omnistage.server.realtime_response import ClientGone, Response, ResponseEvents, output_options
from omnistage.server.realtime_tools import chat_tools
from omnistage.server.realtime_transcription import transcribe_item
from omnistage.server.realtime_warm import TurnWarmer, warm_up
from omnistage.server.vad import InputAudioBuffer, SileroLoader, VadEvent

log = logging.getLogger(__name__)


def add_realtime_route(app: FastAPI, engine, model_name: str, api_key: str | None,
                       max_queued_requests: int, streamed_input: bool = True) -> None:
    silero = SileroLoader()         # one speech detector model for the server's sessions

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        refusal = _refusal(app, ws, engine, model_name, api_key)
        if refusal is not None:
            status, message, param, code = refusal
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(error_response(status, message, param, code))
            else:
                await ws.close(code=1008, reason=message[:120])
            return
        await ws.accept()
        await RealtimeSession(ws, engine, model_name, max_queued_requests, silero,
                              streamed_input).run()


def _refusal(app, ws: WebSocket, engine, model_name: str, api_key: str | None):
    """(status, message, param, code) when the handshake must be refused, else None. The HTTP
    middleware never sees WebSocket scopes, so the key is checked here."""
    if api_key is not None:
        given = ws.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return (401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                    "invalid_api_key")
    if app.state.draining:
        return 503, "the server is shutting down", None, None
    if engine.abilities.makes_pixels:
        return (400, ("this model generates images or video; the Realtime API serves text and "
                      "speech models (use /v1/images/generations or /v1/videos)"), "model", None)
    model = ws.query_params.get("model")
    if model is not None and model != model_name:
        return 400, f"model {model!r} is not served here; use {model_name!r}", "model", None
    return None


class RealtimeSession:
    def __init__(self, ws: WebSocket, engine, model_name: str, max_queued_requests: int,
                 silero: SileroLoader, streamed_input: bool = True):
        self.ws, self.engine, self.model_name = ws, engine, model_name
        self.max_queued = max_queued_requests
        self.model = model_abilities(engine)
        self.cfg = default_config(self.model)
        self.id = new_id("sess")
        self.conv = Conversation(self.model)
        self.events = ResponseEvents(self.send, self.conv)
        self.buffer = InputAudioBuffer(PCM_RATE, silero)  # with a detector while turns are detected
        self._buffer_lock = asyncio.Lock()  # appends run the detector in a worker thread
        self.turn_item: str | None = None  # the item id speech_started announced
        # streamed input: the turn in progress is prefilled while spoken (server/realtime_warm)
        self.warmer = TurnWarmer(PCM_RATE) if streamed_input else None
        self._warms = 0
        self._idle: asyncio.TimerHandle | None = None   # idle_timeout_ms's timer, while armed
        self._tasks: set[asyncio.Task] = set()            # the timer's work in progress
        self.active: Response | None = None
        self._send_lock = asyncio.Lock()  # response tasks and the reader both send
        self._handlers = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.delete": self._item_event,
            "conversation.item.truncate": self._item_event,
            "conversation.item.retrieve": self._item_event,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear,
        }

    # ---- the connection ---------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._set_detector()
            await self.send({"type": "session.created",
                             "session": self.cfg.to_json(self.id, self.model_name)})
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                await self._dispatch(msg.get("text"))
        except ClientGone:
            pass
        finally:
            self._disarm_idle()
            for task in list(self._tasks):
                task.cancel()
            await self._stop_active("disconnect")

    async def send(self, event: dict) -> None:
        event = {"event_id": new_id("event"), **event}
        async with self._send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED:
                raise ClientGone()
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception as e:   # the peer went away mid-send (uvicorn's own error types)
                raise ClientGone() from e

    async def _dispatch(self, text: str | None) -> None:
        event_id = None
        try:
            if text is None:
                raise InvalidRequestError("send client events as JSON text frames, not binary",
                                          param="type")
            try:
                event = json.loads(text)
            except ValueError:
                raise InvalidRequestError("the event is not valid JSON", param=None) from None
            if not isinstance(event, dict):
                raise InvalidRequestError("an event must be a JSON object with a 'type'")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            check_event_size(len(text), event.get("type"))
            handler = self._handlers.get(event.get("type"))
            if handler is None:
                raise InvalidRequestError(
                    f"unknown event type {event.get('type')!r}; send one of "
                    f"{', '.join(self._handlers)}", param="type")
            await handler(event)
        except InvalidRequestError as e:
            code = e.code if isinstance(e, RealtimeError) else "invalid_value"
            await self.send(error_json(str(e), e.param, code, event_id))

    # ---- session and input audio ------------------------------------------------------------
    async def _session_update(self, event: dict) -> None:
        self.cfg = update_config(self.cfg, event.get("session"), self.model, self.model_name)
        await self._set_detector()
        await self.send({"type": "session.updated",
                         "session": self.cfg.to_json(self.id, self.model_name)})

    async def _set_detector(self) -> None:
        """The detector the session's turn detection asks for (loading the model once)."""
        td = self.cfg.turn_detection
        if td is None or td.idle_timeout_ms is None:
            self._disarm_idle()
        async with self._buffer_lock:
            if await asyncio.to_thread(self.buffer.set_detector, None if td is None else td.vad):
                self.turn_item = None
                self._end_turn()

    async def _append(self, event: dict) -> None:
        raw = appended_pcm(event, self.model)
        limit = int(self.model.max_audio_seconds * PCM_RATE) * 2
        if len(self.buffer) + len(raw) > limit:
            raise InvalidRequestError(
                f"the input audio buffer would exceed the {self.model.max_audio_seconds:g} s "
                "limit; commit or clear it first (this chunk was dropped)", param="audio")
        async with self._buffer_lock:
            edges = (await asyncio.to_thread(self.buffer.append, raw) if self.buffer.vad
                     else self.buffer.append(raw))
        self._follow_turn(raw, began=any(ev.kind == "start" for ev, _ in edges))
        for ev, turn in edges:
            try:
                if ev.kind == "start":
                    await self._speech_started(ev)
                else:
                    await self._speech_stopped(ev, turn)
            except InvalidRequestError as e:     # e.g. a full conversation: the next turn may fit
                await self.send(error_json(str(e), e.param, "invalid_value", event.get("event_id")))
        self._maybe_warm()

    def _follow_turn(self, raw: bytes, began: bool) -> None:
        """Streamed input: the appended audio joins the turn in progress (with turn detection
        a turn begins at speech_started, which hands over its audio so far; without, at the
        first append after a commit)."""
        w = self.warmer
        if w is None:
            return
        if self.buffer.vad is None and not w.active:
            w.begin(bytes(self.buffer.pcm))
        elif not began:                  # a start in this append handed over all it holds
            w.feed(raw)

    def _maybe_warm(self) -> None:
        """A warm request, when one is due (after the append's turn edges: a turn that just
        stopped is committed instead); never beside an answer being spoken."""
        w = self.warmer
        if w is not None and w.due() and self.active is None:
            self._warms += 1
            turn = Item("warm", "user", [Part("input_audio", audio=w.take())])
            w.task = self._spawn(warm_up(
                self.engine, self.ws.app.state.admission,
                self.conv.messages(self.cfg.instructions) + [turn.message()],
                output_options(self.cfg, prefill_only=True),
                f"realtime-{self.id}-warm-{self._warms}"))

    async def _commit(self, event: dict) -> None:
        if not self.buffer:
            raise RealtimeError("the input audio buffer is empty; append audio before committing",
                                "audio", "input_audio_buffer_commit_empty")
        self.turn_item = None
        async with self._buffer_lock:
            raw = self.buffer.take()
        self._end_turn()
        await self._commit_audio(raw, new_id("item"))

    async def _commit_audio(self, raw: bytes, item_id: str) -> None:
        part = await asyncio.to_thread(audio_part, raw, self.model.max_audio_seconds, "audio")
        item = Item(item_id, "user", [part])
        check_room(self.conv.items, item, self.model)
        await self.send({"type": "input_audio_buffer.committed", "item_id": item.id,
                         "previous_item_id": self.conv.last_id()})
        await self._add_item(item, len(self.conv.items))
        if self.cfg.transcription is not None:
            self._spawn(transcribe_item(self.engine, self.ws.app.state.admission, self.send, item,
                                        self.cfg.transcription))

    def _end_turn(self) -> None:
        if self.warmer is not None:
            self.warmer.end()

    async def _clear(self, event: dict) -> None:
        async with self._buffer_lock:
            self.buffer.take()
        self._end_turn()
        self.turn_item = None
        await self.send({"type": "input_audio_buffer.cleared"})

    # ---- turn detection ---------------------------------------------------------------------
    async def _speech_started(self, ev: VadEvent) -> None:
        self._disarm_idle()
        self.turn_item = new_id("item")
        await self.send({"type": "input_audio_buffer.speech_started", "item_id": self.turn_item,
                         "audio_start_ms": ev.at * 1000 // PCM_RATE})
        if self.warmer is not None:    # the buffer starts at the turn's first sample now
            self.warmer.begin(bytes(self.buffer.pcm[2 * max(0, ev.at - self.buffer.start):]))
        r = self.active
        if r is not None and self.cfg.turn_detection.interrupt_response:
            await self._barge_in(r)

    async def _barge_in(self, r: Response) -> None:
        """Cancels `r` and cuts its audio to what the user can have heard by now: what was sent
        since its first audio delta, by the clock (a client that plays later, or slower, sends
        its own conversation.item.truncate, which may cut further)."""
        heard = (0.0 if r.first_audio_at is None
                 else asyncio.get_running_loop().time() - r.first_audio_at)
        await self._stop_active("turn_detected")
        if r.item is None or r.item.parts[0].type != "output_audio":
            return
        audio_end_ms = self.conv.cut_heard(r.item.id, int(heard * 1000))
        if audio_end_ms is not None:
            await self.send({"type": "conversation.item.truncated", "item_id": r.item.id,
                             "content_index": 0, "audio_end_ms": audio_end_ms})

    def _arm_idle(self, r: Response) -> None:
        """idle_timeout_ms: armed when a response ends, to fire that long after its audio has
        played out (by the clock, from its first delta) unless speech starts first. Once per
        silence: the response the timeout makes does not arm it again (no endless answers to
        nobody); the next turn or response does."""
        td = self.cfg.turn_detection
        self._disarm_idle()
        if td is None or td.idle_timeout_ms is None:
            return
        loop = asyncio.get_running_loop()
        played = loop.time() if r.first_audio_at is None else r.first_audio_at + r.audio_seconds
        delay = max(0.0, played - loop.time()) + td.idle_timeout_ms / 1000
        start = self.buffer.end()
        self._idle = loop.call_later(delay, lambda: self._spawn(self._idle_timeout(start)))

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _spawn(self, coro) -> asyncio.Task:
        """A task of the session's own (a timer's work, a warm-up), kept until done; cancelled
        at disconnect."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _idle_timeout(self, start: int) -> None:
        """The user said nothing for idle_timeout_ms: commit what the buffer holds (silence, as
        OpenAI's: the model may still hear something) and answer."""
        self._idle = None
        if self.active is not None or (self.buffer.vad is not None and self.buffer.vad.speaking):
            return
        item_id = new_id("item")
        try:
            async with self._buffer_lock:
                raw = self.buffer.take()
            self._end_turn()
            await self.send({"type": "input_audio_buffer.timeout_triggered", "item_id": item_id,
                             "audio_start_ms": start * 1000 // PCM_RATE,
                             "audio_end_ms": self.buffer.end() * 1000 // PCM_RATE})
            if raw:
                await self._commit_audio(raw, item_id)
            await self._start_response(self.cfg, by_idle=True)
        except InvalidRequestError as e:       # e.g. a full conversation
            await self.send(error_json(str(e), e.param, "invalid_value"))
        except ClientGone:
            pass

    async def _output_clear(self, event: dict) -> None:
        """output_audio_buffer.clear (OpenAI's WebRTC event): stop the audio of the running
        response; on a WebSocket the audio already sent is the client's to drop."""
        r = self.active
        if r is not None:
            await self._stop_active("client_cancelled")
        await self.send({"type": "output_audio_buffer.cleared",
                         "response_id": None if r is None else r.id})

    async def _speech_stopped(self, ev: VadEvent, turn: bytes) -> None:
        item_id, self.turn_item = self.turn_item or new_id("item"), None
        self._end_turn()
        await self.send({"type": "input_audio_buffer.speech_stopped", "item_id": item_id,
                         "audio_end_ms": ev.at * 1000 // PCM_RATE})
        await self._commit_audio(turn, item_id)
        # a response still running (interrupt_response false) keeps the turn unanswered
        if self.cfg.turn_detection.create_response and self.active is None:
            await self._start_response(self.cfg)

    # ---- conversation -----------------------------------------------------------------------
    async def _item_create(self, event: dict) -> None:
        at = insert_position(event.get("previous_item_id"), self.conv.items)
        taken = {i.id for i in self.conv.items}
        item = await asyncio.to_thread(parse_item, event.get("item"), self.model, taken)
        await self._add_item(item, at)

    async def _add_item(self, item: Item, at: int) -> None:
        previous = self.conv.insert(item, at)
        for kind in ("conversation.item.added", "conversation.item.done"):
            await self.send({"type": kind, "previous_item_id": previous, "item": item.to_json()})

    async def _item_event(self, event: dict) -> None:
        """conversation.item.delete / truncate / retrieve (a running response keeps its input)"""
        await self.send(await self.conv.answer(event))

    # ---- responses --------------------------------------------------------------------------
    async def _response_create(self, event: dict) -> None:
        if self.active is not None:
            raise RealtimeError("Conversation already has an active response in progress: "
                                f"{self.active.id}. Wait until the response is finished (its "
                                "response.done) or send response.cancel first", "response",
                                "conversation_already_has_active_response")
        body = event.get("response")
        metadata = check_metadata(body.get("metadata"), "response.metadata") if isinstance(body, dict) else None
        await self._start_response(response_config(self.cfg, body, self.model), event.get("event_id"),
                                   metadata)

    async def _start_response(self, cfg: SessionConfig, event_id: str | None = None,
                              metadata: dict | None = None, by_idle: bool = False) -> None:
        if not self.conv.items and not cfg.instructions:
            # with instructions, the answer comes from them alone (a greeting), as OpenAI's
            raise InvalidRequestError("the conversation is empty and there are no instructions; "
                                      "add an item (conversation.item.create), commit audio or "
                                      "give the response instructions first")
        # the HTTP routes' bound (server/admission.py): the response holds a ticket until done
        admission = self.ws.app.state.admission
        ticket = admission.try_acquire()
        if ticket is None and self.warmer is not None and await self.warmer.stop():
            ticket = admission.try_acquire()      # a warm-up never costs a response its seat
        if ticket is None:
            await self.send(error_json(admission.refusal_message(), code="rate_limit_exceeded",
                                       kind="rate_limit_error", event_id=event_id))
            return
        r = Response(new_id("resp"), cfg, metadata=metadata, by_idle=by_idle)
        self.active = r
        r.task = asyncio.create_task(self._respond(r, self.conv.messages(cfg.instructions)))
        r.task.add_done_callback(lambda _task: ticket.release())

    async def _response_cancel(self, event: dict) -> None:
        r = self.active
        wanted = event.get("response_id")
        if r is None or (wanted is not None and wanted != r.id):
            raise RealtimeError("Cancellation failed: no active response found"
                                + (f" with id {wanted}" if wanted is not None else ""),
                                "response_id", "response_cancel_not_active")
        await self._stop_active("client_cancelled")

    async def _stop_active(self, reason: str) -> None:
        r = self.active
        if r is None or r.task is None:
            return
        r.cancel_reason = reason
        if not r.closing or reason == "disconnect":
            r.task.cancel()
        await asyncio.wait([r.task])      # never raises: the task's own end is its business
        if not r.task.cancelled() and r.task.exception() is not None:
            log.error("realtime response %s ended with %r", r.id, r.task.exception())

    async def _respond(self, r: Response, messages: list[dict]) -> None:
        """Runs one response to its response.done (completed, incomplete, cancelled, failed)."""
        params = SamplingParams(temperature=r.cfg.temperature, max_tokens=r.cfg.max_output_tokens)
        prompt = messages
        if r.cfg.offered_tools:
            prompt = {"messages": messages, "tools": chat_tools(r.cfg.offered_tools)}
            r.calls = ToolCallStream()
        try:
            await self._run(r, prompt, params, output_options(r.cfg))
        except ClientGone:
            pass
        finally:
            if self.active is r:
                self.active = None

    async def _run(self, r: Response, messages, params: SamplingParams, opts: OutputOptions) -> None:
        status, details = "completed", None
        try:
            await self.send({"type": "response.created",
                             "response": response_json(r.id, "in_progress", r.cfg, [], metadata=r.metadata)})
            if self.warmer is not None:     # the response does what it had left (realtime_warm)
                await self.warmer.stop()
            deltas = self.engine.generate(messages, params, request_id=f"realtime-{r.id}",
                                          output=opts)
            try:
                await self.events.stream(r, deltas)
            finally:
                await deltas.aclose()       # leaving an unfinished stream aborts the request
            if r.finish_reason == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            if r.cancel_reason not in ("client_cancelled", "turn_detected"):
                raise
            asyncio.current_task().uncancel()   # we cancelled it: close the response properly
            status, details = "cancelled", {"type": "cancelled", "reason": r.cancel_reason}
        except ClientGone:
            return
        # a bad conversation (the client's mistake), or an engine fault: this response fails
        except Exception as e:  # noqa: BLE001
            r.closing = True
            status, details = "failed", await self._failure(r, e)
        r.closing = True          # a cancel from now on waits for the done events instead
        await self._finish(r, status, details)

    async def _failure(self, r: Response, e: Exception) -> dict:
        if isinstance(e, InvalidRequestError):
            kind, message = "invalid_request_error", str(e)
            await self.send(error_json(message, e.param, "invalid_value"))
        else:
            log.error("realtime response %s failed", r.id, exc_info=e)
            kind, message = "server_error", f"internal error; see the server log for {r.id}"
        return {"type": "failed", "error": {"type": kind, "code": None, "message": message}}

    async def _finish(self, r: Response, status: str, details: dict | None) -> None:
        output = await self.events.close_output(r, status)
        if self.active is r:      # a response.create that answers response.done is welcome
            self.active = None
        if r.cancel_reason is None and not r.by_idle:
            self._arm_idle(r)
        await self.send({"type": "response.done", "response": response_json(
            r.id, status, r.cfg, output, details, usage_json(r.prompt_tokens, r.output_tokens),
            r.metadata)})
