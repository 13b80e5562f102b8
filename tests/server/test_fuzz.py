"""Fuzzing every route of the real server on loopback: 0 responses >= 500, 0 crashes, /health
200 after each test.

- The JSON routes, from the server's own OpenAPI schema (schemathesis: cases that fit the
  schema and cases that break it), against a speech model (tiny Qwen2.5-Omni) and an image
  model (tiny Qwen-Image).
- The multipart routes (transcriptions, image edits, videos) and the Realtime WebSocket, whose
  bodies the schema does not describe, from hand-written hypothesis strategies: valid parts,
  garbage, wrong types and lying media headers mixed.

Bounded: hypothesis runs derandomized (the same cases on every run: a failure reproduces), a
fixed number of cases per test, generation lengths clamped (`_bounded`), every wait with a
timeout. Each test prints how many cases ran (`pytest -s`).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.entrypoints.model_source import tiny_checkpoint
from server_helpers import png_claiming

schemathesis = pytest.importorskip("schemathesis")

CASES = 120            # per test
TIMEOUT_S = 60         # one request or WebSocket wait
MAX_TOKENS = 8         # generation lengths in fuzzed bodies are clamped to this
FUZZ = settings(max_examples=CASES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def servers(start_server):
    """{"omni": base URL of a tiny Qwen2.5-Omni server, "image": one of tiny Qwen-Image},
    started side by side."""
    models = {"omni": (str(tiny_checkpoint("qwen2_5_omni")), "--linear-kernel", "matmul"),
              "image": (str(tiny_checkpoint("qwen_image")), "--max-image-pixels", "4096",
                        "--max-diffusion-steps", "2")}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = {k: pool.submit(stack.enter_context, start_server(*args, "--max-body-mb", "2"))
                   for k, args in models.items()}
        yield {k: f.result().base for k, f in started.items()}


@pytest.fixture(scope="module")
def auth(api_key):
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="module")
def tally():
    """Cases run and status codes seen, per test; printed at the end of the module."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    yield counts
    for name, seen in counts.items():
        print(f"\n{name}: {sum(seen.values())} cases, statuses {dict(sorted(seen.items()))}")


def _bounded(body):
    """A fuzzed JSON body with its generation lengths clamped (a case may ask for any length;
    the fuzz is about the answer's kind, not about waiting for 10^6 tokens)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "num_inference_steps", "n"):
        if isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = max(-1, min(out[key], MAX_TOKENS if key != "n" else 2))
    if isinstance(out.get("input"), str):
        out["input"] = out["input"][:64]
    return out


def _check(response: httpx.Response, tally_for: collections.Counter, what: str) -> None:
    tally_for[response.status_code] += 1
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400 and response.status_code != 404:
        error = response.json()["error"]            # OpenAI's error JSON
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def _healthy(base: str) -> None:
    assert httpx.get(f"{base}/health", timeout=TIMEOUT_S).status_code == 200


# ---- the JSON routes, from the OpenAPI schema -----------------------------------------------

def _operations(base: str, auth: dict):
    from schemathesis import GenerationMode

    spec = httpx.get(f"{base}/openapi.json", headers=auth, timeout=TIMEOUT_S).json()
    schema = schemathesis.openapi.from_dict(spec)
    ops = [op.ok() for op in schema.get_all_operations()]
    return st.sampled_from([(op, mode) for op in ops for mode in GenerationMode])


def _call(base: str, auth: dict, case) -> httpx.Response:
    path = case.formatted_path
    kwargs = {"params": case.query or None, "headers": {**auth, "Connection": "close"}}
    if case.body is not None and not isinstance(case.body, type(schemathesis.core.NOT_SET)):
        body = case.body
        kwargs["content"] = body if isinstance(body, bytes) else json.dumps(_bounded(body)).encode()
        kwargs["headers"]["Content-Type"] = case.media_type or "application/json"
    return httpx.request(case.method, f"{base}{path}", timeout=TIMEOUT_S, **kwargs)


@pytest.mark.parametrize("model", ["omni", "image"])
def test_openapi_routes_never_5xx(servers, auth, tally, model):
    base = servers[model]
    operations = _operations(base, auth)

    @FUZZ
    @given(data=st.data())
    def run(data):
        op, mode = data.draw(operations)
        case = data.draw(op.as_strategy(generation_mode=mode))
        _check(_call(base, auth, case), tally[f"openapi[{model}]"], f"{case.method} {case.formatted_path}")

    run()
    _healthy(base)


# ---- multipart routes -----------------------------------------------------------------------

def _wav(seconds: float) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    t = np.arange(int(16000 * seconds)) / 16000
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def _png(size: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), 90, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


MEDIA = st.one_of(st.binary(max_size=256), st.sampled_from([_wav(0.5), _wav(0.01), _png(32),
                                                            _png(1), png_claiming(9999, 9999),
                                                            b"#EXTM3U\n#EXTINF:1,\n/etc/passwd\n",
                                                            b"ffconcat version 1.0\nfile '/etc/passwd'\n"]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "tiny", "json", "text", "srt", "verbose_json",
                                                         "vtt", "true", "false", "0", "-1", "2", "32x32",
                                                         "auto", "png", "webp", "b64_json", "url", "nan"]))


MULTIPART = {     # route: (its file fields, its text fields)
    "/v1/audio/transcriptions": (["file", "audio"],
                                 ["model", "language", "prompt", "response_format", "temperature",
                                  "stream", "timestamp_granularities[]", "chunking_strategy"]),
    "/v1/images/edits": (["image", "image[]", "mask"],
                         ["prompt", "model", "n", "size", "output_format", "response_format", "stream",
                          "partial_images", "seed", "num_inference_steps", "background", "strength"]),
    "/v1/videos": (["input_reference"], ["prompt", "model", "size", "seconds", "num_frames", "fps", "seed"]),
}
# A valid body per route (the image server's edits; the omni server's transcriptions), which
# the strategy below mutates: so that some cases pass and the fuzz reaches the work behind.
VALID = {
    "/v1/audio/transcriptions": ([("file", ("a.wav", _wav(0.5), "audio/wav"))], {"model": "tiny"}),
    "/v1/images/edits": ([("image", ("b.png", _png(32), "image/png"))],
                         {"prompt": "x", "size": "32x32", "num_inference_steps": "2"}),
    "/v1/videos": ([], {"prompt": "x"}),
}


@st.composite
def _multipart(draw, path: str):
    """The route's valid body with up to three of its parts dropped, replaced or added."""
    file_fields, text_fields = MULTIPART[path]
    files, data = list(VALID[path][0]), dict(VALID[path][1])
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            part = (draw(st.sampled_from(file_fields)),
                    (draw(st.sampled_from(["a.wav", "b.png", "c", ""])), draw(MEDIA),
                     draw(st.sampled_from(["audio/wav", "image/png", "application/octet-stream", "text/plain"]))))
            files = files[1:] + [part] if files and draw(st.booleans()) else files + [part]
        else:
            name = draw(st.sampled_from(text_fields))
            if name in data and draw(st.booleans()):
                del data[name]
            else:
                data[name] = draw(TEXT)
    return files, data


