"""Voice turns on the real server (tiny Qwen2.5-Omni) with real speech (espeak-ng), driven by
the openai SDK's Realtime client as a microphone would (100 ms appends): the default session
detects turns (server_vad, at the speech within 100 ms) and answers them; a user speaking over
an answer cancels it at once (barge-in: response.done cancelled before the turn ends, nothing
left in the engine, the answer cut to what was sent, the new turn answered); idle_timeout_ms
answers a silent user once; semantic_vad turns; output_audio_buffer.clear."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from benchmarks.espeak import RATE, SENTENCES, espeak, pcm16
from tests.server.conftest import metric
from tests.server.test_realtime_server import _say, _until, _wait_engine_empty

MS = RATE // 1000


@pytest.fixture(scope="module")
def client(omni_server, api_key):
    return openai.OpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0, timeout=60)


def _spoken(k: int, lead_s: float = 0.8, tail_s: float = 1.2) -> tuple[bytes, int, int]:
    """Sentence k between silences, as pcm16; and where its speech starts and ends (ms)."""
    s = espeak(SENTENCES[k])
    speech = s.audio[s.onset:s.end]
    audio = np.concatenate([np.zeros(int(lead_s * RATE), np.float32), speech,
                            np.zeros(int(tail_s * RATE), np.float32)])
    return pcm16(audio), int(lead_s * 1000), int(lead_s * 1000) + speech.size // MS


def _append(conn, pcm: bytes, chunk_ms: int = 100) -> None:
    step = 2 * chunk_ms * MS
    for i in range(0, len(pcm), step):
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())


def _session(conn, **session) -> object:
    assert conn.recv().type == "session.created"
    conn.session.update(session={"type": "realtime", "temperature": 0, **session})
    return _until(conn, "session.updated")[-1].session


def test_default_session_detects_turns_and_answers_them(client):
    pcm, onset_ms, end_ms = _spoken(0)
    with client.realtime.connect(model="tiny") as conn:
        created = conn.recv()
        td = created.session.audio.input.turn_detection
        assert (td.type, td.threshold, td.prefix_padding_ms, td.silence_duration_ms) == \
            ("server_vad", 0.5, 300, 500)
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "max_output_tokens": 3})
        _until(conn, "session.updated")
        _append(conn, pcm)
        events = _until(conn, "response.done")
    types = [e.type for e in events]
    assert types[:6] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added",
                         "conversation.item.done", "response.created"]
    started, stopped, committed, _, item_done = events[:5]
    assert abs(started.audio_start_ms - (onset_ms - 300)) <= 100     # the speech, less padding
    assert abs(stopped.audio_end_ms - (end_ms + 500)) <= 100         # the speech, and the silence
    assert started.item_id == stopped.item_id == committed.item_id == item_done.item.id
    assert item_done.item.role == "user" and item_done.item.content[0].type == "input_audio"
    assert events[-1].response.usage.output_tokens == 3


def test_barge_in_cancels_the_answer_at_once_and_the_new_turn_is_answered(client, omni_server,
                                                                          api_key):
    aborted = metric(omni_server, "omnistage_requests_aborted_total", api_key)
    pcm, _, _ = _spoken(3, lead_s=0.3)
    with client.realtime.connect(model="tiny") as conn:
        _session(conn, max_output_tokens=3)
        _say(conn, "Talk")
        conn.response.create(response={"output_modalities": ["audio"], "max_output_tokens": 4000})
        first = _until(conn, "response.output_audio.delta")
        answer_item = next(e.item for e in first if e.type == "response.output_item.added")
        # 0.3 s of silence and 0.5 s of speech: the speech starts, and under 1 s of the turn no
        # warm prefill is due yet (one cancelled by the turn's own response counts as aborted too)
        head = 2 * 800 * MS
        _append(conn, pcm[:head])
        events = _until(conn, "response.done")
        types = [e.type for e in events]
        started = types.index("input_audio_buffer.speech_started")
        # cancelled on the append that started the speech: before the turn could end
        assert "input_audio_buffer.speech_stopped" not in types
        assert set(types[started + 1:]) <= {"response.output_audio.delta",
                                            "response.output_audio_transcript.delta",
                                            "response.output_audio.done",
                                            "response.output_audio_transcript.done",
                                            "response.content_part.done",
                                            "response.output_item.done",
                                            "conversation.item.done", "response.done"}
        done = events[-1].response
        assert (done.status, done.status_details.reason) == ("cancelled", "turn_detected")
        sent_ms = sum(len(base64.b64decode(e.delta)) for e in first + events
                      if e.type == "response.output_audio.delta") // 2 // MS
        truncated = _until(conn, "conversation.item.truncated")[-1]
        assert truncated.item_id == answer_item.id and 0 <= truncated.audio_end_ms <= sent_ms
        _wait_engine_empty(omni_server, api_key)                    # every stage let it go
        assert metric(omni_server, "omnistage_requests_aborted_total", api_key) == aborted + 1
        _append(conn, pcm[head:])
        answered = _until(conn, "response.done")                    # the new turn
        kinds = [e.type for e in answered]
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
        assert answered[-1].response.status in ("completed", "incomplete")
        assert answered[-1].response.usage.output_tokens <= 3
        conn.conversation.item.retrieve(item_id=answer_item.id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert len(base64.b64decode(got.content[0].audio)) == 2 * truncated.audio_end_ms * MS
        assert got.content[0].transcript == ""          # truncate's semantics: unheard text goes
        # the client's own truncate (its playback's count) is welcome, even past the cut
        conn.conversation.item.truncate(item_id=answer_item.id, content_index=0,
                                        audio_end_ms=truncated.audio_end_ms + 500)
        assert _until(conn, "conversation.item.truncated")[-1].item_id == answer_item.id
    _wait_engine_empty(omni_server, api_key)


def test_idle_timeout_answers_a_silent_user_once(client):
    with client.realtime.connect(model="tiny") as conn:
        _session(conn, output_modalities=["text"], max_output_tokens=2,
                 audio={"input": {"turn_detection": {"type": "server_vad",
                                                     "idle_timeout_ms": 300}}})
        _say(conn, "Hi")
        # the user's microphone: 200 ms of silence, no speech (the buffer keeps it)
        conn.input_audio_buffer.append(audio=base64.b64encode(bytes(2 * 4800)).decode())
        conn.response.create()
        _until(conn, "response.done")
        events = _until(conn, "response.done")     # 300 ms later, unasked
        types = [e.type for e in events]
        assert types[:3] == ["input_audio_buffer.timeout_triggered",
                             "input_audio_buffer.committed", "conversation.item.added"]
        trig = events[0]
        assert trig.audio_end_ms >= trig.audio_start_ms and trig.item_id == events[1].item_id
        # the response the timeout made does not arm it again: the session stays quiet
        with pytest.raises(TimeoutError):
            conn._connection.recv(timeout=1.5, decode=False)


def test_semantic_vad_ends_turns_by_eagerness(client):
    pcm, onset_ms, _ = _spoken(1, tail_s=1.0)
    with client.realtime.connect(model="tiny") as conn:
        session = _session(conn, output_modalities=["text"], max_output_tokens=2,
                           audio={"input": {"turn_detection": {"type": "semantic_vad",
                                                               "eagerness": "high"}}})
        td = session.audio.input.turn_detection
        assert (td.type, td.eagerness) == ("semantic_vad", "high")
        _append(conn, pcm)
        events = _until(conn, "response.done")
    started, stopped = events[0], events[1]
    assert (started.type, stopped.type) == ("input_audio_buffer.speech_started",
                                            "input_audio_buffer.speech_stopped")
    assert abs(started.audio_start_ms - (onset_ms - 300)) <= 100


def test_output_audio_buffer_clear_stops_the_answer(client, omni_server, api_key):
    with client.realtime.connect(model="tiny") as conn:
        _session(conn)
        _say(conn, "Talk")
        conn.response.create(response={"output_modalities": ["audio"], "max_output_tokens": 4000})
        _until(conn, "response.output_audio.delta")
        conn.send({"type": "output_audio_buffer.clear"})
        events = _until(conn, "output_audio_buffer.cleared")
        done = next(e for e in events if e.type == "response.done").response
        assert done.status == "cancelled" and events[-1].response_id == done.id
    _wait_engine_empty(omni_server, api_key)


def test_input_audio_is_transcribed_by_the_served_model(client):
    """LiveKit's default asks for gpt-4o-mini-transcribe: any name is served by our own model,
    and the transcript is what /v1/audio/transcriptions says of the same audio."""
    import io
    import wave

    pcm, _, _ = _spoken(4, lead_s=0.2, tail_s=0.2)
    with client.realtime.connect(model="tiny") as conn:
        session = _session(conn, output_modalities=["text"], audio={"input": {
            "turn_detection": None, "transcription": {"model": "gpt-4o-mini-transcribe",
                                                      "language": "en"}}})
        assert session.audio.input.transcription.model == "gpt-4o-mini-transcribe"
        _append(conn, pcm)
        conn.input_audio_buffer.commit()
        events = _until(conn, "conversation.item.input_audio_transcription.completed")
        item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
        deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
        done = events[-1]
        assert deltas and {e.item_id for e in deltas} == {item_id} == {done.item_id}
        assert done.transcript == "".join(e.delta for e in deltas).strip() and done.transcript
        assert done.usage.output_tokens >= len(deltas)
        conn.conversation.item.retrieve(item_id=item_id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert got.content[0].transcript == done.transcript
        conn.session.update(session={"type": "realtime", "audio": {"input": {
            "noise_reduction": {"type": "near_field"}}}})
        err = _until(conn, "error")[-1].error
        assert err.param == "session.audio.input.noise_reduction"
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(RATE), w.writeframes(pcm)
    offline = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav.getvalue()),
                                                 language="en")
    assert offline.text == done.transcript
