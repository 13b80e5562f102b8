"""What a request must satisfy before it enters the engine: the shapes of its prompt inputs
and the model's limits. Every failure is an InvalidRequestError naming the field."""

from __future__ import annotations

import torch

from omnistage.errors import InvalidRequestError, PromptTooLongError


def check_prompt_inputs(prompt_token_ids: list[int], prompt_embeds: torch.Tensor | None,
                        mrope_positions: torch.Tensor | None, width: int, vocab_size: int,
                        max_model_len: int) -> list[int]:
    """-> the prompt's token ids (placeholders of length P when only `prompt_embeds` (P,
    width) were given). `mrope_positions` must be (3, P)."""
    if prompt_embeds is not None:
        if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != width:
            raise InvalidRequestError(
                f"prompt_embeds must have shape (num_tokens, {width}), "
                f"got {tuple(prompt_embeds.shape)}", param="prompt_embeds")
        if not prompt_token_ids:
            prompt_token_ids = [0] * prompt_embeds.shape[0]
        elif len(prompt_token_ids) != prompt_embeds.shape[0]:
            raise InvalidRequestError(
                f"prompt_token_ids ({len(prompt_token_ids)}) and prompt_embeds "
                f"({prompt_embeds.shape[0]} rows) must have the same length", param="prompt_embeds")
    if mrope_positions is not None and tuple(mrope_positions.shape) != (3, len(prompt_token_ids)):
        raise InvalidRequestError(f"mrope_positions must have shape (3, {len(prompt_token_ids)}), "
                                  f"got {tuple(mrope_positions.shape)}", param="mrope_positions")
    ids = prompt_token_ids
    if not ids:
        raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len}, "
            f"which must leave room for at least one generated token; shorten the prompt",
            param="prompt")
    if prompt_embeds is None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise InvalidRequestError(
            f"prompt token ids must lie in [0, {vocab_size}); got one outside", param="prompt")
    return prompt_token_ids
