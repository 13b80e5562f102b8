"""Qwen2.5-Omni end to end: omnistage (AsyncOmni, streamed speech, requests at concurrency C)
against transformers (`generate` with audio, one request at a time), in one run, as ratios.

    python -m benchmarks.omni_e2e [--model DIR | --size small] [--concurrency 1,4,8,16]
                                  [--requests N] [--hf-requests 2] [--skip-hf] [--threads T]

Workload: text chats rendered with the folder's chat template under the default system prompt
(which the pipeline adds for speech); thinker greedy, exactly --text-tokens tokens (EOS banned
by min_tokens, as transformers' min_new_tokens); talker greedy with the folder's repetition
penalty, exactly --codec-tokens codes (min = max), i.e. codec_tokens / 50 s of audio; token2wav
with its defaults (10 ODE steps, guidance 0.5) on both sides. Every request has its own prompt.

Figures: per level C, throughput = audio seconds out / wall seconds from the first submit to
the last request done; time to first audio (TTFA) = submit to the first PCM chunk, p50/p95.
transformers: per-request latency (its first audio is its end) and audio-s per wall-s, in a
subprocess after omnistage has shut down (its own OpenMP team, an idle machine). Per level
(printed as each ends), the wall time of each stage's step(), timed around the stage objects.
Human-readable lines go to stdout as it runs; the LAST line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import omni_peers  # noqa: E402
from benchmarks.llm_throughput import _busy_note, _engine_option, log  # noqa: E402
from benchmarks.machine import finish_report, other_load  # noqa: E402
from benchmarks.omni_peers import percentile, print_breakdown, print_table, summarize  # noqa: E402

TOPICS = ("the sea", "a lighthouse", "winter", "a train", "the desert", "bees", "a violin",
          "the moon", "an old map", "rain", "a market", "glaciers", "a kite", "volcanoes",
          "a library", "owls", "a bridge", "tea", "comets", "a garden")
GRAPH = "<graph>"   # StageClock's key for the whole engine step (stages + routing)


VOCODER_FRAME_BUDGET = 1536   # VocoderSettings' default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Qwen2.5-Omni folder (default: build --size into the cache)")
    p.add_argument("--size", default="small", help="tiny-builder size when --model is not given")
    p.add_argument("--seed", type=int, default=0, help="seed of the built checkpoint")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of levels")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: max(4, 2 * C))")
    p.add_argument("--hf-requests", type=int, default=2,
                   help="transformers requests, one at a time (~8 s each on the small size)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers side")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on both sides (default: torch's choice)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--codec-tokens", type=int, default=300)
    p.add_argument("--deploy-config", default=None, metavar="YAML",
                   help="stage placement (e.g. token2wav in its own process); stages outside this "
                        "process are not in the per-stage breakdown")
    p.add_argument("--token2wav-bf16", action="store_true",
                   help="opt-in: the token2wav DiT's matmuls in bfloat16 (not the reference's numerics)")
    p.add_argument("--frame-budget", type=int, default=VOCODER_FRAME_BUDGET,
                   help="token2wav mel frames per step (VocoderSettings.frame_budget)")
    p.add_argument("--engine-opt", action="append", default=[], type=_engine_option,
                   metavar="KEY=VALUE", help="omnistage engine option, e.g. linear_kernel=matmul")
    p.add_argument("--out-json", help="also write the final JSON object here")
    args = p.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c})
    except ValueError:
        p.error(f"--concurrency must be a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs at least one level, each >= 1")
    for name in ("requests", "hf_requests", "text_tokens", "codec_tokens", "threads"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "hf_requests" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {v}")
    return args


def ensure_omni_model(size: str, seed: int = 0) -> Path:
    """The tiny-builder Qwen2.5-Omni of `size`, built once into <omnistage cache>/tiny/
    (delete the folder to rebuild it after the builder changed)."""
    from omnistage.entrypoints.model_source import tiny_checkpoint

    log(f"[model] the {size} Qwen2.5-Omni (built into the omnistage cache on first use)")
    return tiny_checkpoint("qwen2_5_omni", size, seed)


def code_state() -> dict:
    """The commit and the uncommitted omnistage files the figures were measured on."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=Path(__file__).resolve().parent.parent,
                              capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "omnistage").splitlines()}


