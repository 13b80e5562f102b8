"""Stages on Ray with the deploy config's actor options (a local Ray node started with a custom
resource stands for the node a stage is pinned to): the same pixels as in-process, the actor
holding the resource, an actor's death failing its request at once (the death pipe wakes the
graph) and the stage restarting, and an actor no node can host failing the start clearly."""

from __future__ import annotations

import time

import numpy as np
import pytest

from omnistage import Omni
from omnistage.deploy import DeployConfig, StagePlacement
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import ModelLoadError, StageFailedError
from omnistage.stages.ray_stage import LOCAL_RAY_SYSTEM_CONFIG

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def folder():
    return str(tiny_checkpoint("qwen_image"))


@pytest.fixture(scope="module")
def ray_node():
    ray.init(num_cpus=2, resources={"stage_node": 1}, include_dashboard=False, log_to_driver=False,
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    yield
    ray.shutdown()


def run(omni, seed=1):
    return omni.generate(["a red cat"], DiffusionParams(height=32, width=32, num_inference_steps=3, seed=seed))


def test_pinned_actor_serves_dies_and_restarts(folder, ray_node, capsys):
    with Omni(folder) as local:
        want = run(local)
    deploy = DeployConfig({"diffusion": StagePlacement("ray", num_cpus=0, resources={"stage_node": 1},
                                                       start_timeout_s=300)})
    with Omni(folder, deploy_config=deploy, num_threads=1) as omni:
        assert np.abs(run(omni)[0].pixels[0] - want[0].pixels[0]).max() <= 1e-6
        assert ray.available_resources().get("stage_node", 0) == 0     # the actor holds it
        stage = omni.engine.graph.stages["diffusion"]
        stream = omni.stream("a cat", DiffusionParams(height=32, width=32, num_inference_steps=100, seed=3))
        for d in stream:
            if d.progress and d.progress[0] >= 1:
                ray.kill(stage._child._actor)
                killed = time.monotonic()
                break
        with pytest.raises(StageFailedError, match="diffusion"):
            for _ in stream:
                pass
        with capsys.disabled():
            print(f"\nkilled actor -> request failed in {time.monotonic() - killed:.2f} s")
        assert stage.restarts == 1
        assert np.abs(run(omni)[0].pixels[0] - want[0].pixels[0]).max() <= 1e-6   # restarted


def test_an_actor_no_node_can_host_fails_the_start(folder, ray_node):
    deploy = DeployConfig({"diffusion": StagePlacement("ray", resources={"gpu_node": 1},
                                                       start_timeout_s=3)})
    with pytest.raises(ModelLoadError, match=r"no answer in 3 s .*'gpu_node': 1"):
        Omni(folder, deploy_config=deploy, num_threads=1)


class _Handle:
    """A stand-in for a started stage's Ray handle: its actor's niceness, or an error."""

    def __init__(self, niceness: int | Exception):
        self._niceness = niceness
        self.asked: list[float] = []

    def niceness(self, timeout: float = 30.0) -> int:
        self.asked.append(timeout)
        if isinstance(self._niceness, Exception):
            raise self._niceness
        return self._niceness

    def describe(self) -> str:
        return "Ray actor 0123456789ab"


def test_front_warns_of_a_niced_actor(caplog):
    """A stage whose actor runs at Ray's default niceness is named in the front's log (the
    actor's own warning is in a worker log on its node); an actor at 0, or one that cannot
    answer, logs no warning and does not fail the start."""
    from omnistage.stages.ray_stage import NICENESS_TIMEOUT_S, warn_if_stage_niced

    caplog.set_level("DEBUG", logger="omnistage.stages.ray_stage")
    niced = _Handle(15)
    warn_if_stage_niced("talker", niced)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and niced.asked == [NICENESS_TIMEOUT_S]
    text = warnings[0].getMessage()
    assert "stage talker" in text and "niceness 15" in text and "RAY_worker_niceness=0" in text
    assert "0123456789ab" in text

    caplog.clear()
    warn_if_stage_niced("thinker", _Handle(0))
    warn_if_stage_niced("code2wav", _Handle(TimeoutError("no answer")))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("code2wav" in r.getMessage() and "no answer" in r.getMessage() for r in caplog.records)
