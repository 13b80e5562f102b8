"""Which engine serves a model folder. Every kind implements omnistage.engine_api's Engine:
a text model is a TextEngine over LLMEngine; an omni or image/video model is its family's
stage-graph pipeline, placed by an optional deploy config."""

from __future__ import annotations

from omnistage.config import EngineConfig
from omnistage.deploy import DeployConfig
from omnistage.engine_api import Engine
from omnistage.entrypoints.text_engine import TextEngine
from omnistage.errors import InvalidRequestError
from omnistage.layers.checkpoint import architecture_of, read_config
from omnistage.models import pipeline_class


def build_engine(config: EngineConfig, omni_settings=None, deploy=None) -> Engine:
    """`deploy`: a DeployConfig or a YAML path saying where each stage runs (graph models)."""
    cls = pipeline_class(architecture_of(read_config(config.model)))
    if cls is None:
        if deploy is not None:
            raise InvalidRequestError("a deploy config applies to multi-stage (omni) models only",
                                      param="deploy_config")
        return TextEngine.from_config(config)
    settings = cls.recipe.check_settings(omni_settings)
    placement = None
    if deploy is not None:
        deploy = deploy if isinstance(deploy, DeployConfig) else DeployConfig.from_yaml(deploy)
        deploy.check(cls.recipe.stage_names(config.model, settings))
        placement = deploy.placement(cls.recipe.module, config, settings)
    return cls(config, settings, placement)
