"""The Silero speech detector on real speech (espeak-ng sentences at 24 kHz pcm16, as a
Realtime client sends): one start/stop per sentence within 100 ms of where the speech is
(OpenAI's offsets: padding before, the confirming silence after), the same events whatever the
chunking, nothing for white noise or music at the speech's loudness, pauses shorter than the
silence duration kept in the turn, semantic_vad's eagerness rule; the input buffer cutting
turns out of appended audio; and the turn_detection setting's parsing."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.espeak import RATE, SENTENCES, espeak, pcm16
from omnistage.errors import InvalidRequestError
from omnistage.server.turn_detection import TurnDetection, VadConfig, parse_turn_detection
from omnistage.server.vad import InputAudioBuffer, SileroLoader, SileroVad

MS = RATE // 1000
TOLERANCE = 100 * MS


@pytest.fixture(scope="module")
def model():
    return SileroLoader().get()


def _noise_floor(n: int, seed: int) -> np.ndarray:
    """A quiet room (-60 dBFS white noise), so that "silence" is not digital zeros."""
    return (10 ** (-60 / 20) * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _conversation(gaps_s: list[float], tail_s: float = 1.5) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Sentences separated by the given silences (and 0.8 s before the first, `tail_s` after
    the last), over a quiet room; and each sentence's (onset, end) sample."""
    pieces, truth, at = [np.zeros(int(0.8 * RATE), np.float32)], [], int(0.8 * RATE)
    for k, gap in enumerate(gaps_s + [tail_s]):
        s = espeak(SENTENCES[k % len(SENTENCES)])
        speech = s.audio[s.onset:s.end]
        truth.append((at, at + speech.size))
        pieces += [speech, np.zeros(int(gap * RATE), np.float32)]
        at += speech.size + int(gap * RATE)
    audio = np.concatenate(pieces)
    return audio + _noise_floor(audio.size, 0), truth


def _feed(vad: SileroVad, pcm: bytes, chunk_ms: int = 100) -> list:
    events, step = [], 2 * chunk_ms * MS
    for i in range(0, len(pcm), step):
        events += vad.feed(pcm[i:i + step])
    return events


def test_sentences_give_one_turn_each_at_the_speech(model):
    audio, truth = _conversation([1.2, 1.6])
    cfg = VadConfig()                                   # OpenAI's: 0.5, 300 ms, 500 ms
    events = _feed(SileroVad(model, cfg), pcm16(audio))
    assert [e.kind for e in events] == ["start", "stop"] * 3
    for (start, stop), (onset, end) in zip(zip(events[::2], events[1::2]), truth):
        assert abs(start.speech - onset) <= TOLERANCE, (start, onset)
        assert start.at == start.speech - 300 * MS                  # audio_start_ms
        assert abs(stop.speech - end) <= TOLERANCE, (stop, end)
        # audio_end_ms: the confirming silence, 500 ms rounded up to whole 32 ms windows
        assert stop.at - stop.speech == 16 * 768
        assert abs(stop.at - (end + 500 * MS)) <= TOLERANCE


def test_chunking_does_not_move_the_events(model):
    pcm = pcm16(_conversation([1.0])[0])
    whole = _feed(SileroVad(model, VadConfig()), pcm, chunk_ms=100)
    for chunk_ms in (20, 1000):
        assert _feed(SileroVad(model, VadConfig()), pcm, chunk_ms) == whole


