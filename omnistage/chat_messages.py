"""Checks on chat `messages` (OpenAI's shape: role + content string or parts) that every model
family applies before its own processing: roles, content shapes, valid Unicode."""

from __future__ import annotations

from omnistage.errors import InvalidRequestError


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode ({e.reason} at {e.start}); "
                                  f"lone surrogates such as \\ud800 are not text", param=param) from e


def check_messages(messages, media_types: tuple[str, ...]) -> None:
    """Validate a chat: roles, content shapes, valid Unicode; content parts other than text
    must have a type in `media_types` (empty: the model takes text only)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content'",
                                      param=f"messages[{i}]")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"message {i} has unknown role {m['role']!r}",
                                      param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequestError(
                f"message {i} content must be a string or a list of content parts, "
                f"got {type(content).__name__}", param=f"messages[{i}].content")
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message {i} has a text part without a string 'text'",
                                          param=f"messages[{i}].content")
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                check_text(part["text"], f"messages[{i}].content")
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or (kind != "text" and kind not in media_types):
                takes = f"text, {', '.join(media_types)}" if media_types else "text only"
                raise InvalidRequestError(
                    f"message {i} has a content part of type {kind!r}; this model takes {takes}",
                    param=f"messages[{i}].content")
