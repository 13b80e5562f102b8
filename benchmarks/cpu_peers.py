"""omnistage against llama.cpp on the CPU, weight format by weight format, in one run.

    python -m benchmarks.cpu_peers                       # 3 pairs, 2 threads, the small Qwen2
    python -m benchmarks.cpu_peers --pairs 5 --parallel 1,8,32,64 --peer-dir /tmp/peers
    python -m benchmarks.cpu_peers --isa avx2     # both engines held to AVX2 + FMA (a proxy)
    python -m benchmarks.cpu_peers --isa avx2-vnni   # the same plus AVX-VNNI (Alder Lake+)

The peer is built here, in its own folder (`--peer-dir`, default `<omnistage cache>/peers`;
never a CI step): llama.cpp from the llama-cpp-python 0.3.36 sdist (downloaded with pip),
`cmake -DGGML_NATIVE=ON`, targets llama-bench, llama-batched-bench and llama-quantize. The
checkpoint (`tiny:qwen2` size small, 57M parameters, or `--model`) is written as float32 GGUF
(benchmarks/gguf_export.py) and quantized by llama-quantize to q8_0 and q4_0.

Pairs compared: llama.cpp f32 vs our float32, q8_0 vs `quantization=int8`, q4_0 vs `int4`
(each engine quantizing in its own way from the same float weights), and q8_0 / q4_0 against
ours loading llama.cpp's own file (the same weights, bit for bit: int8g / int4 groups of 32).
Per pair of runs, A (ours) then B (llama.cpp), `--pairs` times, each measuring:
- decode: single-stream decode tok/s (llama-bench tg128; ours: 128 streamed tokens after a
  32-token prompt, first to last token);
- prefill: a 512-token prompt, tok/s (llama-bench pp512; ours: generate with one new token);
- parallel N: N prompts of 128 random tokens + 128 generated each, generated tokens / wall
  time, prefill included (llama-batched-bench -npp 128 -ntg 128 -npl N: pl * tg / t).
KV cache: llama.cpp keeps its default, f16 (16 bits a value); ours its default, float32, unless
`--kv-cache-dtype bfloat16` (16 bits a value as well: the same bytes per step to read as the
peer's; at 32 prompts of 256 positions the cache is read as much as the weights).
Every run is printed, then per figure the median of the per-pair ratios ours / llama.cpp. The
read bandwidth (benchmarks/bandwidth.py) is measured at the start and the end, and with it the
bound on single-stream decode for each format's bytes. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bandwidth import measure_read_bandwidth  # noqa: E402
from benchmarks.machine import cpu_description, cpu_line, finish_report, hold_to_isa, other_load  # noqa: E402

PEER_VERSION = "0.3.36"
# (label, llama.cpp GGUF type, our quantization option, whether ours loads llama.cpp's file)
FORMATS = [("f32", "f32", "none", False), ("q8_0 / int8", "q8_0", "int8", False),
           ("q4_0 / int4", "q4_0", "int4", False), ("q8_0 file", "q8_0", "none", True),
           ("q4_0 file", "q4_0", "none", True)]
TARGETS = {("f32", "decode"): 1.0, ("q8_0 / int8", "decode"): 1.0, ("q8_0 / int8", "parallel 32"): 1.5,
           ("q8_0 / int8", "parallel 64"): 1.5, ("q4_0 / int4", "decode"): 1.0}


def log(msg: str) -> None:
    print(msg, flush=True)


class PeerCrashed(RuntimeError):
    """A command killed by a signal (a crash, not an error it reported)."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_name = signal.Signals(signal_number).name


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 3600) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        message = f"{' '.join(map(str, cmd))} failed ({done.returncode}): {done.stderr[-2000:]}"
        if done.returncode < 0:
            raise PeerCrashed(message, -done.returncode)
        raise RuntimeError(message)
    return done.stdout


