"""Hostile input against the real image and video servers (tiny Qwen-Image, tiny Wan) on
loopback: /v1/images/generations, /v1/images/edits and /v1/videos. Each case is a 4xx in
OpenAI's error JSON naming the right `param` (never a 5xx, a silent 2xx or a hang: every call
has a timeout), /health is 200 after each, and at the end normal requests still succeed and
the engines hold no request. Unknown extra fields are ignored, as on the chat routes (the
SDK may send newer fields). Media are built in memory; bodies are limited to 1 MiB."""

from __future__ import annotations

import base64
import contextlib
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from omnistage.entrypoints.model_source import tiny_checkpoint
from server_helpers import Req, png_claiming, send

GEN, EDIT, VIDEOS = "/v1/images/generations", "/v1/images/edits", "/v1/videos"
BODY_LIMIT_MB = 1
IMAGE_FLAGS = ("--max-image-pixels", "4096", "--max-images-per-request", "2", "--max-diffusion-steps", "4",
               "--max-body-mb", str(BODY_LIMIT_MB))
VIDEO_FLAGS = ("--max-video-frames", "17", "--max-diffusion-steps", "1000", "--max-body-mb", str(BODY_LIMIT_MB))
# The engine's count and the stage's (which alone reads 0 while it admits a request)
HELD = ("omnistage_requests_in_engine", 'omnistage_stage_requests{stage="diffusion"}')
TIMEOUT_S = 30          # a case that hangs fails here instead of stalling the run
P = pytest.param


# ---- media, built in memory ------------------------------------------------------------------

def image(mode: str = "RGB", fmt: str = "PNG", size: tuple[int, int] = (32, 32), **save) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, fmt, **save)
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(raw).decode()}"


GOOD, TEXT, BOMB = image(), b"I am definitely a PNG, trust me.\n" * 4, png_claiming(100_000, 100_000)
OVER_LIMIT, DEEP = b"\0" * (BODY_LIMIT_MB * 2**20 + 1), 10_000     # DEEP: JSON nesting levels


def raw(path: str, content: bytes, ctype: str = "application/json") -> Req:
    return Req(path, content=content, headers={"Content-Type": ctype})


def multipart(path: str, fields: dict[str, bytes], files: dict[str, bytes] | None = None) -> Req:
    """A multipart body written by hand: httpx would send a bytes field as its repr."""
    out = b""
    for name, value in fields.items():
        out += b'--xyz\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (name.encode(), value)
    for name, value in (files or {}).items():
        out += (b'--xyz\r\nContent-Disposition: form-data; name="%s"; filename="a.png"\r\n'
                b"Content-Type: image/png\r\n\r\n%s\r\n" % (name.encode(), value))
    return raw(path, out + b"--xyz--\r\n", "multipart/form-data; boundary=xyz")


def gen(**over) -> Req:
    return Req(GEN, json={"prompt": "a red cube", "size": "32x32", "num_inference_steps": 2, **over})


def edit(*images, mask=None, **fields) -> Req:
    """A multipart edit: each image (bytes, or a (name, bytes, mime) tuple) as an `image` part.
    Without images a stray text file goes along: the body stays multipart, as the SDK's is."""
    def part(x):
        return x if isinstance(x, tuple) else ("a.png", x, "image/png")
    files = [("image", part(i)) for i in images] or [("notes", ("n.txt", b"x", "text/plain"))]
    files += [] if mask is None else [("mask", part(mask))]
    return Req(EDIT, files=files, data={"prompt": "make it blue", "num_inference_steps": "2", **fields})


def video(**over) -> Req:
    """5 frames unless `seconds` sets them: Wan's default 81 are over the limit (another error)."""
    frames = {} if "seconds" in over else {"num_frames": 5}
    return Req(VIDEOS, json={"prompt": "a wave", "size": "32x32", "num_inference_steps": 2, **frames, **over})


