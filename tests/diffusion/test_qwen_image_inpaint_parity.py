"""Inpainting (image + mask) and image-to-image (image only) on a text-to-image Qwen-Image
folder vs diffusers' QwenImageInpaintPipeline / QwenImageImg2ImgPipeline loaded from the same
folder (the oracles): same seed -> the same pixels, alone and batched with text-to-image and
other inpainting requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4    # the bound on [0, 1] pixels; measured: ~6e-7
H, W = 48, 64  # the input image (and so the default output) size


@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("qwen_image")


def _pipe(cls, folder):
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def inpaint_pipe(folder):
    from diffusers import QwenImageInpaintPipeline

    return _pipe(QwenImageInpaintPipeline, folder)


@pytest.fixture(scope="module")
def img2img_pipe(folder):
    from diffusers import QwenImageImg2ImgPipeline

    return _pipe(QwenImageImg2ImgPipeline, folder)


@pytest.fixture(scope="module")
def omni(folder):
    with Omni(str(folder)) as o:
        yield o


IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8))
MASK_ARRAY = np.zeros((H, W), np.uint8)
MASK_ARRAY[10:30, 20:50] = 255           # ours: 255 = may change (diffusers: white = repaint)
MASK = Image.fromarray(MASK_ARRAY)       # greyscale, as a diffusers user passes mask_image


def reference(pipe, prompt, seed, negative=None, n=1, steps=4, strength=0.6, **kw):
    return pipe(prompt, negative_prompt=negative, true_cfg_scale=4.0, image=IMAGE, height=H, width=W,
                num_inference_steps=steps, strength=strength, num_images_per_prompt=n,
                generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kw).images


def request(prompt, mask=True):
    return {"prompt": prompt, "image": IMAGE, **({"mask": MASK} if mask else {})}


def close(ref, out, n=1):
    assert len(out.pixels) == n
    for a, b in zip(ref, out.pixels):
        assert b.shape == (H, W, 3)
        assert np.abs(a - b).max() <= ATOL


INPAINT = [  # (prompt, seed, negative, n, steps, strength); strength None: the default 0.6
    ("a red cat", 1, None, 1, 4, None),
    ("a blue dog in the park", 2, "blurry", 2, 5, 0.9),
    ("x", 3, None, 1, 3, 1.0),
]


def inpaint_params(seed, negative, n, steps, strength):
    return DiffusionParams(negative_prompt=negative, num_inference_steps=steps, seed=seed, n=n,
                           strength=strength)


def inpaint_ref(pipe, prompt, seed, negative, n, steps, strength):
    return reference(pipe, prompt, seed, negative, n, steps, 0.6 if strength is None else strength,
                     mask_image=MASK)


def test_inpaint_alone_matches_diffusers(inpaint_pipe, omni):
    outs = []
    for case in INPAINT:
        prompt, seed, negative, n, steps, strength = case
        ref = inpaint_ref(inpaint_pipe, *case)
        out = omni.generate(request(prompt), inpaint_params(seed, negative, n, steps, strength))[0]
        assert out.seed == seed
        close(ref, out, n)
        assert ref[0].std() > 0.01
        outs.append(out.pixels[0])
    # the comparison is not vacuous: the opposite mask gives another image
    flipped = reference(inpaint_pipe, *INPAINT[0][:2], mask_image=Image.fromarray(255 - MASK_ARRAY))
    assert np.abs(flipped[0] - outs[0]).max() > 0.05


def test_img2img_alone_matches_diffusers(img2img_pipe, omni):
    for prompt, seed, negative, n, strength in [("a cow", 4, None, 1, None), ("a tree", 5, "ugly", 2, 0.8)]:
        ref = reference(img2img_pipe, prompt, seed, negative, n, strength=0.6 if strength is None else strength)
        out = omni.generate(request(prompt, mask=False), DiffusionParams(
            negative_prompt=negative, num_inference_steps=4, seed=seed, n=n, strength=strength))[0]
        close(ref, out, n)


def test_batched_with_text_to_image_and_other_inpaints(inpaint_pipe, img2img_pipe, omni):
    plain = DiffusionParams(height=H, width=W, num_inference_steps=4, seed=9)
    alone_plain = omni.generate("a plain house", plain)[0]
    refs = [inpaint_ref(inpaint_pipe, *c) for c in INPAINT[:2]]
    ref_i2i = reference(img2img_pipe, "a cow", 4)
    outs = omni.generate(
        [request(INPAINT[0][0]), "a plain house", request(INPAINT[1][0]), request("a cow", mask=False)],
        [inpaint_params(*INPAINT[0][1:]), plain, inpaint_params(*INPAINT[1][1:]),
         DiffusionParams(num_inference_steps=4, seed=4)])
    close(refs[0], outs[0])
    close(refs[1], outs[2], n=2)
    close(ref_i2i, outs[3])
    assert np.abs(alone_plain.pixels[0] - outs[1].pixels[0]).max() <= 1e-5


def test_inpaint_and_text_to_image_share_forwards(omni):
    """Same size: one key, so the stage runs them in one batch."""
    eng = omni.engine
    stage = eng.graph.stages["diffusion"]
    eng.add_request("inp", eng.prepare(request("a cat")), DiffusionParams(num_inference_steps=4, seed=1))
    eng.add_request("t2i", eng.prepare("a dog"), DiffusionParams(height=H, width=W, num_inference_steps=4, seed=2))
    batches = []
    while eng.has_unfinished_requests():
        eng.step()
        batches.append(stage.last_batch_jobs)
    assert max(batches) == 2


def test_mask_polarity_and_extremes(omni):
    """Mask 0 everywhere keeps the image: the prompt no longer matters. 255 everywhere
    repaints all: exactly image-to-image."""
    keep = {"prompt": "a cat", "image": IMAGE, "mask": Image.fromarray(np.zeros((H, W), np.uint8))}
    p = DiffusionParams(num_inference_steps=3, seed=5)
    a = omni.generate(keep, p)[0].pixels[0]
    b = omni.generate({**keep, "prompt": "a bright green field"}, p)[0].pixels[0]
    assert np.array_equal(a, b)
    full = omni.generate({**keep, "mask": np.full((H, W, 3), 255, np.uint8)}, p)[0].pixels[0]   # (RGB works too)
    i2i = omni.generate(request("a cat", mask=False), p)[0].pixels[0]
    assert np.array_equal(full, i2i) and not np.array_equal(full, a)


def test_default_size_follows_the_input_image(omni):
    odd = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    out = omni.generate({"prompt": "a cat", "image": odd}, DiffusionParams(num_inference_steps=2, seed=1))[0]
    assert out.pixels[0].shape == (48, 64, 3)          # rounded down to multiples of 16
    out = omni.generate({"prompt": "a cat", "image": odd}, DiffusionParams(num_inference_steps=2, seed=1,
                                                                           height=32, width=32))[0]
    assert out.pixels[0].shape == (32, 32, 3)


@pytest.mark.parametrize("prompt, bad, param", [
    (request("a cat"), dict(strength=0.0), "strength"),
    (request("a cat"), dict(strength=1.5), "strength"),
    (request("a cat"), dict(strength=1e-20), "strength"),           # no step left
    ("a cat", dict(strength=0.5, height=32, width=32), "strength"),  # text-to-image takes no strength
    ({"prompt": "a cat", "image": [IMAGE, IMAGE]}, {}, "image"),
    ({"prompt": "a cat", "image": IMAGE, "mask": Image.new("L", (8, 8))}, {}, "mask"),   # not the image's size
    ({"prompt": "a cat", "mask": MASK}, {}, "mask"),                                     # a mask without image
    ({"prompt": "a cat", "image": IMAGE}, dict(height=40), "size"),
    ({"prompt": "a cat", "image": IMAGE}, dict(num_inference_steps=1), "num_inference_steps"),
])
def test_bad_requests_raise_typed_errors(omni, prompt, bad, param):
    with pytest.raises(InvalidRequestError) as e:
        omni.generate(prompt, DiffusionParams(**{"num_inference_steps": 2, **bad}))
    assert e.value.param == param
    assert not omni.engine.requests
