"""Function calling in a Realtime session: the session's (or a response's) `tools` and
`tool_choice`, the conversation's function_call / function_call_output items, and the events
that hand a call to the client.

Realtime tools are flat ({type: function, name, description, parameters}); the model's chat
template gets them in chat completions' shape, and calls are read from the answer as there
(omnistage/chat_tools.py). A call becomes a `function_call` item (call_id, name, arguments
JSON); the client runs it and adds a `function_call_output` item (call_id, output), then asks
for the next response. Calls come from text answers (output_modalities ["text"]); a model whose
chat template renders no tools fails the response naming `tools`.
"""

from __future__ import annotations

from omnistage.chat_tools import check_tools
from omnistage.errors import InvalidRequestError


def parse_tools(value, param: str) -> list[dict]:
    """session.tools / response.tools: realtime function tools, checked (param names the field)."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{param} must be a list of function tools", param=param)
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f"{param}[{i}] must be {{type: function, name, description, "
                                      f"parameters}} (only function tools are served)", param=f"{param}[{i}]")
        unknown = set(tool) - {"type", "name", "description", "parameters"}
        if unknown:
            raise InvalidRequestError(f"{param}[{i}] has unknown keys {sorted(unknown)}",
                                      param=f"{param}[{i}]")
        try:
            check_tools(chat_tools([tool]))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{param}[{i}]: {e}", param=f"{param}[{i}]") from e
        out.append(dict(tool))
    return out


def parse_tool_choice(value, param: str) -> str:
    if value not in ("auto", "none"):
        raise InvalidRequestError(f"{param} must be 'auto' (the model decides) or 'none'; "
                                  "'required' and a named function are not served", param=param)
    return value


def chat_tools(tools: list[dict]) -> list[dict]:
    """Realtime tools in chat completions' shape (what chat templates read)."""
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                              if k in t}} for t in tools]


def call_message(call_id: str, name: str, arguments: str) -> dict:
    """A function_call item as the chat message templates read."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def output_message(call_id: str, output: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": output}