def video_form(reference=None, **fields) -> Req:
    files = [] if reference is None else [("input_reference", ("f.png", reference, "image/png"))]
    return Req(VIDEOS, files=files, data={"prompt": "a wave", "size": "32x32", "num_frames": "5", **fields})


def one_field(make, tag: str = "", **values: list) -> list:
    """One case per bad value: make(field=value), whose error must name that field."""
    return [P(make(**{k: v}), k, id=f"{tag}{k}-{str(v)[:20]}") for k, vs in values.items() for v in vs]


# ---- servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clients(start_server, api_key):
    """{"image": client of a tiny:qwen_image server, "video": of tiny:wan}, started side by side."""
    models = {"image": (str(tiny_checkpoint("qwen_image")), IMAGE_FLAGS),
              "video": (str(tiny_checkpoint("wan")), VIDEO_FLAGS)}
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:
            started = {k: pool.submit(stack.enter_context, start_server(d, *flags))
                       for k, (d, flags) in models.items()}
        yield {k: stack.enter_context(httpx.Client(base_url=f.result().base, timeout=TIMEOUT_S,
                                                   headers={"Authorization": f"Bearer {api_key}"}))
               for k, f in started.items()}


def assert_openai_error(r: httpx.Response, status: int = 400, param="any") -> dict:
    assert r.status_code == status, f"status {r.status_code}, wanted {status}: {r.text[:300]}"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10 and err["type"], err
    assert param == "any" or err["param"] == param, err
    return err


def held(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return sum(float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1)) for name in HELD)


