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


@torch.no_grad()
def _decode_like_diffusers(pipe, latents, size):
    """QwenImagePipeline's own decode of packed latents (its __call__'s last lines)."""
    latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    z = pipe.vae.config.z_dim
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
    image = pipe.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type="np")[0]


def test_partial_images_are_the_predicted_final_image_from_diffusers_trajectory(ref_pipe, omni):
    """A partial image after step s is the flow-matching prediction x0 = x_s - sigma_s * v of
    the final latents, decoded; v is the step's velocity, read off diffusers' own trajectory
    (its latents after each step, via callback_on_step_end) as (x_s - x_{s-1}) / (sigma_s -
    sigma_{s-1}). And asking for previews leaves the final image as it is."""
    steps, seed = 6, 4
    seen = []

    def grab(pipe, i, t, tensors):
        seen.append(tensors["latents"].clone())
        return tensors

    with torch.inference_mode():
        final = ref_pipe("a green hill", negative_prompt="fog", true_cfg_scale=4.0, height=SIZE,
                         width=SIZE, num_inference_steps=steps,
                         generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                         callback_on_step_end=grab).images[0]
        sigmas = ref_pipe.scheduler.sigmas          # this run's schedule
        eng = omni.engine
        eng.add_request("pv", eng.prepare("a green hill"), DiffusionParams(
            negative_prompt="fog", height=SIZE, width=SIZE, num_inference_steps=steps, seed=seed,
            partial_images=3))
        deltas = []
        while eng.has_unfinished_requests():
            deltas += eng.step()
    previews = [d for d in deltas if d.partial_image is not None]
    assert [d.partial_image_index for d in previews] == [0, 1, 2]     # after steps 2, 3, 4 of 6
    last = [d for d in deltas if d.finished][0]
    assert np.abs(last.images[0] - final).max() <= ATOL
    for d, s in zip(previews, (2, 3, 4)):
        v = (seen[s - 1] - seen[s - 2]) / (sigmas[s] - sigmas[s - 1])
        want = _decode_like_diffusers(ref_pipe, seen[s - 1] - sigmas[s] * v, SIZE)
        assert d.partial_image.shape == (SIZE, SIZE, 3)
        assert np.abs(d.partial_image - want).max() <= ATOL        # measured ~1e-6
    # the previews approach the final image (the comparison is not vacuous)
    dist = [np.abs(d.partial_image - final).mean() for d in previews]
    assert dist[0] > dist[-1] and np.abs(previews[0].partial_image - final).max() > 0.01
