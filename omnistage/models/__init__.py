"""Model implementations and the table of architectures omnistage serves."""

from __future__ import annotations

import importlib

# config.json "architectures" entry -> "module:Class". One line per supported architecture.
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "omnistage.models.qwen2:Qwen2ForCausalLM",
}


# Multi-stage models served as a stage graph: architecture -> the module of its recipe.
STAGE_GRAPH_ARCHITECTURES = {
    "Qwen2_5OmniForConditionalGeneration": "omnistage.models.qwen2_5_omni.recipe",
    # diffusers folders (model_index.json "_class_name"): one recipe for every family
    **{name: "omnistage.diffusion.recipe" for name in (
        "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline",
        "QwenImageLayeredPipeline", "ZImagePipeline", "WanPipeline", "WanImageToVideoPipeline",
        "OvisImagePipeline", "LongCatImagePipeline", "LongCatImageEditPipeline")},
}


def supported_architectures() -> list[str]:
    return sorted([*_ARCHITECTURES, *STAGE_GRAPH_ARCHITECTURES])


def resolve_model_class(architecture: str) -> type:
    from omnistage.errors import UnsupportedArchitectureError

    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
