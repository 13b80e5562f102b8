"""The compiled-kernel cache is private: its folder is made 0700, and a cached library this user
does not own, or that others may write, is rebuilt instead of loaded (the log says why)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import sys

import pytest

from omnistage.kernels import build

SOURCE = "int answer(void) { return 42; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch, c_compiler):
    """A fresh OMNISTAGE_CACHE, and no private build folder left from another test."""
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_private", [])
    return tmp_path / "cache"


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "answer.c"
    path.write_text(SOURCE)
    return path


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _plant(lib, mode: int = 0o666) -> None:
    """Replace the cached library with other bytes, as another user of a loose cache could."""
    lib.unlink()
    lib.write_bytes(b"planted: not the kernel")
    os.chmod(lib, mode)


def _is_ours(lib) -> bool:
    return lib.read_bytes()[:4] == b"\x7fELF" and os.lstat(lib).st_uid == os.getuid()


def test_the_folder_is_private_and_a_world_writable_library_is_rebuilt(cache, source, caplog):
    lib = build.build_library(source, {})
    folder = cache / "kernels"
    assert lib.parent == folder and _mode(folder) == 0o700
    assert _mode(lib) & 0o022 == 0 and _is_ours(lib)
    inode = os.lstat(lib).st_ino
    assert build.build_library(source, {}) == lib            # a sound library is reused,
    assert os.lstat(lib).st_ino == inode                     # not rebuilt
    _plant(lib)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.build_library(source, {}) == lib
    assert "writable by other users" in caplog.text and "rebuilding" in caplog.text
    assert _is_ours(lib) and _mode(lib) & 0o022 == 0         # rebuilt, not the planted bytes
    assert ctypes.CDLL(str(lib)).answer() == 42


# Waits for a line on stdin, then builds the library argv[1] and prints its path.
BUILD_ON_GO = """
import sys
from pathlib import Path
from omnistage.kernels import build
print("ready", flush=True)
sys.stdin.readline()
print(build.build_library(Path(sys.argv[1]), {}), flush=True)
"""


def test_processes_building_one_library_at_once_compile_it_once(cache, source, tmp_path, c_compiler):
    """Two processes (a deployment's stage processes starting together) ask for the same
    library at the same moment: one compiles, the other waits for it and loads the same file.
    The compiler is wrapped to log each compile and take a second, so that without the lock
    both would be compiling at once."""
    log = tmp_path / "compiles.log"
    cc = tmp_path / "cc.sh"
    cc.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo compile >> "{log}"; sleep 1;; esac\n'
                  f'exec "{shutil.which(c_compiler) or c_compiler}" "$@"\n')
    cc.chmod(0o755)
    env = {**os.environ, "OMNISTAGE_CACHE": str(cache), "CC": str(cc)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ON_GO, str(source)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        paths = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    assert paths[0] == paths[1] and ctypes.CDLL(paths[0]).answer() == 42
    assert log.read_text().splitlines() == ["compile"]


def test_a_symlinked_library_is_rebuilt(cache, source, tmp_path, caplog):
    lib = build.build_library(source, {})
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"planted")
    lib.unlink()
    lib.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        build.build_library(source, {})
    assert "is not a regular file" in caplog.text
    assert not lib.is_symlink() and _is_ours(lib)


@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's file needs root")
def test_another_users_library_is_rebuilt(cache, source, caplog):
    lib = build.build_library(source, {})
    _plant(lib, 0o755)
    os.chown(lib, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        build.build_library(source, {})
    assert "owned by uid 65534" in caplog.text and _is_ours(lib)


def test_a_loose_folder_of_this_user_is_made_private_again(cache, source, caplog):
    folder = cache / "kernels"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        lib = build.build_library(source, {})
    assert "making it private" in caplog.text
    assert lib.parent == folder and _mode(folder) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's folder needs root")
def test_another_users_folder_is_not_used(cache, source, caplog):
    folder = cache / "kernels"
    folder.mkdir(parents=True, mode=0o755)
    os.chown(folder, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        lib = build.build_library(source, {})
    assert "owned by uid 65534" in caplog.text and "private temporary folder" in caplog.text
    assert lib.parent != folder and _mode(lib.parent) == 0o700 and _is_ours(lib)
    assert not any(folder.iterdir())
    assert build.build_library(source, {}) == lib            # reused within the process


WIDEST = """
int widest(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
"""


@pytest.mark.skipif(build.platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU names")
def test_the_kernel_march_setting_builds_for_an_older_cpu(cache, tmp_path, monkeypatch):
    """$OMNISTAGE_KERNEL_MARCH=x86-64-v3 builds the AVX2 paths even on an AVX-512 CPU (a
    library of its own), and a value that is no CPU name is refused before the compiler runs."""
    path = tmp_path / "widest.c"
    path.write_text(WIDEST)
    native = build.build_library(path, {})
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    older = build.build_library(path, {})
    assert older != native and ctypes.CDLL(str(older)).widest() == 256
    if " avx512f" in build._cpu_flags():                       # the native build is wider
        assert ctypes.CDLL(str(native)).widest() == 512
    monkeypatch.setenv(build.MARCH_ENV, "native -fplugin=x.so")
    with pytest.raises(build.NativeBuildError, match="not a CPU name"):
        build.build_library(path, {})
