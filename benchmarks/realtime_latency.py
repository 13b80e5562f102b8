"""The delay a speaker feels on the Realtime API: end of speech -> first response audio.

N concurrent sessions over the real WebSocket each stream an espeak-ng utterance at real-time
pace (a microphone: a 100 ms append when its 100 ms have been spoken), then:
- manual: commit + response.create at once (turn_detection null);
- vad: keep streaming silence; the server's VAD (server_vad, silence_duration_ms as given)
  ends the turn and answers. Its silence window is reported apart: `delay_s` counts from the end
  of speech, `after_stop_s` from speech_stopped's arrival.
- bargein: as vad, but spoken over a long answer to a text turn once its audio plays:
  `cancel_s` is speech_started -> that answer's response.done (cancelled).
Per session it also plays the answer back as a client would (from the first delta, gap-free
if every delta arrives before the audio before it has played out) and reports the playback
gaps: the seconds a listener would hear nothing mid-answer.

A/B: `--servers` lists the variants to compare, each an `omnistage serve` of the same model
with extra flags (e.g. streamed input on and off), run interleaved (A B A B) per setting; every
run is printed, then the medians and the ratio. The last line is one JSON object.

    python -m benchmarks.realtime_latency --model tiny:qwen2_5_omni:small \\
        --lengths 2,6,15 --sessions 1,4,8 --modes manual,vad --repeats 2

`first_text_s` (manual): commit -> first transcript delta, the encoding and prefill left at
commit -- what streamed input shrinks.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from websockets.asyncio.client import connect

from benchmarks.espeak import RATE, pcm16, utterance
from benchmarks.machine import other_load
from benchmarks.serve_process import free_port, stop, wait_healthy

CHUNK_S = 0.1
API_KEY = "bench-key"


@dataclass
class SessionResult:
    delay_s: float | None = None          # end of speech -> first output audio delta
    first_text_s: float | None = None     # commit (manual) -> first transcript delta: the
                                          # encoding and prefill left at commit
    after_stop_s: float | None = None     # speech_stopped (vad) -> first output audio delta
    stop_s: float | None = None           # end of speech -> speech_stopped arrives (vad)
    cancel_s: float | None = None         # bargein: speech_started -> the cut answer's response.done
    audio_s: float = 0.0                  # answer audio received
    gaps: list[float] = field(default_factory=list)   # playback stalls, seconds each
    status: str | None = None
    error: str | None = None


@contextmanager
def served(model: str, port: int, flags: list[str]):
    """`omnistage serve` on loopback until the block ends (bounded start)."""
    cmd = [sys.executable, "-m", "omnistage.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--api-key", API_KEY, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 300, lambda: proc.stderr.read()[-2000:], poll_s=0.5)
        yield base
    finally:
        stop(proc, 30)


def playback_gaps(arrivals: list[tuple[float, float]]) -> list[float]:
    """(arrival time, seconds of audio) per delta -> the stalls a client playing from the
    first delta on would hear."""
    gaps, played_until = [], None
    for t, dur in arrivals:
        if played_until is not None and t > played_until:
            gaps.append(t - played_until)
        played_until = max(played_until or t, t) + dur
    return gaps


async def session(base: str, model: str, speech: bytes, mode: str, silence_ms: int,
                  max_tokens: int, timeout_s: float) -> SessionResult:
    url = base.replace("http", "ws", 1) + f"/v1/realtime?model={model}"
    res = SessionResult()
    async with connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                       max_size=2**25) as ws:
        json.loads(await ws.recv())                                  # session.created
        td = None if mode == "manual" else {"type": "server_vad", "silence_duration_ms": silence_ms}
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["audio"], "temperature": 0,
            "max_output_tokens": max_tokens, "audio": {"input": {"turn_detection": td}}}}))
        marks: dict[str, float] = {}
        cut = await asyncio.wait_for(_answer_playing(ws), timeout_s) if mode == "bargein" else None
        first_audio = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(_read(ws, res, marks, first_audio, cut))
        try:
            await asyncio.wait_for(_speak(ws, speech, mode, marks, first_audio), timeout_s)
            await asyncio.wait_for(reader, timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            res.error = "timeout"
        finally:
            reader.cancel()
    end = marks.get("speech_end")
    if end is not None and "first_audio" in marks:
        res.delay_s = marks["first_audio"] - end
        if mode == "manual" and "first_text" in marks:
            res.first_text_s = marks["first_text"] - end
        if "started" in marks and "cancelled" in marks:
            res.cancel_s = marks["cancelled"] - marks["started"]
        if "stopped" in marks:
            res.after_stop_s = marks["first_audio"] - marks["stopped"]
            res.stop_s = marks["stopped"] - end
    return res


async def _speak(ws, speech: bytes, mode: str, marks: dict, first_audio) -> None:
    """Appends at a microphone's pace; then commits (manual) or streams silence (vad) until
    the first answer audio arrives."""
    step = int(2 * CHUNK_S * RATE)
    t0 = time.monotonic()
    n = -(-len(speech) // step)
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + (i + 1) * CHUNK_S - time.monotonic()))
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(speech[i * step:(i + 1) * step]).decode()}))
    marks["speech_end"] = time.monotonic()
    if mode == "manual":          # (vad and bargein: the server's VAD ends the turn)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        return
    silence = base64.b64encode(bytes(step)).decode()
    i = n
    while not first_audio.done():
        i += 1
        await asyncio.sleep(max(0.0, t0 + i * CHUNK_S - time.monotonic()))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))


async def _answer_playing(ws) -> str:
    """bargein: a long spoken answer to a text turn, read up to its first audio; its id."""
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Tell me a long story about the sea."}]}}))
    await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 2000}}))
    async for raw in ws:
        ev = json.loads(raw)
        if ev.get("type") == "response.output_audio.delta":
            return ev["response_id"]
        if ev.get("type") == "response.done":
            raise RuntimeError(f"the answer to interrupt ended first: {ev['response']['status']}")
    raise RuntimeError("the server closed the session")


async def _read(ws, res: SessionResult, marks: dict, first_audio, cut: str | None) -> None:
    """Server events until the turn's response is done; `cut`: the answer a barge-in
    interrupts (its events are not the turn's, its response.done marks the cancel)."""
    arrivals = []
    async for raw in ws:
        ev, now = json.loads(raw), time.monotonic()
        kind = ev.get("type")
        if cut is not None and ev.get("response_id", ev.get("response", {}).get("id")) == cut:
            if kind == "response.done":
                marks["cancelled"] = now
                res.error = None if ev["response"]["status"] == "cancelled" else "not cancelled"
            continue
        if kind == "input_audio_buffer.speech_started":
            marks.setdefault("started", now)
        elif kind == "input_audio_buffer.speech_stopped":
            marks.setdefault("stopped", now)
        elif kind == "response.output_audio_transcript.delta":
            marks.setdefault("first_text", now)
        elif kind == "response.output_audio.delta":
            dur = len(base64.b64decode(ev["delta"])) / 2 / RATE
            arrivals.append((now, dur))
            res.audio_s += dur
            if not first_audio.done():
                marks["first_audio"] = now
                first_audio.set_result(now)
        elif kind == "error":
            res.error = ev["error"]["message"][:200]
        elif kind == "response.done":
            res.status = ev["response"]["status"]
            break
    res.gaps = playback_gaps(arrivals)
    if not first_audio.done():
        first_audio.set_result(None)


async def one_run(base: str, args, seconds: float, n: int, mode: str,
                  take: int) -> list[SessionResult]:
    """N sessions at once. Each `take` (a run's number) scales the speech by an inaudible
    1 - take/1000: its bytes differ from every earlier run's, so no cache (encoder chunks,
    prefix blocks) serves one run from another's audio -- only from its own turn."""
    speeches = [pcm16(utterance(seconds, first=k).audio * (1 - take / 1000)) for k in range(n)]
    return await asyncio.gather(*(session(base, args.served_name, s, mode, args.silence_ms,
                                          args.max_tokens, seconds + 120) for s in speeches))


def summarize(results: list[SessionResult]) -> dict:
    delays = [r.delay_s for r in results if r.delay_s is not None]
    after = [r.after_stop_s for r in results if r.after_stop_s is not None]
    cancels = [r.cancel_s for r in results if r.cancel_s is not None]
    first_text = [r.first_text_s for r in results if r.first_text_s is not None]
    return {"delay_p50_s": _median(delays), "delay_max_s": max(delays) if delays else None,
            "first_text_p50_s": _median(first_text),
            "after_stop_p50_s": _median(after),
            "cancel_p50_s": _median(cancels), "cancel_max_s": max(cancels) if cancels else None,
            "sessions_with_gaps": sum(1 for r in results if r.gaps),
            "gap_total_s": round(sum(sum(r.gaps) for r in results), 3),
            "errors": [r.error for r in results if r.error]}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:qwen2_5_omni:small")
    p.add_argument("--served-name", default=None, help="the name the server serves (default: --model)")
    p.add_argument("--servers", default="streamed=;plain=--no-realtime-streamed-input",
                   help="variants as NAME=FLAGS;NAME=FLAGS (FLAGS for omnistage serve, "
                        "space-separated; default: streamed input on, then off)")
    p.add_argument("--lengths", default="2,6,15", help="utterance seconds")
    p.add_argument("--sessions", default="1,4,8")
    p.add_argument("--modes", default="manual,vad",
                   help="manual, vad, bargein (vad, the turn spoken over a long answer)")
    p.add_argument("--silence-ms", type=int, default=500, help="server_vad silence_duration_ms")
    p.add_argument("--max-tokens", type=int, default=48,
                   help="answer length bound (tokens); first audio grows with it up to ~60 on Qwen2.5-Omni: the talker reads one thinker row per code, and the first chunk needs 60 codes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8123,
                   help="first variant's port, the next ones count up (0: free ports)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    args.served_name = args.served_name or args.model
    args.takes = itertools.count()
    variants = [v.split("=", 1) for v in args.servers.split(";")]
    report = {"model": args.model, "runs": [], "cpu": os.cpu_count()}
    with other_load(report):
        _run_all(args, variants, report)
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _run_all(args, variants: list[list[str]], report: dict) -> None:
    from contextlib import ExitStack
    with ExitStack() as stack:
        bases = {name: stack.enter_context(served(args.model, _port(args.port, i), flags.split()))
                 for i, (name, flags) in enumerate(variants)}
        for seconds in [float(x) for x in args.lengths.split(",")]:
            for n in [int(x) for x in args.sessions.split(",")]:
                for mode in args.modes.split(","):
                    _setting(args, bases, seconds, n, mode, report)


def _port(first: int, i: int) -> int:
    return first + i if first else free_port()


def _setting(args, bases: dict, seconds: float, n: int, mode: str, report: dict) -> None:
    per: dict[str, list[dict]] = {name: [] for name in bases}
    for rep in range(args.repeats):
        for name, base in bases.items():                 # interleaved: A B A B
            results = asyncio.run(one_run(base, args, seconds, n, mode, next(args.takes)))
            s = summarize(results)
            per[name].append(s)
            row = {"variant": name, "seconds": seconds, "sessions": n, "mode": mode,
                   "repeat": rep, **s, "sessions_detail": [asdict(r) for r in results]}
            report["runs"].append(row)
            print(f"{name:>10} {seconds:4.0f}s N={n} {mode:6} run {rep}: delay p50 "
                  f"{s['delay_p50_s']} max {s['delay_max_s']} first-text {s['first_text_p50_s']} "
                  f"after-stop {s['after_stop_p50_s']} cancel {s['cancel_p50_s']} "
                  f"gaps {s['sessions_with_gaps']}/{n} ({s['gap_total_s']} s) "
                  f"{'errors ' + str(s['errors']) if s['errors'] else ''}", flush=True)
    for key in ("delay_p50_s", "first_text_p50_s"):
        medians = {name: _median([r[key] for r in rows if r[key] is not None])
                   for name, rows in per.items()}
        names = list(medians)
        line = "  ".join(f"{k} {v}" for k, v in medians.items())
        if len(names) == 2 and medians[names[0]] and medians[names[1]]:
            line += f"  ratio {names[1]}/{names[0]} {medians[names[1]] / medians[names[0]]:.2f}"
        print(f"  median {key.removesuffix('_p50_s')} {seconds:.0f}s N={n} {mode}: {line}", flush=True)


if __name__ == "__main__":
    main()
