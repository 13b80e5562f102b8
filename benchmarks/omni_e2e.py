"""Qwen2.5-Omni or Qwen3-Omni end to end: omnistage (AsyncOmni, streamed speech, requests at
concurrency C) against transformers (`generate` with audio, one request at a time), in one run,
as ratios.

    python -m benchmarks.omni_e2e [--model DIR | --model qwen3_omni | --size small]
                                  [--family qwen2_5_omni|qwen3_omni] [--concurrency 1,4,8,16]
                                  [--requests N | N1,N2,..] [--hf-requests 2] [--skip-hf] [--threads T]

The family: `--model qwen2_5_omni` / `--model qwen3_omni` (its tiny build of --size, small by
default), `--model tiny:ARCH[:SIZE]`, or a folder (its config.json architecture); no --model:
`--family` (default qwen2_5_omni) built at --size.

Workload: every request its own text chat, rendered with the folder's chat template (Qwen2.5-Omni:
under the default system prompt, which its pipeline adds for speech; Qwen3-Omni has none);
thinker greedy, exactly --text-tokens tokens (EOS banned by min_tokens, as transformers'
min_new_tokens); talker greedy with the folder's repetition penalty, min = max. Qwen2.5-Omni:
exactly --codec-tokens codes (default 300, 50 Hz: 6 s), token2wav with its defaults (10 ODE
steps, guidance 0.5) on both sides. Qwen3-Omni: exactly --codec-tokens 16-codebook frames
(default 75, 12.5 Hz: 6 s; the talker runs frames + 1 steps, its last code gets no frame), code2wav
streamed in growing chunks (transformers: one chunked_decode at the end).

Figures: per level C, throughput = audio seconds out / wall seconds from the first submit to
the last request done; time to first audio (TTFA) = submit to the first PCM chunk, p50/p95;
real-time gap per request = the largest (time since its first chunk - audio received) just
before a chunk arrives (<= 0: the audio was always ahead of real time). transformers:
per-request latency (its first audio is its end) and audio-s per wall-s, in a subprocess after
omnistage has shut down (its own OpenMP team, an idle machine). Per level (printed as each
ends), the wall time of each stage's step(), timed around the stage objects. `--rounds N` runs
the levels N times interleaved (C1 C8 C1 C8 ...: a slow spell of a shared machine then falls on
every level alike); each level's figures pool its rounds' requests, and the report's `rounds`
holds each round's TTFA p50 and throughput per level and its C=8 / C=1 first-audio ratio.
Human-readable lines go to stdout as it runs; the LAST line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import omni_peers  # noqa: E402
from benchmarks.llm_throughput import _busy_note, _engine_option, log  # noqa: E402
from benchmarks.machine import cpu_description, cpu_line, finish_report, hold_to_isa, ISA_ENV, other_load  # noqa: E402
from benchmarks.omni_peers import percentile, print_breakdown, print_table, summarize  # noqa: E402
from benchmarks.qwen3_omni_peer import frames_from_windows  # noqa: E402

TOPICS = ("the sea", "a lighthouse", "winter", "a train", "the desert", "bees", "a violin",
          "the moon", "an old map", "rain", "a market", "glaciers", "a kite", "volcanoes",
          "a library", "owls", "a bridge", "tea", "comets", "a garden")
GRAPH = "<graph>"   # StageClock's key for the whole engine step (stages + routing)


VOCODER_FRAME_BUDGET = 1536   # VocoderSettings' default
QWEN2_5, QWEN3 = "qwen2_5_omni", "qwen3_omni"
ARCHITECTURES = {"Qwen2_5OmniForConditionalGeneration": QWEN2_5,
                 "Qwen3OmniMoeForConditionalGeneration": QWEN3}
DEFAULT_CODEC_TOKENS = {QWEN2_5: 300, QWEN3: 75}   # 6 s of audio: 50 Hz codes / 12.5 Hz frames


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Qwen2.5-Omni or Qwen3-Omni folder, tiny:ARCH[:SIZE], or "
                   f"{QWEN2_5} | {QWEN3} (its tiny build of --size); default: --family's build")
    p.add_argument("--family", choices=(QWEN2_5, QWEN3), default=None,
                   help="model family (default: from --model's config.json, else qwen2_5_omni)")
    p.add_argument("--size", default="small", help="tiny-builder size when --model is not a folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the built checkpoint")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="how the built checkpoint stores its weights: bfloat16 as the released "
                        "models (both engines compute in float32; default: float32)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of levels")
    p.add_argument("--requests", default=None,
                   help="requests per level: N, or one N per level in --concurrency's order "
                        "(default: max(4, 2 * C))")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the levels this many times, interleaved (C1 C8 C1 C8 ...), each round "
                        "its own requests: a slow spell of the machine then falls on every level "
                        "alike; each round is printed, and the figures pool every round's requests")
    p.add_argument("--hf-requests", type=int, default=2,
                   help="transformers requests, one at a time (~8 s each on the small Qwen2.5-Omni)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers side")
    p.add_argument("--isa", choices=sorted(ISA_ENV), default="native",
                   help="native: every library's best code for this CPU; avx2: both engines held "
                        "to AVX2 + FMA (our kernels, ATen, oneDNN, MKL: what a CPU without AVX-512 "
                        "runs; a proxy on this one's cores and memory); avx2-vnni: that plus "
                        "AVX-VNNI (Intel cores without AVX-512 since Alder Lake)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on both sides (default: torch's choice)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--codec-tokens", type=int, default=None,
                   help="talker codes per request: Qwen2.5-Omni codes (default 300), Qwen3-Omni "
                        "16-codebook frames (default 75)")
    p.add_argument("--deploy-config", default=None, metavar="YAML",
                   help="stage placement (e.g. token2wav in its own process); stages outside this "
                        "process are not in the per-stage breakdown")
    p.add_argument("--token2wav-bf16", action="store_true",
                   help="Qwen2.5-Omni, opt-in: the token2wav DiT's matmuls in bfloat16 (not the "
                        "reference's numerics)")
    p.add_argument("--token2wav-int8", action="store_true",
                   help="Qwen2.5-Omni, opt-in: the token2wav DiT's frame products in int8 (W8A8; "
                        "not the reference's numerics)")
    p.add_argument("--token2wav-catch-up", action="store_true",
                   help="Qwen2.5-Omni, opt-in: while a listener has run dry, later chunks are the "
                        "largest (VocoderSettings.catch_up)")
    p.add_argument("--frame-budget", type=int, default=None,
                   help=f"Qwen2.5-Omni: token2wav mel frames per step (VocoderSettings.frame_budget, "
                        f"default {VOCODER_FRAME_BUDGET})")
    p.add_argument("--engine-opt", action="append", default=[], type=_engine_option,
                   metavar="KEY=VALUE", help="omnistage engine option, e.g. linear_kernel=matmul")
    p.add_argument("--out-json", help="also write the final JSON object here")
    p.add_argument("--timeline", metavar="FILE",
                   help="write every stage step of every level as JSON lines (level, stage, start "
                        "and end seconds since the level began, requests in the stage): what first "
                        "audio waits on")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _levels(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.concurrency: sorted levels; args.requests_per_level: level -> requests."""
    try:
        given = [int(c) for c in args.concurrency.split(",") if c]
        counts = [int(n) for n in args.requests.split(",") if n] if args.requests else []
    except ValueError:
        p.error(f"--concurrency and --requests take comma lists of integers, got "
                f"{args.concurrency!r} and {args.requests!r}")
    if not given or min(given) < 1 or len(set(given)) != len(given):
        p.error("--concurrency needs at least one level, each >= 1, none twice")
    if len(counts) not in (0, 1, len(given)) or (counts and min(counts) < 1):
        p.error(f"--requests takes one positive count, or one per level ({len(given)})")
    counts = counts * len(given) if len(counts) == 1 else counts
    args.requests_per_level = {c: counts[i] if counts else max(4, 2 * c) for i, c in enumerate(given)}
    args.concurrency = sorted(given)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    _levels(p, args)
    for name in ("hf_requests", "text_tokens", "codec_tokens", "threads", "frame_budget", "rounds"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "hf_requests" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {v}")


def resolve_family(args: argparse.Namespace) -> tuple[Path, str]:
    """(checkpoint folder, family) from --model / --family / --size (see the module docstring)."""
    from omnistage.entrypoints.model_source import resolve_model

    model, family = args.model, args.family
    if model in ARCHITECTURES.values() or not model:
        family = model or family or QWEN2_5
        if args.family and args.family != family:
            raise SystemExit(f"--model {model} is a {family} build, but --family says {args.family}")
        return ensure_omni_model(family, args.size, args.seed, args.weights_dtype), family
    folder = Path(resolve_model(model))
    cfg = json.loads((folder / "config.json").read_text())
    found = ARCHITECTURES.get((cfg.get("architectures") or [None])[0])
    if found is None or (family and family != found):
        raise SystemExit(f"{folder}: architecture {cfg.get('architectures')} is not "
                         f"{family or ' or '.join(ARCHITECTURES)}")
    return folder, found


def finish_args(args: argparse.Namespace) -> None:
    """Family-dependent defaults and checks, once the family is known."""
    args.codec_tokens = args.codec_tokens or DEFAULT_CODEC_TOKENS[args.family]
    if args.family == QWEN3 and (args.token2wav_bf16 or args.token2wav_int8 or args.frame_budget
                                 or args.token2wav_catch_up):
        raise SystemExit("--token2wav-bf16, --token2wav-int8, --token2wav-catch-up and --frame-budget "
                         "are Qwen2.5-Omni's (token2wav); Qwen3-Omni's code2wav has none of them")
    args.frame_budget = args.frame_budget or VOCODER_FRAME_BUDGET


def ensure_omni_model(family: str, size: str, seed: int = 0, weights_dtype: str = "float32") -> Path:
    """The tiny-builder checkpoint of `family` and `size`, built once into <omnistage cache>/tiny/
    (delete the folder to rebuild it after the builder changed)."""
    from omnistage.entrypoints.model_source import tiny_checkpoint

    name = "Qwen3-Omni" if family == QWEN3 else "Qwen2.5-Omni"
    log(f"[model] the {size} {name}, weights stored in {weights_dtype} (built into the omnistage "
        f"cache on first use)")
    return tiny_checkpoint(family, size, seed, weights_dtype)


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
    codes: list | None = None  # the talker's codes token2wav received (in-process token2wav);
                               # Qwen3: the (16, F) frames code2wav decoded (requests alone, C=1)
    chunks: list[tuple[float, float]] = field(default_factory=list)   # (submit -> arrival s, audio s)
    samples: int = 0           # PCM samples received

    @property
    def realtime_gap_s(self) -> float | None:
        """The largest (time since the first chunk - audio received) just before a later chunk
        arrives: <= 0 if the audio received always covered the time since the first chunk.
        With one chunk: minus its length. None without audio."""
        return realtime_gap(self.chunks)


def realtime_gap(chunks: list[tuple[float, float]]) -> float | None:
    """See RequestTiming.realtime_gap_s; `chunks`: (arrival s, audio s) in arrival order."""
    if not chunks:
        return None
    first, got, gaps = chunks[0][0], 0.0, []
    for t, audio in chunks:
        if got:
            gaps.append((t - first) - got)
        got += audio
    return max(gaps) if gaps else -got


@dataclass
class StageTimes:
    step_s: dict[str, float]   # stage name (or GRAPH: the whole engine step) -> summed wall s
    calls: dict[str, int]      # step() calls that computed something
    parts_s: dict[str, float]  # token2wav's DiT and BigVGAN forwards (inside its step_s)
    steps: list[tuple[str, float, float, int]] = field(default_factory=list)   # StageClock.steps


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
        # (stage, start, end, requests in the stage after the step), perf_counter seconds
        self.steps: list[tuple[str, float, float, int]] = []
        for stage in pipeline.graph.stages.values():
            stage.step = self._timed(stage.name, stage.step, stage.num_requests)
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

    def _timed(self, key: str, step, requests=None):
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                t1 = time.perf_counter()
                self._s[key] += t1 - t0
                self._calls[key] += 1
                if requests is not None:
                    self.steps.append((key, t0, t1, requests()))
        return timed

    def _start(self, part: str) -> None:
        self._sync()
        self._started[part] = time.perf_counter()

    def _stop(self, part: str) -> None:
        self._sync()
        self._parts[part] += time.perf_counter() - self._started.pop(part)

    def reset(self) -> None:
        self.steps.clear()
        self._s.clear()
        self._calls.clear()
        self._parts.clear()

    def take(self) -> StageTimes:
        out = StageTimes({k: self._s[k] for k in self._names},
                         {k: self._calls[k] for k in self._names}, dict(self._parts), list(self.steps))
        self.reset()
        return out


@dataclass
class LevelResult:
    concurrency: int
    timings: list[RequestTiming]
    wall_s: float              # first submit -> last request done
    stages: StageTimes
    other_cores: float         # cores other processes used meanwhile
    started: float = 0.0       # perf_counter at the first submit

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

    def summary(self, text_tokens: int, audio_ok) -> dict:
        """`audio_ok(timing)`: whether the request got the workload's audio length."""
        ts = self.timings
        ttfa, last = [t.ttfa_s for t in ts], [t.last_audio_s for t in ts]
        gaps = [t.realtime_gap_s for t in ts if t.realtime_gap_s is not None]
        return {"requests": len(ts), "wall_s": round(self.wall_s, 3),
                "audio_s": round(sum(t.audio_s for t in ts), 3),
                "audio_s_per_wall_s": round(self.throughput, 4),
                "ttfa_p50_s": percentile(ttfa, 50), "ttfa_p95_s": percentile(ttfa, 95),
                "ttft_p50_s": percentile([t.ttft_s for t in ts], 50),
                "last_audio_p50_s": percentile(last, 50), "last_audio_p95_s": percentile(last, 95),
                "lengths_ok": all(len(t.text_token_ids) == text_tokens and audio_ok(t) for t in ts),
                "realtime_worst_gap_s": round(max(gaps), 4) if gaps else None,
                "other_cores": self.other_cores, "stages": self.breakdown(),
                "per_request": {"index": [t.index for t in ts], "ttfa_s": [round(x, 3) for x in ttfa],
                                "last_audio_s": [round(x, 3) for x in last],
                                "realtime_gap_s": [None if t.realtime_gap_s is None
                                                   else round(t.realtime_gap_s, 4) for t in ts]}}

    @staticmethod
    def pooled(rounds: list[LevelResult]) -> LevelResult:
        """One level's rounds as one result: every request, the walls and stage times summed
        (throughput = all audio / all wall), the busiest round's other_cores; the first
        round's start and steps (a timeline is written per round)."""
        first = rounds[0]
        if len(rounds) == 1:
            return first
        stages = StageTimes(defaultdict(float), Counter(), defaultdict(float), first.stages.steps)
        for r in rounds:
            for k, v in r.stages.step_s.items():
                stages.step_s[k] += v
                stages.calls[k] += r.stages.calls[k]
            for k, v in r.stages.parts_s.items():
                stages.parts_s[k] += v
        return LevelResult(first.concurrency, [t for r in rounds for t in r.timings],
                           sum(r.wall_s for r in rounds), stages, max(r.other_cores for r in rounds),
                           first.started)

    def line(self) -> str:
        return (f"[omnistage] C={self.concurrency}: {self.throughput:.3f} audio-s per wall-s "
                f"({sum(t.audio_s for t in self.timings):.1f} s of audio in {self.wall_s:.1f} s); "
                f"TTFA p50 {self.ttfa_p50():.2f} s")


# ---- omnistage ------------------------------------------------------------------------------
class FrameCapture:
    """omnistage's side of the Qwen3-Omni frames check: while a request runs alone (C=1), a
    forward hook on the code2wav stage's model records the windows it decodes; the request's
    (16, F) frames are their new frames (frames_from_windows with the stage's left context), as
    tests/models/qwen3_omni/test_qwen3_omni_parity.py reads them. Nothing is recorded when
    code2wav runs in another process."""

    def __init__(self, pipeline):
        from omnistage.models.qwen3_omni.code2wav_stage import Code2WavStage

        stage = pipeline.graph.stages.get("code2wav")
        self.stage = stage if isinstance(stage, Code2WavStage) else None
        self.frames: dict[str, list | None] = {}   # request id -> (16, F) frames

    @contextmanager
    def request(self, rid: str):
        if self.stage is None:
            yield
            return
        windows: list = []
        handle = self.stage.model.register_forward_hook(
            lambda m, args, out: windows.append(args[0].clone()))
        try:
            yield
        finally:
            handle.remove()
            self.frames[rid] = frames_from_windows(windows, self.stage.settings.left_context)


def omni_settings(args: argparse.Namespace):
    if args.family == QWEN3:
        from omnistage.models.qwen3_omni.recipe import Qwen3OmniSettings

        return Qwen3OmniSettings()
    from omnistage.models.qwen2_5_omni.recipe import OmniSettings
    from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings

    return OmniSettings(vocoder=VocoderSettings(frame_budget=args.frame_budget,
                                                bf16_dit=args.token2wav_bf16,
                                                int8_dit=args.token2wav_int8,
                                                catch_up=args.token2wav_catch_up))


def omnistage_params(args: argparse.Namespace):
    """(thinker SamplingParams, OutputOptions with the talker's) of every timed request.
    Qwen3-Omni: frames + 1 talker codes (its last code gets no frame, as in transformers)."""
    from omnistage import SamplingParams
    from omnistage.engine_api import OutputOptions

    gen_file = Path(args.model_dir) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    codes = args.codec_tokens + (1 if args.family == QWEN3 else 0)
    thinker = SamplingParams(temperature=0.0, max_tokens=args.text_tokens, min_tokens=args.text_tokens)
    talker = SamplingParams(temperature=0.0, max_tokens=codes, min_tokens=codes,
                            repetition_penalty=gen.get("talker_repetition_penalty", 1.05))
    return thinker, OutputOptions(modalities=["text", "audio"], talker_params=talker)


async def one_request(engine, rid: str, index: int, thinker, opts, sem: asyncio.Semaphore,
                      capture: FrameCapture | None = None) -> RequestTiming:
    """One streamed request; with `capture`, code2wav's windows are recorded while it runs."""
    async with sem:
        with capture.request(rid) if capture else nullcontext():
            t0 = time.perf_counter()
            first_text, rate, tokens, chunks = None, 24000, [], []
            async for d in engine.generate(chat(index), thinker, request_id=rid, output=opts):
                now = time.perf_counter()
                if d.token_ids and first_text is None:
                    first_text = now
                tokens += d.token_ids
                if d.audio is not None and d.audio.size:
                    rate = d.sample_rate or rate
                    chunks.append((now - t0, d.audio.size))
                if d.finished and d.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"request {rid} ended with {d.finish_reason}: {d}")
            done = time.perf_counter()
    if not chunks:
        raise RuntimeError(f"request {rid} returned no audio")
    samples = sum(n for _, n in chunks)
    return RequestTiming(index, chunks[0][0], (first_text or done) - t0, chunks[-1][0], done - t0,
                         samples / rate, tokens, chunks=[(t, n / rate) for t, n in chunks],
                         samples=samples)


