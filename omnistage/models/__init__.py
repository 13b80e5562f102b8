"""Model implementations and the table of architectures omnistage serves."""

from __future__ import annotations

import importlib

# config.json "architectures" entry -> "module:Class". One line per supported architecture.
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "omnistage.models.qwen2:Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "omnistage.models.qwen3_moe:Qwen3MoeForCausalLM",
}


# Models served as a stage graph: architecture -> "module:Class" of its pipeline, an engine
# (omnistage.engine_api) whose `recipe` builds its stages.
STAGE_GRAPH_ARCHITECTURES = {
    "Qwen2_5OmniForConditionalGeneration": "omnistage.models.qwen2_5_omni.pipeline:Qwen2_5OmniPipeline",
    "Qwen3OmniMoeForConditionalGeneration": "omnistage.models.qwen3_omni.pipeline:Qwen3OmniPipeline",
    "OmnistageCascade": "omnistage.models.cascade.pipeline:CascadePipeline",   # models/cascade/spec.py
    # diffusers folders (model_index.json "_class_name"): one pipeline for every family
    **{name: "omnistage.diffusion.pipeline:DiffusionPipeline" for name in (
        "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline",
        "QwenImageLayeredPipeline", "ZImagePipeline", "WanPipeline", "WanImageToVideoPipeline",
        "OvisImagePipeline", "LongCatImagePipeline", "LongCatImageEditPipeline")},
}


def supported_architectures() -> list[str]:
    return sorted([*_ARCHITECTURES, *STAGE_GRAPH_ARCHITECTURES])


def resolve_model_class(architecture: str) -> type:
    """The AR model class of a text architecture."""
    from omnistage.errors import UnsupportedArchitectureError

    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}")
    return _load(target)


def pipeline_class(architecture: str) -> type | None:
    """The pipeline (engine) class of a stage-graph architecture; None for text models."""
    target = STAGE_GRAPH_ARCHITECTURES.get(architecture)
    return None if target is None else _load(target)


def _load(target: str) -> type:
    """ "module:Class" -> the class. Imported on use: a table entry costs nothing until served."""
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
