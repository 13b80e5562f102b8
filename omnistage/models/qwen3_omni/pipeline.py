"""Qwen3-Omni served as a graph of stages (each in this process unless a placement says
otherwise):

    encoder -> thinker (MoE) -> talker (MoE + code predictor) -> code2wav

`Qwen3OmniPipeline` is an engine (omnistage.engine_api): Omni, AsyncOmni and the server drive it
as any other. Text deltas come from the thinker as it writes; audio chunks from code2wav as soon
as the talker has the first chunk of frames.
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
from omnistage.models.qwen2_5_omni.rope_index import OmniLayout
from omnistage.models.qwen2_5_omni.vision_preprocess import VisionPreprocessConfig
from omnistage.models.qwen3_omni.loader import check_config, speakers, voice_order
from omnistage.models.qwen3_omni.processor import (Qwen3OmniProcessor, Qwen3Prompt, TalkerLayout,
                                                   talker_positions)
from omnistage.models.qwen3_omni.rope_index import RopeIds
from omnistage.models.qwen3_omni.recipe import RECIPE, Qwen3OmniSettings, load_thinker_tokenizer, speaks
from omnistage.models.qwen3_omni.request import Qwen3OmniRequest
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def default_talker_params(model_dir: Path, cfg: dict) -> SamplingParams:
    """transformers' Qwen3-Omni generate() defaults for the talker, overridden by
    generation_config.json's `talker_*` keys; the top 1024 codec ids but end-of-speech are
    never sampled (generate's suppress list)."""
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    t = cfg["talker_config"]
    vocab, eos = t["text_config"]["vocab_size"], t["codec_eos_token_id"]
    do_sample = gen.get("talker_do_sample", True)
    return SamplingParams(
        temperature=gen.get("talker_temperature", 0.9) if do_sample else 0.0,
        top_k=gen.get("talker_top_k", 50), top_p=gen.get("talker_top_p", 1.0),
        repetition_penalty=gen.get("talker_repetition_penalty", 1.05),
        max_tokens=gen.get("talker_max_new_tokens", 4096), min_tokens=gen.get("talker_min_new_tokens", 0),
        suppress_token_ids=[i for i in range(max(0, vocab - 1024), vocab) if i != eos])


class Qwen3OmniPipeline(GraphPipeline):
    recipe = RECIPE

    def __init__(self, config: EngineConfig, settings: Qwen3OmniSettings | None = None, placement=None):
        check_config(read_config(config.model), str(Path(config.model) / "config.json"))
        super().__init__(config, settings, placement)
        model_dir = Path(config.model)
        cfg = read_config(model_dir)
        audio_output = speaks(model_dir, self.settings)
        self.tokenizer = load_thinker_tokenizer(config)
        self.voices = speakers(cfg) if audio_output else {}
        self.speakers = voice_order(self.voices)
        self.im_start, self.assistant = cfg["im_start_token_id"], cfg["assistant_token_id"]
        th = cfg["thinker_config"]
        self.rope = RopeIds(th["vision_start_token_id"], th["image_token_id"], th["video_token_id"],
                            th["vision_config"].get("spatial_merge_size", 2), th.get("position_id_per_seconds", 25))
        self.talker_layout = TalkerLayout(self.im_start, cfg["user_token_id"], cfg["tts_pad_token_id"])
        self.processor = Qwen3OmniProcessor(self.tokenizer, _layout(cfg, self.tokenizer), _vision(model_dir),
                                            self.settings.limits, th["audio_config"].get("n_window", 50), self.rope)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        positions = cfg["thinker_config"]["text_config"].get("max_position_embeddings", 32768)
        self.abilities = EngineAbilities(
            audio_output=audio_output, audio_input=True,
            max_model_len=config.max_model_len or positions, sample_rate=24000,
            end_of_turn_id=end if isinstance(end, int) and end >= 0 else self.tokenizer.eos_token_id,
            talker_defaults=default_talker_params(model_dir, cfg) if audio_output else None,
            speakers=tuple(self.speakers), max_audio_seconds=self.settings.limits.max_audio_seconds)
        log.info("Qwen3-Omni ready: stages %s, voices %s", list(self.graph.stages), self.speakers)

    # ---- requests -------------------------------------------------------------------------
    def prepare(self, prompt, opts: OutputOptions) -> Qwen3Prompt:
        """CPU preprocessing (decode media, features, ids); thread-safe."""
        return self.processor(prompt, opts.wants_audio(self.abilities), opts.use_audio_in_video)

    def default_params(self) -> SamplingParams:
        return SamplingParams()

    def resolve(self, pp: Qwen3Prompt, params: SamplingParams) -> SamplingParams:
        if params.n != 1:
            raise InvalidRequestError("n must be 1 for this model", param="n")
        return params

    def add_request(self, request_id: str, pp: Qwen3Prompt, params: SamplingParams,
                    opts: OutputOptions, return_hidden_states: bool = False) -> None:
        if return_hidden_states:
            raise InvalidRequestError("return_hidden_states is not offered for omni models",
                                      param="return_hidden_states")
        params = self.resolve(pp, params)
        talker_params, speaker_id, assistant_at, t_pos, t_delta = None, -1, -1, None, 0
        speaks, params = opts.wants_audio(self.abilities), opts.text_params(params)
        if speaks:
            t_pos, t_delta = talker_positions(pp, self.talker_layout, self.rope)
        if speaks and not opts.prefill_only:
            speaker_id = self._voice(opts.voice)
            assistant_at = self._assistant_turn(pp.token_ids)
            talker_params = opts.talker_params or self.abilities.talker_defaults
            suppress = self.abilities.talker_defaults.suppress_token_ids
            if not set(suppress) <= set(talker_params.suppress_token_ids):
                talker_params = replace(talker_params, suppress_token_ids=sorted(
                    {*talker_params.suppress_token_ids, *suppress}))
        req = Qwen3OmniRequest(request_id, pp.token_ids, pp.positions, pp.position_delta, pp.media,
                               params, talker_params, speaker_id, assistant_at, t_pos, t_delta,
                               keep_hidden=speaks, prefill_only=opts.prefill_only)
        self.graph.add_request(request_id, req)

    def _voice(self, voice: str | None) -> int:
        name = (voice or self.speakers[0]).lower()
        if name not in self.voices:
            raise InvalidRequestError(f"unknown voice {voice!r}; choose one of {self.speakers}", param="voice")
        return self.voices[name]

    def _assistant_turn(self, ids: list[int]) -> int:
        """Index of the last `<|im_start|>assistant`: the talker speaks what follows it."""
        at = [i for i in range(len(ids) - 1) if ids[i] == self.im_start and ids[i + 1] == self.assistant]
        if not at or at[-1] + 3 > len(ids):
            raise InvalidRequestError("speech needs a chat prompt that ends with the assistant's turn "
                                      "(<|im_start|>assistant\\n); send chat messages, or ask for "
                                      "modalities ['text']", param="messages")
        return at[-1]

    def num_waiting_requests(self) -> int:
        """Requests beyond the thinker's seats (the server's queue bound reads it)."""
        return max(0, len(self.graph.requests) - self.config.max_num_seqs)


def _layout(cfg: dict, tokenizer) -> OmniLayout:
    th = cfg["thinker_config"]
    return OmniLayout(audio_token_id=th["audio_token_id"], image_token_id=th["image_token_id"],
                      video_token_id=th["video_token_id"], audio_start_token_id=th["audio_start_token_id"],
                      audio_end_token_id=tokenizer.convert_tokens_to_ids("<|audio_end|>"),
                      spatial_merge_size=th["vision_config"].get("spatial_merge_size", 2),
                      position_id_per_seconds=th.get("position_id_per_seconds", 13))


def _vision(model_dir: Path) -> VisionPreprocessConfig:
    path = model_dir / "preprocessor_config.json"
    return VisionPreprocessConfig.from_dict(json.loads(path.read_text()) if path.is_file() else {})
