"""GET /v1/realtime on the real server with a tiny Qwen2.5-Omni, driven by the openai SDK's
Realtime client: text and audio turns (the transcript equals the offline API's greedy text),
response.cancel and disconnects (the engine keeps nothing), bad events (an error event, and the
session carries on), and the API key on the handshake. Turns cut by the speech detector, barge-in
and the voice-agent frameworks: test_realtime_voice.py."""

from __future__ import annotations

import base64
import time

import numpy as np
import openai
import pytest

from omnistage import Omni, SamplingParams
from omnistage.engine_api import OutputOptions
from tests.server.conftest import metric


@pytest.fixture(scope="module", params=["local", "process"])
def omni_server(request, tiny_omni, tmp_path_factory, place_omni_server):
    """This suite runs twice: every stage in the server's process, then each stage in its own
    process (the deploy config): the API must not tell them apart."""
    with place_omni_server(tiny_omni, request.param, tmp_path_factory.mktemp("deploy")) as base:
        yield base


DEADLINE_S = 30            # every wait for an event is bounded by this


@pytest.fixture(scope="module")
def client(omni_server, api_key):
    return openai.OpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0, timeout=60)


def _pcm16_tone(seconds: float = 0.5, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def _until(conn, last: str, deadline_s: float = DEADLINE_S) -> list:
    """Events up to and including the first of type `last` (bounded by a deadline)."""
    events, end = [], time.monotonic() + deadline_s
    while True:
        left = end - time.monotonic()
        assert left > 0, f"no {last!r} within {deadline_s} s: {[e.type for e in events]}"
        try:   # the SDK's recv() has no timeout: read the socket with one, then parse as recv() does
            raw = conn._connection.recv(timeout=left, decode=False)
        except TimeoutError:
            raise AssertionError(f"no {last!r} within {deadline_s} s: {[e.type for e in events]}") from None
        ev = conn.parse_event(raw)
        events.append(ev)
        if ev.type == last:
            return events


def _wait_engine_empty(base: str, api_key: str) -> None:
    end = time.monotonic() + 10
    while metric(base, "omnistage_requests_in_engine", api_key) != 0:
        assert time.monotonic() < end, "the engine still holds the aborted request"
        time.sleep(0.05)


def test_text_turn(client):
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "temperature": 0, "max_output_tokens": 6})
        updated = _until(conn, "session.updated")[-1]
        assert updated.session.output_modalities == ["text"]
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Hello sea"}]})
        added = _until(conn, "conversation.item.done")
        assert [e.type for e in added] == ["conversation.item.added", "conversation.item.done"]
        conn.response.create()
        events = _until(conn, "response.done")
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                         "response.content_part.added"]
    assert types[-5:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "conversation.item.done", "response.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens == 6
    assert done.output[0].content[0].text == text == events[-5].text


def test_audio_turn_transcript_equals_offline(client, tiny_omni):
    pcm = _pcm16_tone()
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                     "temperature": 0, "max_output_tokens": 5,
                                     "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                         "turn_detection": None},
                                               "output": {"voice": "Chelsie"}}})
        _until(conn, "session.updated")
        for i in range(0, len(pcm), 4800):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 4800]).decode())
        conn.input_audio_buffer.commit()
        committed = _until(conn, "conversation.item.done")
        assert committed[0].type == "input_audio_buffer.committed"
        conn.response.create()
        events = _until(conn, "response.done", deadline_s=60)
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    samples = np.frombuffer(audio, dtype="<i2")
    assert samples.size > 2400 and np.abs(samples).max() > 0
    done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert done.transcript == transcript

    offline = Omni(tiny_omni, block_size=4, linear_kernel="matmul")
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(pcm).decode(), "format": "pcm16"}}]}]
    [want] = offline.generate(messages, SamplingParams(temperature=0, max_tokens=5),
                              output=OutputOptions(modalities=["text", "audio"], voice="Chelsie"))
    assert transcript == want.text


