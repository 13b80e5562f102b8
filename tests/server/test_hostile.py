"""Hostile input against the real server: every malformed request is a 4xx in OpenAI's error
JSON (never a 5xx, never a silent 2xx), and the server is still healthy afterwards.

Requests go through httpx with raw bytes / raw JSON, since the openai SDK refuses to send
most of these.
"""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
DEEP = 10_000


def chat(**over) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **over}


def comp(**over) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **over}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


def deep_json(prefix: bytes, suffix: bytes = b"}") -> bytes:
    return prefix + b"[" * DEEP + b"]" * DEEP + suffix


@pytest.fixture(scope="module")
def http(server, api_key):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {api_key}"},
                      timeout=30) as client:
        yield client


def send(http: httpx.Client, method: str, path: str, body=None, headers: dict | None = None):
    """dict/list -> JSON; bytes -> sent as is (Content-Type application/json unless given).
    Connection: close, so that a case the server answers badly cannot poison the pooled
    connection the next case would reuse."""
    h = {"Connection": "close", **(headers or {})}
    if isinstance(body, bytes):
        h.setdefault("Content-Type", "application/json")
        return http.request(method, path, content=body, headers=h)
    if body is None:
        return http.request(method, path, headers=h)
    return http.request(method, path, json=body, headers=h)


def assert_openai_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, f"status {r.status_code}: {r.text[:300]}"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err


