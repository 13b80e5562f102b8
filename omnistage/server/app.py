"""FastAPI app: OpenAI's chat completions, completions and models routes over AsyncOmni.

Every route checks the API key (when set) but /health (and /metrics with metrics_auth
"open"); every client mistake is a 4xx in OpenAI's error JSON; work is admitted at arrival
under the server's bound (server/admission.py, 429 beyond it); a client that disconnects
mid-stream aborts its request in the engine; each request leaves one access-log line
(server/access_log.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.chat_tools import ToolCallStream, split_tool_calls
from omnistage.engine_api import OutputOptions
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.errors import EngineDeadError, InvalidRequestError, OmniStageError
from omnistage.media.fetch import MediaFetchPolicy
from omnistage.outputs import Delta
from omnistage.runtime.process import serial_executor, serial_torch_thread
from omnistage.server.access_log import AccessLogMiddleware, AccessRecord, ResponseEndMiddleware
from omnistage.server.admission import Admission, AdmissionMiddleware
from omnistage.server.audio_routes import add_audio_routes
from omnistage.server.body_limit import BodyLimitMiddleware
from omnistage.server.errors import error_event, error_response
from omnistage.server.image_routes import add_image_routes
from omnistage.server.metrics import ServerMetrics
from omnistage.server.process_metrics import process_metrics
from omnistage.server.protocol import ChatCompletionRequest, CompletionRequest
from omnistage.server.realtime import add_realtime_route
from omnistage.server.speech import (AudioCollector, SpeechRequest, output_options,
                                     resolve_media_urls, stream_audio_delta)
from omnistage.server.streams import DeltaStreamingResponse, chain
from omnistage.server.video_routes import add_video_routes
from omnistage.version import __version__

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    max_body_bytes: int = 16 * 2**20      # request bodies larger than this get 413
    max_queued_requests: int = 256        # requests waiting beyond the seats; more get 429
    seats: int | None = None              # requests served at once; None: the engine's max_num_seqs
    metrics_auth: str = "key"             # "key": /metrics asks for the API key; "open": it does not
    allowed_origins: tuple[str, ...] = ()  # CORS origins; none by default
    media: MediaFetchPolicy = field(default_factory=MediaFetchPolicy)  # http(s) media: off by default
    max_video_jobs: int = 32              # video jobs remembered (oldest finished ones forgotten)
    realtime_streamed_input: bool = True  # Realtime turns prefilled while spoken (realtime_warm)


def build_app(engine: AsyncOmni, model_name: str, api_key: str | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="omnistage", version=__version__, lifespan=_serial_torch_threads)
    if limits.metrics_auth not in ("key", "open"):
        raise ValueError(f"metrics_auth must be 'key' or 'open', got {limits.metrics_auth!r}")
    app.state.draining = False    # set on SIGTERM: new work gets 503 while in-flight finishes
    stats = ServerMetrics()
    # read on first use: the app may be built around an engine stand-in that serves nothing
    admission = Admission(limits.max_queued_requests,
                          lambda: limits.seats if limits.seats is not None else engine.config.max_num_seqs)
    app.state.admission = admission      # the Realtime API's responses take tickets too
    _add_middleware(app, api_key, limits, admission)
    _add_error_handlers(app)
    _add_info_routes(app, engine, stats, model_name, admission)

    def check_model(name: str) -> None:
        if name != model_name:
            raise InvalidRequestError(f"model {name!r} is not served here; use {model_name!r}",
                                      param="model")

    def check_request(name: str, max_tokens: int | None) -> None:
        can = engine.abilities
        if can.makes_pixels:
            where = "POST /v1/videos" if can.generates == "video" else "/v1/images/generations"
            raise InvalidRequestError(f"this model generates images or video, not text; use {where}",
                                      param="model")
        if max_tokens is not None and max_tokens >= can.max_model_len:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} does not fit the context window of "
                f"{can.max_model_len} tokens", param="max_tokens")
        check_model(name)

    _add_text_routes(app, engine, stats, model_name, limits, check_request)
    add_audio_routes(app, engine, stats, model_name, lambda name: check_request(name, None))
    # WebSockets bypass the HTTP middleware: the route checks the key itself.
    add_realtime_route(app, engine, model_name, api_key, limits.max_queued_requests,
                       limits.realtime_streamed_input)
    add_image_routes(app, engine, stats, model_name, check_model)
    app.state.video_jobs = add_video_routes(app, engine, model_name, check_model,
                                            limits.max_video_jobs)
    return app


@asynccontextmanager
async def _serial_torch_threads(app: FastAPI) -> AsyncIterator[None]:
    """The event loop's thread and the threads of its `asyncio.to_thread` (media decoding,
    the Realtime session's audio and VAD) run torch serially: the engine thread keeps the
    process's one OpenMP team (runtime/process.py: a second team slows every engine step)."""
    serial_torch_thread()
    asyncio.get_running_loop().set_default_executor(serial_executor("omnistage-server"))
    yield


