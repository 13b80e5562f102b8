"""The transformers side of benchmarks/omni_e2e.py: Qwen2.5-Omni `generate` with audio, one
request at a time, in its own process (Qwen3-Omni's: benchmarks/qwen3_omni_peer.py, the same
subprocess with `HFJob.family = "qwen3_omni"`).

    python -m benchmarks.omni_peers '<json of HFJob>'     # the last stdout line is JSON

A fresh process keeps transformers' torch work off the OpenMP thread team of omnistage's
engine thread (two teams in one process slow both; see docs/architecture.md, "Threads").
Arguments and results travel as JSON (no pickle between processes).

Each request: the chat messages rendered with the folder's chat template (the default system
prompt first, as omnistage's pipeline adds it for speech), one masked left-pad token in front
(transformers 5.24 drops an all-ones attention mask and its talker then skips the codec
bos/pad additions; the masked pad keeps the mask, as tests/models/qwen2_5_omni/
test_omni_parity.py does), greedy thinker forced to exactly `text_tokens`
(thinker_min_new_tokens), greedy talker forced to exactly `codec_tokens`
(talker_min_new_tokens = talker_max_new_tokens; eos ids and repetition penalty from
generation_config.json), token2wav with its defaults (10 ODE steps, guidance 0.5).

Below the subprocess side: omnistage's figures set against it (ratios and figures against the
targets, cross-checks of text tokens and talker codes, the summary table).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.omni_jobs import HFJob, HFResult  # noqa: F401 (re-exported for callers)

_REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 24000   # token2wav's output rate


def system_prompt() -> str:
    from omnistage.models.qwen2_5_omni.prompt import DEFAULT_SYSTEM_PROMPT

    return DEFAULT_SYSTEM_PROMPT


def talker_settings(model_dir: str | Path, codec_tokens: int) -> dict:
    """Greedy talker forced to `codec_tokens` codes; eos ids and repetition penalty from the
    folder's generation_config.json (transformers' generate does not read them from there)."""
    gen_file = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return {"talker_do_sample": False, "talker_max_new_tokens": codec_tokens,
            "talker_min_new_tokens": codec_tokens,
            "talker_eos_token_id": gen.get("talker_eos_token_id", [8292, 8294]),
            "talker_repetition_penalty": gen.get("talker_repetition_penalty", 1.05)}


def _input_ids(tokenizer, messages: list[dict], pad_id: int):
    """(1, 1 + P) ids with one masked left pad, and its attention mask."""
    import torch

    chat = [{"role": "system", "content": system_prompt()}, *messages]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([[pad_id] + tokenizer(text)["input_ids"]])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    return ids, mask


def _time_parts(model) -> dict[str, float]:
    """A dict that forward hooks keep filling with each part's summed forward seconds."""
    parts = {"thinker": model.thinker, "talker": model.talker,
             "token2wav_dit": model.token2wav.code2wav_dit_model,
             "token2wav_bigvgan": model.token2wav.code2wav_bigvgan_model}
    spent, started = dict.fromkeys(parts, 0.0), {}

    def stop(name: str) -> None:
        spent[name] += time.perf_counter() - started.pop(name)

    for name, module in parts.items():
        module.register_forward_pre_hook(lambda *_, n=name: started.__setitem__(n, time.perf_counter()))
        module.register_forward_hook(lambda *_, n=name: stop(n))
    return spent


def run_job(job: HFJob) -> HFResult:
    if job.family == "qwen3_omni":
        from benchmarks.qwen3_omni_peer import run_job as run_qwen3_job

        return run_qwen3_job(job)
    return run_qwen2_5_job(job)


