"""The cascade (pocketsphinx -> tiny text model -> flite) behind the real server, driven by the
openai SDK on the same routes as the omni models: chat with a spoken question and a spoken
answer, /v1/audio/speech heard back, /v1/audio/transcriptions, a Realtime voice turn."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from omnistage.media.audio import decode_audio, resample
from omnistage.models.cascade.speech_tools import FliteTTS, PocketsphinxASR
from tests.models.cascade.test_cascade import QUESTION, wav_bytes, wer
from tests.server.test_realtime_server import _until


@pytest.fixture(scope="module")
def question() -> tuple[np.ndarray, int]:
    said = FliteTTS().speak(QUESTION, "slt")
    return said.samples, said.sample_rate


@pytest.fixture(scope="module")
def cascade_server(tiny_qwen2, start_server):
    with start_server(f"cascade:pocketsphinx+{tiny_qwen2}+flite") as running:
        yield running.base


@pytest.fixture(scope="module")
def client(cascade_server, api_key):
    return openai.OpenAI(base_url=f"{cascade_server}/v1", api_key=api_key, max_retries=0, timeout=120)


def test_spoken_question_spoken_answer(client, question, tiny_qwen2):
    from omnistage.layers.checkpoint import load_tokenizer

    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(*question)).decode(),
                                                    "format": "wav"}}
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [audio]}], max_tokens=12, temperature=0,
        modalities=["text", "audio"], audio={"voice": "slt", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.audio.transcript == msg.content and msg.content
    wav = decode_audio(base64.b64decode(msg.audio.data), sample_rate=24000)
    assert wav.duration > 0.2
    # the LLM read what the ASR heard: the prompt is the chat with the transcript as its text
    tok = load_tokenizer(tiny_qwen2)
    want = tok.apply_chat_template([{"role": "user", "content": "i would like a cup of coffee"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert resp.usage.prompt_tokens == len(want)


def test_speech_is_heard_back(client):
    data = client.audio.speech.create(model="tiny", voice="rms", input="Here is your coffee. Please enjoy it!",
                                      response_format="wav").read()
    wav = decode_audio(data, sample_rate=16000)
    assert wer("Here is your coffee. Please enjoy it!", PocketsphinxASR().recognize(wav.samples)) <= 0.3
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tiny", voice="nova-unknown", input="Hi.", response_format="wav")
    assert e.value.body["param"] == "voice"


def test_transcription_is_what_the_asr_heard(client, question):
    resp = client.audio.transcriptions.create(model="tiny", file=("q.wav", wav_bytes(*question), "audio/wav"))
    assert wer(QUESTION, resp.text) <= 0.3, resp.text


def test_realtime_voice_turn(client, question):
    samples, rate = question
    pcm = (np.clip(resample(samples, rate, 24000), -1, 1) * 32767).astype("<i2").tobytes()
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "max_output_tokens": 8, "audio": {"input": {
            "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
        _until(conn, "session.updated")
        for i in range(0, len(pcm), 4800):                      # 100 ms appends
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 4800]).decode())
        conn.input_audio_buffer.commit()
        conn.response.create()
        events = _until(conn, "response.done")
        events += [] if any(e.type == "conversation.item.input_audio_transcription.completed" for e in events) \
            else _until(conn, "conversation.item.input_audio_transcription.completed")
    done = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert wer(QUESTION, done.transcript) <= 0.3, done.transcript
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert len(audio) > 0
    assert events[[e.type for e in events].index("response.done")].response.status in ("completed", "incomplete")
