"""EnergyVad on synthetic 24 kHz pcm16: one start/stop per burst at the burst's edges (within
a frame), prefix padding and silence duration as configured, the threshold's dB mapping, the
noise floor, clicks ignored, and offsets independent of how the audio is chunked; the input
buffer cutting turns out of appended audio; and the turn_detection setting's parsing."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.errors import InvalidRequestError
from omnistage.server.vad import EnergyVad, InputAudioBuffer, VadConfig, parse_turn_detection

RATE = 24000
FRAME = 480                       # 20 ms


def _db(amplitude_db: float, n: int, rng, kind: str = "noise") -> np.ndarray:
    """n float samples whose RMS is `amplitude_db` dBFS (white noise, or a 440 Hz sine)."""
    if kind == "tone":
        x = np.sin(2 * np.pi * 440 * np.arange(n) / RATE) * np.sqrt(2)
    else:
        x = rng.standard_normal(n)
    return x * 10 ** (amplitude_db / 20)


def _pcm(parts: list[tuple[float, float | None, str]], seed: int = 0) -> bytes:
    """[(seconds, level dBFS or None for digital silence, kind)] -> pcm16 bytes."""
    rng = np.random.default_rng(seed)
    chunks = [np.zeros(round(s * RATE)) if db is None else _db(db, round(s * RATE), rng, kind)
              for s, db, kind in parts]
    return (np.clip(np.concatenate(chunks), -1, 1) * 32767).astype("<i2").tobytes()


def _feed(vad: EnergyVad, pcm: bytes, chunk: int = 2 * 1234) -> list:
    """Feeds odd-sized chunks (not a multiple of the frame) and collects the events."""
    events = []
    for i in range(0, len(pcm), chunk):
        events += vad.feed(pcm[i:i + chunk])
    return events


@pytest.mark.parametrize("kind", ["noise", "tone"])
@pytest.mark.parametrize("background", [None, -70.0])
def test_one_burst_gives_one_turn_at_its_edges(kind, background):
    lead = 1.0 + 100 / RATE                       # the burst starts mid-frame, at sample 24100
    pcm = _pcm([(lead, background, "noise"), (0.6, -20.0, kind), (1.0, background, "noise")])
    start, stop = _feed(EnergyVad(VadConfig()), pcm)
    onset, end = 24100, 24100 + 14400
    assert start.kind == "start" and stop.kind == "stop"
    assert abs(start.speech - onset) < FRAME and start.speech % FRAME == 0
    assert start.at == start.speech - 300 * 24                    # prefix_padding_ms = 300
    assert abs(stop.speech - end) < FRAME
    assert stop.at == stop.speech + 500 * 24                      # silence_duration_ms = 500


def test_chunking_does_not_move_the_events():
    pcm = _pcm([(0.7, None, ""), (0.6, -25.0, "noise"), (0.8, None, "")])
    whole = EnergyVad(VadConfig()).feed(pcm)
    assert len(whole) == 2
    for chunk in (2, 2 * 479, 2 * 481, 2 * 4800):
        assert _feed(EnergyVad(VadConfig()), pcm, chunk) == whole


def test_padding_and_silence_follow_the_config_and_clamp_at_the_origin():
    pcm = _pcm([(0.2, None, ""), (0.6, -20.0, "noise"), (0.5, None, "")])
    cfg = VadConfig(prefix_padding_ms=500, silence_duration_ms=200)
    start, stop = EnergyVad(cfg, origin=1000).feed(pcm)
    assert start.speech == 1000 + 4800 and start.at == 1000          # 500 ms before is < origin
    assert stop.speech == 1000 + 4800 + 14400 and stop.at == stop.speech + 4800


def test_a_pause_shorter_than_the_silence_duration_keeps_the_turn():
    pcm = _pcm([(0.5, None, ""), (0.6, -20.0, "noise"), (0.3, None, ""), (0.6, -20.0, "noise"),
                (1.0, None, "")])
    long_silence = EnergyVad(VadConfig(silence_duration_ms=500)).feed(pcm)
    assert [e.kind for e in long_silence] == ["start", "stop"]
    assert long_silence[1].speech == 12000 + 36000                  # the second burst's end
    short_silence = EnergyVad(VadConfig(silence_duration_ms=200)).feed(pcm)
    assert [e.kind for e in short_silence] == ["start", "stop", "start", "stop"]


def test_threshold_maps_onto_the_level_gate():
    quiet = _pcm([(0.5, None, ""), (0.6, -40.0, "noise"), (1.0, None, "")])
    assert len(EnergyVad(VadConfig(threshold=0.5)).feed(quiet)) == 2      # gate -45 dBFS
    assert EnergyVad(VadConfig(threshold=0.9)).feed(quiet) == []          # gate -33 dBFS
    assert VadConfig(threshold=0.0).gate_db == -60 and VadConfig(threshold=1.0).margin_db == 25


def test_steady_background_noise_becomes_the_floor():
    vad = EnergyVad(VadConfig())                    # floor_window_ms = 3000
    # -35 dBFS clears the -45 dBFS gate: from the first sample it is a turn, until the window
    # has heard nothing else (3 s), then it is the floor
    start, stop = vad.feed(_pcm([(4.0, -35.0, "noise")]))
    assert start.speech == 0 and stop.speech == 3 * RATE
    assert vad.feed(_pcm([(2.0, -35.0, "noise")], 1)) == [] and not vad.speaking
    # over that floor, only what clears it by the 15 dB margin (at threshold 0.5) is speech
    assert vad.feed(_pcm([(0.6, -30.0, "noise"), (1.0, -35.0, "noise")], 2)) == []
    [start, stop] = vad.feed(_pcm([(0.6, -15.0, "noise"), (1.0, -35.0, "noise")], 3))
    assert (start.speech, stop.speech) == (76 * RATE // 10, 82 * RATE // 10)


def test_a_voice_at_the_first_sample_is_heard():
    start, stop = EnergyVad(VadConfig()).feed(_pcm([(0.6, -20.0, "tone"), (0.8, None, "")]))
    assert (start.at, start.speech, stop.speech) == (0, 0, 14400)


def test_a_click_is_not_a_turn():
    click = _pcm([(0.5, None, ""), (0.04, -10.0, "noise"), (1.0, None, "")])   # 40 ms < 60 ms
    assert EnergyVad(VadConfig()).feed(click) == []


def test_keep_from_bounds_the_audio_a_session_must_keep():
    vad = EnergyVad(VadConfig())
    vad.feed(_pcm([(1.0, None, "")]))
    assert vad.keep_from() == RATE - 7200                   # the last prefix_padding_ms
    [start] = vad.feed(_pcm([(0.3, -20.0, "noise")]))
    assert vad.speaking and vad.keep_from() == start.at == RATE - 7200
    vad.reset()                                             # a manual commit ends the turn
    assert not vad.speaking and vad.feed(_pcm([(1.0, None, "")])) == []


def test_input_buffer_cuts_turns_and_drops_the_silence_between():
    buf = InputAudioBuffer()
    assert buf.append(_pcm([(0.5, None, "")])) == [] and len(buf) == 2 * 12000   # no detector
    assert buf.set_detector(VadConfig()) and not buf.set_detector(VadConfig())
    pcm = _pcm([(2.0, None, ""), (0.6, -20.0, "noise"), (1.0, None, "")])
    edges = []
    for i in range(0, len(pcm), 4800):
        edges += buf.append(pcm[i:i + 4800])
        assert len(buf) <= 2 * (7200 + 14400 + 12000 + 4800)    # padding, burst, silence, chunk
    (start, head), (stop, turn) = edges
    assert head == b"" and start.at == 12000 + 48000 - 7200     # offsets count all audio
    assert turn == pcm[2 * (start.at - 12000):2 * (stop.at - 12000)]
    assert buf.end() == 12000 + len(pcm) // 2 and len(buf) <= 2 * 7200
    buf.append(_pcm([(0.3, -20.0, "noise")]))                   # a turn begins ...
    assert buf.vad.speaking and buf.take() and not buf.vad.speaking and len(buf) == 0
    assert buf.set_detector(None) and buf.vad is None


def test_turn_detection_setting():
    assert parse_turn_detection(None) is None
    td = parse_turn_detection({"type": "server_vad", "silence_duration_ms": 200,
                               "create_response": False})
    assert td.vad == VadConfig(silence_duration_ms=200) and not td.create_response
    assert td.interrupt_response and td.to_json()["threshold"] == 0.5
    for bad, param in [({"type": "semantic_vad"}, "turn_detection"),
                       ({"type": "server_vad", "threshold": True}, "threshold"),
                       ({"type": "server_vad", "prefix_padding_ms": 2.5}, "prefix_padding_ms"),
                       ({"type": "server_vad", "interrupt_response": 1}, "interrupt_response"),
                       ({"type": "server_vad", "idle_timeout_ms": 5000}, "idle_timeout_ms")]:
        with pytest.raises(InvalidRequestError) as e:
            parse_turn_detection(bad)
        assert e.value.param.endswith(param)
