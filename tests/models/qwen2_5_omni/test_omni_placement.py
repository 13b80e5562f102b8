"""Stages outside this process: every stage in its own OS process, or as Ray actors, give the
same output as the in-process graph; a killed stage process fails its requests with a clear
error within seconds and is restarted."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from omnistage import Omni, SamplingParams
from omnistage.deploy import DeployConfig
from omnistage.engine_api import OutputOptions
from omnistage.errors import StageFailedError

STAGES = ["encoder", "thinker", "talker", "token2wav"]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("omni-place"), seed=2))


def _wav() -> bytes:
    import soundfile as sf

    t = np.arange(12000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


PROMPT = [{"role": "user", "content": [{"type": "audio", "audio": _wav()}, {"type": "text", "text": "Hm?"}]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8)
OPTS = OutputOptions(talker_params=SamplingParams(temperature=0, max_tokens=50, min_tokens=30, seed=5))


def _run(omni_dir, deploy=None):
    with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        [out] = omni.generate(PROMPT, PARAMS, output=OPTS)
    return out


@pytest.fixture(scope="module")
def local_out(omni_dir):
    return _run(omni_dir)


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.audio.shape == b.audio.shape
    np.testing.assert_allclose(a.audio, b.audio, atol=1e-5)


def test_every_stage_in_its_own_process(omni_dir, local_out):
    _same(_run(omni_dir, DeployConfig.everywhere("process", STAGES)), local_out)


def test_ray_actors(omni_dir, local_out):
    pytest.importorskip("ray")
    import ray

    deploy = DeployConfig.everywhere("ray", ["thinker", "token2wav"])
    try:
        with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
            [out] = omni.generate(PROMPT, PARAMS, output=OPTS)
            # The local Ray omnistage started runs its actors at the priority of ordinary
            # processes, not Ray's niceness 15 (ray_stage.py).
            stages = omni.engine.graph.stages
            assert [stages[name]._child.niceness() for name in ("thinker", "token2wav")] == [0, 0]
        _same(out, local_out)
    finally:
        ray.shutdown()


def test_killed_stage_fails_its_requests_and_restarts(omni_dir, local_out):
    deploy = DeployConfig.everywhere("process", ["talker"])
    with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        talker = omni.engine.graph.stages["talker"]
        long = OutputOptions(talker_params=SamplingParams(temperature=0, max_tokens=2000, min_tokens=2000))
        t0 = None
        with pytest.raises(StageFailedError, match="talker.*died"):
            for d in omni.stream(PROMPT, PARAMS, long):
                if d.audio is not None and t0 is None:   # mid-speech: kill the talker's process
                    talker._child._child.process.kill()
                    t0 = time.monotonic()
        assert t0 is not None and time.monotonic() - t0 < 5.0
        assert talker.restarts == 1 and talker.dead is None
        metrics = {name: value for name, _, _, value in omni.engine.metrics()}
        assert metrics['omnistage_stage_restarts_total{stage="talker"}'] == 1
        assert metrics['omnistage_stage_up{stage="talker"}'] == 1
        assert not omni.engine.has_unfinished_requests()
        assert all(s.num_requests() == 0 for s in omni.engine.graph.stages.values())
        [again] = omni.generate(PROMPT, PARAMS, output=OPTS)   # the restarted stage serves
    _same(again, local_out)


def test_remote_stages_hold_nothing_once_a_request_is_done(omni_dir):
    """At the moment the caller sees the request finish, no stage still counts it (a remote
    stage learns a request's last output is final before that output arrives)."""
    deploy = DeployConfig.everywhere("process", ["thinker", "token2wav"])
    with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        for _ in range(3):
            for d in omni.stream(PROMPT, PARAMS, OPTS):
                if d.finished:
                    assert all(s.num_requests() == 0 for s in omni.engine.graph.stages.values())


def test_stage_past_its_restarts_makes_the_model_unhealthy(omni_dir):
    deploy = DeployConfig.everywhere("process", ["token2wav"])
    with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        stage = omni.engine.graph.stages["token2wav"]
        stage.max_restarts = 0
        assert omni.engine.health() is None
        stage._child._child.process.kill()
        with pytest.raises(StageFailedError):
            omni.generate(PROMPT, PARAMS, output=OPTS)
        assert stage.dead and "token2wav" in omni.engine.health()
        metrics = {name: value for name, _, _, value in omni.engine.metrics()}
        assert metrics['omnistage_stage_up{stage="token2wav"}'] == 0
        with pytest.raises(StageFailedError, match="not restarting"):   # fails at once now
            omni.generate(PROMPT, PARAMS, output=OPTS)
        [text] = omni.generate(PROMPT, PARAMS, output=OutputOptions(modalities=["text"]))
        assert text.token_ids                                          # text still served


def test_replicas_share_requests_and_give_the_same_output(omni_dir, local_out):
    from omnistage.deploy import StagePlacement

    deploy = DeployConfig({"token2wav": StagePlacement("process", num_threads=1, replicas=2)})
    with Omni(omni_dir, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        pipe, stage = omni.engine, omni.engine.graph.stages["token2wav"]
        pp = pipe.prepare(PROMPT, OPTS)
        for rid in ("a", "b"):
            pipe.add_request(rid, pp, PARAMS, OPTS)
        audio, spread = {"a": [], "b": []}, False
        while pipe.has_unfinished_requests():
            for d in pipe.step():
                if d.audio is not None:
                    audio[d.request_id].append(d.audio)
            spread |= [r.num_requests() for r in stage.replicas] == [1, 1]
        assert spread                      # one request on each copy
        metrics = {name: value for name, _, _, value in pipe.metrics()}
        assert [metrics[f'omnistage_stage_up{{stage="token2wav",replica="{i}"}}'] for i in (0, 1)] == [1, 1]
        for chunks in audio.values():      # each the same as the in-process graph's
            np.testing.assert_allclose(np.concatenate(chunks), local_out.audio, atol=1e-5)


@pytest.mark.parametrize("yaml_text, why", [
    ("stages:\n  talker: {where: gpu}\n", "where must be one of"),
    ("stages:\n  talker: {where: process, replicas: 0}\n", "replicas must be a positive"),
    ("stages:\n  talker: {replicas: 2}\n", "needs where: process or ray"),
    ("stages:\n  talker: {where: process, colour: red}\n", "colour"),
    ("workers: 3\n", "unknown keys"),
])
def test_bad_deploy_configs_say_what_is_wrong(tmp_path, yaml_text, why):
    from omnistage.errors import InvalidRequestError

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml_text)
    with pytest.raises(InvalidRequestError, match=why):
        DeployConfig.from_yaml(path)


def test_deploy_config_names_only_real_stages(omni_dir):
    from omnistage.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="stages this model does not have"):
        Omni(omni_dir, deploy_config=DeployConfig.everywhere("process", ["vocoder"]))
