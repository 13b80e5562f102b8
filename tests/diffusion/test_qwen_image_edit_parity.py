"""Qwen-Image-Edit and Qwen-Image-Edit-2509 ("Plus") on our diffusion stage vs diffusers'
QwenImageEditPipeline / QwenImageEditPlusPipeline.__call__ (the oracles): same folder, same
input images (uint8 arrays here, the same PIL images there), same seed -> the same pixels,
alone and batched with other requests.

Cost: both pipelines VAE-encode every input image at ~1024x1024 whatever the output size, so
each distinct image costs one encode per side (ours caches it per image content, so the
second run of an image is cheap); the outputs stay 64x64 with 2 steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.pipeline import DiffusionPrompt
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4   # the bound on [0, 1] pixels; measured: ~7e-7
SIZE, STEPS = 64, 2


def _image(seed: int, height: int, width: int) -> np.ndarray:
    """A smooth uint8 (H, W, 3) image plus noise: not a trivial VAE input."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx / width, yy / height, (xx + yy) / (width + height)], -1) * 200
    return (base + rng.integers(0, 55, (height, width, 3))).astype(np.uint8)


IMG_A = _image(0, 48, 40)   # portrait: VAE-encoded at 928x1120
IMG_B = _image(1, 32, 64)   # landscape: 1440x736
# (a single array goes in a list: DiffusionPipeline.prepare's `image or []` raises on a bare
# numpy array today)


def pil(a: np.ndarray) -> Image.Image:
    return Image.fromarray(a)   # what a diffusers user passes


@pytest.fixture(scope="module")
def edit_folder():
    return tiny_checkpoint("qwen_image_edit")


@pytest.fixture(scope="module")
def plus_folder():
    return tiny_checkpoint("qwen_image_edit_plus")


@pytest.fixture(scope="module")
def edit_omni(edit_folder):
    with Omni(str(edit_folder)) as o:
        yield o


@pytest.fixture(scope="module")
def plus_omni(plus_folder):
    with Omni(str(plus_folder)) as o:
        yield o