async def run_level(engine, clock: StageClock, c: int, indices: list[int], thinker, opts,
                    capture: FrameCapture | None = None) -> LevelResult:
    """All `indices` submitted at once behind a semaphore of `c`; the engine idle at both ends.
    `capture` (Qwen3-Omni) records each request's frames at C=1 only, where it runs alone."""
    await asyncio.to_thread(engine.wait_idle)
    clock.reset()
    sem = asyncio.Semaphore(c)
    capture = capture if c == 1 else None
    load: dict = {}
    with other_load(load):
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(one_request(engine, f"c{c}-r{i}", i, thinker, opts, sem, capture)
                                         for i in indices))
        wall = time.perf_counter() - t0
        await asyncio.to_thread(engine.wait_idle)
    for t in timings:
        rid = f"c{c}-r{t.index}"
        t.codes = clock.codes.pop(rid, None) or (capture.frames.pop(rid, None) if capture else None)
    return LevelResult(c, list(timings), wall, clock.take(), load.get("other_cores", 0.0), t0)


async def _all_levels(engine, args: argparse.Namespace, report: dict,
                      levels: dict[int, LevelResult]) -> None:
    """The warm-up (not timed: every stage runs once, first-use packing, allocator growth), then
    each level in turn; every request its own chat."""
    thinker, opts = omnistage_params(args)
    clock = StageClock(engine.engine)
    capture = FrameCapture(engine.engine) if args.family == QWEN3 else None
    t = time.perf_counter()
    warm = replace(opts, talker_params=replace(opts.talker_params, max_tokens=32, min_tokens=32))
    await one_request(engine, "warm-up", 10_000, replace(thinker, max_tokens=8, min_tokens=8),
                      warm, asyncio.Semaphore(1))
    report["omnistage_warmup_s"] = round(time.perf_counter() - t, 3)
    start, rounds = 0, defaultdict(list)
    for r in range(args.rounds):
        for c in args.concurrency:
            n = args.requests_per_level[c]
            log(f"[omnistage] {_round_tag(args, r)}concurrency {c}: {n} requests ...")
            res = await run_level(engine, clock, c, list(range(start, start + n)), thinker, opts, capture)
            start += n
            rounds[c].append(res)
            levels[c] = LevelResult.pooled(rounds[c])
            log(res.line() + _busy_note({"other_cores": res.other_cores}))
            print_breakdown(res)
            if args.timeline:
                write_timeline(args.timeline, res, append=start > n)
    if args.rounds > 1:
        report["rounds"] = round_figures(rounds)