def run_qwen2_5_job(job: HFJob) -> HFResult:
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    if job.threads:
        torch.set_num_threads(job.threads)
    t0 = time.perf_counter()
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(job.model_dir,
                                                                dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(job.model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    speaker = sorted(model.speaker_map)[0]     # omnistage's default voice: the first by name
    talker = talker_settings(job.model_dir, job.codec_tokens)

    @torch.inference_mode()
    def generate(messages, text_tokens: int, codec_tokens: int):
        ids, mask = _input_ids(tok, messages, pad_id)
        kw = {**talker, "talker_max_new_tokens": codec_tokens, "talker_min_new_tokens": codec_tokens}
        seq, wav = model.generate(input_ids=ids, attention_mask=mask, speaker=speaker,
                                  thinker_max_new_tokens=text_tokens,
                                  thinker_min_new_tokens=text_tokens, thinker_do_sample=False,
                                  **kw)
        return seq[0, ids.shape[1]:].tolist(), wav.reshape(-1).numel() / SAMPLE_RATE

    generate([{"role": "user", "content": "Warm up."}], 4, 16)   # not timed
    load_s = time.perf_counter() - t0
    res = HFResult(load_s, [], [], [], [], torch.get_num_threads(), talker, _time_parts(model))
    # token2wav's first argument: the talker's codes (B=1), recorded by a forward hook
    model.token2wav.register_forward_hook(lambda m, args, out: res.codes.append(args[0][0].tolist()))
    for messages in job.messages:
        t = time.perf_counter()
        tokens, audio_s = generate(messages, job.text_tokens, job.codec_tokens)
        res.latency_s.append(time.perf_counter() - t)
        res.audio_s.append(audio_s)
        res.text_token_ids.append(tokens)
        print(f"[hf] request {len(res.latency_s)}/{len(job.messages)}: {res.latency_s[-1]:.2f} s, "
              f"{audio_s:.2f} s of audio, {len(tokens)} text tokens", file=sys.stderr, flush=True)
    return res


def run_in_subprocess(job: HFJob, timeout_s: float | None = None) -> HFResult:
    """run_job in a fresh Python process; its progress lines go to our stderr."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.omni_peers", json.dumps(asdict(job))],
                          stdout=subprocess.PIPE, stderr=None, text=True, cwd=_REPO_ROOT,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the transformers subprocess exited with {done.returncode} "
                           f"(its traceback is above on stderr)")
    return HFResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def run_peer(model_dir, chats: list[list[dict]], text_tokens: int, codec_tokens: int,
             threads: int | None = None, family: str = "qwen2_5_omni") -> HFResult:
    """The whole transformers side, with progress lines."""
    print(f"[hf] transformers generate(return_audio) one request at a time, {len(chats)} "
          f"requests, in a subprocess ...", flush=True)
    res = run_in_subprocess(HFJob(str(model_dir), chats, text_tokens, codec_tokens, threads, family))
    print(f"[hf] load + warm-up {res.load_s:.1f} s; latency "
          f"{', '.join(f'{x:.2f}' for x in res.latency_s)} s; {res.throughput:.3f} audio-s per "
          f"wall-s; forward time by part: "
          f"{', '.join(f'{k} {v:.2f} s' for k, v in res.parts_s.items())}", flush=True)
    return res


def percentile(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 3) if xs else float("nan")


# ---- omnistage set against it -----------------------------------------------------------------
TARGETS = {  # name: (target, "min" = value must be >= target | "max" = value must be <= target,
             #        unit: "x" a ratio | "s" seconds)
    "throughput_c16_vs_hf": (8.0, "min", "x"), "ttfa_c1_vs_hf_latency": (0.1, "max", "x"),
    "ttfa_p50_c8_vs_c1": (2.0, "max", "x"),
    # Qwen3-Omni's issue adds: TTFA p50 at C=1 in seconds, and every request at C <= 8 ahead of
    # real time (the worst gap between time since its first audio and audio received, <= 0)
    "ttfa_c1_s": (0.4, "max", "s"), "realtime_worst_gap_s": (0.0, "max", "s")}
QWEN3_TARGETS = ("ttfa_c1_s", "realtime_worst_gap_s")
REALTIME_MAX_C = 8          # the real-time target holds for levels C <= this


def _verdict(name: str, value) -> dict:
    target, kind, unit = TARGETS[name]
    if value is None or value != value:   # missing level/side, or NaN
        return {"value": None, "target": target, "kind": kind, "unit": unit, "met": None}
    return {"value": round(value, 4), "target": target, "kind": kind, "unit": unit,
            "met": value >= target if kind == "min" else value <= target}


def _ratio(name: str, num, den) -> dict:
    if not num or not den or num != num or den != den:
        return _verdict(name, None)
    return _verdict(name, num / den)


def _targets(levels: dict, hf: HFResult | None, same: set[int], family: str) -> dict:
    lv1, lv8, lv16 = levels.get(1), levels.get(8), levels.get(16)
    out = {
        "throughput_c16_vs_hf": _ratio("throughput_c16_vs_hf", lv16 and lv16.throughput,
                                       hf and hf.throughput),
        "ttfa_c1_vs_hf_latency": _ratio("ttfa_c1_vs_hf_latency", lv1 and lv1.ttfa_p50(same),
                                        hf and percentile(hf.latency_s, 50)),
        "ttfa_p50_c8_vs_c1": _ratio("ttfa_p50_c8_vs_c1", lv8 and lv8.ttfa_p50(), lv1 and lv1.ttfa_p50())}
    if family == "qwen3_omni":
        gaps = [t.realtime_gap_s for c, lv in levels.items() if c <= REALTIME_MAX_C
                for t in lv.timings if t.realtime_gap_s is not None]
        out["ttfa_c1_s"] = _verdict("ttfa_c1_s", lv1.ttfa_p50() if lv1 else None)
        out["realtime_worst_gap_s"] = _verdict("realtime_worst_gap_s", max(gaps) if gaps else None)
    return out


def _hf_figures(hf: HFResult, report: dict) -> dict:
    return {"requests": len(hf.latency_s), "latency_s": [round(x, 3) for x in hf.latency_s],
            "latency_p50_s": percentile(hf.latency_s, 50), "audio_s": hf.audio_s,
            "audio_s_per_wall_s": round(hf.throughput, 4), "load_s": round(hf.load_s, 3),
            "threads": hf.threads, "talker_settings": hf.talker_settings,
            "parts_s": {k: round(v, 3) for k, v in hf.parts_s.items()},
            "other_cores": report.get("hf_other_cores")}


def _first_difference(ours: list, theirs: list) -> int | None:
    """Index of the first differing code (Qwen3: frame, all codebooks) of two requests' codes."""
    if ours and isinstance(ours[0], list):          # (Q, F) frames: compare frame by frame
        ours, theirs = [list(f) for f in zip(*ours)], [list(f) for f in zip(*theirs)]
    diff = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    return diff[0] if diff else (None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def _correctness(levels: dict, hf: HFResult, same: set[int]) -> dict:
    """Text tokens and talker codes of the requests both sides ran (None: none did; codes also
    None when omnistage's were not seen: token2wav in another process, or for Qwen3-Omni a
    request that did not run alone at C=1)."""
    by_index = {t.index: t for lv in levels.values() for t in lv.timings}
    pairs = [(by_index[i], i) for i in sorted(same) if i in by_index]
    seen = bool(pairs) and all(t.codes is not None and hf.codes[i] is not None for t, i in pairs)
    out = {"requests_compared": len(pairs),
           "text_tokens_equal_hf": all(t.text_token_ids == hf.text_token_ids[i] for t, i in pairs)
           if pairs else None,
           "talker_codes_equal_hf": all(t.codes == hf.codes[i] for t, i in pairs) if seen else None}
    if seen and isinstance(pairs[0][0].codes[0], list):     # Qwen3: (16, F) frames per request
        ours = pairs[0][0].codes
        out["frames_compared"] = {"codebooks": len(ours), "frames": [len(t.codes[0]) for t, _ in pairs]}
        out["first_differing_frame"] = {i: _first_difference(t.codes, hf.codes[i]) for t, i in pairs}
    elif seen:                                              # Qwen2.5: one code list per request
        out["first_differing_code"] = {i: _first_difference(t.codes, hf.codes[i]) for t, i in pairs}
        out["codes_compared"] = {i: [len(t.codes), len(hf.codes[i])] for t, i in pairs}
    return out


def summarize(report: dict, levels: dict, hf: HFResult | None, text_tokens: int,
              audio_ok=None, family: str = "qwen2_5_omni") -> None:
    """Fill per-level figures, the transformers figures, the targets and the cross-checks.
    `levels`: concurrency -> omni_e2e.LevelResult; `audio_ok(timing)`: whether a request's
    audio has the workload's length (default: audio_s_per_request within 1 ms)."""
    audio_s = report["workload"]["audio_s_per_request"]
    audio_ok = audio_ok or (lambda t: abs(t.audio_s - audio_s) < 1e-3)
    report["levels"] = {str(c): lv.summary(text_tokens, audio_ok) for c, lv in levels.items()}
    same = set(range(len(hf.latency_s))) if hf else set()
    if hf:
        report["hf"] = _hf_figures(hf, report)
        report["correctness"] = _correctness(levels, hf, same)
    report["ratios"] = _targets(levels, hf, same, family)
    loads = [lv.other_cores for lv in levels.values()] + [report.get("hf_other_cores") or 0.0]
    report["max_other_cores"] = max(loads)
    report["quiet_machine"] = max(loads) < 0.2   # else some figures are depressed by other load


def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    """Levels (times in s; `last`: submit to last audio chunk; `RT gap`: the worst request's
    time since its first audio minus audio received, <= 0 = ahead of real time; `others`: cores
    other processes used meanwhile), the transformers line, the checks, the targets."""
    print(f"\n{'C':>3} {'reqs':>4} {'wall s':>8} {'audio s':>8} {'audio-s/s':>9} {'TTFA p50':>8} "
          f"{'TTFA p95':>8} {'TTFT p50':>8} {'last p50':>8} {'RT gap':>7} {'others':>6}")
    for c, lv in report["levels"].items():
        print(f"{c:>3} {lv['requests']:>4} {lv['wall_s']:>8.1f} {lv['audio_s']:>8.1f} "
              f"{lv['audio_s_per_wall_s']:>9.3f} {lv['ttfa_p50_s']:>8.2f} {lv['ttfa_p95_s']:>8.2f} "
              f"{lv['ttft_p50_s']:>8.2f} {lv['last_audio_p50_s']:>8.2f} "
              f"{_fmt(lv['realtime_worst_gap_s'], '.3f'):>7} {lv['other_cores']:>6.2f}")
    if "hf" in report:
        h = report["hf"]
        print(f" hf {h['requests']:>4} one at a time: latency p50 {h['latency_p50_s']:.2f} s "
              f"(= its TTFA), {h['audio_s_per_wall_s']:.3f} audio-s per wall-s, "
              f"others {h['other_cores']:.2f}")
    if "correctness" in report:
        c = report["correctness"]
        what = "talker frames (16 codebooks)" if "frames_compared" in c else "talker codes"
        print(f"[check] {c['requests_compared']} request(s) on both sides: thinker tokens equal "
              f"transformers': {c['text_tokens_equal_hf']}; {what} equal: {c['talker_codes_equal_hf']}"
              + (f" {c['frames_compared']}" if "frames_compared" in c else ""))
    for name, r in report["ratios"].items():
        cmp = ">=" if r["kind"] == "min" else "<="
        verdict = "n/a" if r["met"] is None else ("met" if r["met"] else "MISSED")
        unit = " s" if r["unit"] == "s" else ""
        label = "[target]" if r["unit"] == "s" else "[ratio]"
        print(f"{label} {name}: {_fmt(r['value'], '.3f')}{unit} (target {cmp} {r['target']:g}{unit}) {verdict}")


def print_breakdown(lv) -> None:
    """One level's stage times (`lv`: an omni_e2e.LevelResult)."""
    b = lv.breakdown()
    lines = [f"[stages] C={lv.concurrency}, wall {lv.wall_s:.1f} s: engine stepping "
             f"{b['engine_step_s']:.1f} s, idle {b['engine_idle_s']:.1f} s, routing {b['routing_s']:.2f} s"]
    lines += [f"[stages]   {name:<10} {v['s']:>8.2f} s  {v['calls']:>5} steps  {v['ms_per_call']:>8.1f} "
              f"ms/step  {100 * v['share_of_wall']:>5.1f}% of wall"
              for name, v in b.items() if isinstance(v, dict)]
    lines += [f"[stages]     token2wav {part}: {b[f'token2wav_{part}_s']:.2f} s"
              for part in ("dit", "bigvgan") if f"token2wav_{part}_s" in b]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.omni_peers '<HFJob as JSON>'")
    print(json.dumps(asdict(run_job(HFJob(**json.loads(argv[0]))))), flush=True)


if __name__ == "__main__":
    main()
