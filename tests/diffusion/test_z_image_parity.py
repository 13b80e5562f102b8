"""Z-Image on our diffusion stage vs diffusers' ZImagePipeline.__call__ (the oracle): same
folder, same seed -> the same pixels, with and without CFG, alone and batched with requests of
other sizes, prompts and seeds (the transformer takes lists, so sizes mix in one forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4   # the bound on [0, 1] pixels; measured: ~3e-6 (batching changes GEMM order)


@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("z_image")


@pytest.fixture(scope="module")
def ref_pipe(folder):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def omni(folder):
    with Omni(str(folder)) as o:
        yield o


def reference(pipe, prompt, seed, negative, n, guidance, height, width, steps=4):
    return pipe(prompt, negative_prompt=negative, height=height, width=width, num_inference_steps=steps,
                guidance_scale=guidance, num_images_per_prompt=n,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images


CASES = [  # (prompt, seed, negative prompt, n, guidance_scale, height, width)
    ("a red cat", 1, None, 1, 5.0, 64, 64),                                   # CFG, "" negative
    ("a blue dog on a long walk in the park at dawn", 2, "blurry", 2, 3.0, 64, 32),
    ("x", 3, None, 1, 0.0, 32, 64),                                           # no CFG
    ("a small green house", 4, None, 1, 5.0, 32, 32),                         # CFG, another size
]


def params(seed, negative, n, guidance, height, width):
    return DiffusionParams(negative_prompt=negative, height=height, width=width, num_inference_steps=4,
                           guidance_scale=guidance, seed=seed, n=n)


def stage_of(omni):
    return omni.engine.graph.stages["diffusion"]


@pytest.fixture(scope="module")
def refs(ref_pipe):
    return [reference(ref_pipe, *case) for case in CASES]


@pytest.mark.parametrize("i", [0, 2])          # with and without CFG
def test_alone_matches_diffusers(omni, refs, i):
    prompt, seed, negative, n, guidance, h, w = CASES[i]
    out = omni.generate(prompt, params(seed, negative, n, guidance, h, w))[0]
    assert out.seed == seed and len(out.pixels) == n
    for a, b in zip(refs[i], out.pixels):
        assert b.shape == (h, w, 3) and b.dtype == np.float32
        assert np.abs(a - b).max() <= ATOL
    assert refs[i][0].std() > 0.01            # a non-trivial image, so the comparison means something


def test_batched_matches_diffusers_and_mixes_sizes(omni, refs):
    family = stage_of(omni).family
    shapes_per_forward = []
    predict = family.predict

    def spy(jobs):
        shapes_per_forward.append({tuple(j.latents.shape) for j in jobs})
        return predict(jobs)

    family.predict = spy        # an attribute of this test's own family instance
    try:
        outs = omni.generate([c[0] for c in CASES], [params(*c[1:]) for c in CASES])
    finally:
        del family.predict
    for ref, out in zip(refs, outs):
        assert len(out.pixels) == len(ref)
        for a, b in zip(ref, out.pixels):
            assert np.abs(a - b).max() <= ATOL
    # one transformer forward served latents of different sizes (lists of variable-size inputs)
    assert any(len(s) > 1 for s in shapes_per_forward)
    # the two samples of a request (different noise) differ: the comparison is not vacuous
    assert np.abs(outs[1].pixels[0] - outs[1].pixels[1]).max() > 0.01


def test_guidance_changes_the_image(omni):
    a = omni.generate("a cat", params(5, None, 1, 0.0, 32, 32))[0].pixels[0]
    b = omni.generate("a cat", params(5, None, 1, 5.0, 32, 32))[0].pixels[0]
    assert np.abs(a - b).max() > 0.01


@pytest.mark.parametrize("prompt, bad, param", [
    ("a cat", {"num_frames": 5}, "num_frames"),                       # an image model
    ("a cat", {"height": 40}, "size"),                                # not a multiple of 16
    ("a cat", {"true_cfg_scale": 4.0}, "true_cfg_scale"),             # Qwen-Image's knob
    ({"prompt": "a cat", "image": Image.new("RGB", (32, 32))}, {}, "image"),  # text only
])
def test_bad_input_raises_typed_errors(omni, prompt, bad, param):
    with pytest.raises(InvalidRequestError) as e:
        omni.generate(prompt, DiffusionParams(**{"height": 32, "width": 32, "num_inference_steps": 2, **bad}))
    assert e.value.param == param
    assert not omni.engine.requests                    # nothing left behind


def test_a_step_cache_is_refused_where_there_is_none(omni):
    from omnistage.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        omni.generate("a cat", DiffusionParams(height=32, width=32, num_inference_steps=2, cache="teacache"))
    assert e.value.param == "cache"