def _round_tag(args: argparse.Namespace, r: int) -> str:
    return f"round {r + 1}/{args.rounds}, " if args.rounds > 1 else ""


def round_figures(rounds: dict[int, list[LevelResult]]) -> dict:
    """Each round's TTFA p50 and throughput per level, and its first-audio ratio C=8 / C=1 (the
    issue's) where both levels ran, with the median of those ratios; printed as it goes."""
    out = {str(c): {"ttfa_p50_s": [r.ttfa_p50() for r in rs],
                    "audio_s_per_wall_s": [round(r.throughput, 4) for r in rs]} for c, rs in rounds.items()}
    for c, fig in out.items():
        log(f"[rounds] C={c}: TTFA p50 {fig['ttfa_p50_s']} s; audio-s per wall-s {fig['audio_s_per_wall_s']}")
    if 1 in rounds and 8 in rounds:
        ratios = [round(b / a, 3) for a, b in zip(out["1"]["ttfa_p50_s"], out["8"]["ttfa_p50_s"])]
        out["ttfa_p50_c8_vs_c1"] = {"per_round": ratios, "median": round(statistics.median(ratios), 3)}
        log(f"[rounds] TTFA p50 C=8 / C=1 per round {ratios}, median {out['ttfa_p50_c8_vs_c1']['median']}")
    return out