def test_cancel_then_disconnect_leave_nothing_in_the_engine(client, omni_server, api_key):
    aborted = metric(omni_server, "omnistage_requests_aborted_total", api_key)
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Talk"}]})
        _until(conn, "conversation.item.done")
        conn.response.create(response={"output_modalities": ["audio"], "max_output_tokens": 4000})
        _until(conn, "response.output_audio_transcript.delta")
        conn.response.cancel()
        done = _until(conn, "response.done")[-1]
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "client_cancelled"
        _wait_engine_empty(omni_server, api_key)
        assert metric(omni_server, "omnistage_requests_aborted_total", api_key) == aborted + 1
        # the session carries on: the partial answer is in the conversation
        conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 4000})
        _until(conn, "response.output_text.delta")
    _wait_engine_empty(omni_server, api_key)      # leaving mid-response aborted it
    assert metric(omni_server, "omnistage_requests_aborted_total", api_key) == aborted + 2


def _manual(conn) -> None:
    """Turn detection off (sessions start with server_vad): the test commits the audio it
    appended, all of it (the detector drops the silence between turns)."""
    assert conn.recv().type == "session.created"
    conn.session.update(session={"type": "realtime",
                                 "audio": {"input": {"turn_detection": None}}})
    assert _until(conn, "session.updated")[-1].session.audio.input.turn_detection is None


def test_bad_events_are_error_events_and_the_session_continues(client):
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.send({"type": "no.such.event"})
        err = _until(conn, "error")[-1].error
        assert err.type == "invalid_request_error" and "unknown event type" in err.message
        conn.send({"type": "input_audio_buffer.append", "audio": "not base64!", "event_id": "ev1"})
        err = _until(conn, "error")[-1].error
        assert "base64" in err.message and err.event_id == "ev1"
        conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}})
        err = _until(conn, "error")[-1].error
        assert "low, medium" in err.message
        assert err.param == "session.audio.input.turn_detection.eagerness"
        conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "threshold": 2}}}})
        err = _until(conn, "error")[-1].error
        assert "[0, 1]" in err.message
        assert err.param == "session.audio.input.turn_detection.threshold"
        conn.input_audio_buffer.commit()
        assert "empty" in _until(conn, "error")[-1].error.message
        conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "nobody"}}})
        assert "Chelsie" in _until(conn, "error")[-1].error.message
        conn.input_audio_buffer.append(audio=base64.b64encode(_pcm16_tone(0.001)).decode())
        conn.input_audio_buffer.commit()
        _until(conn, "conversation.item.done")
        conn.response.create(response={"output_modalities": ["text"]})
        events = _until(conn, "response.done")       # too short a clip for the model: it fails
        assert [e.type for e in events] == ["response.created", "error", "response.done"]
        assert "too short" in events[1].error.message and events[2].response.status == "failed"
        # still alive, and nothing of the refused updates applied
        conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        session = _until(conn, "session.updated")[-1].session
        assert session.audio.input.turn_detection.type == "server_vad"    # the default
        assert session.instructions == "Be brief."
        assert session.audio.output.voice != "nobody"


def test_audio_buffer_is_bounded(client):
    thirty_seconds = base64.b64encode(_pcm16_tone(30.0)).decode()
    with client.realtime.connect(model="tiny") as conn:
        _manual(conn)
        for _ in range(11):             # the tiny model's limit: 300 s per clip
            conn.input_audio_buffer.append(audio=thirty_seconds)
        err = _until(conn, "error")[-1].error
        assert "300 s limit" in err.message and err.param == "audio"
        conn.input_audio_buffer.clear()
        _until(conn, "input_audio_buffer.cleared")


