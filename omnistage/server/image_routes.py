"""/v1/images/generations (JSON) and /v1/images/edits (multipart), served by an image model
(a DiffusionPipeline engine): OpenAI's ImagesResponse, whole or as server-sent events.

Streams send SSE comments with the denoising progress, `image_generation.partial_image`
(`image_edit.partial_image`) events when `partial_images` (1-3) asks for them, and one
`image_generation.completed` (`image_edit.completed`) event per image. A partial image is a
sample's predicted final image decoded part-way through denoising (after steps round(k * N /
(P + 1)), k = 1..P, of N): few steps give fewer of them, as OpenAI's contract allows ("the
final image may be sent before the full number of partial images"); with n > 1 each sample
sends its own, each counting `partial_image_index` from 0. Token usage is not counted for these
models: `usage` is all zeros where the SDK requires it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import FormData, UploadFile

from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import InvalidRequestError, OmniStageError, StageFailedError
from omnistage.outputs import Delta
from omnistage.server.access_log import AccessRecord
from omnistage.server.errors import error_response
from omnistage.server.image_protocol import (ImageRequest, b64, decode_mask, encode_image, pictures,
                                             size_of, validated)
from omnistage.server.metrics import ServerMetrics
from omnistage.server.streams import DeltaStreamingResponse, chain

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
    record = request.state.access
    if body.stream:
        return DeltaStreamingResponse(_events(first, deltas, body, kind, stats, t0, record), deltas,
                                      media_type="text/event-stream")
    final = await _final(chain(first, deltas))
    encoded = await asyncio.to_thread(_encode_all, final, body)
    stats.latency.observe(time.monotonic() - t0)
    record.images = len(encoded)
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


def _image_fields(data: str, pixels, body: ImageRequest) -> dict:
    """The fields a streamed image event (partial or completed) carries about its picture."""
    return {"b64_json": data, "created_at": int(time.time()), "output_format": body.output_format,
            "size": size_of(pixels), "background": "transparent" if pixels.shape[-1] == 4 else "opaque",
            "quality": "auto"}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _partial_events(d: Delta, body: ImageRequest, kind: str) -> list[str]:
    """A preview delta as `{kind}.partial_image` events (a layered model's: one per layer)."""
    return [_sse({"type": f"{kind}.partial_image", "partial_image_index": d.partial_image_index,
                  **_image_fields(b64(encode_image(p, body.output_format, body.output_compression)),
                                  p, body)})
            for p in pictures([d.partial_image])]


async def _events(first: Delta, deltas: AsyncIterator[Delta], body: ImageRequest, kind: str,
                  stats: ServerMetrics, t0: float, record: AccessRecord) -> AsyncIterator[str]:
    stream = chain(first, deltas)        # closing it (client gone) aborts the request
    try:
        async for d in stream:
            if d.progress is not None:
                yield f": progress {d.progress[0]}/{d.progress[1]}\n\n"    # SSE comment: keep-alive
            if d.partial_image is not None:
                for event in await asyncio.to_thread(_partial_events, d, body, kind):
                    yield event
            if not d.finished:
                continue
            if not d.images:
                raise RuntimeError(f"image request ended ({d.finish_reason}) without images")
            encoded = await asyncio.to_thread(_encode_all, d, body)
            record.images = len(encoded)
            for data in encoded:
                event = {"type": f"{kind}.completed", **_image_fields(data, d.images[0], body),
                         "usage": NO_USAGE}
                yield _sse(event)
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