def _add_middleware(app: FastAPI, api_key: str | None, limits: ServerLimits,
                    admission: Admission) -> None:
    """Outermost first: the access log, CORS (preflights are answered before the key is
    asked for: a browser sends none), one HTTP middleware for the API key, the request id,
    draining (503) and last-resort 500s, then admission (429), the body size bound, and the
    access log's watch on responses cut short."""
    app.add_middleware(ResponseEndMiddleware)      # tells the access log of streams cut short
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    open_paths = {"/health"} | ({"/metrics"} if limits.metrics_auth == "open" else set())

    @app.middleware("http")
    async def auth_and_request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = rid
        if api_key is not None and request.url.path not in open_paths:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                      code="invalid_api_key", headers={"X-Request-Id": rid})
        if app.state.draining and (request.method == "POST" or request.url.path == "/health"):
            return error_response(503, "the server is shutting down", headers={"X-Request-Id": rid})
        try:
            response = await call_next(request)
        except Exception as exc:   # answer here: re-raised errors would reset the connection
            log.exception("request %s failed", rid)
            if isinstance(exc, EngineDeadError):
                return error_response(503, "the engine is not running", headers={"X-Request-Id": rid})
            return error_response(500, f"internal error; see the server log for request id {rid}",
                                  headers={"X-Request-Id": rid})
        response.headers["X-Request-Id"] = rid
        return response

    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id", "Retry-After"])
    app.add_middleware(AccessLogMiddleware)


def _add_error_handlers(app: FastAPI) -> None:
    """Client mistakes as OpenAI's error JSON (400 naming the field where one is at fault)."""

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON ({detail})")
        loc = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return error_response(400, f"{loc or 'body'}: {err.get('msg', 'invalid request')}", param=loc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if detail == "There was an error parsing the body":   # FastAPI's words for any bad body
            detail = ("the request body could not be parsed: send valid UTF-8 JSON (or, for "
                      "uploads, multipart/form-data) without excessive nesting")
        return error_response(exc.status_code, detail)


def _add_info_routes(app: FastAPI, engine: AsyncOmni, stats: ServerMetrics, model_name: str,
                     admission: Admission) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return error_response(503, "the engine stopped after an internal error")
        why = engine.health()
        if why is not None:
            return error_response(503, f"unhealthy: {why}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(stats.render(engine, admission.metrics() + process_metrics()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        # `omnistage`: what the model serves, for clients that adapt (the demo picks its tabs
        # by it); OpenAI's clients ignore fields they do not know.
        can = engine.abilities
        serves = {"generates": can.generates, "audio_output": can.audio_output,
                  "audio_input": can.audio_input, "voices": list(can.speakers),
                  "sample_rate": can.sample_rate}
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "omnistage",
             "omnistage": serves}]}


def _add_text_routes(app: FastAPI, engine: AsyncOmni, stats: ServerMetrics, model_name: str,
                     limits: ServerLimits, check_request) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        body.refuse_unserved()
        params = body.to_sampling_params()
        check_request(body.model, params.max_tokens)
        speech = output_options(engine, body)
        tools = body.offered_tools
        if tools and speech.speaks:
            raise InvalidRequestError("tool calls with a spoken answer are not served yet: give tools "
                                      "with modalities [\"text\"]", param="tools")
        messages = await resolve_media_urls(body.messages, limits.media)
        prompt = {"messages": messages, "tools": tools} if tools else messages
        return await _respond(engine, stats, request, prompt, params, body.stream,
                              body.stream_options, model_name, chat=True, output=speech,
                              tools=bool(tools))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body.model, body.max_tokens)
        prompt = body.prompt if isinstance(body.prompt, str) else {"prompt_token_ids": body.prompt}
        return await _respond(engine, stats, request, prompt, body.to_sampling_params(), body.stream,
                              body.stream_options, model_name, chat=False)


async def _respond(engine: AsyncOmni, stats: ServerMetrics, request: Request, prompt, params,
                   stream: bool, stream_options, model_name: str, chat: bool,
                   output: SpeechRequest | None = None, tools: bool = False):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.state.request_id}"
    opts = output.options if output is not None else OutputOptions(modalities=["text"])
    deltas = _observed(engine.generate(prompt, params, request_id=rid, output=opts), stats,
                       time.monotonic(), request.state.access)
    first = await anext(deltas)   # errors in the request surface here, before any byte is sent
    if stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        return DeltaStreamingResponse(_sse(engine, first, deltas, rid, model_name, chat, include_usage,
                                           output, tools), deltas, media_type="text/event-stream")
    return JSONResponse(await _whole(engine, first, deltas, rid, model_name, chat, params.n, output,
                                     tools))


def _tool_delta(stream: ToolCallStream, d: Delta) -> dict:
    """A streamed chat delta with tools offered: text until a call may start; at the end, what
    was held, and the calls (whole: name and arguments in one delta each)."""
    text = stream.push(d.text)
    if not d.finished:
        return {"content": text}
    rest, found = stream.finish()
    delta = {"content": text + rest}
    if found:
        delta["tool_calls"] = [c.to_openai(index=k) for k, c in enumerate(found)]
    return delta