def write_timeline(path: str, res: LevelResult, append: bool) -> None:
    """One JSON line per stage step (see --timeline), then one per request (its first audio and
    last audio, seconds since the level began)."""
    with open(path, "a" if append else "w") as f:
        for stage, t0, t1, n in res.stages.steps:
            f.write(json.dumps({"level": res.concurrency, "stage": stage, "start": round(t0 - res.started, 4),
                                "end": round(t1 - res.started, 4), "requests": n}) + "\n")
        for t in res.timings:
            f.write(json.dumps({"level": res.concurrency, "request": t.index, "ttfa": round(t.ttfa_s, 4),
                                "last_audio": round(t.last_audio_s, 4),
                                "chunks": [[round(a, 4), round(d, 4)] for a, d in t.chunks]}) + "\n")


def run_omnistage(args: argparse.Namespace, report: dict) -> dict[int, LevelResult]:
    from omnistage import AsyncOmni
    from omnistage.runtime.process import freeze_loaded_heap

    options = dict(args.engine_opt)
    if args.threads:
        options.setdefault("num_threads", args.threads)
    options.setdefault("max_num_seqs", max(64, max(args.concurrency)))
    t0 = time.perf_counter()
    engine = AsyncOmni(str(args.model_dir), omni_settings=omni_settings(args),
                       deploy_config=args.deploy_config, **options)
    report["omnistage_engine_start_s"] = round(time.perf_counter() - t0, 3)
    report["omnistage_options"] = options
    freeze_loaded_heap()       # as `omnistage serve` does once its engine is built
    log(f"[omnistage] engine started in {report['omnistage_engine_start_s']:.1f} s; stages "
        f"{list(engine.engine.graph.stages)}")
    levels: dict[int, LevelResult] = {}
    try:
        asyncio.run(_all_levels(engine, args, report, levels))
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


