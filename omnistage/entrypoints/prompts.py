"""Prompt forms accepted by the offline APIs, turned into token ids (or embeddings).

- "text"                               -> tokenized as is (no chat template)
- [{"role": ..., "content": ...}, ...] -> the tokenizer's chat template, generation prompt added
- {"prompt": "text"} / {"messages": [...]}
- {"prompt_token_ids": [int, ...]}
- {"prompt_embeds": Tensor (P, hidden)} (+ optional "prompt_token_ids" placeholders)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from omnistage.errors import InvalidRequestError
from omnistage.sampling_params import SamplingParams


@dataclass
class ParsedPrompt:
    text: str | None
    token_ids: list[int]
    embeds: torch.Tensor | None = None


def is_single_prompt(prompts) -> bool:
    """A str, a dict, or a chat (a list of role dicts) is one prompt; any other list is many."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict) \
        and "role" in prompts[0]


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode ({e.reason} at {e.start}); "
                                  f"lone surrogates such as \\ud800 are not text", param=param) from e


def parse_prompt(prompt, tokenizer) -> ParsedPrompt:
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
        return ParsedPrompt(prompt, tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list):
        return _chat(prompt, tokenizer)
    if not isinstance(prompt, dict):
        raise InvalidRequestError(
            f"a prompt must be a string, a list of chat messages or a dict, got {type(prompt).__name__}",
            param="prompt")
    if "prompt_embeds" in prompt:
        embeds = prompt["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor):
            raise InvalidRequestError("prompt_embeds must be a torch.Tensor", param="prompt_embeds")
        return ParsedPrompt(None, list(prompt.get("prompt_token_ids") or []), embeds)
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", param="prompt_token_ids")
        return ParsedPrompt(None, list(ids))
    if "messages" in prompt:
        return _chat(prompt["messages"], tokenizer)
    if "prompt" in prompt:
        return parse_prompt(str(prompt["prompt"]), tokenizer)
    raise InvalidRequestError(
        "a prompt dict needs one of: prompt, messages, prompt_token_ids, prompt_embeds", param="prompt")


def _chat(messages: list, tokenizer) -> ParsedPrompt:
    check_messages(messages, media_types=())
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return ParsedPrompt(text, tokenizer.encode(text, add_special_tokens=False))


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
            _check_text(content, f"messages[{i}].content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message {i} has a text part without a string 'text'",
                                          param=f"messages[{i}].content")
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                _check_text(part["text"], f"messages[{i}].content")
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or (kind != "text" and kind not in media_types):
                takes = f"text, {', '.join(media_types)}" if media_types else "text only"
                raise InvalidRequestError(
                    f"message {i} has a content part of type {kind!r}; this model takes {takes}",
                    param=f"messages[{i}].content")


def params_for(sampling_params, count: int, kind: type = SamplingParams) -> list:
    """One params object per prompt; `kind` is SamplingParams (text) or DiffusionParams."""
    if sampling_params is None:
        return [kind() for _ in range(count)]
    if isinstance(sampling_params, kind):
        return [sampling_params] * count
    if not isinstance(sampling_params, (list, tuple)):
        raise InvalidRequestError(f"this model takes {kind.__name__}, not {type(sampling_params).__name__}",
                                  param="sampling_params")
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(
            f"got {len(params)} sampling_params for {count} prompts; give one, or one per prompt",
            param="sampling_params")
    return params


def new_request_id() -> str:
    return uuid.uuid4().hex
