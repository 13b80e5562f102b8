"""Qwen3-Omni's stages outside this process give the in-process graph's output: every stage in
its own OS process (its messages, DeepStack rows and codec frames included, cross as msgspec
messages), and the talker and code2wav as Ray actors."""

from __future__ import annotations

import io

import numpy as np
import pytest

from omnistage import Omni, SamplingParams
from omnistage.deploy import DeployConfig
from omnistage.engine_api import OutputOptions

STAGES = ["encoder", "thinker", "talker", "code2wav"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3-place"), seed=3))


def _prompt():
    import soundfile as sf
    from PIL import Image

    t = np.arange(9000) / 16000
    wav = io.BytesIO()
    sf.write(wav, (0.3 * np.sin(2 * np.pi * 250 * t)).astype(np.float32), 16000, format="WAV")
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (32, 48, 3), dtype=np.uint8)).save(png, "PNG")
    return [{"role": "user", "content": [{"type": "audio", "audio": wav.getvalue()},
                                         {"type": "image", "image": png.getvalue()},
                                         {"type": "text", "text": "Hm?"}]}]


def _run(folder, deploy=None):
    with Omni(folder, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        defaults = omni.engine.abilities.talker_defaults
        opts = OutputOptions(voice="Chelsie", talker_params=SamplingParams(
            temperature=0, max_tokens=10, min_tokens=10, suppress_token_ids=defaults.suppress_token_ids))
        [out] = omni.generate(_prompt(), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), output=opts)
    return out


@pytest.fixture(scope="module")
def local_out(folder):
    out = _run(folder)
    assert out.audio is not None and out.audio.size > 0 and len(out.token_ids) == 6
    return out


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.audio.shape == b.audio.shape
    np.testing.assert_allclose(a.audio, b.audio, atol=1e-5)


def test_every_stage_in_its_own_process(folder, local_out):
    _same(_run(folder, DeployConfig.everywhere("process", STAGES)), local_out)


def test_talker_and_code2wav_as_ray_actors(folder, local_out):
    pytest.importorskip("ray")
    import ray

    try:
        _same(_run(folder, DeployConfig.everywhere("ray", ["talker", "code2wav"])), local_out)
    finally:
        ray.shutdown()