def workload(args: argparse.Namespace) -> dict:
    """The report's workload entry; audio_s_per_request: the audio the talker's codes stand for."""
    common = {"family": args.family, "text_tokens": args.text_tokens, "codec_tokens": args.codec_tokens,
              "concurrency": args.concurrency,
              "requests_per_level": {str(c): n for c, n in args.requests_per_level.items()},
              "rounds": args.rounds,
              "hf_requests": 0 if args.skip_hf else args.hf_requests,
              "thinker": "greedy, EOS banned (min_tokens = max_tokens)"}
    if args.family == QWEN3:
        spf = qwen3_code2wav(args.model_dir).samples_per_frame
        return {**common, "audio_s_per_request": args.codec_tokens * spf / 24000,
                "talker": "greedy (code predictor too), folder's repetition penalty, min = max = "
                          "frames + 1 codes (the last gets no frame)",
                "code2wav": "omnistage: streamed in growing chunks; transformers: chunked_decode at "
                            "the end; every chunk is trimmed_samples short of its frames' span"}
    # each code: 2 mel frames (DiT repeats) of 240 samples at 24 kHz
    return {**common, "audio_s_per_request": args.codec_tokens * 2 * 240 / 24000,
            "talker": "greedy, folder's repetition penalty, min = max codes"}


