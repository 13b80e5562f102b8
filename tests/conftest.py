"""Shared fixtures: tiny random checkpoints, built once per test session by the same code as
`omnistage tiny`."""

from __future__ import annotations

import platform

import pytest
import torch

from omnistage.kernels import build
from omnistage.kernels.build import NativeBuildError, compiler

# Two shapes: GQA with tied embeddings (the default tiny), and MHA with untied embeddings,
# three layers and a different head count.
TINY_SHAPES = {
    "gqa": {},
    "mha": {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6,
            "num_key_value_heads": 6, "head_dim": 16, "intermediate_size": 160,
            "tie_word_embeddings": False},
}


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Tiny models gain nothing from 2 threads, and on a busy 2-core machine OpenMP spin
    waits make each step ~10x slower."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2", tmp_path_factory.mktemp("qwen2-gqa"), seed=0, size="tiny"))


@pytest.fixture(scope="session")
def tiny_qwen2_mha(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2", tmp_path_factory.mktemp("qwen2-mha"), seed=1, size="tiny",
                          overrides=TINY_SHAPES["mha"]))


@pytest.fixture(scope="session", params=list(TINY_SHAPES))
def tiny_model(request, tiny_qwen2, tiny_qwen2_mha) -> str:
    """Each test using it runs once per checkpoint shape."""
    return {"gqa": tiny_qwen2, "mha": tiny_qwen2_mha}[request.param]


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("qwen2_5_omni"), seed=0, size="tiny"))


# The kernels as built for this CPU, and (on an x86 CPU with AVX2) for x86-64-v3: the 8-lane
# paths a CPU without AVX-512 takes, run on this one too.
KERNEL_MARCHES = ["native"] + (["x86-64-v3"] if platform.machine().lower() in ("x86_64", "amd64")
                               and " avx2" in build._cpu_flags() else [])


@pytest.fixture(params=KERNEL_MARCHES)
def kernel_march(request, monkeypatch) -> str:
    """Kernels built in the test are built for this -march ($OMNISTAGE_KERNEL_MARCH)."""
    if request.param != "native":
        monkeypatch.setenv(build.MARCH_ENV, request.param)
    return request.param


@pytest.fixture(scope="session")
def c_compiler() -> str:
    """The C compiler the native kernels build with; skips the test where there is none."""
    try:
        return compiler()
    except NativeBuildError as e:
        pytest.skip(f"no C compiler to build the native kernels: {e}")
