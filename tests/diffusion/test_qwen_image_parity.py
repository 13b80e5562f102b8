"""Qwen-Image on our diffusion stage vs diffusers' QwenImagePipeline.__call__ (the oracle):
same folder, same seed -> the same pixels, alone and batched with other requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4   # the bound on [0, 1] pixels; measured: ~5e-7 (batching changes GEMM order)
SIZE = 64


@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("qwen_image")


@pytest.fixture(scope="module")
def ref_pipe(folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def omni(folder):
    with Omni(str(folder)) as o:
        yield o


def reference(pipe, prompt, seed, negative=None, n=1, steps=4, cfg=4.0, size=SIZE):
    return pipe(prompt, negative_prompt=negative, true_cfg_scale=cfg, height=size, width=size,
                num_inference_steps=steps, num_images_per_prompt=n,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images


CASES = [  # (prompt, seed, negative prompt, n)
    ("a red cat", 1, None, 1),
    ("a blue dog on a long walk in the park at dawn", 2, "blurry", 2),
    ("x", 3, "bad quality, lowres, ugly, deformed hands", 1),
]


def params(seed, negative, n, **kw):
    return DiffusionParams(negative_prompt=negative, height=SIZE, width=SIZE, num_inference_steps=4,
                           seed=seed, n=n, **kw)


def test_alone_matches_diffusers(ref_pipe, omni):
    for prompt, seed, negative, n in CASES:
        ref = reference(ref_pipe, prompt, seed, negative, n)
        out = omni.generate(prompt, params(seed, negative, n))[0]
        assert out.seed == seed and len(out.pixels) == n and len(out.images) == n
        for a, b in zip(ref, out.pixels):
            assert b.shape == (SIZE, SIZE, 3)
            assert np.abs(a - b).max() <= ATOL
        assert out.images[0].size == (SIZE, SIZE)
        assert ref[0].std() > 0.01            # a non-trivial image, so the comparison means something


def test_batched_matches_diffusers(ref_pipe, omni):
    refs = [reference(ref_pipe, p, s, neg, n) for p, s, neg, n in CASES]
    outs = omni.generate([c[0] for c in CASES], [params(s, neg, n) for _, s, neg, n in CASES])
    for ref, out in zip(refs, outs):
        for a, b in zip(ref, out.pixels):
            assert np.abs(a - b).max() <= ATOL
    # different seeds give different images (the comparison is not vacuous)
    assert np.abs(outs[0].pixels[0] - outs[2].pixels[0]).max() > 0.01


def test_other_size_and_steps_in_the_same_call(ref_pipe, omni):
    ref = reference(ref_pipe, "a house", 7, None, 1, steps=3, size=32)
    out, other = omni.generate(["a house", "a tree"], [
        DiffusionParams(height=32, width=32, num_inference_steps=3, seed=7),
        params(8, "ugly", 1)])
    assert np.abs(ref[0] - out.pixels[0]).max() <= ATOL
    assert other.pixels[0].shape == (SIZE, SIZE, 3)


def test_random_seed_is_reported_and_reproduces(omni):
    a = omni.generate("a cat", DiffusionParams(height=32, width=32, num_inference_steps=2))[0]
    b = omni.generate("a cat", DiffusionParams(height=32, width=32, num_inference_steps=2, seed=a.seed))[0]
    assert np.array_equal(a.pixels[0], b.pixels[0])


@pytest.mark.parametrize("bad, param", [
    (dict(height=50, width=64), "size"),               # not a multiple of 16
    (dict(height=4096, width=4096), "size"),           # over max_pixels
    (dict(n=9), "n"),
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(num_inference_steps=1000), "num_inference_steps"),
    (dict(num_frames=5), "num_frames"),                # an image model
    (dict(cache="magic"), "cache"),
    (dict(true_cfg_scale=-1.0), "true_cfg_scale"),
])
def test_bad_params_raise_typed_errors(omni, bad, param):
    with pytest.raises(InvalidRequestError) as e:
        omni.generate("a cat", DiffusionParams(**{"height": 32, "width": 32, **bad}))
    assert e.value.param == param
    assert not omni.engine.requests                    # nothing left behind


@pytest.mark.parametrize("prompt", ["", "   ", {"prompt": "a cat", "image": b"not an image"}, 42])
def test_bad_prompts(omni, prompt):
    with pytest.raises(InvalidRequestError):
        omni.generate(prompt, DiffusionParams(height=32, width=32))


def test_layer_params_are_refused(omni):
    for bad in (dict(layers=3), dict(resolution=640)):
        with pytest.raises(InvalidRequestError) as e:
            omni.generate("a cat", DiffusionParams(height=32, width=32, **bad))
        assert e.value.param in ("layers", "resolution")
