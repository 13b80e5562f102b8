"""Video generation jobs (OpenAI's /v1/videos model): each job is an asyncio task consuming
AsyncOmni.generate; its status and progress follow the engine's deltas, and the finished MP4
stays in memory for download.

Memory bound: at most `max_kept` jobs are remembered; when a job is added or finishes beyond
that, the oldest finished (completed or failed) jobs are forgotten with their MP4s. Running
jobs are never evicted (their number is bounded by the server's queue limit).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import InvalidRequestError, OmniStageError
from omnistage.media.video_encode import encode_mp4
from omnistage.outputs import to_uint8

log = logging.getLogger(__name__)

FINISHED = ("completed", "failed")


def seconds_of(num_frames: int, fps: int) -> str:
    """A video's `seconds` as this API reports them (a string): the time from its first frame
    to its last, (frames - 1) / fps, the inverse of the request's seconds * fps + 1 frames."""
    return f"{(num_frames - 1) / fps:g}"


def api_param(param: str | None) -> str | None:
    """The engine's name for a request field -> this API's (its input image is `input_reference`)."""
    return "input_reference" if param == "image" else param


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    size: str                     # "WxH" the job runs at
    seconds: str                  # duration as OpenAI reports it (a string): seconds_of(num_frames, fps)
    num_frames: int               # frames the job renders (once completed: the MP4's)
    fps: int
    seed: int
    created_at: int
    status: str = "queued"        # queued -> in_progress -> completed | failed
    progress: int = 0             # 0-100; 100 only once the MP4 is ready
    completed_at: int | None = None
    error: dict | None = None     # {"code", "message"} when failed
    mp4: bytes | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        """OpenAI's Video object (plus the extension fields num_frames, fps and seed)."""
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": None, "model": self.model, "prompt": self.prompt, "size": self.size,
                "seconds": self.seconds, "error": self.error, "remixed_from_video_id": None,
                "num_frames": self.num_frames, "fps": self.fps, "seed": self.seed}


class VideoJobs:
    def __init__(self, engine: AsyncOmni, max_kept: int = 32):
        if max_kept < 1:
            raise ValueError("max_kept must be >= 1")
        self.engine, self.max_kept = engine, max_kept
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()     # creation order

    def start(self, model: str, prompt, params: DiffusionParams,
              seconds: str | None = None) -> VideoJob:
        """Register a job for `prompt` (a string or {"prompt", "image"}) with resolved `params`
        (size, frames and seed filled in) and start it. Its `seconds` are those of its frames;
        a caller's own figure, if given, must be the same (a job never reports a duration it
        does not render)."""
        text = prompt if isinstance(prompt, str) else prompt["prompt"]
        derived = seconds_of(params.num_frames, params.fps)
        if seconds is not None and seconds != derived:
            raise ValueError(f"seconds {seconds!r} disagree with {params.num_frames} frames at "
                             f"{params.fps} fps ({derived!r})")
        job = VideoJob(id=f"video_{uuid.uuid4().hex}", model=model, prompt=text,
                       size=f"{params.width}x{params.height}", seconds=derived,
                       num_frames=params.num_frames, fps=params.fps, seed=params.seed,
                       created_at=int(time.time()))
        self._jobs[job.id] = job
        job.task = asyncio.create_task(self._run(job, prompt, params), name=job.id)
        self._evict()
        return job

    def get(self, job_id: str) -> VideoJob | None:
        return self._jobs.get(job_id)

    def list(self) -> list[VideoJob]:
        return list(self._jobs.values())

    async def delete(self, job_id: str) -> VideoJob | None:
        """Forget a job; a running one is cancelled and its request aborted in the engine."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        if job.task is not None and not job.task.done():
            # Cancelling the consumer closes AsyncOmni.generate, which aborts the request (the
            # stage drops its jobs); abort() again covers a task between its steps.
            job.task.cancel()
            await asyncio.wait([job.task])
            await self.engine.abort(job.id)
        return job

    # ---- one job ---------------------------------------------------------------------------
    async def _run(self, job: VideoJob, prompt, params: DiffusionParams) -> None:
        try:
            video = None
            deltas = self.engine.generate(prompt, params, request_id=job.id)
            try:
                async for d in deltas:
                    if d.progress is not None:
                        step, total = d.progress
                        job.status = "in_progress"
                        job.progress = min(99, 100 * step // max(total, 1))
                    if d.finished:
                        if d.finish_reason != "stop" or not d.images:
                            raise RuntimeError(f"the video request ended ({d.finish_reason}) "
                                               "without a video")
                        video = d.images[0]
                        break
            finally:
                await deltas.aclose()
            if video is None:
                raise RuntimeError("the video request ended without a result")
            frames = to_uint8(video)                      # (F, H, W, 3)
            job.mp4 = await asyncio.to_thread(encode_mp4, frames, job.fps)
            # What the MP4 holds, should the model have rendered other than was asked.
            job.num_frames, job.seconds = len(frames), seconds_of(len(frames), job.fps)
            job.size = f"{frames.shape[2]}x{frames.shape[1]}"
            job.status, job.progress = "completed", 100
        except asyncio.CancelledError:
            raise
        except InvalidRequestError as e:   # refused once the stage saw the input: the client's to fix
            self._fail(job, "invalid_request", str(e), api_param(e.param))
        except OmniStageError as e:     # a stage lost the request, or the engine stopped
            self._fail(job, "generation_failed", str(e))
        except Exception:
            log.exception("video job %s failed", job.id)
            self._fail(job, "internal_error", "internal error; see the server log for " + job.id)
        job.completed_at = int(time.time())
        self._evict()

    @staticmethod
    def _fail(job: VideoJob, code: str, message: str, param: str | None = None) -> None:
        job.status = "failed"
        job.error = {"code": code, "message": message, "param": param}

    def _evict(self) -> None:
        excess = len(self._jobs) - self.max_kept
        if excess <= 0:
            return
        for job_id in [j.id for j in self._jobs.values() if j.status in FINISHED][:excess]:
            del self._jobs[job_id]
