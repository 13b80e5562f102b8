"""LiveKit Agents' OpenAI Realtime plugin (livekit.plugins.openai.realtime.RealtimeModel) against
the real server (tiny Qwen2.5-Omni), with the plugin's defaults: only base_url, api_key and
model point at us, so the session asks for what LiveKit asks OpenAI for (semantic_vad
eagerness medium, gpt-4o-mini-transcribe transcription, voice "marin", audio output,
max_output_tokens "inf"). The plugin's RealtimeSession is driven directly, as AgentSession
drives it (no LiveKit room): real speech from espeak-ng pushed as microphone frames, the server
cutting the turn and answering it; text turns (a user chat message, and the quickstart's
greeting on an empty conversation); a barge-in while the answer streams. The model is random:
the checks are on protocol outcomes (events, statuses, audio), never on content. Every wait is
bounded (asyncio.wait_for)."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from benchmarks.espeak import RATE, SENTENCES, espeak, pcm16

rtc = pytest.importorskip("livekit.rtc")
llm = pytest.importorskip("livekit.agents.llm")
lk_realtime = pytest.importorskip("livekit.plugins.openai.realtime")

WAIT_S = 60            # one wait for an event or a whole answer (a loaded 2-core machine)
TEST_S = 240           # a whole scenario
OK_DONE = ("completed", "incomplete")   # "inf" tokens: an answer ends at EOS or the context

def _run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario, TEST_S))


class _Recorder:
    """What the plugin's session reports: the raw server events (openai_server_event_received),
    the client events it queued, its error events and its generations. Waits are event-driven
    and bounded."""

    def __init__(self, sess):
        self.server: list[dict] = []
        self.client: list[dict] = []
        self.errors: list = []
        self.generations: asyncio.Queue = asyncio.Queue()
        self._changed = asyncio.Event()
        sess.on("openai_server_event_received", self._on_server)
        sess.on("openai_client_event_queued", self._on_client)
        sess.on("error", self.errors.append)
        sess.on("generation_created", self.generations.put_nowait)

    def _on_server(self, event: dict) -> None:
        self.server.append(event)
        self._changed.set()

    def _on_client(self, event: dict) -> None:
        if event["type"] != "input_audio_buffer.append":     # keep the log small
            self.client.append(event)

    def types(self) -> list[str]:
        return [e["type"] for e in self.server if not e["type"].endswith(".delta")]

    async def until(self, kind: str | tuple[str, ...], since: int = 0,
                    **fields) -> tuple[int, dict]:
        """The first server event of type `kind` (one of them, for a tuple) with `fields`
        equal, at index >= `since`; and its index."""
        kinds = (kind,) if isinstance(kind, str) else kind

        async def scan():
            i = since
            while True:
                for k in range(i, len(self.server)):
                    e = self.server[k]
                    if e["type"] in kinds and all(e.get(f) == v for f, v in fields.items()):
                        return k, e
                i = len(self.server)
                self._changed.clear()      # no await since the scan: nothing is missed
                await self._changed.wait()
        try:
            return await asyncio.wait_for(scan(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"no {kind} {fields or ''} within {WAIT_S} s; server events: "
                        f"{self.types()}; errors: {self.errors}")

    async def generation(self):
        try:
            return await asyncio.wait_for(self.generations.get(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"no generation within {WAIT_S} s; server events: {self.types()}")


@contextlib.asynccontextmanager
async def _livekit_session(base: str, api_key: str):
    """A RealtimeSession of the plugin with its defaults, once the server took its
    session.update; closed (bounded) on the way out."""
    model = lk_realtime.RealtimeModel(base_url=f"{base}/v1", api_key=api_key, model="tiny")
    sess = model.session()
    rec = _Recorder(sess)            # before the session's task runs: nothing is missed
    try:
        _, answer = await rec.until(("session.updated", "error"))
        assert answer["type"] == "session.updated", answer
        yield sess, rec
    finally:
        await asyncio.wait_for(sess.aclose(), 15)
        await model.aclose()


def _next(sess, name: str, when=lambda ev: True) -> asyncio.Future:
    """The plugin's next `name` event for which `when` holds."""
    fut = asyncio.get_running_loop().create_future()

    def seen(ev):
        if when(ev) and not fut.done():
            fut.set_result(ev)
            sess.off(name, seen)
    sess.on(name, seen)
    return fut


