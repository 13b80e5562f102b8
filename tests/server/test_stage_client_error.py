"""A request the model refuses only once its stage encodes the input is still the client's
mistake: a 400 invalid_request_error naming the field, never a 500, whether the diffusion
stage runs in the server's process or in its own (deploy config). The real input: an edit
image so thin (1 x 600 px) that Qwen-Image-Edit-Plus's ~384x384 condition image would be 0 px
wide; the family finds that in `encode`, after the request was accepted. The servers serve on
afterwards. Also: a video job the stage refuses ends "failed" with code invalid_request."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError
from omnistage.server.video_jobs import VideoJobs

STEPS = {"num_inference_steps": 2}
HELD = ("omnistage_requests_in_engine", 'omnistage_stage_requests{stage="diffusion"}')


def _png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


THIN, NORMAL = _png(600, 1), _png(32, 32)


@pytest.fixture(scope="module")
def servers(start_server, tmp_path_factory):
    """{"local": base URL, "process": base URL of a server whose diffusion stage runs in its
    own process}, both serving tiny:qwen_image_edit_plus, started side by side."""
    folder = str(tiny_checkpoint("qwen_image_edit_plus"))
    deploy = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    deploy.write_text("stages:\n  diffusion: {where: process, num_threads: 1}\n")
    flags = {"local": (), "process": ("--deploy-config", str(deploy))}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = {k: pool.submit(stack.enter_context, start_server(folder, *f)) for k, f in flags.items()}
        yield {k: f.result().base for k, f in started.items()}


@pytest.fixture(params=["local", "process"])
def base(request, servers):
    return servers[request.param]


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def _held(base: str, key: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    return sum(float(re.search(rf"^{re.escape(n)} (\S+)$", text, re.MULTILINE).group(1)) for n in HELD)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_refused_at_encode_is_a_400_naming_the_param(base, api_key, stream):
    client = _client(base, api_key)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(image=("thin.png", THIN, "image/png"), prompt="make it blue", size="32x32",
                           stream=stream, extra_body=STEPS)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "image", err
    assert "aspect ratio" in err["message"] and "crop" in err["message"], err
    # the server serves on: healthy, nothing held, and a normal edit works
    assert httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).status_code == 200
    assert _held(base, api_key) == 0
    ok = client.images.edit(image=("a.png", NORMAL, "image/png"), prompt="make it blue", size="32x32",
                            extra_body={**STEPS, "seed": 1})
    assert ok.size == "32x32" and len(ok.data) == 1 and ok.data[0].b64_json


class _RefusingEngine:
    """Stands in for AsyncOmni where the stage refuses the input while stepping, after a
    progress delta (no video family refuses at encode time today: the job's error path is
    what is under test here)."""

    async def generate(self, prompt, params, request_id=None):
        from omnistage.outputs import Delta

        yield Delta(request_id, 0, "", [], progress=(0, 2))
        raise InvalidRequestError("the first frame's aspect ratio is too extreme; crop it", param="image")

    async def abort(self, request_id: str) -> None:
        pass


def test_a_refused_video_job_fails_with_invalid_request():
    async def main():
        jobs = VideoJobs(_RefusingEngine())
        params = DiffusionParams(height=32, width=32, num_frames=5, fps=16, seed=1)
        job = jobs.start("tiny", {"prompt": "a wave", "image": []}, params, "0.25")
        await asyncio.wait_for(job.task, 10)
        return job

    job = asyncio.run(main())
    assert job.status == "failed" and job.completed_at is not None
    assert job.error["code"] == "invalid_request" and job.error["param"] == "input_reference"
    assert "crop it" in job.error["message"]
    assert job.to_json()["error"] == job.error
