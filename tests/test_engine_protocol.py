"""Every engine kind implements omnistage.engine_api's Engine and declares what it can do in
its EngineAbilities; the stage kinds declare the Stage protocol and each recipe is a Recipe."""

from __future__ import annotations

import pytest

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.engine_api import Engine, OutputOptions
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError
from omnistage.sampling_params import SamplingParams
from omnistage.stages.base import Stage
from omnistage.stages.recipe import Recipe, load_recipe


def test_text_engine(tiny_qwen2):
    with Omni(tiny_qwen2) as llm:
        eng = llm.engine
        assert isinstance(eng, Engine)
        can = eng.abilities
        assert (can.generates, can.audio_output, can.audio_input) == ("text", False, False)
        assert can.max_model_len == eng.llm.max_model_len and not can.makes_pixels
        assert isinstance(eng.default_params(), SamplingParams)
        assert eng.num_samples(SamplingParams(n=3)) == 3
        with pytest.raises(InvalidRequestError, match="audio"):
            eng.prepare("hi", OutputOptions(modalities=["text", "audio"]))


def test_omni_pipeline(tiny_omni):
    with Omni(tiny_omni, linear_kernel="matmul") as omni:
        eng = omni.engine
        assert isinstance(eng, Engine)
        can = eng.abilities
        assert can.audio_output and can.audio_input and can.generates == "text"
        assert can.sample_rate == 24000 and list(can.speakers) == eng.speakers and can.speakers
        assert can.end_of_turn_id == eng.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert can.talker_defaults is not None and can.max_audio_seconds > 0
        assert all(isinstance(s, Stage) for s in eng.graph.stages.values())
        pp = eng.prepare("hi", OutputOptions(modalities=["text"]))
        with pytest.raises(InvalidRequestError, match="n must be 1"):
            eng.resolve(pp, SamplingParams(n=2))


def test_diffusion_pipeline():
    with Omni(str(tiny_checkpoint("qwen_image"))) as omni:
        eng = omni.engine
        assert isinstance(eng, Engine)
        can = eng.abilities
        assert can.generates == "image" and can.makes_pixels and can.max_input_pixels > 0
        assert isinstance(eng.default_params(), DiffusionParams)
        assert eng.num_samples(DiffusionParams(n=2)) == 1      # the images come in one delta
        resolved = eng.resolve(eng.prepare("a cat"), DiffusionParams(height=32, width=32))
        assert resolved.seed is not None and resolved.num_inference_steps is not None


def test_recipes_load_by_module_name():
    for module in ("omnistage.models.qwen2_5_omni.recipe", "omnistage.diffusion.recipe"):
        recipe = load_recipe(module)
        assert isinstance(recipe, Recipe) and recipe.module == module
        assert recipe.message_types()
        with pytest.raises(InvalidRequestError, match="takes"):
            recipe.check_settings(object())
    with pytest.raises(TypeError, match="RECIPE"):
        load_recipe("omnistage.errors")