async def _bounded(awaitable, what: str):
    try:
        return await asyncio.wait_for(awaitable, WAIT_S)
    except TimeoutError:
        pytest.fail(f"{what} did not happen within {WAIT_S} s")


def _speech(k: int, lead_s: float, tail_s: float) -> np.ndarray:
    """Sentence k between silences, as int16 samples at 24 kHz."""
    s = espeak(SENTENCES[k])
    audio = np.concatenate([np.zeros(int(lead_s * RATE), np.float32), s.audio[s.onset:s.end],
                            np.zeros(int(tail_s * RATE), np.float32)])
    return np.frombuffer(pcm16(audio), np.int16)


async def _push(sess, pcm: np.ndarray, frame_ms: int, pace: float) -> None:
    """A microphone: `frame_ms` rtc.AudioFrames, at `pace` times real time."""
    n = RATE * frame_ms // 1000
    for i in range(0, len(pcm), n):
        chunk = pcm[i:i + n]
        sess.push_audio(rtc.AudioFrame(chunk.tobytes(), RATE, 1, len(chunk)))
        await asyncio.sleep(frame_ms / 1000 / pace)


async def _read_message(msg) -> tuple[int, str]:
    """A message's audio (bytes) and text, read to the ends of both streams."""
    audio, text = 0, []

    async def read_audio():
        nonlocal audio
        async for frame in msg.audio_stream:
            audio += len(frame.data) * 2          # int16 samples
    async def read_text():
        async for delta in msg.text_stream:
            text.append(str(delta))
    await asyncio.gather(read_audio(), read_text())
    return audio, "".join(text)


async def _read_generation(gen) -> list[tuple[str, list, int, str]]:
    """A generation as AgentSession reads it: (message id, modalities, audio bytes, text) of
    each message, when the plugin has closed its streams."""
    out = []
    async for msg in gen.message_stream:
        audio, text = await _read_message(msg)
        out.append((msg.message_id, await msg.modalities, audio, text))
    return out


def _check_no_errors(rec: _Recorder) -> None:
    assert not [e for e in rec.server if e["type"] == "error"], rec.server
    assert rec.errors == []


# ---- (1) a voice turn ---------------------------------------------------------------------------

def test_voice_turn_cut_by_server_vad_is_answered_with_audio(omni_server, api_key):
    _run(_voice_turn(omni_server, api_key))


async def _voice_turn(base: str, api_key: str) -> None:
    async with _livekit_session(base, api_key) as (sess, rec):
        _check_default_session(rec)
        started = _next(sess, "input_speech_started")
        stopped = _next(sess, "input_speech_stopped")
        final = _next(sess, "input_audio_transcription_completed", lambda ev: ev.is_final)
        # a microphone: 40 ms frames, twice real time; the server's VAD must end the turn
        await _push(sess, _speech(0, lead_s=0.5, tail_s=1.5), frame_ms=40, pace=2)
        await _bounded(started, "input_speech_started")
        assert (await _bounded(stopped, "input_speech_stopped")).user_transcription_enabled
        _, committed = await rec.until("input_audio_buffer.committed")
        gen = await rec.generation()
        assert not gen.user_initiated                # the server's own answer to the turn
        [(msg_id, modalities, audio, _)] = await _bounded(_read_generation(gen), "the answer")
        assert modalities == ["audio", "text"] and audio > 0
        _, done = await rec.until("response.done")
        assert done["response"]["id"] == gen.response_id
        assert done["response"]["status"] in OK_DONE
        assert done["response"]["output"][0]["id"] == msg_id
        # the turn's transcript (gpt-4o-mini-transcribe is served by the model itself)
        transcript = await _bounded(final, "the final input transcript")
        assert transcript.item_id == committed["item_id"]
        assert [i.role for i in sess.chat_ctx.items] == ["user", "assistant"]
        _check_no_errors(rec)


