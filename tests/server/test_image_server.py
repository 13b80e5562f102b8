"""The real server with tiny Qwen-Image models on loopback, driven by the openai SDK:
/v1/images/generations (whole and streamed, equal to the offline API's pixels for the same
seed) and /v1/images/edits (one and two input images), their limits and their errors."""

from __future__ import annotations

import base64
import contextlib
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.entrypoints.model_source import tiny_checkpoint

STEPS = {"num_inference_steps": 2}
LIMITS = ("--max-image-pixels", "4096", "--max-images-per-request", "2", "--max-diffusion-steps", "4")


@pytest.fixture(scope="module")
def servers(start_server):
    """{"gen": base URL of a tiny:qwen_image server, "edit": one of tiny:qwen_image_edit_plus},
    started side by side (each spends seconds importing torch and diffusers)."""
    models = {"gen": str(tiny_checkpoint("qwen_image")),
              "edit": str(tiny_checkpoint("qwen_image_edit_plus"))}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = {k: pool.submit(stack.enter_context, start_server(d, *LIMITS)) for k, d in models.items()}
        yield {k: f.result().base for k, f in started.items()}


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(servers, api_key):
    return _client(servers["gen"], api_key)


@pytest.fixture(scope="module")
def edit_client(servers, api_key):
    return _client(servers["edit"], api_key)


def _image(b64: str, fmt: str = "PNG") -> np.ndarray:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert img.format == fmt
    return np.asarray(img.convert("RGB"))


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_generate_png_of_the_size_asked_and_seed_repeats(client):
    resp = client.images.generate(model="tiny", prompt="a red cube", size="64x32",
                                  extra_body={**STEPS, "seed": 7})
    assert resp.size == "64x32" and resp.output_format == "png" and len(resp.data) == 1
    assert _image(resp.data[0].b64_json).shape == (32, 64, 3)
    again = client.images.generate(prompt="a red cube", size="64x32", extra_body={**STEPS, "seed": 7})
    assert again.data[0].b64_json == resp.data[0].b64_json          # same seed: same bytes
    other = client.images.generate(prompt="a red cube", size="64x32", extra_body={**STEPS, "seed": 8})
    assert other.data[0].b64_json != resp.data[0].b64_json


def test_n2_gives_two_different_images(client):
    resp = client.images.generate(prompt="two cats", n=2, size="32x32", extra_body={**STEPS, "seed": 3})
    a, b = (_image(d.b64_json) for d in resp.data)
    assert a.shape == b.shape == (32, 32, 3) and not np.array_equal(a, b)


@pytest.mark.parametrize("fmt, pil", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_jpeg_and_webp(client, fmt, pil):
    resp = client.images.generate(prompt="a boat", size="48x32", output_format=fmt, output_compression=90,
                                  extra_body={**STEPS, "seed": 1})
    assert resp.output_format == fmt and _image(resp.data[0].b64_json, pil).shape == (32, 48, 3)


def test_stream_sends_progress_then_the_completed_image(client, servers, api_key):
    whole = client.images.generate(prompt="a tree", size="32x32", extra_body={**STEPS, "seed": 5})
    events = list(client.images.generate(prompt="a tree", size="32x32", stream=True,
                                         extra_body={**STEPS, "seed": 5}))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert events[0].b64_json == whole.data[0].b64_json and events[0].size == "32x32"
    raw = httpx.post(servers["gen"] + "/v1/images/generations", timeout=30,
                     json={"prompt": "a tree", "size": "32x32", "stream": True, "num_inference_steps": 3},
                     headers={"Authorization": f"Bearer {api_key}"}).text
    assert ": progress 2/3\n\n" in raw and raw.index(": progress 2/3") < raw.index("event: image_generation")


def test_stream_sends_partial_images_then_the_completed_image(client, edit_client):
    """partial_images=2 over 4 steps: previews after steps 1 and 3, then the final image,
    which previews leave unchanged; the SDK parses each event into its own type."""
    body = {"num_inference_steps": 4, "seed": 9}
    whole = client.images.generate(prompt="a tree", size="32x32", extra_body=body)
    events = list(client.images.generate(prompt="a tree", size="32x32", stream=True,
                                         partial_images=2, output_format="webp", extra_body=body))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "32x32" and e.output_format == "webp" and e.background == "opaque"
               for e in events)
    previews = [_image(e.b64_json, "WEBP") for e in events[:2]]
    assert all(p.shape == (32, 32, 3) for p in previews)
    final = client.images.generate(prompt="a tree", size="32x32", output_format="webp", extra_body=body)
    assert events[-1].b64_json == final.data[0].b64_json
    assert _image(whole.data[0].b64_json).shape == (32, 32, 3)
    # not streamed: partial_images has nowhere to go and changes nothing
    quiet = client.images.generate(prompt="a tree", size="32x32", partial_images=2, extra_body=body)
    assert quiet.data[0].b64_json == whole.data[0].b64_json
    edits = list(edit_client.images.edit(image=("in.png", _png(32, 32, 1), "image/png"),
                                         prompt="paint it", size="32x32", stream=True, partial_images=1,
                                         extra_body={"num_inference_steps": 2, "seed": 2}))
    assert [e.type for e in edits] == ["image_edit.partial_image", "image_edit.completed"]