def test_wrong_key_and_model_are_refused(omni_server, api_key):
    from websockets.exceptions import InvalidStatus

    bad = openai.OpenAI(base_url=f"{omni_server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(InvalidStatus) as e, bad.realtime.connect(model="tiny"):
        pass
    assert e.value.response.status_code == 401
    good = openai.OpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(InvalidStatus) as e, good.realtime.connect(model="other"):
        pass
    assert e.value.response.status_code == 400 and b"tiny" in e.value.response.body


def test_text_model_serves_text_sessions(server, api_key):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key=api_key, max_retries=0)
    with c.realtime.connect(model="tiny") as conn:
        created = conn.recv()
        assert created.session.output_modalities == ["text"] and created.session.audio.output.voice is None
        conn.input_audio_buffer.append(audio=base64.b64encode(_pcm16_tone(0.1)).decode())
        assert "text only" in _until(conn, "error")[-1].error.message
        conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        assert "text only" in _until(conn, "error")[-1].error.message
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Hi"}]})
        conn.response.create(response={"max_output_tokens": 3})
        done = _until(conn, "response.done")[-1].response
    assert done.usage.output_tokens == 3 and done.output[0].content[0].type == "output_text"


def test_image_models_refuse_the_handshake():
    """No server process needed: the refusal happens before the engine is used."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient, WebSocketDenialResponse

    from omnistage.engine_api import EngineAbilities
    from omnistage.server.app import build_app

    engine = SimpleNamespace(abilities=EngineAbilities(generates="image"))
    with pytest.raises(WebSocketDenialResponse) as e, \
            TestClient(build_app(engine, "m")).websocket_connect("/v1/realtime?model=m"):
        pass
    assert e.value.status_code == 400 and "images or video" in e.value.json()["error"]["message"]


def _say(conn, text: str) -> str:
    conn.conversation.item.create(item={"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": text}]})
    return _until(conn, "conversation.item.done")[-1].item.id


def _error(conn, **event) -> object:
    conn.send(event)
    return _until(conn, "error")[-1].error


def test_truncate_and_retrieve_assistant_audio(client):
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        user_id = _say(conn, "Talk")
        conn.response.create(response={"output_modalities": ["audio"], "max_output_tokens": 6})
        events = _until(conn, "response.done", deadline_s=60)
        item = events[-1].response.output[0]
        sent = b"".join(base64.b64decode(e.delta) for e in events
                        if e.type == "response.output_audio.delta")
        assert len(sent) > 4800 and item.content[0].transcript
        conn.conversation.item.retrieve(item_id=item.id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert base64.b64decode(got.content[0].audio) == sent          # kept as it was sent
        assert got.content[0].transcript == item.content[0].transcript

        duration_ms = len(sent) // 2 * 1000 // 24000
        for bad, param in [({"audio_end_ms": duration_ms + 1}, "audio_end_ms"),
                           ({"audio_end_ms": -1}, "audio_end_ms"),
                           ({"content_index": 1}, "content_index"),
                           ({"item_id": user_id}, "item_id"),
                           ({"item_id": "item_nope"}, "item_id")]:
            event = {"type": "conversation.item.truncate", "item_id": item.id,
                     "content_index": 0, "audio_end_ms": 100, **bad}
            err = _error(conn, **event, event_id="ev_bad")
            assert err.param == param and err.event_id == "ev_bad", (bad, err)
        assert str(duration_ms) in _error(conn, type="conversation.item.truncate", item_id=item.id,
                                          content_index=0, audio_end_ms=duration_ms + 1).message

        conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=100)
        done = _until(conn, "conversation.item.truncated")[-1]
        assert (done.item_id, done.content_index, done.audio_end_ms) == (item.id, 0, 100)
        conn.conversation.item.retrieve(item_id=item.id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert base64.b64decode(got.content[0].audio) == sent[:2400 * 2]   # 100 ms at 24 kHz
        assert got.content[0].transcript == ""     # OpenAI deletes the unheard transcript

        conn.conversation.item.retrieve(item_id=user_id)   # a text item: no audio
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert got.content[0].text == "Talk" and got.content[0].audio is None
        conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 2})
        assert _until(conn, "response.done")[-1].response.status in ("completed", "incomplete")


def test_retrieve_returns_committed_audio(client):
    pcm = _pcm16_tone(0.5)
    with client.realtime.connect(model="tiny") as conn:
        _manual(conn)
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        conn.input_audio_buffer.commit()
        item_id = _until(conn, "conversation.item.done")[-1].item.id
        conn.conversation.item.retrieve(item_id=item_id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
    assert got.role == "user" and got.content[0].type == "input_audio"
    back = np.frombuffer(base64.b64decode(got.content[0].audio), dtype="<i2").astype(np.float32)
    want = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    assert abs(back.size - want.size) <= 48       # 24 kHz again, after the model's 16 kHz
    n = min(back.size, want.size) - 200
    assert np.abs(back[100:n] - want[100:n]).max() < 0.02 * 32767


def _text_of(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_deleted_items_are_gone_from_later_responses(client):
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                     "temperature": 0, "max_output_tokens": 6})
        _until(conn, "session.updated")
        _say(conn, "Hello sea")
        conn.response.create()
        first = _until(conn, "response.done")
        later = [first[-1].response.output[0].id, _say(conn, "Tell me more about boats")]
        conn.response.create()
        second = _until(conn, "response.done")
        assert _text_of(second) != _text_of(first)    # else deletion could not show
        for item_id in later:
            conn.conversation.item.delete(item_id=item_id)
            assert _until(conn, "conversation.item.deleted")[-1].item_id == item_id
        err = _error(conn, type="conversation.item.delete", item_id=later[0])
        assert err.param == "item_id" and "not in the conversation" in err.message
        assert _error(conn, type="conversation.item.retrieve", item_id=later[1]).param == "item_id"
        conn.send({"type": "conversation.item.delete", "item_id": second[-1].response.output[0].id})
        _until(conn, "conversation.item.deleted")
        conn.response.create()                      # the conversation is ["Hello sea"] again
        assert _text_of(_until(conn, "response.done")) == _text_of(first)


def test_kept_assistant_audio_is_bounded():
    """No server: a session keeps at most max_audio_seconds of assistant audio (oldest dropped)."""
    from omnistage.errors import InvalidRequestError
    from omnistage.server.realtime_events import Item, ModelAbilities, Part
    from omnistage.server.realtime_items import Conversation

    conv = Conversation(ModelAbilities(speakers=["v"], hears_audio=True, max_audio_seconds=0.1))
    old, new = (Item(f"item_{k}", "assistant", [Part("output_audio", text="hi", pcm=bytearray())])
                for k in range(2))
    conv.items += [old, new]
    conv.keep_audio(old, bytes(2 * 1200))            # 50 ms
    conv.keep_audio(new, bytes(2 * 1800))            # 75 ms: the old item's audio makes room
    assert old.parts[0].pcm is None and len(new.parts[0].pcm) == 2 * 1800
    conv.keep_audio(new, bytes(2 * 1200))            # past the bound: only 25 ms more is kept
    assert len(new.parts[0].pcm) == 2 * 2400
    with pytest.raises(InvalidRequestError, match="no longer kept") as e:
        conv.truncate("item_0", 0, 10)
    assert e.value.param == "item_id"
    conv.truncate("item_1", 0, 100)                  # all of what is kept: allowed
    assert new.parts[0].text == "" and len(new.parts[0].pcm) == 2 * 2400


def _text_exchange(conn, text: str = "Hi") -> object:
    """A normal turn on a session: a text item, a short text response; its response.done."""
    _say(conn, text)
    conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 2})
    return _until(conn, "response.done")[-1].response


def test_unknown_session_keys_are_named_and_the_session_continues(client):
    cases = [  # (session.update's session, the param named, a part of the message)
        ({"foo": 1}, "session.foo", "Unknown parameter: 'session.foo'"),
        ({"turn_detectoin": {"type": "server_vad"}}, "session.turn_detectoin",
         "Did you mean session.audio.input.turn_detection?"),
        ({"turn_detection": {"type": "semantic_vad"}}, "session.turn_detection",
         "beta layout; the GA API puts it at session.audio.input.turn_detection"),
        ({"voice": "Chelsie"}, "session.voice", "session.audio.output.voice"),
        ({"audio": {"inputs": {}}}, "session.audio.inputs", "Did you mean session.audio.input?"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_ms": 300}}}},
         "session.audio.input.turn_detection.silence_ms", "Unknown parameter"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000, "channels": 1}}}},
         "session.audio.input.format.channels", "Unknown parameter"),
        ({"audio": {"output": {"voice": {"id": "Chelsie", "name": "c"}}}},
         "session.audio.output.voice.name", "Unknown parameter"),
    ]
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        for i, (session, param, message) in enumerate(cases):
            conn.session.update(session={"type": "realtime", "instructions": "Changed.",
                                         "output_modalities": ["text"], **session},
                                event_id=f"ev{i}")
            err = _until(conn, "error")[-1].error
            assert (err.param, err.code, err.event_id) == (param, "unknown_parameter", f"ev{i}")
            assert message in err.message, err.message
        err = _error(conn, type="session.update", session={"type": "realtime", "tools": [
            {"type": "function", "name": "f", "parameters": {}}]})
        assert err.param == "session.tools" and err.code == "invalid_value"
        assert "no function calling" in err.message          # Qwen2.5-Omni's template has none
        # nothing of the refused updates applied, and the session still serves
        conn.session.update(session={"type": "realtime", "max_output_tokens": 4})
        session = _until(conn, "session.updated")[-1].session
        assert session.instructions == "" and session.output_modalities == ["audio"]
        assert session.audio.input.turn_detection.type == "server_vad"     # the default, kept
        done = _text_exchange(conn)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens == 2


def test_oversized_append_is_an_error_event_and_the_session_continues(client):
    """19 MB (over the 15 MiB event bound, and over uvicorn's default 16 MiB message size, which
    closed the socket with 1009): an error event; the buffer keeps only the later appends."""
    pcm = _pcm16_tone(0.5)
    with client.realtime.connect(model="tiny") as conn:
        _manual(conn)
        conn.input_audio_buffer.append(audio="A" * 19_000_000, event_id="ev_big")  # zeros
        err = _until(conn, "error")[-1].error
        assert (err.param, err.event_id, err.code) == ("audio", "ev_big", "invalid_value")
        assert "at most 15 MiB" in err.message and "smaller appends" in err.message
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        conn.input_audio_buffer.commit()
        item_id = _until(conn, "conversation.item.done")[-1].item.id
        conn.conversation.item.retrieve(item_id=item_id)
        got = _until(conn, "conversation.item.retrieved")[-1].item
        assert abs(len(base64.b64decode(got.content[0].audio)) - len(pcm)) <= 96  # not the 19 MB
        conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 2})
        done = _until(conn, "response.done")[-1].response
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens == 2


def test_the_reported_session_is_a_valid_update():
    """No server: session.created's session (less its read-only id and object) passes
    session.update's checks unchanged, also with server_vad on."""
    from omnistage.server.realtime_events import (ModelAbilities, TurnDetection, default_config,
                                                  update_config)
    from omnistage.server.turn_detection import VadConfig

    model = ModelAbilities(speakers=["Chelsie"], hears_audio=True, max_audio_seconds=300)
    assert default_config(model).turn_detection == TurnDetection()     # server_vad, as OpenAI
    semantic = TurnDetection(VadConfig(eagerness="low"), interrupt_response=False)
    for td in (None, TurnDetection(), TurnDetection(idle_timeout_ms=7000), semantic):
        cfg = default_config(model)
        cfg.turn_detection = td
        shown = {k: v for k, v in cfg.to_json("sess_1", "tiny").items() if k not in ("id", "object")}
        assert update_config(cfg, shown, model, "tiny") == cfg


