"""How busy the rest of the machine was during a measurement (Linux /proc only).

On a 2-core machine another process that keeps one core busy can halve a 2-thread run, or
worse (OpenMP threads wait on each other). Each measurement records how many cores the other
processes used meanwhile, so a reader can tell a slow system from a busy machine.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from contextlib import contextmanager


def _busy_and_own() -> tuple[float, float] | None:
    """(seconds of CPU busy on the whole machine, seconds used by this process + children)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle, iowait
    own = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return busy / tick, own / tick


@contextmanager
def other_load(into: dict):
    """Fill `into["other_cores"]`: mean cores used by other processes while the block ran."""
    before, t0 = _busy_and_own(), time.monotonic()
    try:
        yield into
    finally:
        after, wall = _busy_and_own(), time.monotonic() - t0
        if before and after and wall > 0:
            others = (after[0] - before[0]) - (after[1] - before[1])
            into["other_cores"] = round(max(0.0, others) / wall, 2)


def finish_report(report: dict, out_json: str | None) -> dict:
    """Record the end load, write the report to `out_json` (if given) and print it as the
    last stdout line (one JSON object)."""
    import json
    from pathlib import Path

    report["load_avg_end"] = os.getloadavg()
    if out_json:
        Path(out_json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return report


def cpu_description() -> dict:
    """The CPU's model and its vector / matrix extensions (Linux), printed with every figure."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:        # not Linux: the platform's name only
        pass
    ext = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"model": model, "extensions": ext}


def cpu_line(cpu: dict) -> str:
    return f"[cpu] {cpu['model']}; {' '.join(cpu['extensions']) or 'no vector extensions listed'}"


# --isa avx2: what a CPU without AVX-512 (Zen 1-3, Haswell .. Comet Lake) runs, held on this one:
# our kernels built for x86-64-v3, and every library that picks its code at run time held to
# AVX2: ATen's own kernels, oneDNN, and MKL (torch's BLAS: F.linear, matmul; unheld, the
# transformers side of a run kept AVX-512 GEMMs while ours ran AVX2 ones). A proxy: the cores,
# caches and memory stay this machine's. avx2-vnni: the same plus AVX-VNNI (int8 dot products
# on 256-bit vectors: Intel's cores without AVX-512 since Alder Lake), our kernels built for
# alderlake; this CPU must have avx_vnni.
ISA_ENV = {"native": {},
           "avx2": {"OMNISTAGE_KERNEL_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx2-vnni": {"OMNISTAGE_KERNEL_MARCH": "alderlake", "ATEN_CPU_CAPABILITY": "avx2",
                         "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


# The CPU flags (/proc/cpuinfo names) a proxy's code needs: without them it dies of SIGILL.
ISA_NEEDS = {"native": set(), "avx2": {"avx2", "fma"}, "avx2-vnni": {"avx2", "fma", "avx_vnni"}}


def isa_missing(isa: str, extensions: list[str]) -> set[str]:
    """What a CPU with `extensions` (cpu_description's) lacks of what `isa` runs."""
    return ISA_NEEDS[isa] - set(extensions)


def hold_to_isa(module: str, isa: str, argv: list[str] | None) -> None:
    """Run `python -m module` again (same arguments) in the environment `isa` needs, since
    torch and its libraries read it when loaded; returns at once when this process already
    runs in it. Exits with a message where this CPU lacks what `isa` runs."""
    env = ISA_ENV[isa]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    missing = isa_missing(isa, cpu_description()["extensions"])
    if missing:
        raise SystemExit(f"--isa {isa} runs {' '.join(sorted(ISA_NEEDS[isa]))}; this CPU lacks "
                         f"{' '.join(sorted(missing))}")
    print(f"[isa] {' '.join(f'{k}={v}' for k, v in env.items())}: running again in that environment",
          file=sys.stderr, flush=True)
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **env})


def main(argv: list[str] | None = None) -> dict:
    """`python -m benchmarks.machine [--isa ISA]`: this CPU, and the environment a run held to
    ISA sees (the variables of every ISA_ENV entry, as this process has them)."""
    import argparse

    ap = argparse.ArgumentParser(description="this CPU and an --isa environment")
    ap.add_argument("--isa", choices=sorted(ISA_ENV), default="native")
    args = ap.parse_args(argv)
    hold_to_isa("benchmarks.machine", args.isa, argv)
    names = sorted({k for env in ISA_ENV.values() for k in env})
    held = {k: os.environ.get(k) for k in names}
    print(cpu_line(cpu_description()))
    print(" ".join(f"{k}={v}" for k, v in held.items() if v is not None) or "(no variable held)", flush=True)
    return held


if __name__ == "__main__":
    main()
