"""The diffusion stage in its own process (deploy config): same pixels as in-process, the
front process holds no weights, and a dead stage process fails its requests cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import Omni
from omnistage.deploy import DeployConfig
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import StageFailedError


@pytest.fixture(scope="module")
def folder():
    return str(tiny_checkpoint("qwen_image"))


def run(omni):
    return omni.generate(["a red cat", "a blue dog"], [
        DiffusionParams(height=32, width=32, num_inference_steps=3, seed=1),
        DiffusionParams(height=32, width=32, num_inference_steps=3, seed=2, negative_prompt="ugly")])


def test_process_placement_matches_local(folder):
    with Omni(folder) as local:
        want = run(local)
    deploy = DeployConfig.everywhere("process", ["diffusion"])
    with Omni(folder, deploy_config=deploy, num_threads=1) as remote:
        got = run(remote)
        # the front only checks requests: its family was built without weights
        assert remote.engine.family.transformer.img_in.weight.device.type == "meta"
        for a, b in zip(want, got):
            assert a.seed == b.seed
            assert np.abs(a.pixels[0] - b.pixels[0]).max() <= 1e-6
        # a killed stage process fails the request in flight with a clear error, then restarts
        stage = remote.engine.graph.stages["diffusion"]
        stream = remote.stream("a cat", DiffusionParams(height=32, width=32, num_inference_steps=50, seed=3))
        for d in stream:
            if d.progress and d.progress[0] >= 1:
                stage._child._child.process.kill()
                break
        with pytest.raises(StageFailedError):
            for _ in stream:
                pass
        again = run(remote)          # the restarted stage serves new requests
        assert np.abs(again[0].pixels[0] - want[0].pixels[0]).max() <= 1e-6


def test_ray_actor_and_replicas_match_local(folder):
    pytest.importorskip("ray")
    import ray

    from omnistage.deploy import StagePlacement

    with Omni(folder) as local:
        want = run(local)
    try:
        with Omni(folder, deploy_config=DeployConfig.everywhere("ray", ["diffusion"]), num_threads=1) as o:
            for a, b in zip(want, run(o)):
                assert np.abs(a.pixels[0] - b.pixels[0]).max() <= 1e-6
    finally:
        ray.shutdown()
    # two stage processes behind one stage: requests spread, same pixels
    deploy = DeployConfig({"diffusion": StagePlacement("process", num_threads=1, replicas=2)})
    with Omni(folder, deploy_config=deploy, num_threads=1) as o:
        for a, b in zip(want, run(o)):
            assert np.abs(a.pixels[0] - b.pixels[0]).max() <= 1e-6
