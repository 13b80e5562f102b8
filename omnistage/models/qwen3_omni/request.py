"""A Qwen3-Omni request after preprocessing: what enters its stage graph."""

from __future__ import annotations

import msgspec
import torch

from omnistage.models.qwen2_5_omni.messages import MediaInput
from omnistage.sampling_params import SamplingParams


class Qwen3OmniRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    mrope_positions: torch.Tensor | None          # (3, P) int64; None: plain positions
    position_delta: int
    media: list[MediaInput]
    thinker_params: SamplingParams
    talker_params: SamplingParams | None          # None: text only
    speaker_id: int = -1                          # the voice's codec id (speaking requests)
    assistant_at: int = -1                        # index of the last <|im_start|> assistant
    talker_mrope_positions: torch.Tensor | None = None   # (3, talker prompt length)
    talker_position_delta: int = 0
    keep_hidden: bool = False    # the thinker exports its prompt's hidden rows (a speaking prompt)
    # OutputOptions.prefill_only (a Realtime turn still spoken): background work for the AR
    # stages (ARRequest.background, TalkerStart.background), which no one waits for yet
    prefill_only: bool = False

    @property
    def warm_talker(self) -> bool:
        """A speaking session's turn prefilled while still spoken: the talker prefills the user
        turns' rows too, so that at commit its prefix cache holds them."""
        return self.keep_hidden and self.prefill_only
