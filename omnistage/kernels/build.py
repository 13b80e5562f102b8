"""Compile a kernel's C source into a shared library, once per (source, constants, compiler,
CPU), and cache it under `<omnistage cache>/kernels`.

-march=native: the library is built for the CPU it runs on, so the cache key includes that
CPU's feature flags (a cache dir shared between machines never serves a foreign build).

A cached library is code this process loads, so the cache is private: the folder is created
with mode 0700, and a library is loaded only if it is a regular file of this user that no one
else may write (otherwise it is rebuilt, and the log says why). A kernel folder of this user
that others may write is made 0700 again (its libraries are each checked as above); one owned
by another user is not used: this process builds its kernels in a private temporary folder."""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from omnistage.errors import InvalidRequestError
from omnistage.paths import build_lock, cache_dir

# -ffp-contract=fast: `acc += a * b` is one fused multiply-add in every kernel and every
# compiler (GCC's default for GNU C; clang's default fuses only within one expression).
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
MARCH_ENV = "OMNISTAGE_KERNEL_MARCH"

log = logging.getLogger(__name__)
_private: list[Path] = []            # this process's private build folder, once made
_private_lock = threading.Lock()


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


def narrow_vectors() -> tuple[dict[str, int], tuple[str, ...]]:
    """The defines and flags that build a kernel's AVX2-width paths even on a CPU with AVX-512:
    the paths CPUs without it take, so that they are run and tested everywhere. On x86 the
    compiler must not use AVX-512 anywhere either (it would, for -march=native, in the
    8-lane code too)."""
    flags = ("-mno-avx512f",) if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else ()
    return {"OMNISTAGE_NO_AVX512": 1}, flags


def march() -> str:
    """The `-march` the kernels are built for: `native` (this CPU), or `$OMNISTAGE_KERNEL_MARCH`
    (a compiler's CPU name or level, e.g. `x86-64-v3`: AVX2 + FMA, what a Zen 3 or a Haswell
    has). A narrower target runs the paths an older CPU takes on this one, all kernels at once
    (the AVX2 measurements of benchmarks/README.md); a target this CPU lacks fails at the first
    unsupported instruction, so it is for building what this CPU can run."""
    value = os.environ.get(MARCH_ENV, "native")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", value):
        raise NativeBuildError(f"${MARCH_ENV}={value!r} is not a CPU name (letters, digits, . _ + -)")
    return value


def without_vnni() -> tuple[str, ...]:
    """The compiler flags that build a kernel's paths without VNNI's integer dot products
    (vpdpbusd): AVX-512 without it (Skylake-SP / -X Xeons have AVX-512BW but not VNNI), and
    with narrow_vectors() AVX2 without AVX-VNNI (Zen 1-3, Haswell .. Comet Lake): the paths
    those CPUs take, so that they are run and tested everywhere."""
    return ("-mno-avx512vnni", "-mno-avxvnni") if platform.machine().lower() in ("x86_64", "amd64") else ()


def wide_vectors() -> tuple[str, ...]:
    """The compiler flags (every build's) that let auto-vectorized loops use 512-bit vectors
    where -march=native has them: GCC's tuning for recent Intel cores prefers 256 bits (a
    frequency concern of older cores), half the work per instruction of the kernels' loops
    (the W8A8 product's GELU pass 1.2x faster on an Intel Xeon). The same operations at either
    width (no reassociation), so the same bits; builds for CPUs without AVX-512 (-mno-avx512f)
    have no 512-bit vectors to use."""
    return ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()