# ---- the peer ----------------------------------------------------------------------------------
# --isa: llama.cpp's cmake options (our side's environment: machine.ISA_ENV). avx2: llama.cpp's
# generic x86 build (GGML_NATIVE=OFF: SSE4.2, AVX, AVX2, BMI2, FMA, F16C; no AVX-512, no AMX);
# avx2-vnni: that with its AVX-VNNI option (its q8_0 / q4_0 dot products through vpdpbusd).
LLAMA_CMAKE = {"native": ["-DGGML_NATIVE=ON"], "avx2": ["-DGGML_NATIVE=OFF"],
               "avx2-vnni": ["-DGGML_NATIVE=OFF", "-DGGML_AVX_VNNI=ON"]}


def build_llama_cpp(folder: Path, isa: str = "native") -> tuple[Path, Path]:
    """llama.cpp's source tree from the sdist, built in `folder` for `isa` (steps already done
    are skipped); returns the source tree and the folder of its binaries."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"llama_cpp_python-{PEER_VERSION}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        archive = folder / f"llama_cpp_python-{PEER_VERSION}.tar.gz"
        if not archive.exists():
            log(f"[peer] downloading the llama-cpp-python {PEER_VERSION} sdist")
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={PEER_VERSION}", "-d", folder])
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    build = "build" if isa == "native" else f"build-{isa}"
    binaries = src / build / "bin"
    if not all((binaries / b).exists() for b in ("llama-bench", "llama-batched-bench", "llama-quantize")):
        log(f"[peer] building llama.cpp ({' '.join(LLAMA_CMAKE[isa])}): several minutes")
        run(["cmake", "-B", build, *LLAMA_CMAKE[isa], "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release"], cwd=src)
        run(["cmake", "--build", build, "-j2", "--target", "llama-bench", "llama-batched-bench",
             "llama-quantize"], cwd=src)
    return src, binaries


def gguf_files(folder: Path, src: Path, binaries: Path, model_dir: Path) -> dict[str, Path]:
    """The checkpoint as f32 GGUF and llama-quantize's q8_0 and q4_0 of it."""
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf

    from benchmarks.gguf_export import export

    files = {"f32": folder / f"{model_dir.name}-f32.gguf"}
    if not files["f32"].exists():
        export(model_dir, files["f32"], gguf)
    for q in ("q8_0", "q4_0"):
        files[q] = folder / f"{model_dir.name}-{q}.gguf"
        if not files[q].exists():
            run([binaries / "llama-quantize", files["f32"], files[q], q, "2"])
    return files


class LlamaCpp:
    """llama.cpp's bench tools with their defaults. A run killed by a signal with weight
    repacking on (llama.cpp's default) is run again with it off, and `fallbacks` names it: on an
    Intel Xeon with AMX (2026-12-05) llama.cpp 0.3.36's AMX q8_0 / q4_0 kernels died with SIGILL
    on any batch of rows (prefill, parallel prompts) while single-row decode ran with them."""

    def __init__(self, binaries: Path, threads: int):
        self.bin, self.threads = binaries, threads
        self.fallbacks: set[str] = set()

    def _run(self, tool: str, args: list, no_repack: list) -> str:
        try:
            return run([self.bin / tool, *args])
        except PeerCrashed as e:
            what = f"{tool} on {Path(args[1]).name}"                   # args[1]: the GGUF file
            if what not in self.fallbacks:
                log(f"[peer] {what} died ({e.signal_name}) with weight repacking; again without it")
            self.fallbacks.add(what)
            return run([self.bin / tool, *args, *no_repack])

    def _bench(self, gguf: Path, prompt: int, gen: int) -> float:
        out = self._run("llama-bench", ["-m", gguf, "-t", self.threads, "-p", prompt, "-n", gen,
                                        "-r", "1", "-o", "jsonl"], ["--repack", "0"])
        return json.loads(out.strip().splitlines()[-1])["avg_ts"]

    def decode(self, gguf: Path) -> float:
        return self._bench(gguf, 0, 128)

    def prefill(self, gguf: Path) -> float:
        return self._bench(gguf, 512, 0)

    def parallel(self, gguf: Path, counts: list[int]) -> dict[int, float]:
        ctx = max(counts) * 256 + 256
        out = self._run("llama-batched-bench", ["-m", gguf, "-t", self.threads, "-c", ctx, "-npp", "128",
                                                "-ntg", "128", "-npl", ",".join(map(str, counts)),
                                                "--output-format", "jsonl"], ["--no-repack"])
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return {r["pl"]: r["pl"] * r["tg"] / r["t"] for r in rows}


