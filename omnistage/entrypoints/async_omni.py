"""AsyncOmni: the streaming API. One engine thread runs `engine.step()` while requests
exist and sleeps on a condition variable otherwise (no polling); asyncio callers get deltas
through per-request queues. Torch releases the GIL inside its kernels, so the event loop
stays responsive while the engine computes.

The engine thread owns the process's OpenMP team: a program that also runs parallel torch work
on another thread of its own should call `omnistage.runtime.process.serial_torch_thread()`
there first, or every engine step gets slower (see that module).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from omnistage.engine_api import EngineAbilities, OutputOptions
from omnistage.entrypoints.engines import build_engine
from omnistage.entrypoints.omni import engine_config
from omnistage.entrypoints.prompts import new_request_id
from omnistage.errors import EngineDeadError, InvalidRequestError
from omnistage.graph import failure_error
from omnistage.outputs import Delta
from omnistage.runtime.process import serial_executor
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A burst: requests submitted together (a client's batch, many users at once) reach the engine
# thread a few tenths of a millisecond apart (each is prepared on a worker thread first). An
# idle engine woken by the first used to start its step at once: the thinker prefilled the
# first few, and the rest waited for that prefill and the talker's (~50 ms with 8 Qwen3-Omni
# requests on 2 cores; their first audio 0.20 s instead of 0.16). So a step that starts from
# idle first takes what arrives while requests are still being prepared, and until
# BURST_QUIET_S passes without a new one (at most BURST_MAX_S in all): a lone request pays
# BURST_QUIET_S. (The quiet window alone let bursts split: preparations end unevenly, and of
# 16 Qwen3-Omni requests one went alone in one of three bursts, the other 15 waiting ~20 ms
# for its prefill.)
BURST_QUIET_S = 0.0005
BURST_MAX_S = 0.005


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue       # Delta items, or an Exception that ends the stream


class AsyncOmni:
    def __init__(self, model: str, omni_settings=None, deploy_config=None,
                 burst_max_s: float = BURST_MAX_S, **options):
        """`burst_max_s`: the longest an idle engine waits for the rest of a burst of requests
        before its first step (see BURST_QUIET_S)."""
        self.config = engine_config(model, options)
        self._omni_settings, self._deploy = omni_settings, deploy_config
        self._cv = threading.Condition()
        self._commands: list[Callable[[], None]] = []   # run on the engine thread
        self._streams: dict[str, _Stream] = {}           # touched on the engine thread only
        self._stopping = False
        self._preparing = 0        # generate() calls between their prepare and their submit
        self._burst_max_s = burst_max_s
        self._idle = threading.Event()   # set while the engine has nothing to do
        self.dead: BaseException | None = None
        # The engine is built on its own thread, so that all of its torch work (loading,
        # packing, every step) runs on one OpenMP thread team. A second team in the process
        # (any parallel torch op on another thread) makes libgomp throttle its spin waits,
        # and each parallel region then costs ~50 us more on a 2-core machine: requests are
        # prepared on threads that run torch serially (runtime/process.py).
        self._workers = serial_executor("omnistage-prepare")
        built: list = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, args=(built, ready),
                                        name="omnistage-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        self.engine = built[0]

    def _build_and_run(self, built: list, ready: threading.Event) -> None:
        try:
            self.engine = build_engine(self.config, self._omni_settings, self._deploy)
            built.append(self.engine)
        except BaseException as e:   # re-raised in the constructor's thread
            built.append(e)
            return
        finally:
            ready.set()
        self._run()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- public API -----------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, return_hidden_states: bool = False,
                       output: OutputOptions | None = None) -> AsyncIterator[Delta]:
        """Yields Deltas (text and token deltas per sample; audio chunks in Delta.audio for
        omni models asked for speech) until every sample finished. Leaving the loop early
        (break, cancellation, disconnect) aborts the request."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead!r}")
        params = self.engine.default_params() if sampling_params is None else sampling_params
        rid = request_id or new_request_id()
        opts = output or OutputOptions()
        with self._cv:
            self._preparing += 1
        try:
            parsed = await self.prepare(prompt, opts)
        except BaseException:
            self._prepared()
            raise
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
            self.engine.add_request(rid, parsed, params, opts, return_hidden_states)
            self._streams[rid] = stream

        self._submit(add, stream, prepared=True)
        remaining = self.engine.num_samples(params)   # finished deltas that end the request
        try:
            while remaining:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    remaining = 0   # never added, or already failed: nothing to abort
                    raise item
                if item.finished:
                    remaining -= 1
                if item.finish_reason == "error":     # refused (InvalidRequestError) or lost
                    raise failure_error(item)
                yield item
        finally:
            if remaining:
                self._submit(lambda: self._abort_now(rid))

    async def prepare(self, prompt, opts: OutputOptions | None = None):
        """The engine's checks and preprocessing of a prompt, in a worker thread: tokenizing a
        long prompt or decoding media takes a while, and the event loop stays free."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._workers, self.engine.prepare, prompt, opts or OutputOptions())
        except RuntimeError as e:       # shutdown() stopped the workers (before that, _submit
            if self._stopping:          # answers a prepared request with the same error)
                raise _shut_down() from e
            raise

    def resolve(self, prepared, params):
        """The parameters a prepared request would run with (defaults filled, limits checked)."""
        return self.engine.resolve(prepared, params)

    @property
    def abilities(self) -> EngineAbilities:
        return self.engine.abilities

    def num_waiting_requests(self) -> int:
        """Requests waiting for a seat in the engine (the server's queue bound reads it)."""
        return self.engine.num_waiting_requests()

    def health(self) -> str | None:
        """None while every part of the engine can serve, else why not."""
        return self.engine.health()

    def metrics(self) -> list[tuple[str, str, str, float]]:
        return self.engine.metrics()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generate() stream ends with finish_reason 'abort'."""
        self._submit(lambda: self._abort_now(request_id))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is left (or `timeout`); True if idle. For draining."""
        return self._idle.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.engine.close()   # stage processes / actors

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- engine thread --------------------------------------------------------------------
    def _prepared(self) -> None:
        """A preparation ended without a submit (it failed, or its caller left)."""
        with self._cv:
            self._preparing -= 1
            self._cv.notify()

    def _submit(self, fn: Callable[[], None], stream: _Stream | None = None,
                prepared: bool = False) -> None:
        """Queue `fn` for the engine thread. `prepared`: a generate() call's request, whose
        preparation (counted for the burst, see BURST_QUIET_S) ends with this submit."""
        def guarded() -> None:
            try:
                fn()
            except Exception as e:  # a bad request fails itself only
                if stream is None:
                    raise
                _post(stream.loop, stream.queue.put_nowait, e)

        with self._cv:
            self._preparing -= prepared
            if self._stopping or self.dead is not None:   # no engine thread left to run it
                if stream is not None:
                    _post(stream.loop, stream.queue.put_nowait, _shut_down())
                return
            self._commands.append(guarded)
            self._cv.notify()

    def _abort_now(self, request_id: str) -> None:
        deltas = self.engine.abort_request(request_id)
        self._dispatch(deltas)
        self._streams.pop(request_id, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                was_idle = False
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._idle.set()
                    self._cv.wait()
                    was_idle = True
                if was_idle:
                    self._gather_burst()
                self._idle.clear()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            try:
                for cmd in commands:
                    cmd()
                self._dispatch(self.engine.step())
            except Exception as e:
                log.exception("engine step failed; failing all requests")
                self.dead = e
                self._fail_all(EngineDeadError(f"the engine stopped after an internal error: {e!r}"))
                return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _gather_burst(self) -> None:
        """With the lock held: wait while requests are being prepared or keep arriving (see
        BURST_QUIET_S). Each submit and each failed preparation notifies."""
        deadline = time.monotonic() + self._burst_max_s
        seen = len(self._commands)
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            if self._preparing:
                self._cv.wait(left)
            else:
                self._cv.wait(min(BURST_QUIET_S, left))
                if len(self._commands) == seen and not self._preparing:
                    return
            seen = len(self._commands)

    def _dispatch(self, deltas: list[Delta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        finished: set[str] = set()
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream.queue, d))
            if d.finished:
                finished.add(d.request_id)
        # Only after the loop: the other samples' final deltas of this step still need it.
        for rid in finished - set(self.engine.requests):
            self._streams.pop(rid, None)
        for loop, items in by_loop.items():   # one wake-up per event loop per step
            _post(loop, _put_all, items)

    def _fail_all(self, err: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            _post(stream.loop, stream.queue.put_nowait, err)
        self._streams.clear()


def _shut_down() -> EngineDeadError:
    return EngineDeadError("the engine was shut down; create a new AsyncOmni")


def _put_all(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, d in items:
        q.put_nowait(d)


def _post(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    """Hand work to an event loop; a loop that has closed meanwhile has no reader left."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass
