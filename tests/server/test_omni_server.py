"""The real server with a tiny Qwen2.5-Omni on loopback, driven by the openai SDK: chat with
audio in and out (whole and streamed, equal to the offline API's waveform for the same seed),
image in, speech in every format, transcriptions."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

from omnistage import Omni, SamplingParams
from omnistage.engine_api import OutputOptions
from tests.server.conftest import scrape_metrics

from server_helpers import cut_off_streams


@pytest.fixture(scope="module", params=["local", "process"])
def omni_server(request, tiny_omni, tmp_path_factory, place_omni_server):
    """This suite runs twice: every stage in the server's process, then each stage in its own
    process (the deploy config): the API must not tell them apart."""
    with place_omni_server(tiny_omni, request.param, tmp_path_factory.mktemp("deploy")) as base:
        yield base


# Every field given: the server merges them over the model's talker defaults.
TALKER = {"temperature": 0, "max_tokens": 40, "min_tokens": 30, "seed": 9, "repetition_penalty": 1.05,
          "top_k": -1, "top_p": 1.0}
MESSAGES = [{"role": "user", "content": "Say hello to the sea."}]


@pytest.fixture(scope="module")
def client(omni_server, api_key):
    return openai.OpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_omni):
    return Omni(tiny_omni, block_size=4, linear_kernel="matmul")


def _offline_speech(offline, max_tokens=6):
    [out] = offline.generate(MESSAGES, SamplingParams(temperature=0, max_tokens=max_tokens),
                             output=OutputOptions(talker_params=SamplingParams(
                                 **TALKER, suppress_token_ids=[offline.engine.codec_bos])))
    return out


def _pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def test_chat_audio_out_whole_equals_offline(client, offline):
    import soundfile as sf

    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"}, extra_body={"talker": TALKER})
    want = _offline_speech(offline)
    msg = resp.choices[0].message
    assert msg.content == want.text and msg.audio.transcript == want.text
    assert msg.audio.id.startswith("audio_") and msg.audio.expires_at > 0
    wav, rate = sf.read(io.BytesIO(base64.b64decode(msg.audio.data)), dtype="float32")
    assert rate == want.sample_rate == 24000 and wav.shape == want.audio.shape
    np.testing.assert_allclose(wav, want.audio, atol=1.5 / 32768)   # 16-bit rounding


def test_chat_audio_out_streamed_equals_offline(client, offline):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"}, stream=True,
        stream_options={"include_usage": True}, extra_body={"talker": TALKER})
    text, transcript, pcm, chunks, usage = "", "", b"", 0, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            audio = choice.delta.audio
            if audio:
                transcript += audio.transcript or ""
                if audio.data:
                    pcm += base64.b64decode(audio.data)
                    chunks += 1
    want = _offline_speech(offline)
    assert text == want.text == transcript
    assert chunks >= 1 and usage is not None and usage.completion_tokens == 6
    np.testing.assert_allclose(_pcm16(pcm), want.audio, atol=1.5 / 32768)


def test_streamed_audio_needs_pcm16(client):
    with pytest.raises(openai.BadRequestError, match="pcm16"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "mp3"}, stream=True)


def test_unknown_voice_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                       modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"})


def _wav_b64(seconds=0.6) -> str:
    import soundfile as sf

    t = np.arange(int(seconds * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def _png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("part", ["audio", "image"])
def test_media_in_equals_offline(client, offline, part):
    content = [{"type": "input_audio", "input_audio": {"data": _wav_b64(), "format": "wav"}}
               if part == "audio" else {"type": "image_url", "image_url": {"url": _png_data_url()}},
               {"type": "text", "text": "What is this?"}]
    messages = [{"role": "user", "content": content}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    [want] = offline.generate(messages, SamplingParams(temperature=0, max_tokens=5),
                              output=OutputOptions(modalities=["text"]))
    assert resp.choices[0].message.content == want.text


def test_remote_media_urls_are_refused_by_default(client):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="allowed-media-domains"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
def test_speech_every_format_decodes(client, fmt):
    import av

    resp = client.audio.speech.create(model="tiny", input="Hello there, sea.", voice="Ethan",
                                      response_format=fmt)
    data = resp.read()
    if fmt == "pcm":
        samples = _pcm16(data)
    else:
        with av.open(io.BytesIO(data)) as f:
            samples = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)])
    assert samples.size > 2400 and np.isfinite(samples).all()


def test_speech_streamed_sse(omni_server, api_key):
    import httpx

    with httpx.stream("POST", f"{omni_server}/v1/audio/speech", timeout=120,
                      headers={"Authorization": f"Bearer {api_key}"},
                      json={"model": "tiny", "input": "Hi.", "stream_format": "sse"}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"speech.audio.done"' in events[-1] and len(events) >= 2


def test_transcription(client):
    wav = base64.b64decode(_wav_b64(1.0))
    resp = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav, "audio/wav"))
    assert isinstance(resp.text, str) and resp.text
    verbose = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav, "audio/wav"),
                                                 response_format="verbose_json")
    assert verbose.duration == pytest.approx(1.0, abs=0.01) and verbose.text
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="tiny", file=("a.wav", b"not audio", "audio/wav"))
    assert e.value.body["param"] == "file"


def test_health_and_metrics(omni_server, api_key):
    import httpx

    h = {"Authorization": f"Bearer {api_key}"}
    assert httpx.get(f"{omni_server}/health", headers=h).status_code == 200
    text = httpx.get(f"{omni_server}/metrics", headers=h).text
    assert 'omnistage_stage_requests{stage="talker"}' in text
    assert "omnistage_time_to_first_audio_seconds_count" in text


CUT_OFF_STREAMS = 200


def test_cut_off_speech_streams_free_every_stage(omni_server, api_key):
    import time


    auth = {"Authorization": f"Bearer {api_key}"}
    before = scrape_metrics(omni_server, api_key)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True,
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
            "talker": {"max_tokens": 2000, "min_tokens": 2000}}

    cut_off_streams(omni_server, auth, body, CUT_OFF_STREAMS, lines_cycle=9, timeout_s=240)
    deadline = time.monotonic() + 15
    while True:
        m = scrape_metrics(omni_server, api_key)
        held = sum(v for k, v in m.items() if k.startswith("omnistage_stage_requests"))
        # KV pools of the stages in the server's process (a stage in its own process reports
        # the requests it holds, not its pool)
        pools = [s for s in ("thinker", "talker") if f'omnistage_kv_blocks_free{{stage="{s}"}}' in m]
        free = all(m[f'omnistage_kv_blocks_free{{stage="{s}"}}'] == m[f'omnistage_kv_blocks_total{{stage="{s}"}}']
                   for s in pools)
        if held == 0 and free and m["omnistage_requests_in_engine"] == 0:
            break
        assert time.monotonic() < deadline, f"still held after the clients left: {held} requests"
        time.sleep(0.05)
    aborted = m["omnistage_requests_aborted_total"] - before["omnistage_requests_aborted_total"]
    assert aborted >= CUT_OFF_STREAMS - 10


def test_async_client_streams_speech(omni_server, api_key, offline):
    import asyncio

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{omni_server}/v1", api_key=api_key, max_retries=0, timeout=120)
        pcm = b""
        stream = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, modalities=["text", "audio"],
            audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, extra_body={"talker": TALKER})
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.audio and choice.delta.audio.data:
                    pcm += base64.b64decode(choice.delta.audio.data)
        await client.close()
        return pcm

    pcm = asyncio.run(main())
    np.testing.assert_allclose(_pcm16(pcm), _offline_speech(offline).audio, atol=1.5 / 32768)


def test_text_routes_on_the_omni_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    lp = chat.choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 2 for t in lp)
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    streamed = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert done.usage.completion_tokens == 5


def test_a_client_gone_before_the_first_byte_aborts_its_request(omni_server, api_key):
    """A client that sends a streamed request and leaves before any byte came back: the
    request is aborted, not left to run its 2000 speech tokens for nobody (the response ended
    before its body ever started: server/streams.py)."""
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    before = scrape_metrics(omni_server, api_key)["omnistage_requests_aborted_total"]
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
                       "talker": {"max_tokens": 2000, "min_tokens": 2000}}).encode()
    url = urlsplit(omni_server)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30       # the request itself would take far longer
    while True:
        m = scrape_metrics(omni_server, api_key)
        if m["omnistage_requests_aborted_total"] > before and m["omnistage_requests_in_engine"] == 0:
            break
        assert time.monotonic() < deadline, "the request of a client that left is still running"
        time.sleep(0.05)