async def _whole(engine, first: Delta, deltas: AsyncIterator[Delta], rid, model_name, chat, n,
                 output: SpeechRequest | None = None, tools: bool = False):
    texts, counts, reasons, logprobs = [""] * n, [0] * n, [None] * n, [[] for _ in range(n)]
    prompt_tokens = 0
    audio = AudioCollector()
    async for d in chain(first, deltas):
        texts[d.index] += d.text
        counts[d.index] += len(d.token_ids)
        prompt_tokens = max(prompt_tokens, d.num_prompt_tokens)
        audio.add(d)
        if d.logprobs:
            logprobs[d.index] += d.logprobs
        if d.finished:
            reasons[d.index] = _finish_reason(d)
    choices = []
    for i in range(n):
        lp = _chat_logprobs(engine, logprobs[i]) if logprobs[i] else None
        if chat:
            message = {"role": "assistant", "content": texts[i]}
            if tools:
                content, calls = split_tool_calls(texts[i])
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.to_openai() for c in calls]}
                    reasons[i] = "tool_calls"
            if output is not None and output.speaks:
                message["audio"] = audio.message_audio(output.format, texts[i])
            choices.append({"index": i, "message": message, "finish_reason": reasons[i], "logprobs": lp})
        else:
            choices.append({"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "usage": _usage(prompt_tokens, sum(counts))}


async def _sse(engine, first: Delta, deltas, rid, model_name, chat, include_usage,
               output: SpeechRequest | None = None, tools: bool = False):
    created = int(time.time())
    calls: dict[int, ToolCallStream] = {}     # per choice, with tools: text held while a call may start
    audio_id = f"audio_{uuid.uuid4().hex}"
    speaks = output is not None and output.speaks
    obj = "chat.completion.chunk" if chat else "text_completion"
    started: set[int] = set()
    prompt_tokens = completion_tokens = 0

    def event(choices: list, usage: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for d in chain(first, deltas):   # closing this generator aborts the request
            prompt_tokens = max(prompt_tokens, d.num_prompt_tokens)
            completion_tokens += len(d.token_ids)
            if not (d.text or d.finished or d.index not in started or d.audio is not None):
                continue
            if chat:
                delta = {"content": d.text}
                if tools:
                    delta = _tool_delta(calls.setdefault(d.index, ToolCallStream()), d)
                if d.index not in started:
                    delta["role"] = "assistant"
                if speaks and (d.text or d.audio is not None):
                    delta["audio"] = stream_audio_delta(audio_id, d)
                choice = {"index": d.index, "delta": delta, "finish_reason": None, "logprobs": None}
                if d.logprobs:
                    choice["logprobs"] = _chat_logprobs(engine, d.logprobs)
            else:
                choice = {"index": d.index, "text": d.text, "finish_reason": None, "logprobs": None}
            started.add(d.index)
            if d.finished:
                choice["finish_reason"] = "tool_calls" if "tool_calls" in choice.get("delta", {}) \
                    else _finish_reason(d)
            yield event([choice])
    except OmniStageError as e:   # a stage failed or refused mid-stream: say so, then end
        yield error_event(e)
        return
    if include_usage:
        yield event([], _usage(prompt_tokens, completion_tokens))
    yield "data: [DONE]\n\n"


async def _observed(deltas: AsyncIterator[Delta], stats: ServerMetrics, t0: float,
                    record: AccessRecord) -> AsyncIterator[Delta]:
    """Records TTFT, TTFA, latency, token counts and audio seconds of one request as its
    deltas pass (in the server's metrics and in the request's access-log record)."""
    first_text = first_audio = True
    prompt_tokens = 0
    record.prompt_tokens, record.completion_tokens = 0, 0
    try:
        async for d in deltas:
            if first_text and d.token_ids:
                stats.ttft.observe(time.monotonic() - t0)
                first_text = False
            if d.audio is not None:
                if first_audio:
                    stats.ttfa.observe(time.monotonic() - t0)
                    first_audio = False
                stats.audio_seconds += d.audio.size / d.sample_rate
                record.audio_seconds = (record.audio_seconds or 0.0) + d.audio.size / d.sample_rate
            prompt_tokens = max(prompt_tokens, d.num_prompt_tokens)
            record.prompt_tokens = prompt_tokens
            record.completion_tokens += len(d.token_ids)
            stats.generation_tokens += len(d.token_ids)
            yield d
        stats.latency.observe(time.monotonic() - t0)
    finally:
        stats.prompt_tokens += prompt_tokens
        await deltas.aclose()


def _finish_reason(d: Delta) -> str:
    return "length" if d.finish_reason == "length" else "stop"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chat_logprobs(engine: AsyncOmni, lps) -> dict:
    tok = engine.tokenizer

    def entry(token_id: int, logprob: float) -> dict:
        text = tok.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

