"""Every native kernel compiles for the x86 CPUs we do not run on here.

The kernels are built with -march=native on the machine that serves, so a path for another
CPU (AVX-512 with or without VNNI, AVX2 only, no AVX at all) compiles only where such a CPU
runs it: a mistake in it (linear.c once named its AVX2 int4 function on every CPU, and did
not build where AVX-512BW is) would pass every test on one machine and break the engine on
the other. Here each source is compiled (not run) for each target with the build's flags, at
-O1 instead of -O3: what can fail for a target (an intrinsic the target lacks, an always-inline
target mismatch, a vector type's ABI) fails at any level from -O1, which compiles in half the
time; -O0 cannot stand in (intrinsics' immediates are not folded into constants there)."""

from __future__ import annotations

import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omnistage.kernels import build

KERNELS = Path(build.__file__).parent
TARGETS = {
    "x86-64": (),                        # SSE2 only: the vector extensions' generic lowering
    "haswell": (),                       # AVX2 + FMA, 8-lane paths
    "alderlake": (),                     # AVX2 + AVX-VNNI (8-lane vpdpbusd), no AVX-512
    "skylake-avx512": (),                # AVX-512 F/BW without VNNI
    "sapphirerapids": (),                # AVX-512 VNNI / BF16
    "sapphirerapids-narrow": ("-DOMNISTAGE_NO_AVX512=1", "-mno-avx512f"),  # wide_vectors=False
}
ATTENTION = ("-DHEAD_DIM=64", "-DGROUP=4", "-DBLOCK=16")
SOURCES = {
    "linear.c": [()],
    "linear_dots.c": [()],
    "linear_w8a8.c": [()],
    "paged_attention.c": [ATTENTION, (*ATTENTION, "-DKV_BF16=1")],
    "decoder_stack.c": [()],
    "dit_stack.c": [()],
    "snake.c": [()],
    "aa_snake.c": [()],
    "code2wav_unit.c": [()],
    "conv1d_tm.c": [()],
    "window_attention.c": [("-DHEAD_DIM=64", "-DBLOCK=24"), ("-DHEAD_DIM=64", "-DBLOCK=24", "-DIO_BF16=1")],
    "argmax.c": [()],
    "moe.c": [("-ffp-contract=off",)],
}


def _known(march: str) -> bool:
    """Whether this compiler knows the CPU name (an older one may not know the newest)."""
    proc = subprocess.run([build.compiler(), f"-march={march}", "-x", "c", "-E", "-o", "/dev/null", "-"],
                          input="", capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


def _compile(source: str, target: str, defines: tuple[str, ...], out: Path) -> str | None:
    march = target.removesuffix("-narrow")
    flags = [("-O1" if f == "-O3" else f) for f in build.FLAGS if f != "-shared"]
    cmd = [build.compiler(), *flags, f"-march={march}", *TARGETS[target], *defines, "-c",
           str(KERNELS / source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return None if proc.returncode == 0 else f"{source} for {target} {defines}:\n{proc.stderr[-3000:]}"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
def test_every_kernel_compiles_for_every_x86_target(tmp_path):
    targets = [t for t in TARGETS if _known(t.removesuffix("-narrow"))]
    assert {"x86-64", "haswell"} <= set(targets)
    jobs = [(source, target, defines) for source, variants in SOURCES.items()
            for defines in variants for target in targets]
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = list(pool.map(lambda j: _compile(*j[1], tmp_path / f"{j[0]}.o"), enumerate(jobs)))
    assert [e for e in errors if e] == []
    assert {p.name for p in KERNELS.glob("*.c")} == set(SOURCES)     # a new kernel is listed here
