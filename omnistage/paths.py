"""Where omnistage keeps what it builds: tiny checkpoints and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$OMNISTAGE_CACHE`, else `$XDG_CACHE_HOME/omnistage`, else `~/.cache/omnistage`."""
    root = os.environ.get("OMNISTAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "omnistage")
    return Path(root)