def reference(pipeline_cls, folder, image, prompt, seed, negative=None, n=1):
    pipe = pipeline_cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe(image, prompt, negative_prompt=negative, true_cfg_scale=4.0, height=SIZE, width=SIZE,
                num_inference_steps=STEPS, num_images_per_prompt=n,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images


def params(seed, negative=None, n=1, **kw):
    kw = {"height": SIZE, "width": SIZE, **kw}
    return DiffusionParams(negative_prompt=negative, num_inference_steps=STEPS, seed=seed, n=n, **kw)


def assert_close(ref: np.ndarray, out: np.ndarray) -> None:
    assert out.shape == (SIZE, SIZE, 3)
    assert np.abs(ref - out).max() <= ATOL
    assert ref.std() > 0.01          # a non-trivial image, so the comparison means something


def test_edit_matches_diffusers_alone_and_batched(edit_folder, edit_omni):
    from diffusers import QwenImageEditPipeline

    prompt = "make the sky red"
    ref = reference(QwenImageEditPipeline, edit_folder, pil(IMG_A), prompt, 1, "blurry")[0]
    alone = edit_omni.generate({"prompt": prompt, "image": [IMG_A]}, params(1, "blurry"))[0]
    assert_close(ref, alone.pixels[0])
    # one forward for all three jobs (same shapes, all with CFG): the first request's prompt is
    # the shortest, so its rows are padded and masked next to the image tokens
    outs = edit_omni.generate(
        [{"prompt": prompt, "image": [IMG_A]},
         {"prompt": "turn the whole picture into a watercolour painting of a house", "image": pil(IMG_A)}],
        [params(1, "blurry"), params(5, "low quality, ugly", n=2)])
    assert_close(ref, outs[0].pixels[0])
    assert len(outs[1].pixels) == 2
    assert np.abs(outs[1].pixels[0] - outs[0].pixels[0]).max() > 0.01
    assert np.abs(outs[1].pixels[0] - outs[1].pixels[1]).max() > 0.01


def test_plus_matches_diffusers_alone_and_batched(plus_folder, plus_omni):
    from diffusers import QwenImageEditPlusPipeline

    prompt = "put the object of picture 1 into picture 2"
    ref = reference(QwenImageEditPlusPipeline, plus_folder, [pil(IMG_A), pil(IMG_B)], prompt, 2)[0]
    outs = plus_omni.generate([{"prompt": prompt, "image": [IMG_A, IMG_B]},
                               {"prompt": "swap them", "image": [IMG_A, IMG_B]}], [params(2), params(9)])
    assert_close(ref, outs[0].pixels[0])
    assert np.abs(outs[1].pixels[0] - outs[0].pixels[0]).max() > 0.01
    alone = plus_omni.generate({"prompt": prompt, "image": [IMG_A, IMG_B]}, params(2))[0]
    assert_close(ref, alone.pixels[0])


def _family(omni):
    return omni.engine.family


@pytest.mark.parametrize("which", ["edit", "plus"])
def test_default_size_and_shapes_follow_the_input_images(which, edit_omni, plus_omni):
    """No height/width: the output is the pipeline's ~1024x1024 size of the (edit: first,
    plus: last) input image; img_shapes lists the output, then each input image."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    family = _family(edit_omni if which == "edit" else plus_omni)
    images = [IMG_A] if which == "edit" else [IMG_B, IMG_A]
    resolved = family.resolve(DiffusionParams(num_inference_steps=STEPS, seed=0), DiffusionPrompt("a cat", images))
    with torch.inference_mode():
        cond = family.encode(DiffusionRequest("r", "a cat", resolved, images))
    calc = (pipeline_qwenimage_edit.calculate_dimensions if which == "edit"
            else pipeline_qwenimage_edit_plus.calculate_dimensions)
    sizes = [calc(1024 * 1024, a.shape[1] / a.shape[0])[:2] for a in images]   # (w, h) each
    w, h = sizes[0] if which == "edit" else sizes[-1]
    m = family.multiple
    assert (resolved.height, resolved.width) == (h, w)      # filled in, so the pixel limit applies
    assert cond.img_shapes == ((1, h // m, w // m), *[(1, hh // m, ww // m) for ww, hh in sizes])
    assert cond.image_latents.shape == (1, sum(hh * ww // m // m for ww, hh in sizes), 4 * family.latent_channels)


@pytest.mark.parametrize("prompt, size, param", [
    ("an edit with no image", {}, "image"),
    ({"prompt": "two images for a one-image model", "image": [IMG_A, IMG_A]}, {}, "image"),
    ({"prompt": "corrupt bytes", "image": b"\x89PNG\r\n\x1a\nnot really a png"}, {}, "image"),
    ({"prompt": "a size that is not a multiple of 16", "image": [IMG_A]}, {"height": 72}, "size"),
])
def test_edit_bad_input_raises_typed_errors(edit_omni, prompt, size, param):
    with pytest.raises(InvalidRequestError) as e:
        edit_omni.generate(prompt, params(0, **size) if size else params(0))
    assert e.value.param == param
    assert not edit_omni.engine.requests


def test_plus_needs_an_image(plus_omni):
    with pytest.raises(InvalidRequestError) as e:
        plus_omni.generate("no image", params(0))
    assert e.value.param == "image"


def test_a_mask_is_refused(edit_omni):
    """Neither pipeline takes a mask: the request is refused up front (a 400 on the server)."""
    mask = np.full(IMG_A.shape, 255, np.uint8)
    with pytest.raises(InvalidRequestError, match="mask") as e:
        edit_omni.generate({"prompt": "a cat", "image": [IMG_A], "mask": mask}, params(0))
    assert e.value.param == "mask"
    assert not edit_omni.engine.requests


def test_a_single_array_image_is_accepted(edit_omni):
    out = edit_omni.generate({"prompt": "a cat", "image": IMG_A}, params(0, height=32, width=32))[0]
    assert out.pixels[0].shape == (32, 32, 3)


def test_strength_is_refused_by_edit_models(edit_omni):
    with pytest.raises(InvalidRequestError) as e:
        edit_omni.generate({"prompt": "a cat", "image": [IMG_A]}, params(0, strength=0.5))
    assert e.value.param == "strength"
