"""/v1/images/generations (JSON) and /v1/images/edits (multipart), served by an image model
(a DiffusionPipeline engine): OpenAI's ImagesResponse, whole or as server-sent events.

Streams send one `image_generation.completed` (`image_edit.completed`) event per image and SSE
comments with the denoising progress meanwhile; partial images are not produced (the engine
decodes only finished latents), which OpenAI's contract allows ("the final image may be sent
before the full number of partial images"). Token usage is not counted for these models:
`usage` is all zeros where the SDK requires it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import FormData, UploadFile

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import InvalidRequestError, OmniStageError, StageFailedError
from omnistage.outputs import Delta
from omnistage.server.errors import error_response
from omnistage.server.image_protocol import (ImageRequest, b64, decode_mask, encode_image, pictures,
                                             size_of, validated)
from omnistage.server.metrics import ServerMetrics
from omnistage.server.streams import chain

log = logging.getLogger(__name__)

MAX_FORM_FILES = 64            # image[] uploads + mask; the model's own limit is checked later
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": 0, "total_tokens": 0}


def require_diffusion(engine: AsyncOmni, video: bool) -> None:
    """400 unless the served model is an image (video=False) or video (video=True) model."""
    can = engine.abilities
    if not can.makes_pixels:
        raise InvalidRequestError("this model generates text, not images or video; use "
                                  "/v1/chat/completions", param="model")
    if can.generates == "video" and not video:
        raise InvalidRequestError("this is a video model; create videos with POST /v1/videos",
                                  param="model")
    if video and can.generates != "video":
        raise InvalidRequestError("this is an image model; use /v1/images/generations (or "
                                  "/v1/images/edits for models that take input images)",
                                  param="model")


def add_image_routes(app: FastAPI, engine: AsyncOmni, stats: ServerMetrics, model_name: str,
                     check_model: Callable[[str], None]) -> None:
    def checked(body: ImageRequest) -> None:
        if body.model is not None:
            check_model(body.model)
        require_diffusion(engine, video=False)
        body.check_output()

    @app.post("/v1/images/generations")
    async def generations(body: ImageRequest, request: Request):
        checked(body)
        return await _serve(engine, stats, request, body.prompt, body, "image_generation")

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        form = await read_form(request)
        body = validated(ImageRequest, form_fields(form))
        checked(body)
        uploads = form.getlist("image") + form.getlist("image[]")
        if not uploads:
            raise InvalidRequestError("image is required: upload one or more image files as "
                                      "'image' (or 'image[]')", param="image")
        images = [await read_upload(u, "image") for u in uploads]
        prompt = {"prompt": body.prompt, "image": images}
        if form.get("mask") is not None:
            data = await read_upload(form.get("mask"), "mask")
            prompt["mask"] = await asyncio.to_thread(
                decode_mask, data, engine.abilities.max_input_pixels)
        return await _serve(engine, stats, request, prompt, body, "image_edit")


async def read_form(request: Request) -> FormData:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise InvalidRequestError("send this request as multipart/form-data (files as form "
                                  f"parts), not {ctype or 'no content type'}", param=None)
    return await request.form(max_files=MAX_FORM_FILES)


def form_fields(form: FormData) -> dict[str, str]:
    """The form's text fields (the last value of a repeated one); files are read separately."""
    return {k: v for k, v in form.multi_items() if isinstance(v, str)}


async def read_upload(part, param: str) -> bytes:
    if not isinstance(part, UploadFile):
        raise InvalidRequestError(f"{param} must be a file upload (multipart file part), not a "
                                  "text field", param=param)
    data = await part.read()
    if not data:
        raise InvalidRequestError(f"{param} is an empty file", param=param)
    return data


async def _serve(engine: AsyncOmni, stats: ServerMetrics, request: Request, prompt,
                 body: ImageRequest, kind: str):
    t0 = time.monotonic()
    deltas = engine.generate(prompt, body.params(), request_id=f"img-{request.state.request_id}")
    try:
        # Request errors surface here, before any byte is sent: those found on arrival and those
        # the stage finds once it encodes the input (e.g. an edit model refusing an extreme
        # aspect ratio) both arrive as InvalidRequestError, which the app answers 400 naming
        # the param.
        first = await anext(deltas)
    except StageFailedError as e:
        # The stage lost the request (a fault, or its process died): not the client's doing.
        return error_response(500, f"the image request failed: {e}", code="generation_failed")
    if body.stream:
        return StreamingResponse(_events(first, deltas, body, kind, stats, t0),
                                 media_type="text/event-stream")
    final = await _final(chain(first, deltas))
    encoded = await asyncio.to_thread(_encode_all, final, body)
    stats.latency.observe(time.monotonic() - t0)
    return JSONResponse({"created": int(time.time()), "data": [{"b64_json": b} for b in encoded],
                         "output_format": body.output_format, "size": size_of(final.images[0]),
                         "background": _background(final), "seed": final.seed})


async def _final(deltas: AsyncIterator[Delta]) -> Delta:
    """The finished delta (all n images). Stops at it rather than running the stream dry: a
    diffusion request's n images come in ONE finished delta."""
    try:
        async for d in deltas:
            if d.finished:
                if not d.images:
                    raise RuntimeError(f"image request ended ({d.finish_reason}) without images")
                return d
        raise RuntimeError("image request ended without a result")
    finally:
        await deltas.aclose()


def _encode_all(final: Delta, body: ImageRequest) -> list[str]:
    """Every picture of the result (n images; a layered model's layers, each sample's in turn)."""
    return [b64(encode_image(p, body.output_format, body.output_compression))
            for p in pictures(final.images)]


def _background(final: Delta) -> str:
    return "transparent" if final.images[0].shape[-1] == 4 else "opaque"


async def _events(first: Delta, deltas: AsyncIterator[Delta], body: ImageRequest, kind: str,
                  stats: ServerMetrics, t0: float) -> AsyncIterator[str]:
    stream = chain(first, deltas)        # closing it (client gone) aborts the request
    try:
        async for d in stream:
            if d.progress is not None:
                yield f": progress {d.progress[0]}/{d.progress[1]}\n\n"    # SSE comment: keep-alive
            if not d.finished:
                continue
            if not d.images:
                raise RuntimeError(f"image request ended ({d.finish_reason}) without images")
            encoded = await asyncio.to_thread(_encode_all, d, body)
            for data in encoded:
                event = {"type": f"{kind}.completed", "b64_json": data, "created_at": int(time.time()),
                         "output_format": body.output_format, "size": size_of(d.images[0]),
                         "background": _background(d), "quality": "auto", "usage": NO_USAGE}
                yield f"event: {kind}.completed\ndata: {json.dumps(event)}\n\n"
            stats.latency.observe(time.monotonic() - t0)
            break
    except Exception as e:     # after the 200: the error travels as an SSE error event
        err = {"message": str(e), "type": "server_error", "param": None, "code": None}
        if isinstance(e, InvalidRequestError):
            err.update(type="invalid_request_error", param=e.param)
        elif not isinstance(e, OmniStageError):     # ours carry messages meant for the client
            log.exception("image stream failed")
            err["message"] = "internal error; see the server log"
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'error': err})}\n\n"
    finally:
        await stream.aclose()
