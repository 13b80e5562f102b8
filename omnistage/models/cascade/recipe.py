"""How the cascade's stages are built: asr (pocketsphinx) -> llm (our AR engine over any local
text model folder) -> tts (espeak-ng or flite).

The model folder of a cascade is a small one of its own (`spec.py`): config.json names the
architecture `OmnistageCascade`, the ASR, the TTS and the text model's folder. A stage process
reads the same folder, so a deploy config can place any of the three anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from omnistage.config import EngineConfig
from omnistage.layers.checkpoint import load_tokenizer, read_config
from omnistage.llm.engine import LLMEngine
from omnistage.models.cascade.asr_stage import ASRStage
from omnistage.models.cascade.router import CascadeRouter
from omnistage.models.cascade.speech_tools import ASR_TOOLS, TTS_TOOLS
from omnistage.models.cascade.tts_stage import TTSStage
from omnistage.models.loader import load_text_model
from omnistage.models.qwen2_5_omni.processor import MediaLimits
from omnistage.runtime.process import apply_process_options
from omnistage.stages.ar import ARStage
from omnistage.stages.base import Stage
from omnistage.stages.recipe import Recipe


@dataclass
class CascadeSettings:
    limits: MediaLimits = field(default_factory=MediaLimits)   # audio input bounds


@dataclass(frozen=True)
class CascadeParts:
    """What a cascade folder's config.json names."""

    asr: str
    llm: str                  # a local text model folder
    tts: str

    @classmethod
    def of(cls, model_dir: str) -> CascadeParts:
        cfg = read_config(model_dir)
        return cls(cfg["asr"], cfg["llm"], cfg["tts"])


def stage_names(model_dir: str, settings: CascadeSettings) -> list[str]:
    return ["asr", "llm", "tts"]


def build_stage(name: str, config: EngineConfig, settings: CascadeSettings) -> Stage:
    apply_process_options(config)
    parts = CascadeParts.of(config.model)
    if name == "asr":
        return ASRStage(name, ASR_TOOLS[parts.asr]())
    if name == "llm":
        text = replace(config, model=parts.llm, tokenizer=None)   # the cascade's options, its folder
        return ARStage(name, LLMEngine(text, *load_text_model(text)))
    if name == "tts":
        tts = TTS_TOOLS[parts.tts]()
        return TTSStage(name, tts, tts.voices[0])
    raise ValueError(f"the cascade has no stage {name!r}")


def build_router(config: EngineConfig, settings: CascadeSettings) -> CascadeRouter:
    return CascadeRouter(load_tokenizer(CascadeParts.of(config.model).llm), speaks=True)


def _message_types() -> list[type]:
    from omnistage.models.cascade.messages import HearJob, SpeakText, Transcripts
    from omnistage.models.qwen2_5_omni.messages import AudioChunk
    from omnistage.stages.ar import ARFeed, ARRequest, ARStepOutput

    return [ARRequest, ARFeed, ARStepOutput, HearJob, Transcripts, SpeakText, AudioChunk]


RECIPE = Recipe(__name__, CascadeSettings, stage_names, build_stage, build_router, _message_types)
