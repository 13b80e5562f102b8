"""The seed's comparison, measured: the same spoken questions through the cascade (ASR -> LLM ->
TTS as stages: pocketsphinx, our AR engine on a text model, flite or espeak-ng) and through an
end-to-end omni model (Qwen2.5-Omni, small checkpoint) on the same machine in one run.

    python -m benchmarks.cascade_vs_e2e                 # ~3 min: C=1 and C=8, two rounds
    python -m benchmarks.cascade_vs_e2e --concurrency 1 --rounds 1 --omni tiny:qwen2_5_omni

Workload: questions spoken by espeak-ng (~2, ~5 and ~9 s of speech, resampled to 16 kHz),
each request one of them in turn; the answer on both sides forced to the same three sentences
(REPLY, greedy, the reply's tokens then the end of the turn), so both speak the same words: the
cascade's TTS sentence by sentence, the omni model's talker exactly as many 50 Hz codes as the
cascade's speech of the reply lasts (its random small checkpoint does not say the words; the
amount of speech is what is equal). Levels run A B A B (cascade, end to end, cascade, ...).

Per level and side: time to first audio (submit -> first PCM chunk, p50), total latency
(submit -> last PCM chunk, p50), audio seconds per wall second, and each stage's step time
(StageClock of omni_e2e). Every run is printed; then the medians and the ratios end to end /
cascade. No target: this measures the argument (a cascade waits for the whole question to be
heard and for the first whole sentence; an end-to-end model streams), it does not grade it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import zlib
from dataclasses import dataclass

import numpy as np

from benchmarks.espeak import RATE, utterance
from benchmarks.machine import cpu_description, cpu_line, finish_report, other_load
from benchmarks.omni_e2e import StageClock

REPLY = ("Sure, I can help with that. Tomorrow will be sunny and warm, with a light breeze in "
         "the afternoon. Have a lovely day!")
QUESTION_SECONDS = (2.0, 5.0, 9.0)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--omni", default="tiny:qwen2_5_omni:small", help="the end-to-end model (folder or tiny:ARCH[:SIZE])")
    p.add_argument("--llm", default="tiny:qwen2", help="the cascade's text model (folder or tiny:ARCH[:SIZE])")
    p.add_argument("--tts", default="flite", choices=["flite", "espeak"], help="the cascade's TTS")
    p.add_argument("--concurrency", default="1,8", help="comma list of levels")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds per level")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out-json", help="also write the report here")
    args = p.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c})
    except ValueError:
        p.error(f"--concurrency takes a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1 or args.rounds < 1:
        p.error("--concurrency needs levels >= 1 and --rounds >= 1")
    return args


@dataclass
class Timing:
    ttfa_s: float
    last_audio_s: float
    audio_s: float


def questions() -> list[np.ndarray]:
    """The spoken questions, float32 at 16 kHz (what both models hear)."""
    from omnistage.media.audio import resample

    return [resample(utterance(s, first=i).audio, RATE, 16000) for i, s in enumerate(QUESTION_SECONDS)]


def forced(engine, text: str):
    from omnistage import SamplingParams

    ids = engine.tokenizer.encode(text, add_special_tokens=False) + [engine.abilities.end_of_turn_id]
    return SamplingParams(temperature=0.0, max_tokens=len(ids), forced_token_ids=ids)


def dithered(audio: np.ndarray, seed: int) -> np.ndarray:
    """The question with inaudible noise of its own (-80 dBFS): every request's audio differs,
    so neither side's content-keyed caches (the ASR's transcripts, the encoder's features, the
    prefix cache) serve a repeat; the speech is the same."""
    rng = np.random.default_rng(seed)
    return (audio + rng.normal(0.0, 1e-4, audio.shape)).astype(np.float32)


async def one(engine, rid: str, audio: np.ndarray, params, opts, sem: asyncio.Semaphore) -> Timing:
    audio = dithered(audio, zlib.crc32(rid.encode()))
    async with sem:
        t0 = time.perf_counter()
        chunks = []
        messages = [{"role": "user", "content": [{"type": "audio", "audio": audio}]}]
        async for d in engine.generate(messages, params, request_id=rid, output=opts):
            if d.audio is not None and d.audio.size:
                chunks.append((time.perf_counter() - t0, d.audio.size / d.sample_rate))
            if d.finished and d.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {rid} ended with {d.finish_reason}")
    if not chunks:
        raise RuntimeError(f"request {rid} returned no audio")
    return Timing(chunks[0][0], chunks[-1][0], sum(s for _, s in chunks))


async def level(side: dict, c: int, qs: list[np.ndarray], tag: str) -> dict:
    """One level on one side: max(3, c) requests, c at a time, the questions in turn."""
    n = max(len(qs), c)
    sem, load = asyncio.Semaphore(c), {}
    side["clock"].take()
    with other_load(load):
        t0 = time.perf_counter()
        ts = await asyncio.gather(*(one(side["engine"], f"{tag}-{i}", qs[i % len(qs)], side["params"],
                                        side["opts"], sem) for i in range(n)))
        wall = time.perf_counter() - t0
        await asyncio.to_thread(side["engine"].wait_idle)
    steps = side["clock"].take().step_s
    return {"requests": n, "wall_s": round(wall, 3),
            "ttfa_p50_s": round(statistics.median(t.ttfa_s for t in ts), 3),
            "latency_p50_s": round(statistics.median(t.last_audio_s for t in ts), 3),
            "audio_s_per_wall_s": round(sum(t.audio_s for t in ts) / wall, 3),
            "audio_s_per_request": round(statistics.mean(t.audio_s for t in ts), 3),
            "stage_s": {k: round(v, 3) for k, v in steps.items()},
            "other_cores": load.get("other_cores", 0.0)}


def start(model: str, threads: int | None) -> dict:
    from omnistage import AsyncOmni
    from omnistage.entrypoints.model_source import resolve_model

    opts = {"num_threads": threads} if threads else {}
    t = time.perf_counter()
    engine = AsyncOmni(resolve_model(model), **opts)
    log(f"[start] {model}: {time.perf_counter() - t:.1f} s, stages {list(engine.engine.graph.stages)}")
    return {"engine": engine, "clock": StageClock(engine.engine)}


async def warm(side: dict, qs) -> None:
    await one(side["engine"], "warm-up", qs[0], side["params"], side["opts"], asyncio.Semaphore(1))


def reply_codes(cascade: dict, qs) -> int:
    """The omni talker's code count: as many 50 Hz codes as the cascade speaks the reply for."""
    t = asyncio.run(one(cascade["engine"], "measure", qs[0], cascade["params"], cascade["opts"],
                        asyncio.Semaphore(1)))
    return max(1, round(t.audio_s * 50))


