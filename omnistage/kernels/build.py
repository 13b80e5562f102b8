"""Compile a kernel's C source into a shared library, once per (source, constants, compiler,
CPU), and cache it under `<omnistage cache>/kernels`.

-march=native: the library is built for the CPU it runs on, so the cache key includes that
CPU's feature flags (a cache dir shared between machines never serves a foreign build)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

from omnistage.errors import InvalidRequestError
from omnistage.paths import cache_dir

# -ffp-contract=fast: `acc += a * b` is one fused multiply-add in every kernel and every
# compiler (GCC's default for GNU C; clang's default fuses only within one expression).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")


class NativeBuildError(RuntimeError):
    """No C compiler, or the source did not compile here."""


def pick_native(option: str, want: str, why: str | None, build: Callable[[], Any],
                others: str) -> tuple[Any, str | None]:
    """For an engine option (auto | native | ...) set to `want`: (kernel, None) where `why`
    (the reason the kernel cannot serve) is None and `build()` compiles; else (None, the
    reason), or, when the option asked for native explicitly, an InvalidRequestError naming
    the reason and the `others` values to use instead."""
    if why is None:
        try:
            return build(), None
        except NativeBuildError as e:
            why = str(e)
    if want == "native":
        raise InvalidRequestError(f"{option}=native is not available: {why}; use {others}", param=option)
    return None, why


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeBuildError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    return cc


def build_library(source: Path, defines: dict[str, int]) -> Path:
    """The path of `source` compiled with `-D NAME=VALUE` for each of `defines`."""
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"C compiler {cc!r} does not run: {e}") from e
    args = [*FLAGS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    key = hashlib.sha256("\0".join([source.read_text(), *args, version, _cpu_flags()]).encode())
    out = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a private name and renamed: processes and threads building the same
    # library at once never load a half-written file.
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([cc, *args, str(source), "-o", str(tmp), "-lm"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{cc} failed on {source.name}: {e}") from e
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{cc} could not compile {source.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


def _cpu_flags() -> str:
    """The CPU's model and feature flags (Linux), else the platform's machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()