def build_library(source: Path, defines: dict[str, int], flags: tuple[str, ...] = ()) -> Path:
    """The path of `source` compiled with `-D NAME=VALUE` for each of `defines`, and the
    compiler `flags` after ours (e.g. -mno-avx512f: code for CPUs without AVX-512)."""
    cc = compiler()
    version = _compiler_version(cc, _mtime_ns(cc))
    args = [*FLAGS, f"-march={march()}", *wide_vectors(), *flags,
            *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    key = hashlib.sha256("\0".join([_source_text(source), *args, version, _cpu_flags()]).encode())
    out = _library_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if _loadable(out):
        return out
    with build_lock(out):               # one compile for processes starting at once
        if not _loadable(out):
            _compile(cc, args, source, out)
    return out


def _compile(cc: str, args: list[str], source: Path, out: Path) -> None:
    # Built under a private name and renamed: a process or thread never loads a half-written
    # file (where build_lock is a no-op, builders at once only repeat the work).
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([cc, *args, str(source), "-o", str(tmp), "-lm"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{cc} failed on {source.name}: {e}") from e
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{cc} could not compile {source.name}: {proc.stderr.strip()[-2000:]}")
    os.chmod(tmp, 0o700)                 # whatever the umask: writable by this user alone
    os.replace(tmp, out)                 # (replaces a refused library of the same name)


def _mtime_ns(cc: str) -> int:
    """When the compiler's executable last changed (0 if it cannot be found): a new compiler
    under the same name is asked for its version again."""
    try:
        return os.stat(shutil.which(cc) or cc).st_mtime_ns
    except OSError:
        return 0


@functools.lru_cache(maxsize=8)
def _compiler_version(cc: str, mtime_ns: int) -> str:
    """`cc --version`, asked once per compiler executable and process: a model's start looks
    up a dozen libraries, and each subprocess cost ~5-20 ms (more on a busy machine)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"C compiler {cc!r} does not run: {e}") from e


def _source_text(source: Path) -> str:
    """`source` and, after it, each local header it includes (`#include "name.h"`, looked up
    beside it; headers' own includes too): a change in any of them is a new library."""
    seen, todo, parts = set(), [source], []
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        parts.append(text)
        todo += [path.with_name(m) for m in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)]
    return "\0".join(parts)


def _library_dir() -> Path:
    """`<cache>/kernels` (made mode 0700), when it is this user's and no one else may write
    it; else this process's private temporary folder (logging why)."""
    folder = cache_dir() / "kernels"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(folder)
    except OSError as e:
        return _private_dir(f"kernel cache {folder} cannot be used ({e})")
    why = _unsafe(st, "a folder", stat.S_ISDIR)
    if why is None:
        return folder
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        log.warning("kernel cache %s %s; making it private (mode 0700)", folder, why)
        try:
            os.chmod(folder, 0o700)
            return folder
        except OSError as e:
            why = f"{why} and cannot be made private ({e})"
    return _private_dir(f"kernel cache {folder} {why}")


def _loadable(lib: Path) -> bool:
    """Whether `lib` exists and may be loaded: a regular file (not a link) of this user that
    no one else may write. A refused one is logged (the caller rebuilds it)."""
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        return False
    why = _unsafe(st, "a regular file", stat.S_ISREG)
    if why is not None:
        log.warning("not loading kernel library %s: it %s; rebuilding it", lib, why)
    return why is None


def _unsafe(st: os.stat_result, kind: str, is_kind: Callable[[int], bool]) -> str | None:
    """Why a cache entry with status `st` must not be trusted, or None."""
    if not is_kind(st.st_mode):
        return f"is not {kind}"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dir(why: str) -> Path:
    """A folder of this process alone (mode 0700, removed at exit) to build kernels in."""
    with _private_lock:
        if not _private:
            log.warning("%s; building kernels in a private temporary folder instead", why)
            try:
                _private.append(Path(tempfile.mkdtemp(prefix="omnistage-kernels-")))
            except OSError as e:
                raise NativeBuildError(f"{why}, and no private folder could be made ({e})") from e
            atexit.register(shutil.rmtree, _private[0], ignore_errors=True)
        return _private[0]


def _cpu_flags() -> str:
    """The CPU's model and feature flags (Linux), else the platform's machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()
