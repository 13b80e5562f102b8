"""Inpainting through the real server: a tiny text-to-image Qwen-Image model on loopback,
/v1/images/edits with an image and an OpenAI mask (transparent = edit) via the openai SDK."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.entrypoints.model_source import tiny_checkpoint

H, W = 48, 64
STEPS = {"num_inference_steps": 2}
LIMITS = ("--max-image-pixels", "4096", "--max-diffusion-steps", "4")


@pytest.fixture(scope="module")
def client(start_server, api_key):
    with start_server(str(tiny_checkpoint("qwen_image")), *LIMITS) as running:
        yield openai.OpenAI(base_url=f"{running.base}/v1", api_key=api_key, max_retries=0, timeout=60)


IMAGE = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
EDIT = np.zeros((H, W), bool)
EDIT[8:40, 16:48] = True                 # the area to repaint


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def _openai_mask(edit: np.ndarray) -> bytes:
    """OpenAI's mask: an RGBA PNG, fully transparent where the image may change."""
    rgba = np.full((*edit.shape, 4), 255, np.uint8)
    rgba[edit, 3] = 0
    return _png(rgba)


def _edit(client, prompt: str, edit: np.ndarray) -> np.ndarray:
    resp = client.images.edit(image=("a.png", _png(IMAGE), "image/png"),
                              mask=("m.png", _openai_mask(edit), "image/png"),
                              prompt=prompt, extra_body={**STEPS, "seed": 3})
    assert resp.size == f"{W}x{H}" and len(resp.data) == 1
    png = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert png.format == "PNG" and png.size == (W, H)
    return np.asarray(png.convert("RGB"))


def test_inpaint_gives_a_png_of_the_input_size(client):
    got = _edit(client, "a red ball", EDIT)
    assert got.shape == (H, W, 3) and got.std() > 1
    # transparent pixels are the ones repainted: with none, the prompt cannot matter (the
    # result is the input's latents, decoded); with all, it does
    keep = np.zeros((H, W), bool)
    assert np.array_equal(_edit(client, "a red ball", keep), _edit(client, "a green field", keep))
    assert not np.array_equal(_edit(client, "a red ball", ~keep), _edit(client, "a green field", ~keep))


def test_mask_of_another_size_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(image=("a.png", _png(IMAGE), "image/png"),
                           mask=("m.png", _openai_mask(np.ones((16, 16), bool)), "image/png"),
                           prompt="a red ball", extra_body=STEPS)
    assert e.value.status_code == 400 and e.value.body["param"] == "mask"
