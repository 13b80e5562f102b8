"""The cascade baseline (ASR -> LLM -> TTS as stages) with real offline speech: espeak-ng and
flite speak, pocketsphinx hears, the LLM is our AR engine on a tiny text model (its reply
forced, so the words are known)."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import pytest

from omnistage import Omni
from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.media.audio import resample
from omnistage.models.cascade.speech_tools import EspeakTTS, FliteTTS, MissingSpeechTool, PocketsphinxASR
from omnistage.models.cascade.spec import cascade_folder, parse_spec
from omnistage.models.cascade.tts_stage import next_sentence
from omnistage.sampling_params import SamplingParams

QUESTION = "I would like a cup of coffee."
REPLY = "Here is your coffee. Please enjoy it!"


def words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalnum() or c in " '").split()


def wer(reference: str, heard: str) -> float:
    """Word error rate: word-level edit distance / reference words."""
    ref, hyp = words(reference), words(heard)
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        diag, row[0] = row[0], i
        for j in range(1, len(hyp) + 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (ref[i - 1] != hyp[j - 1]))
    return row[len(hyp)] / len(ref)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module", params=["flite", "espeak"])
def cascade(request, tiny_qwen2):
    omni = Omni(f"cascade:pocketsphinx+{tiny_qwen2}+{request.param}", num_threads=1)
    yield omni
    omni.close()


def forced(omni: Omni, text: str) -> SamplingParams:
    ids = omni.tokenizer.encode(text, add_special_tokens=False) + [omni.engine.abilities.end_of_turn_id]
    return SamplingParams(temperature=0, max_tokens=len(ids), forced_token_ids=ids)


def heard(samples: np.ndarray, rate: int) -> str:
    return PocketsphinxASR().recognize(resample(samples, rate, 16000))


@pytest.mark.parametrize("speaker", ["espeak", "flite"])
def test_real_speech_round_trip(cascade, speaker):
    """A spoken question (espeak-ng's en-us+f2 at 130 words/min, or flite's slt) is heard by
    the cascade's ASR, the reply is spoken sentence by sentence by its TTS (flite or espeak-ng),
    and pocketsphinx hears the reply back. Measured word error rates here: 0.0 for the
    question from either speaker and for the reply from either TTS (other espeak-ng voices are
    heard far worse: en-us 0.5-1.0); the bounds leave two words of seven."""
    said = (EspeakTTS().speak(QUESTION, "en-us+f2") if speaker == "espeak"
            else FliteTTS().speak(QUESTION, "slt"))
    audio = {"type": "input_audio", "input_audio": {"data": _b64(wav_bytes(said.samples, said.sample_rate)),
                                                    "format": "wav"}}
    transcript = cascade.generate([{"role": "user", "content": [audio, {"type": "text", "text": "Transcribe."}]}],
                                  SamplingParams(temperature=0),
                                  output=OutputOptions(modalities=["text"], transcribe=True))[0].text
    assert wer(QUESTION, transcript) <= 0.3, transcript

    deltas = list(cascade.stream([{"role": "user", "content": [audio]}], forced(cascade, REPLY),
                                 OutputOptions(modalities=["text", "audio"])))
    text = "".join(d.text for d in deltas)
    chunks = [d.audio for d in deltas if d.audio is not None and d.audio.size]
    assert text == REPLY
    assert len(chunks) == 2                       # one per sentence, the first before the reply ended
    first_audio = next(i for i, d in enumerate(deltas) if d.audio is not None and d.audio.size)
    assert any(d.text for d in deltas[first_audio:])
    reply = np.concatenate(chunks)
    assert 1.0 < reply.size / 24000 < 6.0
    assert wer(REPLY, heard(reply, 24000)) <= 0.3, heard(reply, 24000)


def test_text_in_text_out_and_voices(cascade):
    out = cascade.generate("Say hi.", forced(cascade, "Hi there."), output=OutputOptions(modalities=["text"]))
    assert out[0].text == "Hi there." and out[0].audio is None
    spoken = cascade.generate("Say hi.", forced(cascade, "Hi there."),
                              output=OutputOptions(modalities=["text", "audio"],
                                                     voice=cascade.engine.abilities.speakers[1]))
    assert spoken[0].audio.size > 0 and spoken[0].sample_rate == 24000
    with pytest.raises(InvalidRequestError, match="unknown voice"):
        cascade.generate("Say hi.", output=OutputOptions(modalities=["text", "audio"], voice="nova"))
    with pytest.raises(InvalidRequestError, match="content part of type 'image_url'"):
        cascade.generate([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_sentences_split_where_speech_can_start():
    assert next_sentence("Hello there. How", False) == ("Hello there. ", "How")
    assert next_sentence("Wait!\" he said", False) == ("Wait!\" ", "he said")
    assert next_sentence("line one\nline two", False) == ("line one\n", "line two")
    assert next_sentence("No end yet", False) is None
    assert next_sentence("No end yet", True) == ("No end yet", "")
    assert next_sentence("3.14 is pi", False) is None          # no space after the point


def test_spec_parsing_and_folder(tmp_path, tiny_qwen2):
    assert parse_spec("cascade:pocketsphinx+tiny:qwen2+espeak") == ("pocketsphinx", "tiny:qwen2", "espeak")
    assert parse_spec("cascade:pocketsphinx+/m/a+b+flite") == ("pocketsphinx", "/m/a+b", "flite")
    for bad, why in [("cascade:pocketsphinx+x", "is not cascade:ASR"), ("cascade:whisper+x+flite", "unknown cascade ASR"),
                     ("cascade:pocketsphinx+x+piper", "unknown cascade TTS")]:
        with pytest.raises(InvalidRequestError, match=why):
            parse_spec(bad)
    folder = cascade_folder(f"cascade:pocketsphinx+{tiny_qwen2}+flite", str)
    assert folder == cascade_folder(f"cascade:pocketsphinx+{tiny_qwen2}+flite", str)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["OmnistageCascade"] and cfg["tts"] == "flite"
    with pytest.raises(InvalidRequestError, match="not a model folder"):
        cascade_folder(f"cascade:pocketsphinx+{tmp_path}+flite", str)


def test_a_missing_program_says_what_to_install():
    class Missing(FliteTTS):
        program, package = "omnistage-no-such-tts", "omnistage-no-such-tts"

    with pytest.raises(MissingSpeechTool, match="apt-get install omnistage-no-such-tts"):
        Missing()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def test_a_turn_is_heard_as_it_arrives():
    """Partial jobs (a Realtime turn's streamed input) feed a listener; the final job hears
    only the rest. Live decoding normalises the signal as it goes (pocketsphinx's live CMN), so
    its words may differ from a decode of the whole utterance at once: here "here is your
    coffee" (live) against "there is your coffee" (whole)."""
    import torch

    from omnistage.models.cascade.asr_stage import ASRStage
    from omnistage.models.cascade.messages import HearJob

    said = FliteTTS().speak(QUESTION + " " + REPLY, "slt")
    audio = resample(said.samples, said.sample_rate, 16000)
    asr = PocketsphinxASR()
    whole = asr.recognize(audio)
    stage = ASRStage("asr", asr, max_listeners=2)
    for end in (16000, 32000, 48000):                       # each second of the turn so far
        stage.add(HearJob(f"warm{end}", [torch.from_numpy(audio[:end].copy())], partial=True))
        [out] = stage.step()
        assert out.payload.texts == [""] and stage.listening == 1
    stage.add(HearJob("turn", [torch.from_numpy(audio.copy())]))
    [out] = stage.step()
    assert stage.listening == 0
    assert wer(QUESTION + " " + REPLY, out.payload.texts[0]) <= 0.2, out.payload.texts
    assert wer(QUESTION + " " + REPLY, whole) <= 0.2, whole
    # another turn's prefix is not this one's: a new listener, and the finished one is free
    stage.add(HearJob("other", [torch.from_numpy(audio[8000:24000].copy())], partial=True))
    stage.step()
    assert stage.listening == 1


def test_a_failing_tts_fails_its_request_only():
    """A TTS program that fails on a sentence ends that request with an error; the stage goes
    on serving the others."""
    from omnistage.models.cascade.messages import SpeakText
    from omnistage.models.cascade.tts_stage import TTSStage
    from omnistage.stage_messages import StageFailure

    class Picky(FliteTTS):
        def speak(self, text, voice):
            if "boom" in text:
                raise RuntimeError("flite failed (1): cannot say boom")
            return super().speak(text, voice)

    stage = TTSStage("tts", Picky(), "slt")
    stage.add(SpeakText("bad", "Say boom.", finished=True))
    stage.add(SpeakText("good", "Say hello.", finished=True))
    outs = stage.step() + stage.step()
    by_id = {o.request_id: o for o in outs}
    assert isinstance(by_id["bad"].payload, StageFailure) and "cannot say boom" in by_id["bad"].payload.message
    assert by_id["good"].payload.samples.numel() > 0 and by_id["good"].final
    assert stage.num_requests() == 0


def test_a_chat_the_template_refuses_is_a_client_error(cascade):
    """Tools that are not JSON schemas: transformers' template rendering refuses them; the
    client gets a 400 naming messages, not a 500."""
    with pytest.raises(InvalidRequestError, match="the chat template refused") as e:
        cascade.generate({"messages": [{"role": "user", "content": "hi"}], "tools": [1]},
                         SamplingParams(max_tokens=2), output=OutputOptions(modalities=["text"]))
    assert e.value.param == "messages"


def test_any_reply_text_is_spoken_or_fails_alone():
    """A model's reply may hold control characters (a NUL cannot be passed to a program): they
    are dropped before speaking; a reply of nothing speakable ends with no audio."""
    from omnistage.models.cascade.messages import SpeakText
    from omnistage.models.cascade.tts_stage import TTSStage, speakable

    assert speakable("Hi\x00 there\x04.\n") == "Hi there."
    stage = TTSStage("tts", FliteTTS(), "slt")
    stage.add(SpeakText("nul", "Hello\x00 world.", finished=True))
    stage.add(SpeakText("empty", "\x00\x07", finished=True))
    outs = {o.request_id: o for o in stage.step() + stage.step()}
    assert outs["nul"].payload.samples.numel() > 0 and outs["nul"].final
    assert outs["empty"].payload.samples.numel() == 0 and outs["empty"].final