def _music(n: int, seed: int) -> np.ndarray:
    """A melody: notes with harmonics and a decaying envelope, 250 ms each, a 5 Hz vibrato."""
    t = np.arange(n) / RATE
    notes = 220 * 2 ** (np.random.default_rng(seed).integers(0, 12, size=n // (RATE // 4) + 1) / 12)
    f = notes[(t * 4).astype(int)] * (1 + 0.01 * np.sin(2 * np.pi * 5 * t))
    phase = 2 * np.pi * np.cumsum(f) / RATE
    env = np.exp(-3 * (t % 0.25))
    return env * sum(np.sin(k * phase) / k for k in (1, 2, 3, 4))


@pytest.mark.parametrize("kind", ["white noise", "music"])
def test_noise_and_music_at_speech_loudness_are_no_turn(model, kind):
    s = espeak(SENTENCES[0])
    level = np.sqrt(np.mean(s.audio[s.onset:s.end] ** 2))            # the speech's RMS
    n = 6 * RATE
    x = np.random.default_rng(1).standard_normal(n) if kind == "white noise" else _music(n, 1)
    x = (x * level / np.sqrt(np.mean(x ** 2))).astype(np.float32)
    silence = np.zeros(RATE // 2, np.float32)
    assert _feed(SileroVad(model, VadConfig()), pcm16(np.concatenate([silence, x, silence]))) == []


def test_a_pause_shorter_than_the_silence_duration_keeps_the_turn(model):
    audio, truth = _conversation([0.7])
    pcm = pcm16(audio)
    long_silence = _feed(SileroVad(model, VadConfig(silence_duration_ms=1000)), pcm)
    assert [e.kind for e in long_silence] == ["start", "stop"]
    assert abs(long_silence[1].speech - truth[1][1]) <= TOLERANCE     # the second one's end
    short_silence = _feed(SileroVad(model, VadConfig(silence_duration_ms=400)), pcm)
    assert [e.kind for e in short_silence] == ["start", "stop", "start", "stop"]


def test_semantic_eagerness_sets_the_pause_that_ends_a_turn(model):
    assert VadConfig(eagerness="high").pause_ms(3000) == 400
    assert VadConfig(eagerness="medium").pause_ms(3000) == 800 == VadConfig(eagerness="auto").pause_ms(3000)
    assert VadConfig(eagerness="low").pause_ms(3000) == 1600
    assert VadConfig(eagerness="low").pause_ms(500) == 3200           # a short fragment waits
    assert VadConfig(eagerness="high").pause_ms(500) == 800
    assert VadConfig(silence_duration_ms=700).pause_ms(10) == 700     # server_vad: fixed
    pcm = pcm16(_conversation([1.0], tail_s=3.5)[0])                   # a 1 s pause
    kinds = {e: [ev.kind for ev in _feed(SileroVad(model, VadConfig(eagerness=e)), pcm)]
             for e in ("high", "low")}
    assert kinds == {"high": ["start", "stop"] * 2, "low": ["start", "stop"]}


def test_keep_from_bounds_the_audio_a_session_must_keep(model):
    vad = SileroVad(model, VadConfig())
    vad.feed(pcm16(_noise_floor(RATE, 2)))
    # the last prefix_padding_ms before what was judged (whole windows; the resampler trails)
    assert RATE - 300 * MS - 2 * 768 <= vad.keep_from() <= RATE - 300 * MS
    s = espeak(SENTENCES[4])
    [start] = vad.feed(pcm16(s.audio[s.onset:s.onset + RATE // 2]))
    assert vad.speaking and vad.keep_from() == start.at
    vad.reset()                                               # a manual commit ends the turn
    assert not vad.speaking


def test_input_buffer_cuts_turns_and_drops_the_silence_between(model):
    buf = InputAudioBuffer(RATE, SileroLoader())
    silence = pcm16(_noise_floor(RATE // 2, 3))
    assert buf.append(silence) == [] and len(buf) == 2 * 12000    # no detector: all kept
    assert buf.set_detector(VadConfig()) and not buf.set_detector(VadConfig())
    audio, [(onset, end)] = _conversation([])
    pcm, edges = pcm16(audio), []
    for i in range(0, len(pcm), 4800):
        edges += buf.append(pcm[i:i + 4800])
        assert len(buf) <= 2 * (300 * MS + (end - onset) + 800 * MS + 2400)
    (start, head), (stop, turn) = edges
    assert head == b"" and abs(start.at - (12000 + onset - 300 * MS)) <= TOLERANCE
    assert turn == pcm[2 * (start.at - 12000):2 * (stop.at - 12000)]   # offsets count all audio
    assert buf.end() == 12000 + len(pcm) // 2 and len(buf) <= 2 * (300 * MS + 768)
    s = espeak(SENTENCES[2])
    buf.append(pcm16(s.audio[s.onset:s.onset + RATE // 2]))         # a turn begins ...
    assert buf.vad.speaking and buf.take() and not buf.vad.speaking and len(buf) == 0
    assert buf.set_detector(None) and buf.vad is None


def test_turn_detection_setting():
    assert parse_turn_detection(None) is None
    td = parse_turn_detection({"type": "server_vad", "silence_duration_ms": 200,
                               "create_response": False, "idle_timeout_ms": 6000})
    assert td.vad == VadConfig(silence_duration_ms=200) and not td.create_response
    assert td.interrupt_response and td.idle_timeout_ms == 6000
    assert td.to_json() == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                            "silence_duration_ms": 200, "create_response": False,
                            "interrupt_response": True, "idle_timeout_ms": 6000}
    semantic = parse_turn_detection({"type": "semantic_vad", "eagerness": "low",
                                     "interrupt_response": None})
    assert semantic == TurnDetection(VadConfig(eagerness="low"))
    assert semantic.to_json() == {"type": "semantic_vad", "eagerness": "low",
                                  "create_response": True, "interrupt_response": True}
    assert parse_turn_detection({"type": "semantic_vad"}).vad.eagerness == "auto"
    for bad, param in [({"type": "vad"}, "type"),
                       ({"type": "server_vad", "threshold": True}, "threshold"),
                       ({"type": "server_vad", "threshold": 1.5}, "threshold"),
                       ({"type": "server_vad", "prefix_padding_ms": 2.5}, "prefix_padding_ms"),
                       ({"type": "server_vad", "interrupt_response": 1}, "interrupt_response"),
                       ({"type": "server_vad", "idle_timeout_ms": 0}, "idle_timeout_ms"),
                       ({"type": "semantic_vad", "eagerness": "eager"}, "eagerness")]:
        with pytest.raises(InvalidRequestError) as e:
            parse_turn_detection(bad)
        assert e.value.param.endswith(param)