# ---- ours --------------------------------------------------------------------------------------
class Ours:
    def __init__(self, model_dir: Path, quantization: str, seed: int, kv_cache_dtype: str = "auto"):
        from omnistage import Omni

        self.omni = Omni(str(model_dir), quantization=quantization, enable_prefix_caching=False,
                         max_model_len=1024, max_num_seqs=64, kv_cache_dtype=kv_cache_dtype)
        self.vocab = self.omni.engine.llm.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 100, (n,), generator=self.gen).tolist()

    def _params(self, n: int):
        from omnistage import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def decode(self) -> float:
        stamps = [(time.perf_counter(), len(d.token_ids))
                  for d in self.omni.stream({"prompt_token_ids": self._prompt(32)}, self._params(128))
                  if d.token_ids]
        return sum(k for _, k in stamps[1:]) / (stamps[-1][0] - stamps[0][0])

    def prefill(self) -> float:
        t0 = time.perf_counter()
        self.omni.generate([{"prompt_token_ids": self._prompt(512)}], self._params(1))
        return 512 / (time.perf_counter() - t0)

    def parallel(self, counts: list[int]) -> dict[int, float]:
        out = {}
        for n in counts:
            prompts = [{"prompt_token_ids": self._prompt(128)} for _ in range(n)]
            t0 = time.perf_counter()
            done = self.omni.generate(prompts, self._params(128))
            out[n] = sum(len(o.token_ids) for o in done) / (time.perf_counter() - t0)
        return out


def _figures(decode: float, prefill: float, parallel: dict[int, float]) -> dict[str, float]:
    return {"decode": decode, "prefill 512": prefill, **{f"parallel {n}": v for n, v in parallel.items()}}


def measure_pair(ours: Ours, llama: LlamaCpp, gguf: Path, counts: list[int]) -> tuple[dict, dict]:
    with other_load({}) as load_a:
        a = _figures(ours.decode(), ours.prefill(), ours.parallel(counts))
    with other_load({}) as load_b:
        b = _figures(llama.decode(gguf), llama.prefill(gguf), llama.parallel(gguf, counts))
    a["other_cores"], b["other_cores"] = load_a.get("other_cores"), load_b.get("other_cores")
    return a, b


