"""Qwen2.5-Omni served as a graph of stages (each in this process unless a placement says
otherwise):

    encoder (audio + vision towers) -> thinker (AR) -> talker (AR) -> token2wav (vocoder)

`Qwen2_5OmniPipeline` is an engine (omnistage.engine_api), so Omni, AsyncOmni and the server
drive it as any other. Text deltas come from the thinker as it writes;
audio chunks from token2wav as soon as the talker has a chunk of codes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from omnistage.config import EngineConfig
from omnistage.engine_api import EngineAbilities, OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.graph_pipeline import GraphPipeline
from omnistage.layers.checkpoint import read_config
from omnistage.models.qwen2_5_omni.loader import load_speakers, talker_tokens
from omnistage.models.qwen2_5_omni.messages import OmniRequest
from omnistage.models.qwen2_5_omni.processor import OmniProcessor, ProcessedPrompt
from omnistage.models.qwen2_5_omni.recipe import (RECIPE, OmniSettings, generation_defaults,
                                                  load_thinker_tokenizer, speaks, thinker_config)
from omnistage.models.qwen2_5_omni.rope_index import OmniLayout
from omnistage.models.qwen2_5_omni.vision_preprocess import VisionPreprocessConfig
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def default_talker_params(model_dir: Path, codec_bos: int) -> SamplingParams:
    """transformers' Qwen2.5-Omni generate() defaults for the talker, overridden by
    generation_config.json's `talker_*` keys where it has them."""
    gen = generation_defaults(model_dir)
    do_sample = gen.get("talker_do_sample", True)
    return SamplingParams(
        temperature=gen.get("talker_temperature", 0.9) if do_sample else 0.0,
        top_k=gen.get("talker_top_k", 40), top_p=gen.get("talker_top_p", 0.8),
        repetition_penalty=gen.get("talker_repetition_penalty", 1.05),
        max_tokens=gen.get("talker_max_new_tokens", 4096),
        min_tokens=gen.get("talker_min_new_tokens", 0), suppress_token_ids=[codec_bos])


class Qwen2_5OmniPipeline(GraphPipeline):
    recipe = RECIPE

    def __init__(self, config: EngineConfig, settings: OmniSettings | None = None,
                 placement=None):
        super().__init__(config, settings, placement)
        model_dir = Path(config.model)
        audio_output = speaks(model_dir, self.settings)
        self.tokenizer = load_thinker_tokenizer(config)
        raw = read_config(model_dir)
        tokens = talker_tokens(raw)
        self.codec_bos = tokens.codec_bos
        self.speakers = sorted(load_speakers(model_dir)) if audio_output else []
        pre_file = model_dir / "preprocessor_config.json"
        pre = json.loads(pre_file.read_text()) if pre_file.is_file() else {}
        self.processor = OmniProcessor(self.tokenizer,
                                       OmniLayout.from_thinker_config(thinker_config(model_dir)),
                                       VisionPreprocessConfig.from_dict(pre), self.settings.limits)
        # The token that ends the assistant's turn (ChatML <|im_end|>): a forced answer ends with it.
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        positions = raw["thinker_config"]["text_config"].get("max_position_embeddings", 32768)
        self.abilities = EngineAbilities(
            audio_output=audio_output, audio_input=True,
            max_model_len=config.max_model_len or positions,   # the thinker's context window
            sample_rate=24000,
            end_of_turn_id=end if isinstance(end, int) and end >= 0 else self.tokenizer.eos_token_id,
            talker_defaults=default_talker_params(model_dir, tokens.codec_bos),
            speakers=tuple(self.speakers),
            max_audio_seconds=self.settings.limits.max_audio_seconds)
        log.info("Qwen2.5-Omni ready: stages %s, speakers %s", list(self.graph.stages), self.speakers)

    # ---- requests -------------------------------------------------------------------------
    def prepare(self, prompt, opts: OutputOptions) -> ProcessedPrompt:
        """CPU preprocessing (decode media, features, ids, positions); thread-safe."""
        return self.processor(prompt, opts.wants_audio(self.abilities), opts.use_audio_in_video)

    def default_params(self) -> SamplingParams:
        return SamplingParams()

    def resolve(self, pp: ProcessedPrompt, params: SamplingParams) -> SamplingParams:
        if params.n != 1:
            raise InvalidRequestError("n must be 1 for this model", param="n")
        return params

    def add_request(self, request_id: str, pp: ProcessedPrompt, params: SamplingParams,
                    opts: OutputOptions, return_hidden_states: bool = False) -> None:
        if return_hidden_states:
            raise InvalidRequestError("return_hidden_states is not offered for omni models",
                                      param="return_hidden_states")
        params = self.resolve(pp, params)
        want_audio = opts.wants_audio(self.abilities)
        speaker = opts.voice or (self.speakers[0] if self.speakers else "")
        if want_audio and speaker not in self.speakers:
            raise InvalidRequestError(f"unknown voice {speaker!r}; choose one of {self.speakers}",
                                      param="voice")
        talker_params, params = None, opts.text_params(params)
        if want_audio and not opts.prefill_only:
            talker_params = opts.talker_params or self.abilities.talker_defaults
            if self.codec_bos not in talker_params.suppress_token_ids:
                talker_params = replace(talker_params, suppress_token_ids=[
                    *talker_params.suppress_token_ids, self.codec_bos])
        req = OmniRequest(request_id, pp.token_ids, pp.positions.positions, pp.positions.delta,
                          pp.talker_positions.positions if want_audio else None,
                          pp.talker_positions.delta, pp.media, params, talker_params, speaker,
                          keep_hidden=want_audio, prefill_only=opts.prefill_only)
        self.graph.add_request(request_id, req)

    def num_waiting_requests(self) -> int:
        """Requests beyond the thinker's seats (the server's queue bound reads it)."""
        return max(0, len(self.graph.requests) - self.config.max_num_seqs)