def finished(http: httpx.Client, video_id: str) -> dict:
    """The job once completed or failed (polled: the API offers no wait)."""
    deadline = time.monotonic() + TIMEOUT_S
    while (job := http.get(f"{VIDEOS}/{video_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"video job still {job['status']}"
        time.sleep(0.05)
    return job


# ---- cases: (request, the param its error names: "any" where none is right, None for 413) ----

NOT_OBJECT = [P(raw(path, body), "any", id=f"{path.rsplit('/', 1)[-1]}-json-{name}")
              for path in (GEN, VIDEOS)
              for name, body in (("list", b"[]"), ("string", b'"a cat"'), ("number", b"5"),
                                 ("null", b"null"), ("broken", b'{"prompt": '),
                                 ("invalid-utf8", b'{"prompt": "\xff\xfe"}'),
                                 ("deep", b'{"prompt": "x", "extra": ' + b"[" * DEEP + b"]" * DEEP + b"}"))]

GEN_CASES = [
    *one_field(gen, n=["two", 1.5, True, -1, 0, 10**30, 3, [1]],      # 3: over --max-images-per-request
               size=["0x0", "-1x64", "64", "axb", "64x64x64", "999999x999999", "9999999x16",
                     "40x32", "128x64", "", "32x0", 64],      # 40: not a multiple of 16; 128x64: over 4096 px
               seed=[-1, 2**64, 1.5, "lucky", False],
               num_inference_steps=[0, -3, 10**9, "many", 1, 5, None]),   # 1: Qwen-Image needs 2; None: 50
    *[P(raw(GEN, b'{"prompt": "x", "size": "32x32", "%s": %s}' % (k.encode(), v)), k, id=f"{k}-{v.decode()}")
      for k in ("guidance_scale", "true_cfg_scale") for v in (b"NaN", b"Infinity", b"-Infinity")],
    *one_field(gen, true_cfg_scale=[-1], guidance_scale=[-0.5, "high", False], cache=["magic", 1],
               cache_threshold=[-0.1, "low"], strength=[0, 2, 0.5],     # 0.5: there is no input image
               output_format=["gif", None], response_format=["url", "file"], partial_images=[9],
               background=["plaid"], model=["gpt-image-1", 5], negative_prompt=[5],
               prompt=["", "   \n", ["a", "b"], None, "x" * 32001], stream=["maybe", 1, [True], "yes"]),
    *[P(gen(output_format=fmt, output_compression=q), "output_compression", id=f"output_compression-{fmt}-{q}")
      for fmt, q in (("jpeg", 101), ("webp", -1), ("png", 50))],          # png has no quality setting
    P(gen(stream=True, size="40x32"), "size", id="stream-with-bad-size"),     # 400 before the SSE
    P(Req(GEN, json={"size": "32x32"}), "prompt", id="prompt-missing"),
    P(gen(negative_prompt="x" * 32001), "negative_prompt", id="negative_prompt-over-length-limit"),
    P(gen(prompt="x" * (BODY_LIMIT_MB * 2**20)), None, id="generation-over-body-limit"),
    P(raw(GEN, b"prompt=x&size=32x32", "application/x-www-form-urlencoded"), "any", id="generation-form-body"),
]

EDIT_CASES = [
    *[P(edit(*images, **kw), "image", id=f"edit-{name}") for name, images, kw in (
        ("no-image", (), {}), ("empty-file", (b"",), {}), ("text-file", (("a.txt", TEXT, "text/plain"),), {}),
        ("truncated-png", (GOOD[:60],), {}), ("png-bomb", (BOMB,), {}),
        ("png-4000x4000-from-64-bytes", (png_claiming(4000, 4000),), {}),
        ("png-zero-width", (png_claiming(0, 16),), {}),
        ("two-images-for-one-image-model", (GOOD, GOOD), {}), ("five-images-over-limit", (GOOD,) * 5, {}),
        ("image-as-form-string", (), {"image": "a.png"}))],
    *[P(edit(GOOD, mask=mask), "mask", id=f"edit-mask-{name}") for name, mask in (
        ("wrong-size", image("RGBA", size=(16, 16))), ("not-an-image", TEXT), ("empty", b""),
        ("jpeg", image("RGB", "JPEG")), ("bomb", BOMB), ("truncated", png_claiming(64, 64)))],
    P(Req(EDIT, files=[("image", ("a.png", GOOD, "image/png"))], data={"prompt": "x", "mask": "m.png"}),
      "mask", id="edit-mask-as-form-string"),
    P(edit(image(size=(96, 96))), "size", id="edit-input-gives-size-over-limit"),
    *one_field(lambda **f: edit(GOOD, **f), "edit-", n=["two", "1.5", "true", ""], stream=["maybe", "1"],
               size=["axb", "0x0"], seed=["-1", "1e3"], guidance_scale=["nan", "-1"], strength=["0", "2", "1e-20"],
               output_format=["bmp"], prompt=["", "x" * 32001], response_format=["url"]),
    P(Req(EDIT, files=[("image", ("a.png", GOOD, "image/png"))], data={}), "prompt", id="edit-prompt-missing"),
    P(Req(EDIT, files=[("image", ("a.png", GOOD, "image/png")), ("prompt", ("p.txt", b"blue", "text/plain"))]),
      "prompt", id="edit-prompt-as-file"),
    P(edit(*[GOOD] * 65), "any", id="edit-65-files-over-form-limit"),
    P(Req(EDIT, files=[("image", ("a.png", GOOD, "image/png"))], data={f"f{i}": "x" for i in range(1001)}),
      "any", id="edit-1001-form-fields"),
    P(Req(EDIT, json={"prompt": "x", "image": data_url(GOOD)}), "any", id="edit-json-body"),
    P(raw(EDIT, b"--xyz\r\nbroken", "multipart/form-data; boundary=xyz"), "any", id="edit-broken-multipart"),
    P(raw(EDIT, b"image=x", "multipart/form-data"), "any", id="edit-multipart-without-boundary"),
    P(edit(OVER_LIMIT), None, id="edit-over-body-limit"),
]

VIDEO_CASES = [
    *one_field(video, seconds=["abc", "-1", 0, "1e9", "9", "nan", "inf", [1], True],   # 9 s: 145 frames
               num_frames=[6, 0, -3, 10**12, 21, "five", 4.5, False],                  # 6: Wan takes 4k+1
               fps=[0, -8, 10**6, "fast", True], size=["0x0", "64", "40x32", "999999x999999"],
               num_inference_steps=[0, 1001], guidance_scale_2=[-1], true_cfg_scale=[4],   # Wan has no true CFG
               strength=[0, 2, 0.5], seed=[-1], cache=["magic"], prompt=["", 5, "x" * 32001], model=["sora-2"]),
    P(video(seconds="abc", num_frames=5), "seconds", id="seconds-abc-with-num_frames"),
    P(raw(VIDEOS, b'{"prompt": "x", "guidance_scale": NaN}'), "guidance_scale", id="video-guidance-nan"),
    P(Req(VIDEOS, json={"size": "32x32"}), "prompt", id="video-prompt-missing"),
    *[P(video(input_reference=ref), "input_reference", id=f"reference-{name}") for name, ref in (
        ("not-an-image", {"image_url": data_url(TEXT)}), ("truncated", {"image_url": data_url(GOOD[:60])}),
        ("png-bomb", {"image_url": data_url(BOMB)}), ("bad-base64", {"image_url": "data:image/png;base64,!!"}),
        ("remote", {"image_url": "https://example.com/a.png"}), ("file-id", {"file_id": "file_1"}),
        ("string", "a.png"), ("empty-list", []), ("empty-object", {}),
        ("on-text-to-video", {"image_url": data_url(GOOD)}))],     # tiny:wan makes video from text only
    P(video_form(TEXT), "input_reference", id="reference-upload-not-an-image"),
    P(video_form(b""), "input_reference", id="reference-upload-empty"),
    P(video_form(**{"input_reference[image_url]": "data:image/png;base64,AAAA"}), "input_reference",
      id="reference-form-field-corrupt"),
    P(raw(VIDEOS, b"prompt=x&num_frames=5&input_reference=a.png", "application/x-www-form-urlencoded"),
      "input_reference", id="reference-urlencoded-string"),
    *one_field(video_form, "form-", seconds=["abc"], num_frames=["6"], fps=["0"], guidance_scale=["inf"]),
    P(Req(VIDEOS, files=[("prompt", ("p.txt", b"a wave", "text/plain"))], data={"num_frames": "5"}), "prompt",
      id="video-prompt-as-file"),
    P(raw(VIDEOS, b"--xyz\r\nbroken", "multipart/form-data; boundary=xyz"), "any", id="video-broken-multipart"),
    P(raw(VIDEOS, b"prompt=x", "multipart/form-data"), "any", id="video-multipart-without-boundary"),
    P(video(prompt="x" * (BODY_LIMIT_MB * 2**20)), None, id="video-over-body-limit"),
    P(video_form(OVER_LIMIT), None, id="video-upload-over-body-limit"),
]

# Odd but usable input: a 200 (a video job that then completes) or a 4xx; never a 5xx.
TOLERATED = {
    "special-tokens": gen(prompt="<|im_start|><|im_end|><|endoftext|>"),
    "nul-emoji": gen(prompt="x\u0000y \U0001f600"), "edit-1x1": edit(image(size=(1, 1))),
    "lone-surrogate": raw(GEN, rb'{"prompt": "a\ud800b", "size": "32x32", "num_inference_steps": 2}'),
    "prompt-30000": gen(prompt="a cat " * 5000), "cfg-100": gen(negative_prompt="", true_cfg_scale=100),
    "guidance-100": gen(negative_prompt="blurry", true_cfg_scale=1.5, guidance_scale=100),
    "seed-max": gen(seed=2**63 - 1, size="16x16"), "16x256": gen(size="16x256"), "spaced-X": gen(size=" 32 X 32 "),
    "teacache-10": gen(cache="teacache", cache_threshold=10), "fbcache-0": gen(cache="fbcache", cache_threshold=0),
    "stream-n-2": gen(n=2, stream=True), "stream-str": gen(stream="true"), "int-strs": gen(n="2", seed="3"),
    "jpeg-q0": gen(output_format="jpeg", output_compression=0),
    **{f"edit-{m}-{f}": edit(image(m, f)) for m, f in (
        x.split(":") for x in "RGBA:PNG LA:PNG P:PNG I;16:PNG 1:PNG CMYK:JPEG RGB:GIF RGB:WEBP".split())},
    "mask-grey": edit(GOOD, mask=image("L")), "mask-palette": edit(GOOD, mask=image("P", transparency=0)),
    "mask-webp": edit(GOOD, mask=image("RGBA", "WEBP")), "png-as-text": edit(("a.png", GOOD, "text/plain")),
    "strength-1-resized": edit(GOOD, strength="1", size="16x48"),
    # Starlette reads a form field that is not UTF-8 as Latin-1: an odd prompt, not an error
    "edit-latin-1": multipart(EDIT, {"prompt": b"\xff\xfe blue", "num_inference_steps": b"2"}, {"image": GOOD}),
    "video-1-frame": video(num_frames=1, seed=2**63 - 1), "video-0.25s": video(seconds="0.25"),
    "video-seconds-number": video(seconds=0.5, fps=8, num_frames=None), "video-16x64": video(size="16x64"),
    "video-guidance": video(guidance_scale=0, guidance_scale_2=100), "video-neg": video(negative_prompt=""),
    "video-teacache-10": video(cache="teacache", cache_threshold=10),
    "video-surrogate": raw(VIDEOS, rb'{"prompt": "a\ud800b", "num_frames": 5, "num_inference_steps": 2}'),
    "video-latin-1": multipart(VIDEOS, {"prompt": b"\xff\xfe", "num_frames": b"5", "size": b"32x32",
                                        "num_inference_steps": b"2"}),
}


def _server(req: Req) -> str:
    return "video" if req.path == VIDEOS else "image"     # tiny:wan serves videos, tiny:qwen_image images


@pytest.mark.parametrize("req, param", NOT_OBJECT + GEN_CASES + EDIT_CASES + VIDEO_CASES)
def test_hostile_request_is_openai_4xx(clients, req, param):
    """And /health is 200 after every case, so a case that breaks the server is named."""
    http = clients[_server(req)]
    r = send(http, req)
    assert http.get("/health").status_code == 200, f"unhealthy after: {r.status_code} {r.text[:300]}"
    assert_openai_error(r, 413 if param is None else 400, param or "any")


@pytest.mark.parametrize("req", TOLERATED.values(), ids=TOLERATED.keys())
def test_tolerated_input_is_never_5xx(clients, req):
    http = clients[_server(req)]
    r = send(http, req)
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    elif req.path == VIDEOS:
        job = finished(http, r.json()["id"])
        assert job["status"] == "completed", job["error"]
    elif r.headers["content-type"].startswith("text/event-stream"):       # one event per image
        done = r.text.count("event: image_generation.completed\n")
        assert "event: error" not in r.text and done == int(req.json.get("n", 1)), r.text[-300:]
    else:
        assert r.json()["data"][0]["b64_json"], r.text[:300]


@pytest.mark.parametrize("path", [GEN, EDIT, VIDEOS])
def test_chunked_body_over_the_limit_is_a_413(clients, path):
    """No Content-Length: the limit holds while the body streams in."""
    chunks = (b"x" * 2**19 for _ in range(2 * BODY_LIMIT_MB + 2))
    r = clients["video" if path == VIDEOS else "image"].post(
        path, content=chunks, headers={"Content-Type": "application/json", "Connection": "close"})
    assert_openai_error(r, 413)


@pytest.mark.parametrize("method, path", [
    ("POST", GEN), ("POST", EDIT), ("POST", VIDEOS), ("GET", VIDEOS), ("GET", VIDEOS + "/video_x"),
    ("GET", VIDEOS + "/video_x/content"), ("DELETE", VIDEOS + "/video_x")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "test-key", "Bearer"],
                         ids=["missing", "wrong", "no-bearer", "empty"])
def test_new_routes_need_the_api_key(clients, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    for http in clients.values():
        url = str(http.base_url).rstrip("/") + path
        assert_openai_error(httpx.request(method, url, headers=headers, json={"prompt": "x"}, timeout=TIMEOUT_S), 401)


@pytest.mark.parametrize("video_id", ["video_nope", "x" * 2000, "video_%00", "video_%2F..%2Fx"],
                         ids=["plain", "2000-chars", "nul", "slash-dot-dot"])
def test_unknown_video_ids_are_404s(clients, video_id):
    """An id with a (decoded) slash matches no route: Starlette's bare 'Not Found' (app.py's
    words, in OpenAI's error JSON too)."""
    for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        r = clients["video"].request(method, f"{VIDEOS}/{video_id}{suffix}")
        if "%2F" in video_id:
            assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        else:
            assert "no video job" in assert_openai_error(r, 404, "video_id")["message"]


@pytest.mark.parametrize("query", ["limit=0", "limit=abc", "limit=1000", "order=sideways"])
def test_bad_video_list_queries_are_400s(clients, query):
    assert_openai_error(clients["video"].get(f"{VIDEOS}?{query}"), 400, query.split("=")[0])


def test_unknown_fields_are_ignored_as_on_the_chat_routes(clients):
    extra = {"quality": "hd", "style": "vivid", "user": "u", "frobnicate": {"a": [1]}}
    r = send(clients["image"], gen(seed=1, **extra))
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text[:300]
    r = send(clients["image"], edit(GOOD, seed="1", quality="hd", frobnicate="x"))
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text[:300]
    r = send(clients["video"], video(seed=1, remix_of="video_x", **extra))
    assert r.status_code == 200, r.text[:300]
    assert finished(clients["video"], r.json()["id"])["status"] == "completed"


def test_content_of_an_unfinished_job_is_a_409_and_delete_frees_the_engine(clients):
    http = clients["video"]
    r = send(http, video(size="64x64", num_frames=17, num_inference_steps=1000, seed=3))   # ~8 s
    assert r.status_code == 200, r.text[:300]
    job = r.json()
    assert job["status"] in ("queued", "in_progress")
    err = assert_openai_error(http.get(f"{VIDEOS}/{job['id']}/content"), 409, "video_id")
    assert job["id"] in err["message"]
    assert_openai_error(http.get(f"{VIDEOS}/{job['id']}/content?variant=thumbnail"), 400, "variant")
    assert http.delete(f"{VIDEOS}/{job['id']}").json()["deleted"] is True
    deadline = time.monotonic() + 10
    while held(http) != 0:                 # the abort reaches the engine thread
        assert time.monotonic() < deadline, "the stage still holds the deleted job"
        time.sleep(0.05)
    assert_openai_error(http.get(f"{VIDEOS}/{job['id']}"), 404, "video_id")


def test_servers_survive_the_hostile_suite(clients):
    """Runs last in this module: healthy, nothing left in the engines, and normal requests work."""
    images, videos = clients["image"], clients["video"]
    for http in (images, videos):
        assert http.get("/health").status_code == 200 and held(http) == 0
    for req in (gen(seed=4), edit(GOOD, seed="4")):
        r = send(images, req)
        assert r.status_code == 200 and r.json()["size"] == "32x32", r.text[:300]
    r = send(videos, video(seed=4))
    assert r.status_code == 200, r.text[:300]
    job = finished(videos, r.json()["id"])
    assert job["status"] == "completed", job["error"]
    assert videos.get(f"{VIDEOS}/{job['id']}/content").content[4:8] == b"ftyp"     # an MP4
    for http in (images, videos):
        assert held(http) == 0
