"""Hostile input against the real omni server (tiny Qwen2.5-Omni): media parts, speech-out
options, /v1/audio/speech and /v1/audio/transcriptions. Each case is a 4xx in OpenAI's error
JSON (never a 5xx, never a silent 2xx), and /health is 200 after each case and at the end.
Requests go through httpx with raw JSON / bytes / multipart (the openai SDK refuses most of
these), a few through the SDK. Media are built in memory; the server's body limit is 4 MiB."""

from __future__ import annotations

import base64
import io
import struct

import httpx
import numpy as np
import openai
import pytest

from server_helpers import Req, png_claiming, send

CHAT, SPEECH, TRANSCRIBE = "/v1/chat/completions", "/v1/audio/speech", "/v1/audio/transcriptions"
BODY_LIMIT_MB = 4
DEEP = 10_000


# ---- media, built in memory ------------------------------------------------------------------

def wav(seconds: float = 0.5, rate: int = 16000, subtype: str = "PCM_16") -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def lying_wav(**fields: int) -> bytes:
    """A 0.5 s PCM16 WAV with fields of its canonical 44-byte header overwritten."""
    data = bytearray(wav())
    where = {"riff_size": (4, "<I"), "fmt_size": (16, "<I"), "channels": (22, "<H"), "rate": (24, "<I"),
             "block_align": (32, "<H"), "bits": (34, "<H"), "data_size": (40, "<I")}   # (offset, struct)
    for name, value in fields.items():
        struct.pack_into(where[name][1], data, where[name][0], value)
    return bytes(data)


def png(width: int = 40, height: int = 30) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def gif_claiming(width: int, height: int) -> bytes:
    """GIF89a whose screen and only frame declare `width` x `height` over a few LZW bytes."""
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b","
            + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x4c\x01\x00;")


