"""Which engine serves a model folder, and the two calls every entry point makes on it:
`prepare` (CPU work: templates, tokens, media; safe on any thread) then `submit` (on the
engine's thread). A plain LLM runs on LLMEngine; an omni model on its stage graph pipeline."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from omnistage.config import EngineConfig
from omnistage.entrypoints.prompts import parse_prompt
from omnistage.errors import InvalidRequestError
from omnistage.llm.engine import LLMEngine
from omnistage.models import STAGE_GRAPH_ARCHITECTURES
from omnistage.models.loader import architecture_of, read_config
from omnistage.sampling_params import SamplingParams

MODALITIES = ("text", "audio")


@dataclass
class OutputOptions:
    """What a request wants back, beyond text sampling."""

    modalities: list[str] | None = None   # None: the model's default (text + audio if it speaks)
    voice: str | None = None              # speaker name; None: the model's first
    talker_params: SamplingParams | None = None  # speech token sampling; None: model defaults
    use_audio_in_video: bool = False      # a video's audio track is heard too

    def wants_audio(self, engine) -> bool:
        mods = self.modalities
        if mods is None:
            return bool(getattr(engine, "audio_output", False))
        bad = [m for m in mods if m not in MODALITIES]
        if bad or "text" not in mods:
            raise InvalidRequestError(f"modalities must be ['text'] or ['text', 'audio'], got {mods}",
                                      param="modalities")
        if "audio" in mods and not getattr(engine, "audio_output", False):
            raise InvalidRequestError("this model does not produce audio; ask for ['text']",
                                      param="modalities")
        return "audio" in mods


def build_engine(config: EngineConfig, omni_settings=None, deploy=None):
    """`deploy`: a DeployConfig or a YAML path saying where each stage runs (omni models)."""
    arch = architecture_of(read_config(config.model))
    if arch in STAGE_GRAPH_ARCHITECTURES:
        from omnistage.deploy import DeployConfig

        recipe = importlib.import_module(STAGE_GRAPH_ARCHITECTURES[arch])
        settings = omni_settings or recipe.SETTINGS()
        if not isinstance(settings, recipe.SETTINGS):
            raise InvalidRequestError(f"this model takes {recipe.SETTINGS.__name__}, not "
                                      f"{type(settings).__name__}", param="omni_settings")
        placement = None
        if deploy is not None:
            deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig.from_yaml(deploy)
            deploy.check(recipe.stage_names(config.model, settings))
            placement = deploy.placement(recipe.__name__, config, settings)
        return recipe.build_pipeline(config, settings, placement)
    if deploy is not None:
        raise InvalidRequestError("a deploy config applies to multi-stage (omni) models only",
                                  param="deploy_config")
    return LLMEngine(config)


def is_pipeline(engine) -> bool:
    return not isinstance(engine, LLMEngine)


def is_diffusion(engine) -> bool:
    """An image/video model (its requests take DiffusionParams)."""
    return getattr(engine, "pipeline_class", None) is not None


def prepare(engine, prompt, opts: OutputOptions):
    """-> an object with .text and .token_ids (and whatever submit needs)."""
    if is_diffusion(engine):
        return engine.prepare(prompt)
    if is_pipeline(engine):
        return engine.prepare(prompt, opts.wants_audio(engine), opts.use_audio_in_video)
    if opts.wants_audio(engine):   # raises: a text model asked for audio
        raise InvalidRequestError("this model does not produce audio", param="modalities")
    return parse_prompt(prompt, engine.tokenizer)


def submit(engine, request_id: str, prepared, params: SamplingParams, opts: OutputOptions,
           return_hidden_states: bool = False) -> None:
    if is_diffusion(engine):
        engine.add_request(request_id, prepared, params)
    elif is_pipeline(engine):
        if return_hidden_states:
            raise InvalidRequestError("return_hidden_states is not offered for omni models",
                                      param="return_hidden_states")
        engine.add_request(request_id, prepared, params, opts.talker_params,
                           want_audio=opts.wants_audio(engine), speaker=opts.voice)
    else:
        engine.add_request(request_id, prepared.token_ids, params, prompt_embeds=prepared.embeds,
                           return_hidden_states=return_hidden_states)