def run(args, report: dict) -> None:
    from dataclasses import replace

    from omnistage import SamplingParams
    from omnistage.engine_api import OutputOptions

    qs = questions()
    report["question_s"] = [round(q.size / 16000, 2) for q in qs]
    speak = OutputOptions(modalities=["text", "audio"])
    cascade = start(f"cascade:pocketsphinx+{args.llm}+{args.tts}", args.threads)
    e2e = start(args.omni, args.threads)
    try:
        cascade.update(params=forced(cascade["engine"], REPLY), opts=speak)
        codes = reply_codes(cascade, qs)
        talker = SamplingParams(temperature=0.0, max_tokens=codes, min_tokens=codes, repetition_penalty=1.05)
        e2e.update(params=forced(e2e["engine"], REPLY), opts=replace(speak, talker_params=talker))
        report["omni_talker_codes"] = codes
        for side in (cascade, e2e):
            asyncio.run(warm(side, qs))
        for c in args.concurrency:
            for r in range(args.rounds):
                for name, side in (("cascade", cascade), ("e2e", e2e)):
                    res = asyncio.run(level(side, c, qs, f"{name}-c{c}-r{r}"))
                    report["runs"].append({"side": name, "concurrency": c, "round": r, **res})
                    log(f"[{name:7s}] C={c} round {r}: TTFA p50 {res['ttfa_p50_s']:.3f} s, latency p50 "
                        f"{res['latency_p50_s']:.3f} s, {res['audio_s_per_wall_s']:.3f} audio-s/s, "
                        f"stages {res['stage_s']}")
    finally:
        for side in (cascade, e2e):
            side["engine"].shutdown()


def summarize(report: dict, levels: list[int]) -> None:
    """Medians per side and level, and end-to-end / cascade ratios."""
    out = {}
    for c in levels:
        med = {}
        for side in ("cascade", "e2e"):
            runs = [r for r in report["runs"] if r["side"] == side and r["concurrency"] == c]
            med[side] = {k: round(statistics.median(r[k] for r in runs), 3)
                         for k in ("ttfa_p50_s", "latency_p50_s", "audio_s_per_wall_s")}
        med["e2e_over_cascade"] = {k: round(med["e2e"][k] / med["cascade"][k], 3) for k in med["e2e"]}
        out[str(c)] = med
    report["medians"] = out


def print_table(report: dict) -> None:
    print("  C side     TTFA p50  latency p50  audio-s/s")
    for c, m in report["medians"].items():
        for side in ("cascade", "e2e"):
            v = m[side]
            print(f"{c:>3} {side:8s} {v['ttfa_p50_s']:8.3f} {v['latency_p50_s']:12.3f} {v['audio_s_per_wall_s']:10.3f}")
        r = m["e2e_over_cascade"]
        print(f"{c:>3} e2e/casc {r['ttfa_p50_s']:8.3f} {r['latency_p50_s']:12.3f} {r['audio_s_per_wall_s']:10.3f}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {"omni": args.omni, "llm": args.llm, "tts": args.tts, "reply": REPLY, "runs": [],
              "cpu": cpu_description()}
    log(cpu_line(report["cpu"]))
    run(args, report)
    summarize(report, args.concurrency)
    print_table(report)
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
