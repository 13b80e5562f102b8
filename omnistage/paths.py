"""Where omnistage keeps what it builds: tiny checkpoints and compiled kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock (build_lock)
    fcntl = None


def cache_dir() -> Path:
    """`$OMNISTAGE_CACHE`, else `$XDG_CACHE_HOME/omnistage`, else `~/.cache/omnistage`."""
    root = os.environ.get("OMNISTAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "omnistage")
    return Path(root)


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Held while `target` (a cached build: a checkpoint folder, a compiled kernel) is built,
    so that processes starting at once (a deployment's stage processes, test workers) build it
    once: the others wait, then find it built. An exclusive flock on `target`.lock, released
    by the kernel if the holder dies. Correctness does not rest on it: builds are written
    under a private name and renamed into place; where flock does not exist (Windows) it is a
    no-op and concurrent builders only repeat work."""
    if fcntl is None:
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