def qwen3_code2wav(model_dir: Path):
    """The folder's Code2WavConfig (samples per frame, samples a chunk falls short)."""
    from omnistage.models.qwen3_omni.code2wav import Code2WavConfig

    return Code2WavConfig.from_hf(json.loads((model_dir / "config.json").read_text())["code2wav_config"])


def audio_check(args: argparse.Namespace):
    """timing -> whether it got the workload's audio. Qwen3-Omni: frames * samples_per_frame less
    trimmed_samples for each chunk (1 .. frames chunks; the chunking is code2wav's business)."""
    if args.family != QWEN3:
        return None   # omni_peers.summarize's default: audio_s_per_request within 1 ms
    c = qwen3_code2wav(args.model_dir)
    full, cut, frames = args.codec_tokens * c.samples_per_frame, c.trimmed_samples, args.codec_tokens

    def ok(t: RequestTiming) -> bool:
        short = full - t.samples
        return short == 0 if not cut else (0 < short <= frames * cut and short % cut == 0)
    return ok


def main(argv: list[str] | None = None) -> dict:
    from omnistage.runtime.process import serial_torch_thread

    # This thread (which may build the tiny checkpoint) must not open an OpenMP team of its
    # own: a second team besides the engine thread's halves the engine's speed.
    serial_torch_thread()
    args = parse_args(argv)
    hold_to_isa("benchmarks.omni_e2e", args.isa, argv)
    args.model_dir, args.family = resolve_family(args)
    finish_args(args)
    built = not args.model or args.model in ARCHITECTURES.values()
    report = {"model": str(args.model_dir), "family": args.family, "size": args.size if built else None,
              "workload": workload(args), "threads": args.threads, "code": code_state(), "errors": {},
              "load_avg_start": os.getloadavg(), "cpu_count": os.cpu_count(),
              "cpu": cpu_description(), "isa": args.isa}
    log(f"{cpu_line(report['cpu'])}; libraries held to {args.isa}")
    what = "frames" if args.family == QWEN3 else "codes"
    log(f"[workload] {args.family} model {args.model_dir}; {args.text_tokens} text tokens and "
        f"{args.codec_tokens} {what} ({report['workload']['audio_s_per_request']:.2f} s of audio) "
        f"per request; levels {args.concurrency}, requests {args.requests_per_level}")
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
                args.codec_tokens, args.threads, args.family))
        report["hf_other_cores"] = load.get("other_cores", 0.0)
    summarize(report, levels, hf, args.text_tokens, audio_check(args), args.family)
    print_table(report)
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