def chat(index: int) -> list[dict]:
    """Request `index`'s chat (the pipeline adds the system prompt): distinct for each index,
    so no request reuses another's whole prompt from the prefix cache (the system prompt is
    shared, as in a server)."""
    a, b = TOPICS[index % len(TOPICS)], TOPICS[(index * 7 + 3) % len(TOPICS)]
    return [{"role": "user", "content": f"Request {index}: tell me a short story about {a} and {b}."}]


# ---- measurements ---------------------------------------------------------------------------
@dataclass
class RequestTiming:
    index: int                 # which chat (see chat())
    ttfa_s: float              # submit -> first PCM chunk
    ttft_s: float              # submit -> first text token
    last_audio_s: float        # submit -> last PCM chunk
    done_s: float              # submit -> end of the stream
    audio_s: float             # seconds of audio received
    text_token_ids: list[int]
    codes: list[int] | None = None   # the talker's codes token2wav received (in-process token2wav)


@dataclass
class StageTimes:
    step_s: dict[str, float]   # stage name (or GRAPH: the whole engine step) -> summed wall s
    calls: dict[str, int]      # step() calls that computed something
    parts_s: dict[str, float]  # token2wav's DiT and BigVGAN forwards (inside its step_s)


class StageClock:
    """Wall time of each stage's step() and of the whole graph step, summed on the engine
    thread: wraps the step of the pipeline and of its stage objects (instance attributes, in
    this process only) and hooks the DiT / BigVGAN modules of an in-process token2wav. A stage
    placed in another process is timed as its proxy's step() here. On CUDA each timing first
    synchronises the device, so figures are compute times, not launch times."""

    def __init__(self, pipeline):
        import torch

        from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderStage

        cuda = pipeline.config.torch_device.type == "cuda"
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self._s: dict[str, float] = defaultdict(float)
        self._calls: Counter = Counter()
        self._parts: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self._names = [*pipeline.graph.stages, GRAPH]   # listed even if never stepped
        self.codes: dict[str, list[int]] = defaultdict(list)   # request id -> talker codes
        for stage in pipeline.graph.stages.values():
            stage.step = self._timed(stage.name, stage.step)
        pipeline.step = self._timed(GRAPH, pipeline.step)
        t2w = pipeline.graph.stages.get("token2wav")
        if isinstance(t2w, VocoderStage):
            t2w.add = self._recording(t2w.add)
            for part, module in (("dit", t2w.model.dit), ("bigvgan", t2w.model.vocoder)):
                module.register_forward_pre_hook(lambda *_, part=part: self._start(part))
                module.register_forward_hook(lambda *_, part=part: self._stop(part))

    def _recording(self, add):
        """The vocoder's add(), recording each request's codec codes on the way in."""
        def recording(chunk):
            self.codes[chunk.request_id] += chunk.codes
            return add(chunk)
        return recording

    def _timed(self, key: str, step):
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                self._s[key] += time.perf_counter() - t0
                self._calls[key] += 1
        return timed

    def _start(self, part: str) -> None:
        self._sync()
        self._started[part] = time.perf_counter()

    def _stop(self, part: str) -> None:
        self._sync()
        self._parts[part] += time.perf_counter() - self._started.pop(part)

    def reset(self) -> None:
        self._s.clear()
        self._calls.clear()
        self._parts.clear()

    def take(self) -> StageTimes:
        out = StageTimes({k: self._s[k] for k in self._names},
                         {k: self._calls[k] for k in self._names}, dict(self._parts))
        self.reset()
        return out


