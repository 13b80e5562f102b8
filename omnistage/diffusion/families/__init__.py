"""Model families the diffusion stage serves: pipeline class name (model_index.json
`_class_name`) -> "module:Class" of our family implementation."""

from __future__ import annotations

import importlib

FAMILIES = {
    "QwenImagePipeline": "omnistage.diffusion.families.qwen_image:QwenImageFamily",
}


def family_class(pipeline_class: str) -> type:
    module, cls = FAMILIES[pipeline_class].split(":")
    return getattr(importlib.import_module(module), cls)
