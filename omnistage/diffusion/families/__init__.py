"""Model families the diffusion stage serves: pipeline class name (model_index.json
`_class_name`) -> "module:Class" of our family implementation."""

from __future__ import annotations

import importlib

FAMILIES = {
    "QwenImagePipeline": "omnistage.diffusion.families.qwen_image:QwenImageFamily",
    "WanPipeline": "omnistage.diffusion.families.wan:WanFamily",
    "WanImageToVideoPipeline": "omnistage.diffusion.families.wan:WanImageToVideoFamily",
    "ZImagePipeline": "omnistage.diffusion.families.z_image:ZImageFamily",
    "QwenImageEditPipeline": "omnistage.diffusion.families.qwen_image_edit:QwenImageEditFamily",
    "QwenImageEditPlusPipeline": "omnistage.diffusion.families.qwen_image_edit:QwenImageEditPlusFamily",
    "OvisImagePipeline": "omnistage.diffusion.families.ovis_image:OvisImageFamily",
    "LongCatImagePipeline": "omnistage.diffusion.families.longcat_image:LongCatImageFamily",
    "LongCatImageEditPipeline": "omnistage.diffusion.families.longcat_image:LongCatImageEditFamily",
    "QwenImageLayeredPipeline": "omnistage.diffusion.families.qwen_image_layered:QwenImageLayeredFamily",
}


def family_class(pipeline_class: str) -> type:
    module, cls = FAMILIES[pipeline_class].split(":")
    return getattr(importlib.import_module(module), cls)