@dataclass
class LevelResult:
    concurrency: int
    timings: list[RequestTiming]
    wall_s: float              # first submit -> last request done
    stages: StageTimes
    other_cores: float         # cores other processes used meanwhile

    @property
    def throughput(self) -> float:
        return sum(t.audio_s for t in self.timings) / self.wall_s

    def ttfa_p50(self, indices: set[int] | None = None) -> float:
        return percentile([t.ttfa_s for t in self.timings if indices is None or t.index in indices], 50)

    def breakdown(self) -> dict:
        st, wall = self.stages, self.wall_s
        names = [k for k in st.step_s if k != GRAPH]
        out = {k: {"s": round(st.step_s[k], 3), "calls": st.calls[k],
                   "ms_per_call": round(1e3 * st.step_s[k] / max(1, st.calls[k]), 2),
                   "share_of_wall": round(st.step_s[k] / wall, 3)} for k in names}
        graph = st.step_s.get(GRAPH, 0.0)
        out["routing_s"] = round(graph - sum(st.step_s[k] for k in names), 3)
        out["engine_step_s"], out["engine_idle_s"] = round(graph, 3), round(wall - graph, 3)
        out.update({f"token2wav_{k}_s": round(v, 3) for k, v in st.parts_s.items()})
        return out

    def summary(self, text_tokens: int, audio_s: float) -> dict:
        ts = self.timings
        ttfa, last = [t.ttfa_s for t in ts], [t.last_audio_s for t in ts]
        return {"requests": len(ts), "wall_s": round(self.wall_s, 3),
                "audio_s": round(sum(t.audio_s for t in ts), 3),
                "audio_s_per_wall_s": round(self.throughput, 4),
                "ttfa_p50_s": percentile(ttfa, 50), "ttfa_p95_s": percentile(ttfa, 95),
                "ttft_p50_s": percentile([t.ttft_s for t in ts], 50),
                "last_audio_p50_s": percentile(last, 50), "last_audio_p95_s": percentile(last, 95),
                "lengths_ok": all(len(t.text_token_ids) == text_tokens
                                  and abs(t.audio_s - audio_s) < 1e-3 for t in ts),
                "other_cores": self.other_cores, "stages": self.breakdown(),
                "per_request": {"index": [t.index for t in ts], "ttfa_s": [round(x, 3) for x in ttfa],
                                "last_audio_s": [round(x, 3) for x in last]}}

    def line(self) -> str:
        return (f"[omnistage] C={self.concurrency}: {self.throughput:.3f} audio-s per wall-s "
                f"({sum(t.audio_s for t in self.timings):.1f} s of audio in {self.wall_s:.1f} s); "
                f"TTFA p50 {self.ttfa_p50():.2f} s")


# ---- omnistage ------------------------------------------------------------------------------
def omnistage_params(args: argparse.Namespace):
    """(thinker SamplingParams, OutputOptions with the talker's) of every timed request."""
    from omnistage import SamplingParams
    from omnistage.engine_api import OutputOptions

    gen_file = Path(args.model_dir) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    thinker = SamplingParams(temperature=0.0, max_tokens=args.text_tokens, min_tokens=args.text_tokens)
    talker = SamplingParams(temperature=0.0, max_tokens=args.codec_tokens, min_tokens=args.codec_tokens,
                            repetition_penalty=gen.get("talker_repetition_penalty", 1.05))
    return thinker, OutputOptions(modalities=["text", "audio"], talker_params=talker)


async def one_request(engine, rid: str, index: int, thinker, opts,
                      sem: asyncio.Semaphore) -> RequestTiming:
    async with sem:
        t0 = time.perf_counter()
        first_text = first_audio = last_audio = None
        samples, rate, tokens = 0, 24000, []
        async for d in engine.generate(chat(index), thinker, request_id=rid, output=opts):
            now = time.perf_counter()
            if d.token_ids and first_text is None:
                first_text = now
            tokens += d.token_ids
            if d.audio is not None and d.audio.size:
                first_audio = first_audio or now
                last_audio, rate = now, d.sample_rate or rate
                samples += d.audio.size
            if d.finished and d.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {rid} ended with {d.finish_reason}: {d}")
        done = time.perf_counter()
    if first_audio is None:
        raise RuntimeError(f"request {rid} returned no audio")
    return RequestTiming(index, first_audio - t0, (first_text or done) - t0, last_audio - t0,
                         done - t0, samples / rate, tokens)


async def run_level(engine, clock: StageClock, c: int, indices: list[int], thinker, opts) -> LevelResult:
    """All `indices` submitted at once behind a semaphore of `c`; the engine idle at both ends."""
    await asyncio.to_thread(engine.wait_idle)
    clock.reset()
    sem = asyncio.Semaphore(c)
    load: dict = {}
    with other_load(load):
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(one_request(engine, f"c{c}-r{i}", i, thinker, opts, sem)
                                         for i in indices))
        wall = time.perf_counter() - t0
        await asyncio.to_thread(engine.wait_idle)
    for t in timings:
        t.codes = clock.codes.pop(f"c{c}-r{t.index}", None)
    return LevelResult(c, list(timings), wall, clock.take(), load.get("other_cores", 0.0))


