"""Qwen2.5-Omni served as a graph of stages, in this process:

    encoder (audio + vision towers) -> thinker (AR) -> talker (AR) -> token2wav (vocoder)

`Qwen2_5OmniPipeline` is an engine (add_request / step / abort_request, as LLMEngine), so
Omni and AsyncOmni drive it the same way. Text deltas come from the thinker as it writes;
audio chunks from token2wav as soon as the talker has a chunk of codes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import Qwen2_5OmniConfig

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.graph import StageGraph
from omnistage.llm.engine import LLMEngine, eos_token_ids, load_tokenizer
from omnistage.models.loader import iter_weights, safetensors_files
from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen2_5_omni.encoders import OmniEncoders
from omnistage.models.qwen2_5_omni.loader import bridge_constants, load_lm_parts
from omnistage.models.qwen2_5_omni.messages import OmniRequest
from omnistage.models.qwen2_5_omni.processor import MediaLimits, OmniProcessor, ProcessedPrompt
from omnistage.models.qwen2_5_omni.rope_index import OmniLayout
from omnistage.models.qwen2_5_omni.router import OmniRouter
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.qwen2_5_omni.vision_preprocess import VisionPreprocessConfig
from omnistage.models.weights import load_prefixed, require_complete
from omnistage.sampling_params import SamplingParams
from omnistage.stages.ar import ARStage
from omnistage.stages.encoder import EncoderStage
from omnistage.stages.vocoder import VocoderSettings, VocoderStage

log = logging.getLogger(__name__)

ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"


def default_talker_params(model_dir: Path, codec_bos: int) -> SamplingParams:
    """transformers' Qwen2.5-Omni generate() defaults for the talker, overridden by
    generation_config.json's `talker_*` keys where it has them."""
    gen_file = model_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    do_sample = gen.get("talker_do_sample", True)
    return SamplingParams(
        temperature=gen.get("talker_temperature", 0.9) if do_sample else 0.0,
        top_k=gen.get("talker_top_k", 40), top_p=gen.get("talker_top_p", 0.8),
        repetition_penalty=gen.get("talker_repetition_penalty", 1.05),
        max_tokens=gen.get("talker_max_new_tokens", 4096),
        min_tokens=gen.get("talker_min_new_tokens", 0), suppress_token_ids=[codec_bos])


@dataclass
class OmniSettings:
    audio_output: bool = True                 # load talker + token2wav
    vocoder: VocoderSettings = field(default_factory=VocoderSettings)
    limits: MediaLimits = field(default_factory=MediaLimits)
    encoder_budget: int = 16384               # audio frames + vision patches per encoder step


class Qwen2_5OmniPipeline:
    def __init__(self, config: EngineConfig, settings: OmniSettings | None = None):
        self.config, self.settings = config, settings or OmniSettings()
        dev, model_dir = config.torch_device, Path(config.model)
        raw = json.loads((model_dir / "config.json").read_text())
        dtype = config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))
        hf_cfg = Qwen2_5OmniConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        audio_out = self.settings.audio_output and raw.get("enable_audio_output", True)
        self.parts = load_lm_parts(model_dir, dtype, dev, with_talker=audio_out)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        files = safetensors_files(model_dir)
        tc = hf_cfg.thinker_config
        audio = AudioEncoder(tc.audio_config, dtype, dev)
        audio.load_weights(iter_weights(files))
        vision = Qwen2_5OmniVisionEncoder(tc.vision_config, dtype, dev)
        require_complete(vision, load_prefixed(vision, iter_weights(files), "thinker.visual."), "thinker.visual")
        stages = [EncoderStage("encoder", OmniEncoders(audio.eval(), vision.eval(), dev),
                               self.settings.encoder_budget)]
        thinker = LLMEngine(config, self.parts.thinker, self.tokenizer,
                            eos_token_ids(config.model, self.tokenizer))
        stages.append(ARStage("thinker", thinker))
        self.talker_stop = self.parts.tokens.stop_ids
        self.talker_defaults = default_talker_params(model_dir, self.parts.tokens.codec_bos)
        if audio_out:
            # The talker's own engine: no text, stops on the codec stop ids, no prefix cache
            # (its prompts are embeddings).
            talker = LLMEngine(replace(config, enable_prefix_caching=False), self.parts.talker,
                               None, set(self.talker_stop))
            stages.append(ARStage("talker", talker))
            t2w = Token2Wav(hf_cfg.token2wav_config, torch.float32, dev)
            t2w.load_weights(iter_weights(files))
            stages.append(VocoderStage("token2wav", t2w.eval(), self.parts.speakers, self.settings.vocoder))
        self.graph = StageGraph(stages, OmniRouter(bridge_constants(self.parts), audio_out))
        self.thinker_engine = thinker
        pre = json.loads((model_dir / "preprocessor_config.json").read_text()) \
            if (model_dir / "preprocessor_config.json").is_file() else {}
        self.processor = OmniProcessor(self.tokenizer, OmniLayout.from_thinker_config(tc),
                                       VisionPreprocessConfig.from_dict(pre), self.settings.limits)
        self.audio_output = audio_out
        self.speakers = sorted(self.parts.speakers)
        self.sample_rate = 24000
        log.info("Qwen2.5-Omni ready: stages %s, speakers %s", list(self.graph.stages), self.speakers)

    # ---- requests -------------------------------------------------------------------------
    def prepare(self, prompt, want_audio: bool, use_audio_in_video: bool = False) -> ProcessedPrompt:
        """CPU preprocessing (decode media, features, ids, positions); thread-safe."""
        if want_audio and not self.audio_output:
            raise InvalidRequestError("this model was loaded without audio output; ask for text only",
                                      param="modalities")
        return self.processor(prompt, want_audio, use_audio_in_video)

    def add_request(self, request_id: str, pp: ProcessedPrompt, params: SamplingParams,
                    talker_params: SamplingParams | None = None, want_audio: bool = False,
                    speaker: str | None = None) -> None:
        if params.n != 1:
            raise InvalidRequestError("n must be 1 for this model", param="n")
        speaker = speaker or (self.speakers[0] if self.speakers else "")
        if want_audio and speaker not in self.parts.speakers:
            raise InvalidRequestError(f"unknown voice {speaker!r}; choose one of {self.speakers}",
                                      param="voice")
        if want_audio:
            talker_params = talker_params or self.talker_defaults
            if self.parts.tokens.codec_bos not in talker_params.suppress_token_ids:
                talker_params = replace(talker_params, suppress_token_ids=[
                    *talker_params.suppress_token_ids, self.parts.tokens.codec_bos])
        req = OmniRequest(request_id, pp.token_ids, pp.positions.positions, pp.positions.delta,
                          pp.talker_positions.positions if want_audio else None,
                          pp.talker_positions.delta, pp.media, params,
                          talker_params if want_audio else None, speaker)
        self.graph.add_request(request_id, req)

    # ---- the engine interface ------------------------------------------------------------
    @property
    def requests(self):
        return self.graph.requests

    def step(self):
        return self.graph.step()

    def abort_request(self, request_id: str):
        return self.graph.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.graph.has_unfinished_requests()

    @property
    def num_aborted_requests(self) -> int:
        return self.graph.num_aborted_requests
