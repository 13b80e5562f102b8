"""The diffusion models' recipe: one stage ("diffusion": encode, denoise, decode) and its edge
to the client. A Recipe like the omni families' (stages/recipe.py), so deploy configs place it in a
process or a Ray actor too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.config import EngineConfig
from omnistage.diffusion.families import FAMILIES, family_class
from omnistage.diffusion.messages import (DiffusionPreview, DiffusionProgress, DiffusionRequest,
                                          DiffusionResult)
from omnistage.diffusion.params import DiffusionLimits, DiffusionParams
from omnistage.diffusion.stage import DiffusionStage, DiffusionStageSettings
from omnistage.errors import UnsupportedArchitectureError
from omnistage.graph import CLIENT, Edge
from omnistage.layers.checkpoint import read_model_index
from omnistage.outputs import Delta
from omnistage.stage_messages import StageOutput
from omnistage.stages.recipe import Recipe
from omnistage.runtime.process import apply_process_options

STAGE = "diffusion"


@dataclass(frozen=True)
class DiffusionSettings:
    limits: DiffusionLimits = field(default_factory=DiffusionLimits)
    stage: DiffusionStageSettings = field(default_factory=DiffusionStageSettings)
    default_cache: str = "none"            # step cache for requests that do not choose one


def pipeline_class(model_dir: str | Path) -> str:
    name = read_model_index(model_dir)["_class_name"]
    if name not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"diffusers pipeline {name!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return name


def stage_names(model_dir: str | Path, settings: DiffusionSettings) -> list[str]:
    return [STAGE]


def model_dtype(config: EngineConfig) -> torch.dtype:
    return config.torch_dtype(None)


def build_family(config: EngineConfig, device: torch.device | None = None):
    """The model's family on `device` (default: the config's; "meta": configs only, no weights)."""
    return family_class(pipeline_class(config.model))(config.model, device or config.torch_device,
                                                      model_dtype(config))


def build_stage(name: str, config: EngineConfig, settings: DiffusionSettings) -> DiffusionStage:
    if name != STAGE:
        raise ValueError(f"diffusion models have one stage, {STAGE!r}, not {name!r}")
    apply_process_options(config)
    family = build_family(config)
    vae = getattr(family, "vae", None)
    if isinstance(vae, torch.nn.Module):
        from omnistage.diffusion.vae_frames import use_frame_convs

        use_frame_convs(vae)           # single frames (images) through 2-D convolutions
    if config.linear_kernel != "matmul":
        from omnistage.diffusion.packed_linear import pack_linears

        for attr in ("transformer", "transformer_2"):      # the denoisers: most of the time
            model = getattr(family, attr, None)
            if isinstance(model, torch.nn.Module):
                pack_linears(model)
    return DiffusionStage(name, family, settings.stage)


class DiffusionRouter:
    def __init__(self):
        self.edges = [Edge(STAGE, CLIENT)]
        self._live: set[str] = set()

    def unfinished(self) -> set[str]:
        return set(self._live)

    def forget(self, request_id: str) -> None:
        self._live.discard(request_id)

    def start(self, req: DiffusionRequest) -> list[tuple[str, object]]:
        self._live.add(req.request_id)
        return [(STAGE, req)]

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        if out.request_id not in self._live:
            return []
        p = out.payload
        if isinstance(p, DiffusionProgress):
            return [(CLIENT, Delta(out.request_id, 0, "", [], progress=(p.step, p.total)))]
        if isinstance(p, DiffusionPreview):
            return [(CLIENT, Delta(out.request_id, p.index, "", [], partial_image=p.pixels,
                                   partial_image_index=p.order))]
        assert isinstance(p, DiffusionResult)
        return [(CLIENT, Delta(out.request_id, 0, "", [], finished=True, finish_reason="stop",
                               images=p.outputs, seed=p.seed))]


def build_router(config: EngineConfig, settings: DiffusionSettings) -> DiffusionRouter:
    return DiffusionRouter()


def _message_types() -> list[type]:
    return [DiffusionRequest, DiffusionProgress, DiffusionPreview, DiffusionResult, DiffusionParams]


RECIPE = Recipe(__name__, DiffusionSettings, stage_names, build_stage, build_router, _message_types)
