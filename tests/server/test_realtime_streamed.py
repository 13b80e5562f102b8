"""Streamed input (server/realtime_warm.py): a turn prefilled while it is spoken is answered
with exactly the tokens and the audio of the same turn committed at once.

Two servers on the same greedy tiny Qwen2.5-Omni, then Qwen3-Omni (thinker temperature 0 by
session, the talker greedy by generation_config, Qwen2.5's vocoder noise seeded by request
order): one streams input
(the default), one does not (--no-realtime-streamed-input). The same espeak-ng utterances of
2, 6 and 15 s go to both in 20 ms, 100 ms and 1 s pieces (to the streaming server at three
times real time: the pace gives the warm-ups their chance; to the other at once), with manual
commits and with server VAD. The answers must be equal
to the bit; and the prefix cache must have served the streaming server more prompt tokens
(the warm-ups were used, not only harmless)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import openai
import pytest

from benchmarks.espeak import RATE, pcm16, utterance
from tests.server.test_realtime_server import _until

PACE = 3.0                                   # appended audio-seconds per wall-second
LENGTHS_S = (2, 6, 15)
PIECES_MS = (20, 100, 1000)
HITS = 'omnistage_prefix_cache_hit_tokens_total{stage="%s"}'


@pytest.fixture(scope="module", params=["qwen2_5_omni", "qwen3_omni"])
def greedy_omni(request, tmp_path_factory) -> str:
    """A tiny checkpoint of the family with a greedy talker (generation_config samples by
    default)."""
    from omnistage.tiny import build_tiny

    out = build_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=0)
    gen_path = Path(out) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen["talker_do_sample"] = False
    gen_path.write_text(json.dumps(gen))
    return str(out)


@pytest.fixture(scope="module")
def servers(greedy_omni, start_server, api_key):
    # Qwen3-Omni's code2wav chunks by the frames only: with playback deadlines the chunk
    # boundaries follow the timing, and the samples differ between runs by float rounding
    # (one int16 step here and there), which these bit-for-bit comparisons would see.
    common = ("--max-model-len", "2048", "--code2wav-playback-margin", "off")
    with start_server(greedy_omni, *common) as on, \
            start_server(greedy_omni, *common, "--no-realtime-streamed-input") as off:
        yield {name: openai.OpenAI(base_url=f"{s.base}/v1", api_key=api_key, max_retries=0,
                                   timeout=60) for name, s in (("on", on), ("off", off))}, \
            {"on": on.base, "off": off.base}


def _hits(base: str, api_key: str) -> dict[str, float]:
    """Prefix-cache hit tokens so far of the thinker and the talker."""
    import httpx

    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
    return {stage: sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(HITS % stage)) for stage in ("thinker", "talker")}


def _stream(conn, pcm: bytes, piece_ms: int, pace: float | None) -> None:
    """The pieces at `pace` times real time, as a microphone would send them (None: at once)."""
    step = 2 * piece_ms * RATE // 1000
    start = time.monotonic()
    for i in range(0, len(pcm), step):
        if pace is not None:
            time.sleep(max(0.0, start + i / 2 / RATE / pace - time.monotonic()))
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())


def _answer(events) -> tuple[str, bytes, int]:
    text = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in events
                     if e.type == "response.output_audio.delta")
    done = events[-1].response
    assert done.status in ("completed", "incomplete"), done.status_details   # 8 tokens: incomplete
    return text, audio, done.usage.output_tokens


def _response(conn, deadline_s: float = 120) -> list:
    """Events up to the response's response.done; an error event fails at once."""
    events, end = [], time.monotonic() + deadline_s
    while not events or events[-1].type != "response.done":
        left = end - time.monotonic()
        assert left > 0, f"no response.done within {deadline_s} s: {[e.type for e in events]}"
        try:
            events.append(conn.parse_event(conn._connection.recv(timeout=left, decode=False)))
        except TimeoutError:
            continue                 # the assert above reports it
        assert events[-1].type != "error", events[-1].error
    return events


def _turns(client, turns: list[tuple[bytes, int]], vad: bool,
           pace: float | None) -> list[tuple[str, bytes, int]]:
    """One session; each (pcm, piece_ms) is a user turn, answered in audio (8 text tokens)."""
    td = {"type": "server_vad"} if vad else None
    out = []
    with client.realtime.connect(model="tiny") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session={"type": "realtime", "temperature": 0, "max_output_tokens": 8,
                                     "audio": {"input": {"turn_detection": td}}})
        _until(conn, "session.updated")
        for pcm, piece_ms in turns:
            _stream(conn, pcm, piece_ms, pace)
            if not vad:
                conn.input_audio_buffer.commit()
                conn.response.create()
            out.append(_answer(_response(conn)))
    return out


def test_streamed_turns_answer_as_committed_at_once(servers, api_key):
    clients, bases = servers
    speech = {s: pcm16(utterance(s, first=s).audio) for s in LENGTHS_S}
    got, hits = {}, {}
    for name in ("on", "off"):
        before = _hits(bases[name], api_key)
        got[name] = [_turns(clients[name], [(speech[s], piece) for s in LENGTHS_S], vad=False,
                            pace=PACE if name == "on" else None) for piece in PIECES_MS]
        hits[name] = {k: v - before[k] for k, v in _hits(bases[name], api_key).items()}
    for piece, on, off in zip(PIECES_MS, got["on"], got["off"]):
        for s, a, b in zip(LENGTHS_S, on, off):
            assert a[0] == b[0] and a[2] == b[2], f"{s} s in {piece} ms pieces: text differs"
            assert len(a[1]) > 0 and a[1] == b[1], f"{s} s in {piece} ms pieces: audio differs"
    print("prefix cache hit tokens, streamed input on/off:", hits)
    assert hits["on"]["thinker"] > hits["off"]["thinker"], hits
    assert hits["on"]["talker"] > hits["off"]["talker"], hits     # the talker prefilled them too


def test_streamed_turns_cut_by_server_vad_answer_the_same(servers):
    clients, _ = servers
    quiet = bytes(2 * RATE)                     # 1 s of silence ends each turn
    turns = [(pcm16(utterance(s, first=2).audio) + quiet, 100) for s in (6, 3)]
    on = _turns(clients["on"], turns, vad=True, pace=PACE)
    off = _turns(clients["off"], turns, vad=True, pace=None)
    assert [(t, n) for t, _, n in on] == [(t, n) for t, _, n in off]
    assert all(a[1] and a[1] == b[1] for a, b in zip(on, off))


def test_a_warm_up_never_costs_a_response_its_seat(tiny_omni, start_server, api_key):
    """One seat, no waiting line: the warm-up in flight at commit (1 s pieces: each append
    brings a second of new speech, so one is due at every append) gives its seat up to the
    response instead of the response getting rate_limit_exceeded."""
    with start_server(tiny_omni, "--max-num-seqs", "1", "--max-queued-requests", "0") as s:
        client = openai.OpenAI(base_url=f"{s.base}/v1", api_key=api_key, max_retries=0,
                               timeout=60)
        speech = pcm16(utterance(4, first=1).audio)
        answers = _turns(client, [(speech, 1000)] * 3, vad=False, pace=None)
    assert len(answers) == 3 and all(audio for _, audio, _ in answers)
