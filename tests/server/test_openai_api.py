"""The real server on loopback, driven by the real openai SDK (sync and async)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from omnistage import Omni, SamplingParams
from tests.server.conftest import metric

from server_helpers import cut_off_streams


@pytest.fixture(scope="module")
def client(server, api_key):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_qwen2):
    return Omni(tiny_qwen2, block_size=4)


MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def test_chat_matches_offline_api(client, offline):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    want = offline.generate(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_chat_equals_whole(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8, seed=5,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_n_and_logprobs(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=3,
                                          temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)


def test_neutral_values_of_unserved_fields_are_taken(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=[],
                                         tool_choice="none", response_format={"type": "text"})
    assert out.choices[0].message.content is not None


def test_completions_and_models(client):
    resp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_async_client_concurrent_streams(server, api_key):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=api_key, max_retries=0)

        async def one(i):
            stream = await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"story {i}"}], max_tokens=8,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 60)
        again = await asyncio.wait_for(one(3), 60)
        await aclient.close()
        return texts, again

    texts, again = asyncio.run(main())
    assert texts[3] == again


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"model": "nope"}, "model"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    # OpenAI fields not served are refused, never silently dropped (tools: test_tool_calls.py)
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
])
def test_bad_requests_are_400(client, kwargs, param):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_auth_and_errors_in_openai_shape(server, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{server}/v1/nothing", headers={**auth, "X-Request-Id": "abc123"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "abc123"
    assert httpx.get(f"{server}/health", headers=auth).status_code == 200


CUT_OFF_STREAMS = 200


def test_client_disconnect_aborts_and_frees_blocks(server, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    total = metric(server, "omnistage_kv_blocks_total", api_key)
    aborted = metric(server, "omnistage_requests_aborted_total", api_key)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    cut_off_streams(server, auth, body, CUT_OFF_STREAMS, lines_cycle=7, timeout_s=120)
    deadline = time.monotonic() + 10     # bounded wait for the aborts to land
    while (metric(server, "omnistage_requests_in_engine", api_key) != 0
           or metric(server, "omnistage_kv_blocks_free", api_key) != total):
        assert time.monotonic() < deadline, "requests or blocks still held after the clients went away"
        time.sleep(0.05)
    assert metric(server, "omnistage_requests_running", api_key) == 0
    # A client may leave before its request reached the engine (nothing to abort then); none
    # of these 1500-token requests can finish on its own, so nearly all were aborted.
    assert metric(server, "omnistage_requests_aborted_total", api_key) >= aborted + CUT_OFF_STREAMS - 10


def test_oversized_body_is_413(server, api_key):
    auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * (17 * 2**20) + b'"}]}'
    r = httpx.post(f"{server}/v1/chat/completions", content=big, headers=auth, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_queue_bound_gives_429_with_retry_after(tiny_qwen2, api_key, start_server):
    """One seat, no waiting line: while one request holds the seat, the next gets 429.

    The seat is held deterministically: a request counts from its arrival until its response
    ends, and this one's body never comes. Its `Expect: 100-continue` makes the server answer
    "100 Continue" when the app starts reading the body, i.e. after admission took its seat."""
    import socket
    from urllib.parse import urlsplit

    with start_server(tiny_qwen2, "--max-num-seqs", "1", "--max-queued-requests", "0") as running:
        url = urlsplit(running.base)
        client = openai.OpenAI(base_url=f"{running.base}/v1", api_key=api_key, max_retries=0)
        with socket.create_connection((url.hostname, url.port), timeout=30) as held:
            held.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                         f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n".encode())
            assert held.recv(64).startswith(b"HTTP/1.1 100")          # admitted, reading its body
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            assert e.value.response.headers["retry-after"] == "1"
            assert [m.id for m in client.models.list().data] == ["tiny"]   # GETs still served


def test_sigterm_drains_in_flight_then_exits(tiny_qwen2, api_key, start_server):
    import signal

    auth = {"Authorization": f"Bearer {api_key}"}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 600, "stream": True, "ignore_eos": True}
    with start_server(tiny_qwen2, "--shutdown-timeout", "30") as running:
        base = running.base
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            running.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{base}/health", headers=auth).status_code != 503:   # bounded
                assert time.monotonic() < deadline
            late = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False}, headers=auth)
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"          # the in-flight stream finished whole
        # uvicorn re-raises the signal after its graceful shutdown: exit by SIGTERM is clean.
        assert running.proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_chunked_oversized_body_is_413(server, api_key):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(17):
            yield b"a" * 2**20
        yield b'"}]}'

    auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/chat/completions", content=chunks(), headers=auth, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    small = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60,
                       content=iter([b'{"model": "tiny", "messages": [{"role": "user", ',
                                     b'"content": "hi"}], "max_tokens": 2}']))
    assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"] is not None


def test_metrics_record_ttft_latency_and_tokens(server, api_key, client):
    before = metric(server, "omnistage_time_to_first_token_seconds_count", api_key)
    tokens = metric(server, "omnistage_generation_tokens_total", api_key)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert metric(server, "omnistage_time_to_first_token_seconds_count", api_key) == before + 1
    assert metric(server, "omnistage_request_latency_seconds_count", api_key) >= 1
    assert metric(server, "omnistage_generation_tokens_total", api_key) == tokens + 7