@pytest.mark.parametrize("kwargs, param", [
    ({"size": "big"}, "size"),
    ({"size": "40x32"}, "size"),                 # not a multiple of 16
    ({"size": "128x64"}, "size"),                # over --max-image-pixels 4096
    ({"n": 3}, "n"),                             # over --max-images-per-request 2
    ({"extra_body": {"num_inference_steps": 5}}, "num_inference_steps"),
    ({"response_format": "url"}, "response_format"),
    ({"output_compression": 50}, "output_compression"),   # png has no quality setting
    ({"model": "gpt-image-1"}, "model"),
    ({"extra_body": {"cache": "magic"}}, "cache"),
])
def test_bad_generation_requests_are_400s(client, kwargs, param):
    kwargs = {"size": "32x32", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", **kwargs)
    assert e.value.body["param"] == param


def test_api_key_applies(servers, api_key):
    with pytest.raises(openai.AuthenticationError):
        _client(servers["gen"], "wrong").images.generate(prompt="x", size="32x32")
    for path in ("/v1/images/edits", "/v1/videos", "/v1/videos/video_x"):
        assert httpx.post(servers["gen"] + path, timeout=10).status_code == 401
    assert httpx.get(servers["gen"] + "/v1/videos", timeout=10).status_code == 401


def test_other_endpoints_point_to_the_image_routes(servers, client, api_key):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="/v1/images/generations"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="/v1/images/generations"):
        client.completions.create(model="tiny", prompt="hi")
    r = httpx.post(servers["gen"] + "/v1/videos", json={"prompt": "x"},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 400 and "/v1/images/generations" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:       # image-to-image takes one image
        client.images.edit(image=[("a.png", _png(32, 32, 0), "image/png"),
                                  ("b.png", _png(32, 32, 1), "image/png")], prompt="x", extra_body=STEPS)
    assert e.value.body["param"] == "image"


def test_edit_with_one_and_two_images(edit_client):
    one = edit_client.images.edit(image=("a.png", _png(40, 56, 1), "image/png"), prompt="make it blue",
                                  size="32x48", extra_body={**STEPS, "seed": 2})
    two = edit_client.images.edit(image=[("a.png", _png(40, 56, 1), "image/png"),
                                         ("b.png", _png(24, 24, 2), "image/png")],
                                  prompt="put b into a", size="32x48", extra_body={**STEPS, "seed": 2})
    a, b = _image(one.data[0].b64_json), _image(two.data[0].b64_json)
    assert one.size == two.size == "32x48" and a.shape == b.shape == (48, 32, 3)
    assert not np.array_equal(a, b)         # the second image changes the conditioning


@pytest.mark.parametrize("files, param", [
    ({"image": ("a.png", b"\x89PNG\r\n\x1a\nbroken", "image/png")}, "image"),
    ({"image": ("a.png", _png(32, 32, 0), "image/png"),
      "mask": ("m.png", _png(16, 16, 0), "image/png")}, "mask"),               # not the image's size
    ({}, "image"),
])
def test_bad_edits_are_400s(servers, api_key, files, param):
    r = httpx.post(servers["edit"] + "/v1/images/edits", data={"prompt": "x", "size": "32x32", **STEPS},
                   files=files or {"nothing": ("n.txt", b"", "text/plain")},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_layer_stacks_come_back_as_rgba_pictures():
    """A layered model's sample (L, H, W, 4) is L RGBA pictures; JPEG gets them on white."""
    from omnistage.outputs import to_uint8
    from omnistage.server.image_protocol import encode_image, pictures

    stack = np.random.default_rng(0).random((3, 16, 24, 4)).astype(np.float32)
    image = np.random.default_rng(1).random((16, 24, 3)).astype(np.float32)
    got = pictures([image, stack])
    assert len(got) == 4 and got[0] is image and all(p.shape == (16, 24, 4) for p in got[1:])
    png = Image.open(io.BytesIO(encode_image(got[2], "png")))
    assert png.mode == "RGBA" and np.array_equal(np.asarray(png), to_uint8(stack[1]))
    assert Image.open(io.BytesIO(encode_image(got[2], "jpeg"))).mode == "RGB"
    with pytest.raises(ValueError):
        pictures([np.zeros((5, 16, 24, 3), np.float32)])       # a video is not a picture
