"""OpenAI's video job API, served by a video model (a DiffusionPipeline engine):

    POST   /v1/videos                 JSON or multipart -> a Video object (status "queued")
    GET    /v1/videos                 the jobs kept, newest first (limit, order, after)
    GET    /v1/videos/{id}            status and progress
    GET    /v1/videos/{id}/content    the MP4 (video/mp4), once completed
    DELETE /v1/videos/{id}            cancels a running job (the engine aborts it) and forgets it

A request is checked completely before its job exists (prompt, input image, size, frames,
steps: the model's own rules included), so client mistakes are 400s at POST time, never
failed jobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import InvalidRequestError
from omnistage.media.image import parse_data_url
from omnistage.server.admission import Ticket
from omnistage.server.errors import error_response
from omnistage.server.image_protocol import VideoRequest, validated
from omnistage.server.image_routes import form_fields, read_upload, require_diffusion
from omnistage.server.video_jobs import VideoJob, VideoJobs, api_param


def add_video_routes(app: FastAPI, engine: AsyncOmni, model_name: str,
                     check_model: Callable[[str], None], max_jobs: int = 32) -> VideoJobs:
    jobs = VideoJobs(engine, max_jobs)

    def find(video_id: str) -> VideoJob | Response:
        job = jobs.get(video_id)
        if job is None:
            return error_response(404, f"no video job with id {video_id!r} (finished jobs are "
                                       "kept for a while, then forgotten)", param="video_id")
        return job

    @app.post("/v1/videos")
    async def create(request: Request):
        fields, reference = await _read_body(request)
        body = validated(VideoRequest, fields)
        if body.model is not None:
            check_model(body.model)
        require_diffusion(engine, video=True)
        return await _start(engine, jobs, model_name, body, reference, request.state.admission)

    @app.get("/v1/videos")
    async def list_videos(limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return _page(jobs.list(), limit, order, after)

    @app.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str):
        job = find(video_id)
        return job if isinstance(job, Response) else job.to_json()

    @app.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, variant: str = "video"):
        job = find(video_id)
        if isinstance(job, Response):
            return job
        if variant != "video":
            raise InvalidRequestError(f"variant {variant!r} is not offered; only 'video' (the MP4)",
                                      param="variant")
        if job.status != "completed":
            why = f": {job.error['message']}" if job.error else f" ({job.progress}% done)"
            return error_response(409, f"video {video_id} is {job.status}{why}; its content can "
                                       "be downloaded once its status is 'completed'",
                                  param="video_id")
        return Response(job.mp4, media_type="video/mp4",
                        headers={"Content-Disposition": f'inline; filename="{job.id}.mp4"'})

    @app.delete("/v1/videos/{video_id}")
    async def delete(video_id: str):
        job = find(video_id)
        if isinstance(job, Response):
            return job
        await jobs.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return jobs


async def _start(engine: AsyncOmni, jobs: VideoJobs, model_name: str, body: VideoRequest,
                 reference: bytes | None, ticket: Ticket) -> dict:
    """Check and resolve the request (the input image decoded), then start its job, which
    takes the request's admission ticket over: it holds its place until it ends (completed,
    failed, or cancelled by DELETE), not just until this response."""
    params = body.params(engine.abilities.max_frames)
    prompt = {"prompt": body.prompt, "image": [reference]} if reference is not None else body.prompt
    try:
        prepared = await engine.prepare(prompt)       # decodes the input image
        resolved = engine.resolve(prepared, params)   # defaults, limits, seed
    except InvalidRequestError as e:   # named as this API names the field (input_reference)
        raise InvalidRequestError(str(e), param=api_param(e.param)) from None
    # The job reports the seconds of the frames it renders (seconds_of), not the request's.
    decoded = {"prompt": prepared.text, "image": prepared.images} if prepared.images else prepared.text
    job = jobs.start(model_name, decoded, resolved)
    held = ticket.hand_over()
    job.task.add_done_callback(lambda _task: held.release())
    return job.to_json()


def _page(kept: list[VideoJob], limit: int, order: str, after: str | None) -> dict:
    """One page of the job list, newest first unless `order` is "asc", after job `after`."""
    if order == "desc":
        kept.reverse()
    if after is not None:
        ids = [j.id for j in kept]
        kept = kept[ids.index(after) + 1:] if after in ids else []
    page = kept[:limit]
    return {"object": "list", "data": [j.to_json() for j in page],
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
            "has_more": len(kept) > limit}


async def _read_body(request: Request) -> tuple[dict, bytes | None]:
    """The request's fields and its input_reference image bytes (None without one), from a
    JSON body or a multipart form (the OpenAI SDK sends multipart)."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form(max_files=4)
        fields = form_fields(form)
        upload = form.get("input_reference")
        if upload is not None and not isinstance(upload, str):
            return fields, await read_upload(upload, "input_reference")
        ref = {k[len("input_reference["):-1]: v for k, v in fields.items()
               if k.startswith("input_reference[") and k.endswith("]")}
        if upload is not None:
            ref.setdefault("image_url", upload)
        return fields, _reference(ref) if ref else None
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"the request body is not valid JSON ({e}); send JSON or "
                                  "multipart/form-data") from None
    except RecursionError:          # json.loads recurses once per nesting level
        raise InvalidRequestError("the request body nests too deeply; send a flat JSON object "
                                  "of the request's fields") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    ref = body.pop("input_reference", None)
    if ref is not None and not isinstance(ref, dict):
        raise InvalidRequestError("input_reference must be {\"image_url\": \"data:...\"} in JSON "
                                  "(or a file part in multipart)", param="input_reference")
    return body, _reference(ref) if ref is not None else None    # {} too: a mistake, not "none"


def _reference(ref: dict) -> bytes:
    """{"image_url": data URL} -> the image bytes; file ids and remote URLs are not fetched."""
    if ref.get("file_id"):
        raise InvalidRequestError("input_reference file ids are not offered; upload the image "
                                  "or send it as a data: URL in input_reference.image_url",
                                  param="input_reference")
    url = ref.get("image_url")
    if not isinstance(url, str) or not url.lower().startswith("data:"):
        raise InvalidRequestError("input_reference.image_url must be a data: URL "
                                  "('data:image/png;base64,...'); remote URLs are not fetched",
                                  param="input_reference")
    return parse_data_url(url, param="input_reference").data