@pytest.mark.parametrize("model", ["omni", "image"])
def test_multipart_routes_never_5xx(servers, auth, tally, model):
    base = servers[model]

    @FUZZ
    @given(path=st.sampled_from(sorted(MULTIPART)), data=st.data())
    def run(path, data):
        files, fields = data.draw(_multipart(path))
        if fields.get("num_inference_steps", "1").isdigit():
            fields["num_inference_steps"] = "2"      # bounded: two denoising steps (img2img needs 2)
        r = httpx.post(f"{base}{path}", files=files or None, data=fields, timeout=TIMEOUT_S,
                       headers={**auth, "Connection": "close"})
        _check(r, tally[f"multipart[{model}]"], path)

    run()
    _healthy(base)


# ---- the Realtime WebSocket -----------------------------------------------------------------

JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False)
                       | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
                       max_leaves=8)
PCM = base64.b64encode(np.zeros(2400, np.int16).tobytes()).decode()
EVENT_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
               "input_audio_buffer.clear", "conversation.item.create", "conversation.item.delete",
               "conversation.item.truncate", "conversation.item.retrieve", "response.create",
               "response.cancel", "output_audio_buffer.clear", "unknown.event"]


@st.composite
def _event(draw):
    kind = draw(st.sampled_from(EVENT_TYPES))
    event = {"type": kind, **draw(st.dictionaries(st.sampled_from(
        ["session", "audio", "item", "item_id", "response", "content_index", "audio_end_ms",
         "previous_item_id", "event_id"]), JSONISH, max_size=3))}
    if kind == "input_audio_buffer.append" and draw(st.booleans()):
        event["audio"] = draw(st.sampled_from([PCM, PCM[:-3], "not base64!", ""]))
    if kind == "conversation.item.create" and draw(st.booleans()):
        event["item"] = {"type": "message", "role": draw(st.sampled_from(["user", "system", "assistant", "x"])),
                         "content": [{"type": draw(st.sampled_from(["input_text", "input_audio", "text"])),
                                      "text": draw(st.text(max_size=20)), "audio": PCM}]}
    if kind == "response.create" and draw(st.booleans()):
        event["response"] = {"output_modalities": draw(st.sampled_from([["text"], ["audio"], None, "x"])),
                             "max_output_tokens": draw(st.sampled_from([1, MAX_TOKENS, "inf", -1, None]))}
    return event


def _alive(ws) -> None:
    """The session still answers: a no-op session.update gets its session.updated (events of
    earlier turns may come first). Bounded by TIMEOUT_S per message."""
    ws.send(json.dumps({"type": "session.update", "session": {}}))
    while True:
        event = json.loads(ws.recv(timeout=TIMEOUT_S))
        if event["type"] == "session.updated":
            return
        if event["type"] == "error":
            assert event["error"]["type"] != "server_error", event


def test_realtime_events_never_crash_the_session(servers, auth, tally):
    from websockets.sync.client import connect

    base = servers["omni"].replace("http://", "ws://")

    @FUZZ
    @given(events=st.lists(st.one_of(_event(), _event(), _event(), JSONISH.map(json.dumps),
                                     st.text(max_size=30)),
                           min_size=1, max_size=6))
    def run(events):
        with connect(f"{base}/v1/realtime?model=tiny", additional_headers=auth,
                     open_timeout=TIMEOUT_S, close_timeout=5) as ws:
            assert json.loads(ws.recv(timeout=TIMEOUT_S))["type"] == "session.created"
            for event in events:
                ws.send(event if isinstance(event, str) else json.dumps(event))
                tally["realtime"][event["type"] if isinstance(event, dict) else "raw"] += 1
            _alive(ws)

    run()
    _healthy(servers["omni"])
