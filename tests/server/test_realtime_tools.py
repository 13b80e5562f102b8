"""Function calling in a Realtime session, end to end: the real server over tiny:qwen2 size
`tools` (its greedy answer to a weather question is a call), the openai SDK's Realtime client.
The call comes out as a function_call item with OpenAI's events; the client's
function_call_output then gets a text answer; what cannot be served is an error event naming
the field."""

from __future__ import annotations

import json
import time

import openai
import pytest

from omnistage.tiny.trained import CITIES, WEATHER_TOOL

DEADLINE_S = 60
TOOL = {"type": "function", **WEATHER_TOOL["function"]}          # realtime tools are flat


@pytest.fixture(scope="module")
def client(tools_server, api_key):
    return openai.OpenAI(base_url=f"{tools_server.base}/v1", api_key=api_key, max_retries=0, timeout=60)


def _until(conn, last: str) -> list[dict]:
    """Raw events up to and including the first of type `last` (bounded)."""
    events, end = [], time.monotonic() + DEADLINE_S
    while True:
        left = end - time.monotonic()
        assert left > 0, f"no {last!r} within {DEADLINE_S} s: {[e['type'] for e in events]}"
        events.append(json.loads(conn._connection.recv(timeout=left, decode=False)))
        assert events[-1]["type"] != "error", events[-1]
        if events[-1]["type"] == last:
            return events


def _ask(conn, text: str) -> None:
    conn.conversation.item.create(item={"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": text}]})
    _until(conn, "conversation.item.done")


def test_a_call_and_its_result(client):
    with client.realtime.connect(model="tiny") as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "temperature": 0,
                                     "tools": [TOOL], "tool_choice": "auto"})
        updated = _until(conn, "session.updated")[-1]
        assert updated["session"]["tools"] == [TOOL]
        _ask(conn, "What is the weather in Tokyo?")
        conn.response.create()
        events = _until(conn, "response.done")
        kinds = [e["type"] for e in events]
        assert "response.output_text.delta" not in kinds          # the call's text is not shown
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert done["name"] == "get_weather" and json.loads(done["arguments"])["city"] in CITIES
        [item] = events[-1]["response"]["output"]
        assert item["type"] == "function_call" and item["call_id"] == done["call_id"]
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done") \
            < kinds.index("response.output_item.done")
        conn.conversation.item.create(item={"type": "function_call_output", "call_id": done["call_id"],
                                            "output": "sunny"})
        _until(conn, "conversation.item.done")
        conn.response.create()
        answer = _until(conn, "response.done")
        text = "".join(e["delta"] for e in answer if e["type"] == "response.output_text.delta")
        assert text.startswith("It is ")
        assert answer[-1]["response"]["output"][0]["type"] == "message"


def test_what_is_not_served_is_an_error_event(client):
    with client.realtime.connect(model="tiny") as conn:
        _until(conn, "session.created")
        for session, param in (({"tool_choice": "required"}, "session.tool_choice"),
                               ({"tools": [{"type": "mcp", "server_url": "x"}]}, "session.tools[0]")):
            conn.session.update(session={"type": "realtime", **session})
            error = json.loads(conn._connection.recv(timeout=DEADLINE_S, decode=False))
            assert error["type"] == "error" and error["error"]["param"] == param
        conn.conversation.item.create(item={"type": "function_call_output", "output": "x"})
        error = json.loads(conn._connection.recv(timeout=DEADLINE_S, decode=False))
        assert error["type"] == "error" and error["error"]["param"] == "item.call_id"