def _check_default_session(rec: _Recorder) -> None:
    """The plugin's defaults reached the server as asked, and were taken."""
    asked = rec.client[0]["session"]
    assert rec.client[0]["type"] == "session.update"
    assert asked["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert asked["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe"}
    assert asked["audio"]["output"]["voice"] == "marin"
    got = next(e for e in rec.server if e["type"] == "session.updated")["session"]
    assert got["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert got["audio"]["input"]["turn_detection"]["eagerness"] == "medium"
    assert got["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
    assert got["audio"]["output"]["voice"] == "Chelsie"       # marin is a female voice
    assert got["output_modalities"] == ["audio"]


# ---- (2) text turns -----------------------------------------------------------------------------

def test_user_chat_message_and_generate_reply_get_an_answer(omni_server, api_key):
    _run(_text_turn(omni_server, api_key))


async def _text_turn(base: str, api_key: str) -> None:
    async with _livekit_session(base, api_key) as (sess, rec):
        # what AgentSession does when an agent starts: its instructions and (no) tools, each
        # a session.update the server must take
        mark = len(rec.server)
        await sess.update_instructions("You are a helpful voice assistant.")
        await sess.update_tools([])
        first, _ = await rec.until("session.updated", since=mark)
        await rec.until("session.updated", since=first + 1)
        # session.generate_reply(user_input=...): the message joins the chat, then a reply
        ctx = sess.chat_ctx.copy()
        ctx.add_message(role="user", content="Hello, what can you do?")
        await _bounded(sess.update_chat_ctx(ctx), "update_chat_ctx")
        gen = await _bounded(sess.generate_reply(instructions="Answer in one sentence."),
                             "generate_reply")
        assert gen.user_initiated
        [(_, modalities, audio, _)] = await _bounded(_read_generation(gen), "the answer")
        assert modalities == ["audio", "text"] and audio > 0
        _, done = await rec.until("response.done")
        assert done["response"]["id"] == gen.response_id
        assert done["response"]["status"] in OK_DONE
        # the plugin settles generate_reply by its client_event_id in response.metadata,
        # which the server echoes
        create = next(e for e in rec.client if e["type"] == "response.create")
        assert create["response"]["instructions"].endswith("Answer in one sentence.")
        assert done["response"]["metadata"] == create["response"]["metadata"]
        assert [i.role for i in sess.chat_ctx.items] == ["user", "assistant"]
        _check_no_errors(rec)


def test_greeting_on_an_empty_conversation(omni_server, api_key):
    """LiveKit's quickstart: session.generate_reply(instructions=...) right after start."""
    _run(_greeting(omni_server, api_key))


async def _greeting(base: str, api_key: str) -> None:
    async with _livekit_session(base, api_key) as (sess, rec):
        await sess.update_instructions("You are a helpful voice assistant.")
        # an empty conversation: the answer comes from the instructions alone, as OpenAI's
        gen = await _bounded(sess.generate_reply(
            instructions="Greet the user and offer your assistance."), "generate_reply")
        [(_, _, audio, _)] = await _bounded(_read_generation(gen), "the greeting")
        assert audio > 0
        _, done = await rec.until("response.done")
        assert done["response"]["status"] in OK_DONE
        _check_no_errors(rec)


# ---- (3) a barge-in -----------------------------------------------------------------------------

def test_barge_in_interrupts_the_streaming_answer_and_the_next_turn_is_answered(
        long_answer_server, api_key):
    _run(_barge_in(long_answer_server, api_key))


async def _barge_in(base: str, api_key: str) -> None:
    async with _livekit_session(base, api_key) as (sess, rec):
        gen, msg, reading = await _streaming_answer(sess, rec)

        # AgentSession on the server's input_speech_started: the agent's speech is interrupted
        # and, while the plugin still sees the generation running, interrupt() is sent
        # (voice/agent_activity.py: _on_input_speech_started, then the realtime generation
        # task's `if speech_handle.interrupted and not generation_ended: interrupt()`)
        def on_started(_ev):
            if not reading.done():
                sess.interrupt()
        sess.on("input_speech_started", on_started)
        mark = len(rec.server)
        # the user talks over the answer: 100 ms frames, four times real time
        await _push(sess, _speech(3, lead_s=0.1, tail_s=1.5), frame_ms=100, pace=4)
        k_started, _ = await rec.until("input_audio_buffer.speech_started", since=mark)
        k_done, done = await rec.until("response.done")
        assert k_started < k_done          # an 8 s answer (long_answer_server) outlasts it
        assert done["response"]["id"] == gen.response_id
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "turn_detected"
        played = await _bounded(reading, "the plugin closing the interrupted generation")
        k_cut, _ = await rec.until("conversation.item.truncated", item_id=msg.message_id)
        # AgentSession then truncates the message at what it played (here: all it received);
        # the server takes it (an item it cut itself keeps its cut)
        sess.truncate(message_id=msg.message_id, modalities=await msg.modalities,
                      audio_end_ms=played * 1000 // (2 * RATE))
        await rec.until("conversation.item.truncated", since=k_cut + 1, item_id=msg.message_id)
        await _check_next_turn(sess, rec, gen, k_done)
        sent = [e["type"] for e in rec.client]
        assert "response.cancel" in sent and "conversation.item.truncate" in sent
        _check_barge_in_errors(rec)


async def _streaming_answer(sess, rec: _Recorder):
    """A spoken answer in progress (a user chat message, generate_reply()), read up to its
    first audio frame: the generation, its message, and a task reading the rest (its result:
    the message's audio bytes in all)."""
    ctx = sess.chat_ctx.copy()
    ctx.add_message(role="user", content="Tell me a long story about the sea.")
    await _bounded(sess.update_chat_ctx(ctx), "update_chat_ctx")
    gen = await _bounded(sess.generate_reply(), "generate_reply")
    assert rec.generations.get_nowait() is gen      # generation_created: the same generation
    msg = await _bounded(anext(aiter(gen.message_stream)), "the answer's message")
    frames = aiter(msg.audio_stream)
    first = await _bounded(anext(frames), "the answer's first audio")

    async def read_rest() -> int:
        audio = len(first.data) * 2
        async for frame in frames:
            audio += len(frame.data) * 2
        async for _ in msg.text_stream:
            pass
        return audio
    return gen, msg, asyncio.create_task(read_rest())


async def _check_next_turn(sess, rec: _Recorder, interrupted, k_done: int) -> None:
    """The speech that interrupted is a turn of its own, and it is answered with audio."""
    nxt = await rec.generation()
    assert not nxt.user_initiated and nxt.response_id != interrupted.response_id
    [(_, _, audio, _)] = await _bounded(_read_generation(nxt), "the next turn's answer")
    assert audio > 0
    k_stopped, _ = await rec.until("input_audio_buffer.speech_stopped", since=k_done)
    k_next, done = await rec.until("response.done", since=k_done + 1)
    assert k_stopped < k_next and done["response"]["id"] == nxt.response_id
    assert done["response"]["status"] in OK_DONE
    roles = [i.role for i in sess.chat_ctx.items]
    assert roles == ["user", "assistant", "user", "assistant"], roles


def _check_barge_in_errors(rec: _Recorder) -> None:
    """The only server error a barge-in may bring is the plugin's response.cancel arriving
    after the server's own cancel, answered as OpenAI does (code response_cancel_not_active,
    "Cancellation failed: ..."), which the plugin knows and ignores
    (livekit/agents/llm/_realtime/openai.py _handle_error); it must report nothing."""
    raw = [e["error"] for e in rec.server if e["type"] == "error"]
    assert all(e["code"] == "response_cancel_not_active"
               and e["message"].startswith("Cancellation failed") for e in raw), raw
    assert not rec.errors, rec.errors
