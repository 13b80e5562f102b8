"""Qwen-Image-Layered on our diffusion stage vs diffusers' QwenImageLayeredPipeline.__call__ (the
oracle): same folder, the same RGBA image (a uint8 (H, W, 4) array here, the PIL image there),
same seed -> the same (layers, H, W, 4) pixels, alone and batched with another request.

Cost: the pipeline always works at ~640x640 pixels (its smallest `resolution` bucket), whatever
the input size: the tiny VAE's encode (~1.3 s) and decode (~2.3 s per layer) dominate, so the
runs use one layer and two steps. The blank prompt makes both sides caption the image with the
text encoder's generate (up to 512 tokens, ~1.5 s).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPrompt
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4   # the bound on [0, 1] pixels; measured: ~8e-7 (the tiny VAE amplifies float noise ~100x)
STEPS, LAYERS = 2, 1


def _rgba(seed: int, height: int = 40, width: int = 48) -> np.ndarray:
    """A smooth uint8 (H, W, 4) image plus noise, with a varying alpha."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx / width, yy / height, (xx + yy) / (width + height), 1 - xx / (2 * width)], -1) * 200
    return (base + rng.integers(0, 55, (height, width, 4))).astype(np.uint8)


IMG_A, IMG_B = _rgba(0), _rgba(1)    # 48x40: output and condition 704x576 at resolution 640


@pytest.fixture(scope="module")
def folder():
    return str(tiny_checkpoint("qwen_image_layered"))


@pytest.fixture(scope="module")
def omni(folder):
    with Omni(folder) as o:
        yield o


def params(seed: int, negative: str | None = "blurry", **kw) -> DiffusionParams:
    return DiffusionParams(negative_prompt=negative, num_inference_steps=STEPS, layers=LAYERS, seed=seed, **kw)


def test_matches_diffusers_alone_and_batched(folder, omni):
    from diffusers import QwenImageLayeredPipeline

    pipe = QwenImageLayeredPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    # blank prompt: both sides caption the image first; CFG with a negative prompt
    ref = pipe(Image.fromarray(IMG_A), "", negative_prompt="blurry", num_inference_steps=STEPS, layers=LAYERS,
               resolution=640, generator=torch.Generator("cpu").manual_seed(1), output_type="np").images[0]
    assert ref.shape == (LAYERS, 576, 704, 4) and ref.std() > 0.01

    alone = omni.generate({"prompt": "", "image": IMG_A}, params(1))[0]
    assert alone.pixels[0].shape == ref.shape
    assert np.abs(alone.pixels[0] - ref).max() <= ATOL
    # one forward for both jobs (same shapes, both with CFG); the other one has its own image,
    # seed and prompt (rows padded and masked) and a step cache, so the batch runs the cached
    # path of the transformer runner (two steps: both computed in full)
    outs = omni.generate([{"prompt": "", "image": IMG_A},
                          {"prompt": "a cat on a sofa, with a lamp behind it", "image": IMG_B}],
                         [params(1), params(2, cache="fbcache")])
    assert np.abs(outs[0].pixels[0] - ref).max() <= ATOL
    assert np.abs(outs[1].pixels[0] - ref).max() > 0.01
    # RGBA layers as PIL images, one list per sample; not videos
    layers = alone.layers[0]
    assert [im.mode for im in layers] == ["RGBA"] * LAYERS and layers[0].size == (704, 576)
    assert alone.videos == []
    assert [im.mode for im in alone.images] == ["RGBA"] * LAYERS     # .images: every layer


def test_defaults_follow_the_image_and_resolution(omni):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_layered import calculate_dimensions

    family = omni.engine.family
    for res in (640, 1024):
        kw = {} if res == 640 else {"resolution": res}
        r = family.resolve(DiffusionParams(**kw), DiffusionPrompt("x", [IMG_A]))
        w, h = calculate_dimensions(res * res, IMG_A.shape[1] / IMG_A.shape[0])
        assert (r.height, r.width, r.resolution, r.layers) == (h, w, res, 4)
        assert (r.num_inference_steps, r.true_cfg_scale) == (50, 4.0)


def test_inputs_become_rgba(omni):
    engine = omni.engine
    rgb = IMG_A[..., :3].copy()
    for image in (rgb, Image.fromarray(rgb)):
        got = engine.prepare({"prompt": "x", "image": image}).images[0]
        assert got.shape == (40, 48, 4) and (got[..., 3] == 255).all() and (got[..., :3] == rgb).all()
    buf = io.BytesIO()
    Image.fromarray(IMG_A).save(buf, format="PNG")
    got = engine.prepare({"prompt": "", "image": buf.getvalue()}).images[0]
    assert (got == IMG_A).all()              # alpha kept, RGB not composited


@pytest.mark.parametrize("prompt, kw, param", [
    ("no image", {}, "image"),
    ({"prompt": "two images", "image": [IMG_A, IMG_B]}, {}, "image"),
    ({"prompt": "a mask", "image": IMG_A, "mask": IMG_A[..., :3]}, {}, "mask"),
    ({"prompt": "x", "image": IMG_A}, {"resolution": 800}, "resolution"),
    ({"prompt": "x", "image": IMG_A}, {"height": 640, "width": 640}, "size"),
    ({"prompt": "x", "image": IMG_A}, {"layers": 0}, "layers"),
    ({"prompt": "x", "image": IMG_A}, {"layers": 11}, "layers"),
    ({"prompt": "x", "image": IMG_A}, {"num_inference_steps": 1}, "num_inference_steps"),
    ({"prompt": "x", "image": IMG_A}, {"strength": 0.5}, "strength"),
])
def test_bad_input_raises_typed_errors(omni, prompt, kw, param):
    with pytest.raises(InvalidRequestError) as e:
        omni.generate(prompt, DiffusionParams(**{"seed": 0, **kw}))
    assert e.value.param == param
    assert not omni.engine.requests


def test_runner_needs_the_timestep_condition(omni):
    family = omni.engine.family
    x = torch.zeros(1, 3 * 4, family.transformer.config.in_channels)
    txt = torch.zeros(1, 2, family.transformer.config.joint_attention_dim)
    with pytest.raises(ValueError, match="t_cond"):
        family.runner(x, txt, None, torch.ones(1), [[(1, 2, 2)] * 3], [], [])
