"""The real server with a tiny Wan (text to video) on loopback, driven by the openai SDK's
video job API: create -> progress -> MP4 content; delete during the run frees the engine;
unknown ids, early downloads and bad requests get OpenAI errors."""

from __future__ import annotations

import contextlib
import io
import time
from concurrent.futures import ThreadPoolExecutor

import av
import httpx
import numpy as np
import openai
import pytest

from omnistage.entrypoints.model_source import tiny_checkpoint
from tests.server.conftest import metric

FAST = {"num_inference_steps": 2, "seed": 1}
DEADLINE_S = 60
# The SDK marks its video methods deprecated (OpenAI's own service); the API shape is what this
# server offers.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def servers(start_server):
    """{"t2v": base URL of a tiny:wan server, "i2v": one of tiny:wan_i2v}, started side by side
    (each spends seconds importing torch and diffusers)."""
    flags = ("--max-video-frames", "17", "--max-diffusion-steps", "1000", "--max-video-jobs", "3")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = {k: pool.submit(stack.enter_context, start_server(str(tiny_checkpoint(arch)), *flags))
                   for k, arch in (("t2v", "wan"), ("i2v", "wan_i2v"))}
        yield {k: f.result().base for k, f in started.items()}


@pytest.fixture(scope="module")
def video_server(servers):
    return servers["t2v"]


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(video_server, api_key):
    return _client(video_server, api_key)


def _wait(client, video_id: str, until=("completed", "failed")):
    """Poll (bounded) until the job's status is in `until`; returns (job, progress values seen)."""
    seen, deadline = [], time.monotonic() + DEADLINE_S
    while True:
        job = client.videos.retrieve(video_id)
        seen.append(job.progress)
        if job.status in until:
            return job, seen
        assert time.monotonic() < deadline, f"video job still {job.status} after {DEADLINE_S} s"
        time.sleep(0.05)


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as box:
        return np.stack([f.to_ndarray(format="rgb24") for f in box.decode(video=0)])


STAGE_REQUESTS = 'omnistage_stage_requests{stage="diffusion"}'
ABORTED = "omnistage_requests_aborted_total"


def test_create_poll_and_download(client):
    video = client.videos.create(model="tiny", prompt="a wave", size="48x32",
                                 extra_body={**FAST, "num_frames": 5, "fps": 8})
    assert video.object == "video" and video.status in ("queued", "in_progress")
    assert video.size == "48x32" and video.seconds == "0.5" and video.model == "tiny"
    done, seen = _wait(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= video.created_at
    assert seen == sorted(seen)                 # progress never goes back
    frames = _frames(client.videos.download_content(video.id).content)
    assert frames.shape == (5, 32, 48, 3)
    assert video.id in [v.id for v in client.videos.list()]


def test_seconds_set_the_frame_count(client):
    video = client.videos.create(prompt="rain", size="32x32", seconds="1", extra_body={**FAST, "fps": 8})
    assert video.seconds == "1"
    done, _ = _wait(client, video.id)
    assert done.status == "completed"
    assert _frames(client.videos.download_content(video.id).content).shape[0] == 9   # 1 s * 8 fps + 1


def test_delete_during_the_run_frees_the_engine(client, video_server, api_key):
    aborted = metric(video_server, ABORTED, api_key)
    video = client.videos.create(prompt="a long one", size="64x64",     # ~8 s of denoising
                                 extra_body={"num_inference_steps": 1000, "num_frames": 17, "seed": 3})
    running, _ = _wait(client, video.id, until=("in_progress", "completed", "failed"))
    assert running.status == "in_progress"
    with pytest.raises(openai.ConflictError, match="in_progress"):
        client.videos.download_content(video.id)       # not finished yet
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    deadline = time.monotonic() + 10
    while metric(video_server, STAGE_REQUESTS, api_key) != 0:   # the abort reaches the engine thread
        assert time.monotonic() < deadline, "the stage still holds the deleted job"
        time.sleep(0.05)
    assert metric(video_server, ABORTED, api_key) == aborted + 1
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_image_to_video_from_an_uploaded_first_frame(servers, api_key):
    from PIL import Image

    i2v = _client(servers["i2v"], api_key)
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 48, 3), (200, 30, 30), np.uint8)).save(buf, "PNG")
    video = i2v.videos.create(prompt="it moves", size="48x32",
                              input_reference=("f.png", buf.getvalue(), "image/png"),
                              extra_body={**FAST, "num_frames": 5})
    done, _ = _wait(i2v, video.id)
    assert done.status == "completed", done.error
    assert _frames(i2v.videos.download_content(video.id).content).shape == (5, 32, 48, 3)
    with pytest.raises(openai.BadRequestError) as e:       # the first frame is required
        i2v.videos.create(prompt="it moves", size="48x32", extra_body=FAST)
    assert e.value.body["param"] == "input_reference"


