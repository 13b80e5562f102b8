"""Function calling's pieces (omnistage/chat_tools.py): tool definitions checked, calls read out
of whole and of streamed text (split anywhere), messages made ready for a template."""

from __future__ import annotations

import json

import pytest

from omnistage.chat_tools import (ToolCallStream, check_tools, split_tool_calls, template_messages,
                                  template_takes_tools)
from omnistage.errors import InvalidRequestError

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("tools, param", [
    ({"a": 1}, "tools"), ([{"type": "web"}], "tools[0]"), ([{"type": "function"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools)
    assert e.value.param == param


def test_whole_text():
    content, calls = split_tool_calls("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert calls[0].id != calls[1].id and calls[0].to_openai(0)["index"] == 0
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert split_tool_calls(broken) == (broken, [])            # not a call: stays text
    assert split_tool_calls("plain") == ("plain", [])


@pytest.mark.parametrize("cut", range(1, 60, 3))
def test_streamed_text_split_anywhere(cut):
    text = "Sure: <tool" + " x " + CALL
    stream = ToolCallStream()
    out = stream.push(text[:cut]) + stream.push(text[cut:])
    rest, calls = stream.finish()
    assert out + rest == "Sure: <tool x "                   # text until the call, nothing of it
    assert [c.name for c in calls] == ["get_weather"]
    plain = ToolCallStream()
    assert plain.push("a <tool") == "a " and plain.finish() == ("<tool", [])


def test_templates_and_messages():
    assert template_takes_tools("{% if tools %}x{% endif %}") and not template_takes_tools("{{ messages }}")
    assert not template_takes_tools(None)
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'   # not changed
    with pytest.raises(InvalidRequestError, match="not JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