CASES = [
    # --- bodies that are not JSON, or not a JSON object ----------------------------------
    pytest.param("POST", CHAT, b"{not json", id="garbage-json"),
    pytest.param("POST", CHAT, b'{"model": "tiny", "messages": [', id="truncated-json"),
    pytest.param("POST", COMP, b"", id="empty-body"),
    pytest.param("POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
                 id="invalid-utf8-bytes"),
    pytest.param("POST", COMP, b'{"model": "tiny", "prompt": "\xc0\xaf overlong"}', id="overlong-utf8"),
    pytest.param("POST", CHAT, b"[]", id="json-list"),
    pytest.param("POST", CHAT, b'"hello"', id="json-string"),
    pytest.param("POST", CHAT, b"42", id="json-number"),
    pytest.param("POST", COMP, b"null", id="json-null"),
    pytest.param("POST", COMP, b"[" * DEEP + b"]" * DEEP, id="deep-top-level"),
    pytest.param("POST", CHAT, deep_json(b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": '),
                 id="deep-extra-field"),
    pytest.param("POST", CHAT, deep_json(b'{"model": "tiny", "messages": [{"role": "user", "content": ', b"}]}"),
                 id="deep-content"),
    pytest.param("POST", COMP, deep_json(b'{"model": "tiny", "prompt": '), id="deep-prompt"),
    # --- lone surrogate escapes: valid JSON, not valid Unicode text ---------------------
    pytest.param("POST", CHAT, rb'{"model": "tiny", "messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}',
                 id="lone-surrogate-chat"),
    pytest.param("POST", COMP, rb'{"model": "tiny", "prompt": "a\udfffb", "max_tokens": 2}',
                 id="lone-surrogate-completion"),
    # --- missing required fields ---------------------------------------------------------
    pytest.param("POST", CHAT, without(chat(), "model"), id="chat-no-model"),
    pytest.param("POST", CHAT, without(chat(), "messages"), id="chat-no-messages"),
    pytest.param("POST", COMP, without(comp(), "model"), id="completion-no-model"),
    pytest.param("POST", COMP, without(comp(), "prompt"), id="completion-no-prompt"),
    pytest.param("POST", CHAT, {}, id="empty-object"),
    # --- messages ------------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(messages="hi"), id="messages-string"),
    pytest.param("POST", CHAT, chat(messages=[]), id="messages-empty"),
    pytest.param("POST", CHAT, chat(messages=["hi"]), id="message-string"),
    pytest.param("POST", CHAT, chat(messages=[None]), id="message-null"),
    pytest.param("POST", CHAT, chat(messages=[{"content": "hi"}]), id="message-no-role"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), id="unknown-role"),
    pytest.param("POST", CHAT, chat(messages=[{"role": 5, "content": "hi"}]), id="role-number"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), id="content-number"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": {"text": "hi"}}]), id="content-object"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]), id="image-url-part"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), id="audio-part"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": ["hi"]}]), id="content-part-string"),
    pytest.param("POST", CHAT, chat(modalities=["audio"]), id="modalities-audio"),
    pytest.param("POST", CHAT, chat(modalities=["video"]), id="modalities-unknown"),
    # --- model ---------------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(model="gpt-4o"), id="unknown-model-chat"),
    pytest.param("POST", COMP, comp(model="gpt-3.5-turbo-instruct"), id="unknown-model-completion"),
    pytest.param("POST", CHAT, chat(model=5), id="model-number"),
    pytest.param("POST", CHAT, chat(model=None), id="model-null"),
    # --- max_tokens ----------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(max_tokens="many"), id="max_tokens-string"),
    pytest.param("POST", CHAT, chat(max_tokens=1.5), id="max_tokens-float"),
    pytest.param("POST", CHAT, chat(max_tokens=-1), id="max_tokens-negative"),
    pytest.param("POST", CHAT, chat(max_tokens=0), id="max_tokens-zero"),
    pytest.param("POST", CHAT, chat(max_tokens=10**12, temperature=0), id="max_tokens-huge"),
    pytest.param("POST", COMP, comp(max_tokens="sixteen"), id="completion-max_tokens-string"),
    pytest.param("POST", CHAT, chat(max_completion_tokens=-5), id="max_completion_tokens-negative"),
    # --- temperature / top_p / penalties -------------------------------------------------
    pytest.param("POST", CHAT, chat(temperature="hot"), id="temperature-string"),
    pytest.param("POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                 id="temperature-nan"),
    pytest.param("POST", CHAT, chat(temperature=-1), id="temperature-negative"),
    pytest.param("POST", CHAT, chat(temperature=1e308), id="temperature-huge"),
    pytest.param("POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                               b'"max_tokens": 2, "temperature": Infinity}', id="temperature-infinity"),
    pytest.param("POST", CHAT, chat(top_p=0), id="top_p-zero"),
    pytest.param("POST", CHAT, chat(top_p=1.5), id="top_p-above-one"),
    pytest.param("POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
                 id="top_p-nan"),
    pytest.param("POST", CHAT, chat(presence_penalty=5), id="presence_penalty-5"),
    pytest.param("POST", CHAT, chat(frequency_penalty="lots"), id="frequency_penalty-string"),
    pytest.param("POST", COMP, comp(top_k=-5), id="top_k-negative"),
    pytest.param("POST", COMP, comp(min_tokens=100, max_tokens=2), id="min_tokens-above-max"),
    # --- n -------------------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(n=0), id="n-zero"),
    pytest.param("POST", CHAT, chat(n=100), id="n-100"),
    pytest.param("POST", CHAT, chat(n="x"), id="n-string"),
    # --- stop ----------------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(stop=7), id="stop-number"),
    pytest.param("POST", CHAT, chat(stop=[1, 2]), id="stop-list-of-numbers"),
    pytest.param("POST", CHAT, chat(stop=["ok", None]), id="stop-list-with-null"),
    pytest.param("POST", CHAT, chat(stop=""), id="stop-empty-string"),
    pytest.param("POST", COMP, comp(stop_token_ids=[-1]), id="stop_token_ids-negative"),
    # --- seed ----------------------------------------------------------------------------
    pytest.param("POST", CHAT, chat(seed=1.5), id="seed-float"),
    pytest.param("POST", CHAT, chat(seed="x"), id="seed-string"),
    pytest.param("POST", CHAT, chat(seed=2**64), id="seed-above-uint64"),
    pytest.param("POST", COMP, comp(seed=-(2**64)), id="completion-seed-below-int64"),
    # --- logprobs / stream ---------------------------------------------------------------
    pytest.param("POST", CHAT, chat(logprobs=True, top_logprobs=99), id="top_logprobs-99"),
    pytest.param("POST", CHAT, chat(logprobs=True, top_logprobs=-1), id="top_logprobs-negative"),
    pytest.param("POST", CHAT, chat(logprobs="x"), id="logprobs-string"),
    pytest.param("POST", COMP, comp(logprobs=99), id="completion-logprobs-99"),
    pytest.param("POST", CHAT, chat(stream="maybe"), id="stream-string"),
    pytest.param("POST", CHAT, chat(stream="yes"), id="stream-string-yes"),
    pytest.param("POST", CHAT, chat(stream=True, stream_options="x"), id="stream_options-string"),
    # --- completion prompts --------------------------------------------------------------
    pytest.param("POST", COMP, comp(prompt=[999_999]), id="token-id-out-of-vocab"),
    pytest.param("POST", COMP, comp(prompt=[5, -1]), id="token-id-negative"),
    pytest.param("POST", COMP, comp(prompt=[2**70]), id="token-id-huge"),
    pytest.param("POST", COMP, comp(prompt=[1.5, 2.5]), id="token-id-float"),
    pytest.param("POST", COMP, comp(prompt=["a", "b"]), id="token-id-strings"),
    pytest.param("POST", COMP, comp(prompt=[]), id="token-ids-empty"),
    pytest.param("POST", COMP, comp(prompt=""), id="prompt-empty-string"),
    pytest.param("POST", COMP, comp(prompt=5), id="prompt-number"),
    pytest.param("POST", COMP, comp(prompt=None), id="prompt-null"),
    pytest.param("POST", COMP, comp(prompt="word " * 5000), id="prompt-beyond-context"),
    pytest.param("POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 5000}]), id="chat-beyond-context"),
    # --- transport: content type, size, methods, routes, auth ----------------------------
    pytest.param("POST", CHAT, (json.dumps(chat()).encode(), {"Content-Type": "text/plain"}), id="content-type-text"),
    pytest.param("POST", CHAT, (b"model=tiny&prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
                 id="content-type-form"),
    pytest.param("POST", CHAT, (json.dumps(chat()).encode(), {"Content-Type": "application/xml"}), id="content-type-xml"),
    pytest.param("POST", CHAT, json.dumps(chat(user="x" * (20 * 2**20))).encode(), id="body-20MB"),
    pytest.param("GET", CHAT, None, id="get-chat"),
    pytest.param("GET", COMP, None, id="get-completions"),
    pytest.param("PUT", CHAT, chat(), id="put-chat"),
    pytest.param("POST", "/v1/models", {}, id="post-models"),
    pytest.param("DELETE", "/health", None, id="delete-health"),
    pytest.param("POST", "/v1/nope", chat(), id="unknown-route-post"),
    pytest.param("GET", "/v2/models", None, id="unknown-route-get"),
    pytest.param("POST", CHAT, (json.dumps(chat()).encode(), {"Authorization": "Bearer wrong"}), id="wrong-api-key"),
    pytest.param("POST", COMP, (json.dumps(comp()).encode(), {"Authorization": ""}), id="missing-api-key"),
]


@pytest.mark.parametrize("method, path, body", CASES)
def test_hostile_request_is_openai_4xx(http, method, path, body):
    headers = None
    if isinstance(body, tuple):
        body, headers = body
    assert_openai_error(send(http, method, path, body, headers))


@pytest.mark.parametrize("body", [
    pytest.param(chat(messages=[{"role": "user", "content": ""}]), id="empty-content"),
    pytest.param(chat(messages=[{"role": "user", "content": None}]), id="null-content"),
    pytest.param(chat(messages=[{"role": "user"}]), id="no-content-key"),
    pytest.param(chat(messages=[{"role": "user", "content": []}]), id="empty-content-parts"),
])
def test_degenerate_but_arguably_valid_is_never_5xx(http, body):
    """The chat template renders these as an empty turn: a 200 is fine, so is a 400."""
    r = send(http, "POST", CHAT, body)
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert_openai_error(r)
    else:
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_server_survives_hostile_suite(http):
    """Runs last in this module: the server is healthy and still serves a normal request."""
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json=chat(max_tokens=4, temperature=0))
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    r = http.post(COMP, json=comp(max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
