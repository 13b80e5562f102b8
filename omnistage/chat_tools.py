"""Function calling in chats (OpenAI's `tools`): the definitions checked and handed to the model's
chat template, and the calls read back out of the generated text.

The format is Qwen's (Qwen2.5, Qwen3, Qwen3-Omni; Hermes' too): the template lists the
signatures in the system turn, and the model answers a call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
possibly several, possibly after some text. Text that is not a well-formed call (bad JSON, no
name) stays text. `ToolCallStream` does the same on streamed text: it passes text on until a
call may be starting, holds what could be the beginning of `<tool_call>`, and hands out the
calls when the answer ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from omnistage.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; InvalidRequestError (param tools[i]) naming what is wrong."""
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of {type: function, function: {...}}", param="tools")
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(f, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}",
                                      param=f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f["name"]):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . -",
                                      param=f"tools[{i}].function.name")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      param=f"tools[{i}].function.parameters")
    return tools


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` (a template that never reads them would drop
    the definitions silently)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_for_template(tokenizer, tools) -> dict:
    """apply_chat_template's keyword for a request's `tools` (None or []: none); a model whose
    template does not render tools refuses them."""
    if not tools:
        return {}
    check_tools(tools)
    if not template_takes_tools(tokenizer.chat_template):
        raise InvalidRequestError("this model's chat template has no function calling: it cannot "
                                  "be given tools", param="tools")
    return {"tools": tools}


def template_messages(messages: list) -> list:
    """Messages as chat templates read them: a call's `arguments` (a JSON string in OpenAI's
    messages) as an object, so the template writes it as JSON, not as a quoted string."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = {**m, "tool_calls": [_call_object(c) for c in calls]}
        out.append(m)
    return out


def _call_object(call) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InvalidRequestError("a tool_calls entry must be {id, type: function, function: {name, "
                                  "arguments}}", param="messages")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"tool call {f['name']!r}: arguments are not JSON ({e})",
                                      param="messages") from e
    return {**call, "function": {**f, "arguments": args}}


@dataclass
class ToolCall:
    name: str
    arguments: str                 # JSON text, as OpenAI returns it
    id: str

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _parse(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside well-formed calls, the calls in order)."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _parse(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


class ToolCallStream:
    """Streamed text with calls in it: `push` returns the text that is surely not part of a call,
    `finish` the rest (text, calls)."""

    def __init__(self) -> None:
        self._held = ""              # text from the first possible call start on
        self._calling = False        # a call has started: hold everything to the end

    def push(self, text: str) -> str:
        self._held += text
        if self._calling:
            return ""
        at = self._held.find(OPEN)
        if at >= 0:
            out, self._held, self._calling = self._held[:at], self._held[at:], True
            return out
        # keep a tail that may be the start of OPEN
        keep = next((k for k in range(min(len(OPEN) - 1, len(self._held)), 0, -1)
                     if OPEN.startswith(self._held[-k:])), 0)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        text, calls = split_tool_calls(held)
        return text, calls