def test_openai_error_codes_nulls_and_metadata(client):
    """What voice-agent frameworks rely on: OpenAI's error codes (a barge-in's response.cancel
    with nothing running is `response_cancel_not_active`, not a fatal invalid_value), null for
    every optional field (LiveKit sends `instructions: null`), and response.metadata echoed in
    response.created and response.done (LiveKit settles replies by its client_event_id)."""
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        checks = [({"type": "response.cancel"}, "response_cancel_not_active"),
                  ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
                  ({"type": "conversation.item.retrieve", "item_id": "nope"}, "item_retrieve_invalid_item_id"),
                  ({"type": "conversation.item.delete", "item_id": "nope"}, "item_delete_invalid_item_id"),
                  ({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0,
                    "audio_end_ms": 0}, "item_truncate_invalid_item_id"),
                  ({"type": "response.create", "response": {"frobnicate": 1}}, "unknown_parameter"),
                  ({"type": "response.create", "response": {"tools": [{"type": "function", "name": "f"}]}},
                   "invalid_value")]
        for event, code in checks:
            conn.send(event)
            err = _until(conn, "error")[-1].error
            assert err.code == code, (event, err)
        conn.session.update(session={"type": "realtime", "instructions": None, "max_output_tokens": None,
                                     "tools": None, "tool_choice": None, "tracing": None,
                                     "audio": {"output": {"voice": None, "speed": None}}})
        assert _until(conn, "session.updated")[-1].session.instructions == ""
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Hello!"}]})
        meta = {"client_event_id": "evt-42"}
        # Two creates back to back: the session reads the second before the first (an answer
        # of up to the whole context) can have ended, so it is refused; then the first is
        # cancelled (or, if it already ended at an end-of-turn token, done).
        conn.send({"type": "response.create", "response": {
            "instructions": None, "output_modalities": None, "tool_choice": None, "tools": None,
            "max_output_tokens": "inf", "metadata": meta}})
        conn.send({"type": "response.create", "response": {"max_output_tokens": 2}})
        events = _until(conn, "error")
        if not any(e.type == "response.created" for e in events):    # the error may come first
            events += _until(conn, "response.created")
        created = [e for e in events if e.type == "response.created"]
        errors = [e for e in events if e.type == "error"]
        assert len(created) == 1 and created[0].response.metadata == meta
        assert [e.error.code for e in errors] == ["conversation_already_has_active_response"]
        conn.send({"type": "response.cancel"})
        done = [e for e in _until(conn, "response.done") if e.type == "response.done"][-1].response
        assert done.metadata == meta and done.status in ("cancelled", "completed")


