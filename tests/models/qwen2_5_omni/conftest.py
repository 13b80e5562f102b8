"""Qwen2.5-Omni test options: `--omni-deploy process|ray` runs the API tests with every stage
outside the test process (tests that look inside local stages skip themselves then)."""

from __future__ import annotations

import pytest

OMNI_STAGES = ["encoder", "thinker", "talker", "token2wav"]


def pytest_addoption(parser):
    parser.addoption("--omni-deploy", default="local", choices=["local", "process", "ray"],
                     help="where the Qwen2.5-Omni API tests place every stage (default: local)")


@pytest.fixture(scope="session")
def omni_deploy(request):
    """A DeployConfig for Omni/AsyncOmni, or None for the in-process graph."""
    where = request.config.getoption("--omni-deploy")
    if where == "local":
        yield None
        return
    from omnistage.deploy import DeployConfig

    if where == "ray":
        pytest.importorskip("ray")
    yield DeployConfig.everywhere(where, OMNI_STAGES)
    if where == "ray":
        import ray

        ray.shutdown()


@pytest.fixture
def local_only(omni_deploy):
    if omni_deploy is not None:
        pytest.skip("looks inside in-process stages")
