"""Function calling on /v1/chat/completions, end to end: the real server over `tiny:qwen2` size
`tools` (trained on chats that offer a weather tool, omnistage/tiny/trained.py), driven by the
openai SDK. The model's greedy answer is a call: it comes back as `tool_calls` (whole and
streamed), the tool's result in a later turn gets a text answer, and what cannot be served
is refused naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from omnistage.tiny.trained import CITIES, WEATHER_TOOL

ASK = [{"role": "user", "content": "What is the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def tools_model(tools_server) -> str:
    return tools_server.model


@pytest.fixture(scope="module")
def client(tools_server, api_key):
    return openai.OpenAI(base_url=f"{tools_server.base}/v1", api_key=api_key, max_retries=0, timeout=60)


def _is_weather_call(call) -> bool:
    args = json.loads(call.function.arguments)
    return call.type == "function" and call.function.name == "get_weather" and args.get("city") in CITIES


def test_a_call_comes_back_as_tool_calls(client, tools_model):
    from transformers import AutoTokenizer

    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL],
                                          temperature=0, max_tokens=60)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert _is_weather_call(call) and call.id.startswith("call_")
    # the prompt is the model's template with the tools in it (transformers renders the same)
    tok = AutoTokenizer.from_pretrained(tools_model)
    want = tok.apply_chat_template(ASK, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))


def test_streamed_call(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=60, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert text == ""                                   # the call's text never leaks as content
    assert len(calls) == 1 and calls[0].index == 0 and _is_weather_call(calls[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_the_result_gets_a_text_answer(client):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL],
                                          temperature=0, max_tokens=60)
    call = resp.choices[0].message.tool_calls[0]
    messages = ASK + [resp.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=60)
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.content.startswith("It is ")


def test_tool_choice_none_offers_no_tools(client):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL],
                                          tool_choice="none", temperature=0, max_tokens=8)
    assert resp.choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces please"}}]}, "tools[0].function.name"),
])
def test_what_is_not_served_is_refused(client, extra, param):
    body = {"tools": [WEATHER_TOOL], **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param


def test_a_template_without_tools_refuses_them(omni_server, api_key):
    """Qwen2.5-Omni's template has no function calling: tools are refused, not dropped."""
    plain = openai.OpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="no function calling") as e:
        plain.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL], max_tokens=4)
    assert e.value.body["param"] == "tools"