def mpegts_video() -> bytes:
    """A real 4-frame MPEG-TS / MPEG-2 video: decodable, but not a container the server takes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as out:
        stream = out.add_stream("mpeg2video", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 60 * i, np.uint8), format="rgb24")))
        out.mux(stream.encode(None))
    return buf.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{b64(raw)}"


GARBAGE = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
# 301 s: one second over the processor's 300 s cap; 8-bit at 4 kHz keeps it 1.2 MB (1.6 MB base64).
LONG_WAV = wav(301, rate=4000, subtype="PCM_U8")


def chat(**over) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **over}


def parts(*content, **over) -> dict:
    return chat(messages=[{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]}], **over)


def au(data, fmt="wav") -> dict:
    """A chat with an input_audio part; bytes are base64-encoded, a str is sent as is."""
    data = b64(data) if isinstance(data, bytes) else data
    return parts({"type": "input_audio", "input_audio": {"data": data, "format": fmt}})


def img(url, mime: str = "image/png") -> dict:
    """A chat with an image_url part; bytes become a base64 data: URL of `mime`."""
    return parts({"type": "image_url", "image_url": {"url": url if isinstance(url, str) else data_url(mime, url)}})


def vid(url, mime: str = "video/mp4") -> dict:
    return parts({"type": "video_url", "video_url": {"url": url if isinstance(url, str) else data_url(mime, url)}})


def speaking(**over) -> dict:
    return chat(**{"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}, **over})


def speech(**over) -> dict:
    return {"model": "tiny", "input": "Hello.", "voice": "Ethan", **over}


def form(file: tuple | None = ("a.wav", wav(), "audio/wav"), model="tiny", **fields) -> Req:
    """A multipart transcription request; None leaves the file or the model out."""
    model_field = {} if model is None else {"model": model}
    return Req(TRANSCRIBE, files={"file": file} if file is not None else {}, data={**model_field, **fields})


def deep(prefix: bytes, suffix: bytes = b"}") -> bytes:
    return prefix + b"[" * DEEP + b"]" * DEEP + suffix


@pytest.fixture(scope="module")
def http(start_server, tiny_omni, api_key):
    with (start_server(tiny_omni, "--linear-kernel", "matmul", "--max-body-mb", str(BODY_LIMIT_MB)) as running,
          httpx.Client(base_url=running.base, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as c):
        yield c


@pytest.fixture(scope="module")
def sdk(http, api_key):
    return openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=60)


def assert_openai_error(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, f"status {r.status_code}: {r.text[:300]}"
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10 and err["type"], err
    return err


# ---- cases (P = pytest.param) ---------------------------------------------------------------

P = pytest.param
MEDIA_CASES = [
    P(au("!!!not base64!!!"), id="audio-bad-base64"),
    P(au(GARBAGE), id="audio-base64-of-garbage"),
    P(au(wav()[:20]), id="audio-truncated-wav-header"),
    P(au(lying_wav(fmt_size=0xFFFFFFF0)), id="audio-wav-fmt-chunk-claims-4GB"),
    P(au(lying_wav(fmt_size=8)), id="audio-wav-fmt-chunk-too-short"),
    P(au(lying_wav(channels=65535)), id="audio-wav-65535-channels"),
    P(au(lying_wav(channels=0)), id="audio-wav-zero-channels"),
    P(au(lying_wav(rate=0)), id="audio-wav-zero-rate"),
    P(au(""), id="audio-empty-data"),
    P(au(wav(0)), id="audio-wav-zero-frames"),
    P(au(LONG_WAV), id="audio-301s-over-limit"),
    P(au(wav(), "xyz"), id="audio-unknown-format"),
    P(au(wav(), 5), id="audio-format-number"),
    P(au(data_url("audio/wav", wav())), id="audio-data-url-instead-of-base64"),
    P(parts({"type": "audio_url", "audio_url": {"url": data_url("image/png", png())}}), id="audio-url-wrong-mime-png"),
    P(parts({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}), id="audio-url-remote"),
    P(parts({"type": "audio", "audio": "AAAA"}), id="audio-raw-not-data-url"),
    P(parts({"type": "input_audio"}), id="audio-missing-payload"),
    P(parts({"type": "input_audio", "input_audio": 5}), id="audio-payload-number"),
    P(parts({"type": "input_audio", "input_audio": [b64(wav())]}), id="audio-payload-list"),
    P(parts({"type": "input_audio", "input_audio": {"data": {"data": b64(wav())}}}), id="audio-data-nested-dict"),
    P(img(png_claiming(100_000, 100_000)), id="image-png-claims-100000x100000"),
    P(img(png()[:60]), id="image-truncated-png"),
    P(img(gif_claiming(65535, 65535), "image/gif"), id="image-gif-bomb"),
    P(img(gif_claiming(4000, 4000), "image/gif"), id="image-gif-4000x4000-from-4-bytes"),
    P(img(png_claiming(0, 10)), id="image-png-zero-width"),
    P(img(png(1000, 2)), id="image-aspect-500"),
    P(img(SVG, "image/svg+xml"), id="image-svg"),
    P(img(b"I am definitely a PNG"), id="image-text-as-png"),
    P(img(wav(), "audio/wav"), id="image-url-wrong-mime-wav"),
    P(img("data:image/png,hello%20world"), id="image-non-base64-data-url"),
    P(img("data:image/png;base64,!!!!"), id="image-invalid-base64"),
    P(img("data:image/png;base64"), id="image-data-url-no-comma"),
    P(img("data:png;base64," + b64(png())), id="image-data-url-bad-mime"),
    P(img("http://example.com/cat.png"), id="image-remote-http"),
    P(img("file:///etc/passwd"), id="image-file-url"),
    P(img("/etc/passwd"), id="image-bare-path"),
    P(parts({"type": "image_url"}), id="image-missing-payload"),
    P(parts({"type": "image_url", "image_url": 5}), id="image-payload-number"),
    P(parts({"type": "image_url", "image_url": [data_url("image/png", png())]}), id="image-payload-list"),
    P(parts({"type": "image_url", "image_url": {"url": {"url": data_url("image/png", png())}}}), id="image-nested-dict"),
    P(vid(GARBAGE), id="video-garbage"),
    P(vid(b"\0\0\0\x18ftypmp42" + GARBAGE), id="video-mp4-magic-then-garbage"),
    P(vid(mpegts_video(), "video/mp2t"), id="video-mpegts-container"),
    P(vid(wav()), id="video-wav-as-video"),
    P(vid(b""), id="video-empty"),
    P(vid("https://example.com/v.mp4"), id="video-remote"),
    P(parts({"type": "video_url"}), id="video-missing-payload"),
    P(parts({"type": "video", "video": 5}), id="video-raw-number"),
    P(parts({"type": "hologram", "hologram": {"url": "data:x/y;base64,AAAA"}}), id="part-unknown-type"),
    P(parts({"image_url": {"url": data_url("image/png", png())}}), id="part-without-type"),
    P(parts({"type": 5}), id="part-type-number"),
    P(parts({"type": "text"}), id="text-part-missing-text"),
    P(parts({"type": "text", "text": 5}), id="text-part-number"),
    P(parts({"type": "text", "text": {"nested": "dict"}}), id="text-part-dict"),
]

OUTPUT_CASES = [
    P(chat(modalities=["text", "smell"]), id="modalities-unknown-value"),
    P(chat(modalities=["audio"], audio={"voice": "Chelsie", "format": "wav"}), id="modalities-audio-without-text"),
    P(chat(modalities="audio"), id="modalities-string"),
    P(speaking(audio={"voice": "Chelsie", "format": "ogg"}), id="audio-format-unknown"),
    P(speaking(audio="wav"), id="audio-param-string"),
    P(chat(audio={"voice": "Chelsie", "format": "wav"}), id="audio-param-without-modality"),
    P(speaking(stream=True, audio={"voice": "Chelsie", "format": "mp3"}), id="stream-audio-mp3"),
    P(speaking(audio={"voice": "Nobody", "format": "wav"}), id="voice-unknown"),
    P(speaking(audio={"voice": 5, "format": "wav"}), id="voice-number"),
    P(speaking(talker={"max_tokens": -1}), id="talker-max_tokens-negative"),
    P(speaking(talker={"temperature": 5}), id="talker-temperature-5"),
    P(speaking(talker={"beam_width": 4}), id="talker-unknown-field"),
    P(speaking(talker="fast"), id="talker-string"),
    P(chat(talker={"temperature": 0.5}), id="talker-without-audio-output"),
    P(chat(use_audio_in_video="true"), id="use_audio_in_video-string"),
    P(chat(n=2), id="n-2-omni"),
    P(speaking(n=2), id="n-2-omni-speaking"),
    P(chat(model="gpt-4o-audio-preview"), id="chat-wrong-model"),
    P(Req(CHAT, content=deep(b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"modalities": ["text", "audio"], "talker": ')), id="talker-deep-json"),
    P(Req(CHAT, content=deep(b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": '
                             b'"image_url", "image_url": ', b"}]}]}")), id="image-url-deep-json"),
    P(Req(CHAT, content=b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "input_audio", '
                        b'"input_audio": {"data": "\xff\xfe", "format": "wav"}}]}]}'), id="audio-data-invalid-utf8"),
    P(au("A" * (BODY_LIMIT_MB + 1) * 2**20), id="chat-audio-over-body-limit"),
]

SPEECH_CASES = [
    P(speech(input=""), id="speech-empty-input"),
    P(speech(input="x" * 5000), id="speech-5000-chars"),
    P({"model": "tiny", "voice": "Ethan"}, id="speech-missing-input"),
    P(speech(input=["Hello."]), id="speech-input-list"),
    P(speech(response_format="ogg"), id="speech-unknown-response_format"),
    P(speech(speed=0), id="speech-speed-0"),
    P(speech(speed=10), id="speech-speed-10"),
    P(Req(SPEECH, content=b'{"model": "tiny", "input": "Hi.", "speed": NaN}'), id="speech-speed-nan"),
    P(speech(stream_format="websocket"), id="speech-unknown-stream_format"),
    P(speech(stream_format="sse", speed=2), id="speech-sse-with-speed"),
    P(speech(voice="Nobody"), id="speech-voice-unknown"),
    P(speech(voice={"name": "Ethan"}), id="speech-voice-dict"),
    P(speech(instructions="x" * 5000), id="speech-instructions-5000-chars"),
    P(speech(model="tts-1"), id="speech-wrong-model"),
    P({"input": "Hello."}, id="speech-missing-model"),
    P(Req(SPEECH, content=b'{"model": "tiny", "input": "\xff\xfe\xc3 hi"}'), id="speech-invalid-utf8"),
    P(Req(SPEECH, content=rb'{"model": "tiny", "input": "a\ud800b"}'), id="speech-lone-surrogate"),
    P(Req(SPEECH, content=deep(b'{"model": "tiny", "input": "hi", "extra": ')), id="speech-deep-json"),
    P(Req(SPEECH, content=deep(b'{"model": "tiny", "input": ')), id="speech-deep-input"),
    P(Req(SPEECH, content=b"[]"), id="speech-json-list"),
    P(Req(SPEECH, content=b"model=tiny&input=hi", headers={"Content-Type": "application/x-www-form-urlencoded"}),
      id="speech-form-body"),
    P(speech(input="x" * (BODY_LIMIT_MB + 1) * 2**20), id="speech-over-body-limit"),
]

TRANSCRIBE_CASES = [
    P(form(file=None), id="transcribe-missing-file"),
    P(form(file=("a.wav", b"", "audio/wav")), id="transcribe-empty-file"),
    P(form(file=("a.wav", GARBAGE, "audio/wav")), id="transcribe-garbage-file"),
    P(form(file=("a.wav", wav()[:30], "audio/wav")), id="transcribe-truncated-wav"),
    P(form(file=("a.png", png(), "image/png")), id="transcribe-png-file"),
    P(form(file=("a.ts", mpegts_video(), "video/mp2t")), id="transcribe-video-without-audio"),
    P(form(file=("a.wav", LONG_WAV, "audio/wav")), id="transcribe-301s-over-limit"),
    P(form(response_format="srt"), id="transcribe-unknown-response_format"),
    P(form(temperature="5"), id="transcribe-temperature-5"),
    P(form(temperature="hot"), id="transcribe-temperature-string"),
    P(form(model="whisper-1"), id="transcribe-wrong-model"),
    P(form(model=None), id="transcribe-missing-model"),
    P(form(model=b"\xff\xfe"), id="transcribe-model-invalid-utf8"),
    P(Req(TRANSCRIBE, json={"model": "tiny", "file": b64(wav())}), id="transcribe-json-body"),
    P(Req(TRANSCRIBE, content=deep(b'{"model": "tiny", "file": ')), id="transcribe-deep-json"),
    P(Req(TRANSCRIBE, content=b"\xff\xfe\xc3 not utf8", headers={"Content-Type": "multipart/form-data; boundary=xyz"}),
      id="transcribe-broken-multipart"),
    P(form(file=("a.wav", b"\0" * (BODY_LIMIT_MB + 1) * 2**20, "audio/wav")), id="transcribe-over-body-limit"),
]

# Header lies decoders tolerate by design (streamed WAVs carry 0xFFFFFFFF sizes, the server's own
# too), and odd but usable inputs: 200 or 4xx are fine, a 5xx is not.
TOLERATED_CASES = [
    P(au(lying_wav(data_size=0x7FFFFFF0)), id="wav-data-size-claims-2GB"),
    P(au(lying_wav(riff_size=0xFFFFFFFF, data_size=0xFFFFFFFF)), id="wav-streamed-sizes"),
    P(au(lying_wav(bits=3, block_align=0)), id="wav-bits-3"),
    P(au(wav(), "mp3"), id="wav-bytes-labelled-mp3"),
    P(img(png(), "text/plain"), id="png-labelled-text-plain"),
    P(img(png(1, 1)), id="image-1x1"),
    P(chat(modalities=[]), id="modalities-empty"),
]


def on(path: str, cases: list) -> list:   # the cases as Reqs; a plain dict is a JSON body for `path`
    return [P(c.values[0] if isinstance(c.values[0], Req) else Req(path, json=c.values[0]), id=c.id, marks=c.marks)
            for c in cases]


@pytest.mark.parametrize("req", on(CHAT, MEDIA_CASES) + on(CHAT, OUTPUT_CASES) + on(SPEECH, SPEECH_CASES)
                         + TRANSCRIBE_CASES)
def test_hostile_request_is_openai_4xx(http, req):
    """And /health is 200 after every case, so a case that breaks the server is named."""
    r = send(http, req)
    assert http.get("/health").status_code == 200, f"unhealthy after: {r.status_code} {r.text[:300]}"
    assert_openai_error(r)


def test_speech_chunked_body_over_limit(http):
    """No Content-Length: the limit is enforced while the body streams in."""
    chunks = (b"x" * 2**20 for _ in range(BODY_LIMIT_MB + 2))
    r = http.post(SPEECH, content=chunks, headers={"Content-Type": "application/json", "Connection": "close"})
    assert r.status_code == 413 and assert_openai_error(r)


def test_transcription_error_names_the_file(http):
    err = assert_openai_error(send(http, form(file=("a.wav", GARBAGE, "audio/wav"))))
    assert err["param"] == "file" and "messages[" not in err["message"], err


@pytest.mark.parametrize("call", [
    P(lambda c: c.audio.speech.create(model="tiny", input="", voice="Ethan"), id="sdk-speech-empty"),
    P(lambda c: c.audio.speech.create(model="tiny", input="Hi.", voice="Ethan", speed=10), id="sdk-speed-10"),
    P(lambda c: c.audio.speech.create(model="tiny", input="Hi.", voice="Nobody"), id="sdk-voice-unknown"),
    P(lambda c: c.audio.transcriptions.create(model="tiny", file=("a.wav", b"", "audio/wav")), id="sdk-transcribe-empty"),
    P(lambda c: c.audio.transcriptions.create(model="tiny", file=("a.mp3", GARBAGE, "audio/mpeg")), id="sdk-garbage"),
    P(lambda c: c.chat.completions.create(**au("%%%")), id="sdk-chat-bad-base64"),
    P(lambda c: c.chat.completions.create(**speaking(n=2)), id="sdk-chat-n-2"),
])
def test_sdk_gets_bad_request(sdk, call):
    with pytest.raises(openai.BadRequestError) as info:
        call(sdk)
    assert_openai_error(info.value.response)


@pytest.mark.parametrize("req", on(CHAT, TOLERATED_CASES))
def test_tolerated_input_is_never_5xx(http, req):
    r = send(http, req)
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert_openai_error(r)
    else:
        assert r.json()["object"] == "chat.completion"


def test_server_survives_omni_hostile_suite(http):
    """Runs last in this module: healthy, and still answers audio in, speech out and speech."""
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={**au(wav()), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text[:300]
    r = http.post(CHAT, json=speaking(max_tokens=3, temperature=0, talker={"max_tokens": 8, "min_tokens": 4}))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["audio"]["data"], r.text[:300]
    r = http.post(SPEECH, json=speech(response_format="wav"))
    assert r.status_code == 200 and r.content[:4] == b"RIFF"
    r = http.post(TRANSCRIBE, files={"file": ("a.wav", wav(), "audio/wav")}, data={"model": "tiny"})
    assert r.status_code == 200 and isinstance(r.json()["text"], str)
