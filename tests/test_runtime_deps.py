"""Every built-in tiny model serves after exactly the README's install (`pip install -e .`):
no test-only package may be needed on a serving path (`accelerate`, once only a test extra,
was needed to load Wan's components)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.tiny import SUPPORTED_TINY_ARCHS

TESTS = Path(__file__).resolve().parent
PROBE = TESTS / "runtime_deps_probe.py"
sys.path.insert(0, str(TESTS))
import runtime_deps_probe  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("runtime-site")
    return folder, runtime_deps_probe.runtime_site(folder)


def _run(site_dir: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site_dir}{os.pathsep}{TESTS.parent}"}
    return subprocess.run([sys.executable, "-S", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_runtime_site_lacks_the_test_extra(site):
    folder, left_out = site
    assert {"pytest", "openai", "ray"} <= {n.lower() for n in left_out}
    done = _run(folder, "-c", "import torch, transformers, diffusers, fastapi, omnistage.server.app\n"
                "try:\n    import pytest\nexcept ModuleNotFoundError as e:\n    print('absent', e.name)",
                timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "absent pytest"


def test_every_tiny_family_serves_with_runtime_dependencies_only(site):
    done = _run(site[0], str(PROBE), *SUPPORTED_TINY_ARCHS, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    served = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("OK ")]
    assert served == list(SUPPORTED_TINY_ARCHS)