def main(argv=None) -> dict:
    from omnistage.paths import cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="A B pairs per format (>= 3 for a figure)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", default="1,8,32,64", help="parallel prompt counts")
    ap.add_argument("--model", help="a Qwen2 HF folder (default: tiny:qwen2 size small, built here)")
    ap.add_argument("--peer-dir", help="where llama.cpp is built (default: <omnistage cache>/peers)")
    ap.add_argument("--formats", default=",".join(f[0] for f in FORMATS),
                    help=f"comma-separated labels of the pairs to run (default: all: "
                         f"{', '.join(f[0] for f in FORMATS)})")
    ap.add_argument("--isa", choices=sorted(LLAMA_CMAKE), default="native",
                    help="native: both engines built for this CPU; avx2: both held to AVX2 + FMA "
                         "(what a CPU without AVX-512 runs; a proxy on this one's cores and memory); "
                         "avx2-vnni: that plus AVX-VNNI (Intel cores without AVX-512 since Alder Lake)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="our KV cache (auto: the model's float32; llama.cpp keeps its f16)")
    ap.add_argument("--out-json")
    args = ap.parse_args(argv)
    hold_to_isa("benchmarks.cpu_peers", args.isa, argv)
    wanted = args.formats.split(",")
    unknown = set(wanted) - {f[0] for f in FORMATS}
    if unknown:
        ap.error(f"unknown --formats {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.parallel.split(",")]
    folder = Path(args.peer_dir) if args.peer_dir else cache_dir() / "peers"
    src, binaries = build_llama_cpp(folder, args.isa)
    model_dir = Path(args.model) if args.model else folder / "qwen2-small"
    if not args.model and not (model_dir / "config.json").exists():
        from omnistage.tiny import build_tiny

        build_tiny("qwen2", model_dir, size="small")
    files = gguf_files(folder, src, binaries, model_dir)
    cpu = cpu_description()
    log(f"{cpu_line(cpu)}; {args.threads} threads; both engines built for {args.isa}; KV cache: ours "
        f"{args.kv_cache_dtype}, llama.cpp f16")
    report = {"cpu": cpu, "isa": args.isa, "threads": args.threads, "model": str(model_dir), "peer": f"llama.cpp from "
              f"llama-cpp-python {PEER_VERSION}", "kv_cache_dtype": {"ours": args.kv_cache_dtype, "llama.cpp": "f16"},
              "bandwidth_start": measure_read_bandwidth(threads=args.threads)}
    llama = LlamaCpp(binaries, args.threads)
    results = {}
    for label, gtype, quant, same_file in [f for f in FORMATS if f[0] in wanted]:
        ours = Ours(files[gtype] if same_file else model_dir, quant, seed=0, kv_cache_dtype=args.kv_cache_dtype)
        ours.decode(), llama.decode(files[gtype])                       # warm-ups, not counted
        runs = []
        for i in range(args.pairs):
            a, b = measure_pair(ours, llama, files[gtype], counts)
            runs.append({"ours": a, "llama.cpp": b})
            log(f"[{label}] pair {i + 1}: " + "; ".join(
                f"{k} {a[k]:.0f} vs {b[k]:.0f}" for k in a if k != "other_cores")
                + f" (other cores {a['other_cores']}/{b['other_cores']})")
        medians = {k: statistics.median(r["ours"][k] / r["llama.cpp"][k] for r in runs)
                   for k in runs[0]["ours"] if k != "other_cores"}
        results[label] = {"runs": runs, "median_ratio": medians,
                          "weight_bytes": files[gtype].stat().st_size}
        ours.omni.close()
    report["peer_without_repack"] = sorted(llama.fallbacks)
    report["bandwidth_end"] = measure_read_bandwidth(threads=args.threads)
    bw = min(report["bandwidth_start"]["bytes_per_s"], report["bandwidth_end"]["bytes_per_s"])
    report["results"] = results
    log(f"[summary] {cpu['model']}, {args.threads} threads, read bandwidth "
        f"{bw / 1e9:.1f} GB/s (lower of start/end); ratios are medians of ours / llama.cpp per pair")
    for label, r in results.items():
        bound = bw / r["weight_bytes"]
        best = max(x["ours"]["decode"] for x in r["runs"]), max(x["llama.cpp"]["decode"] for x in r["runs"])
        r["decode_bound_tok_s"], r["decode_fraction_of_bound"] = bound, [best[0] / bound, best[1] / bound]
        line = ", ".join(f"{k} {v:.2f}x" + (f" (target {TARGETS[label, k]})" if (label, k) in TARGETS else "")
                         for k, v in r["median_ratio"].items())
        log(f"[summary] {label}: {line}; decode bound {bound:.0f} tok/s (GGUF bytes): best ours "
            f"{best[0] / bound:.2f}, llama.cpp {best[1] / bound:.2f} of it")
    if llama.fallbacks:
        log(f"[summary] llama.cpp ran without weight repacking where its default crashed: "
            f"{', '.join(sorted(llama.fallbacks))} (see the LlamaCpp docstring)")
    return finish_report(report, args.out_json)


if __name__ == "__main__":
    main()