def run_omnistage(args: argparse.Namespace, report: dict) -> dict[int, LevelResult]:
    from omnistage import AsyncOmni

    options = dict(args.engine_opt)
    if args.threads:
        options.setdefault("num_threads", args.threads)
    options.setdefault("max_num_seqs", max(64, max(args.concurrency)))
    t0 = time.perf_counter()
    from omnistage.models.qwen2_5_omni.recipe import OmniSettings
    from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings

    settings = OmniSettings(vocoder=VocoderSettings(frame_budget=args.frame_budget,
                                                    bf16_dit=args.token2wav_bf16))
    engine = AsyncOmni(str(args.model_dir), omni_settings=settings, deploy_config=args.deploy_config,
                       **options)
    report["omnistage_engine_start_s"] = round(time.perf_counter() - t0, 3)
    report["omnistage_options"] = options
    log(f"[omnistage] engine started in {report['omnistage_engine_start_s']:.1f} s; stages "
        f"{list(engine.engine.graph.stages)}")
    thinker, opts = omnistage_params(args)
    clock = StageClock(engine.engine)
    levels: dict[int, LevelResult] = {}

    async def all_levels() -> None:
        # Warm-up, not timed: every stage runs once (first-use packing, allocator growth).
        t = time.perf_counter()
        warm = replace(opts, talker_params=replace(opts.talker_params, max_tokens=32, min_tokens=32))
        await one_request(engine, "warm-up", 10_000, replace(thinker, max_tokens=8, min_tokens=8),
                          warm, asyncio.Semaphore(1))
        report["omnistage_warmup_s"] = round(time.perf_counter() - t, 3)
        start = 0
        for c in args.concurrency:
            n = args.requests or max(4, 2 * c)
            log(f"[omnistage] concurrency {c}: {n} requests ...")
            res = await run_level(engine, clock, c, list(range(start, start + n)), thinker, opts)
            start += n
            levels[c] = res
            log(res.line() + _busy_note({"other_cores": res.other_cores}))
            print_breakdown(res)

    try:
        asyncio.run(all_levels())
    finally:
        engine.shutdown()
    return levels


def _attempt(report: dict, key: str, fn):
    """Run one side; on failure record the error under `key` and carry on."""
    try:
        return fn()
    except Exception as e:   # one broken side must not hide the other's figures
        traceback.print_exc(file=sys.stderr)
        log(f"[{key}] FAILED: {type(e).__name__}: {e}")
        report["errors"][key] = f"{type(e).__name__}: {e}"
        return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.model_dir = Path(args.model) if args.model else ensure_omni_model(args.size, args.seed)
    report = {"model": str(args.model_dir), "size": None if args.model else args.size,
              "workload": {"text_tokens": args.text_tokens, "codec_tokens": args.codec_tokens,
                           # each code: 2 mel frames (DiT repeats) of 240 samples at 24 kHz
                           "audio_s_per_request": args.codec_tokens * 2 * 240 / 24000,
                           "concurrency": args.concurrency, "requests_per_level": args.requests,
                           "hf_requests": 0 if args.skip_hf else args.hf_requests,
                           "thinker": "greedy, EOS banned (min_tokens = max_tokens)",
                           "talker": "greedy, folder's repetition penalty, min = max codes"},
              "threads": args.threads, "code": code_state(), "errors": {},
              "load_avg_start": os.getloadavg(), "cpu_count": os.cpu_count()}
    log(f"[workload] model {args.model_dir}; {args.text_tokens} text tokens and "
        f"{args.codec_tokens} codes ({report['workload']['audio_s_per_request']:.2f} s of audio) "
        f"per request; levels {args.concurrency}")
    if os.getloadavg()[0] > 0.5:
        log(f"[warning] load average {os.getloadavg()[0]:.1f} before starting: other processes "
            f"share the {os.cpu_count()} CPUs, timings will be low and noisy")
    levels = _attempt(report, "omnistage", lambda: run_omnistage(args, report)) or {}
    hf = None
    if not args.skip_hf and args.hf_requests:
        load: dict = {}
        with other_load(load):
            hf = _attempt(report, "hf", lambda: omni_peers.run_peer(
                args.model_dir, [chat(i) for i in range(args.hf_requests)], args.text_tokens,
                args.codec_tokens, args.threads))
        report["hf_other_cores"] = load.get("other_cores", 0.0)
    summarize(report, levels, hf, args.text_tokens)
    print_table(report)
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