def test_openai_voice_names_map_to_the_model_speakers(client):
    """LiveKit's default voice "marin" (and OpenAI's other names) reach a speaker of the model."""
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        for voice, speaker in (("marin", "Chelsie"), ("ash", "Ethan"), ("alloy", "Chelsie"), ("ETHAN", "Ethan")):
            conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": voice}}})
            assert _until(conn, "session.updated")[-1].session.audio.output.voice == speaker
    audio = client.audio.speech.create(model="tiny", voice="alloy", input="Hi.", response_format="pcm").read()
    assert len(audio) > 0


def test_resolve_voice_table():
    from omnistage.server.voices import resolve_voice

    qwen3 = ("ethan", "aiden", "chelsie")                            # as the Qwen3-Omni pipeline lists them
    assert resolve_voice("shimmer", qwen3) == "chelsie" and resolve_voice("cedar", qwen3) == "ethan"
    assert resolve_voice("fable", qwen3) == "ethan"                  # neutral: the default speaker
    assert resolve_voice("AIDEN", qwen3) == "aiden"                  # the model's own, any case
    assert resolve_voice("nobody", qwen3) == "nobody"                # left for the engine to refuse
    assert resolve_voice("marin", ("Zed",)) == "Zed" and resolve_voice(None, qwen3) is None