def test_only_the_newest_finished_jobs_are_kept(client):
    ids = []
    for seed in range(4):                                 # --max-video-jobs 3
        video = client.videos.create(prompt="short", size="32x32",
                                     extra_body={"num_inference_steps": 1, "num_frames": 1, "seed": seed})
        assert _wait(client, video.id)[0].status == "completed"
        ids.append(video.id)
    assert [v.id for v in client.videos.list()] == ids[:0:-1]     # newest first
    page = client.videos.list(order="asc", limit=2)
    assert [v.id for v in page.data] == ids[1:3] and page.has_more
    assert [v.id for v in page] == ids[1:]                        # the SDK follows last_id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[0])


def test_unknown_ids_are_404s(client):
    for call in (client.videos.retrieve, client.videos.download_content, client.videos.delete):
        with pytest.raises(openai.NotFoundError):
            call("video_nope")


@pytest.mark.parametrize("fields, param", [
    ({"size": "40x32"}, "size"),                          # not a multiple of 16
    ({"size": "wide"}, "size"),
    ({"num_frames": 6}, "num_frames"),                    # Wan: 4k+1 frames
    ({"num_frames": 21}, "num_frames"),                   # over --max-video-frames 17
    ({"seconds": "9", "fps": 8}, "seconds"),              # 73 frames, over --max-video-frames 17
    ({"num_inference_steps": 1001}, "num_inference_steps"),
    ({"model": "sora-2"}, "model"),
    ({"input_reference": {"image_url": "data:image/png;base64,AAAA"}}, "input_reference"),
])
def test_bad_video_requests_are_400s(video_server, api_key, fields, param):
    r = httpx.post(f"{video_server}/v1/videos", json={"prompt": "x", "size": "32x32", **fields},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_other_endpoints_point_to_videos(client):
    with pytest.raises(openai.BadRequestError, match="/v1/videos"):
        client.images.generate(prompt="x", size="32x32")
    with pytest.raises(openai.BadRequestError, match="/v1/videos"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def _json(base: str, key: str, video_id: str) -> dict:
    r = httpx.get(f"{base}/v1/videos/{video_id}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_seconds_and_num_frames_that_disagree_are_a_400(video_server, api_key):
    # The case: seconds "4" with num_frames 5 made a 5-frame MP4 of 0.31 s reported as 4 s.
    for fields in ({"seconds": "4", "num_frames": 5}, {"seconds": "1", "fps": 8, "num_frames": 5}):
        r = httpx.post(f"{video_server}/v1/videos", json={"prompt": "x", "size": "32x32", **fields},
                       headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "num_frames"
        assert "contradicts seconds" in error["message"] and "send one of them" in error["message"]


def test_the_job_reports_the_seconds_it_renders(client, video_server, api_key):
    """seconds and num_frames that agree are served; a job of num_frames alone reports the
    seconds of those frames at its fps ((frames - 1) / fps), before and after rendering."""
    agree = client.videos.create(prompt="rain", size="32x32", seconds="1",
                                 extra_body={**FAST, "fps": 8, "num_frames": 9})
    frames_only = client.videos.create(prompt="rain", size="32x32",
                                       extra_body={**FAST, "num_frames": 5})       # fps 16
    assert agree.seconds == "1" and frames_only.seconds == "0.25"
    for video, frames, fps, seconds in ((agree, 9, 8, "1"), (frames_only, 5, 16, "0.25")):
        assert _json(video_server, api_key, video.id)["num_frames"] == frames
        done, _ = _wait(client, video.id)
        assert done.status == "completed", done.error
        job = _json(video_server, api_key, video.id)
        assert (job["seconds"], job["num_frames"], job["fps"]) == (seconds, frames, fps)
        mp4 = client.videos.download_content(video.id).content
        assert _frames(mp4).shape[0] == frames
        with av.open(io.BytesIO(mp4)) as box:
            assert box.streams.video[0].average_rate == fps
