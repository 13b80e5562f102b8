"""Prompt forms accepted by the offline APIs, turned into token ids (or embeddings).

- "text"                               -> tokenized as is (no chat template)
- [{"role": ..., "content": ...}, ...] -> the tokenizer's chat template, generation prompt added
- {"prompt": "text"} / {"messages": [...]} / {"messages": [...], "tools": [...]} (function
  calling: the template lists the tools; chat_tools.py)
- {"prompt_token_ids": [int, ...]}
- {"prompt_embeds": Tensor (P, hidden)} (+ optional "prompt_token_ids" placeholders)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from omnistage.chat_messages import check_messages, check_text
from omnistage.chat_tools import template_messages, tools_for_template
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


def parse_prompt(prompt, tokenizer) -> ParsedPrompt:
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
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
        return _chat(prompt["messages"], tokenizer, prompt.get("tools"))
    if "prompt" in prompt:
        return parse_prompt(str(prompt["prompt"]), tokenizer)
    raise InvalidRequestError(
        "a prompt dict needs one of: prompt, messages, prompt_token_ids, prompt_embeds", param="prompt")


def _chat(messages: list, tokenizer, tools: list | None = None) -> ParsedPrompt:
    check_messages(messages, media_types=())
    text = tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                         add_generation_prompt=True, **tools_for_template(tokenizer, tools))
    return ParsedPrompt(text, tokenizer.encode(text, add_special_tokens=False))


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
