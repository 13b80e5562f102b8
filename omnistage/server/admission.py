"""Admission control: the server's bound on the engine work it has taken on.

`Admission` counts the requests admitted to engine work and not yet finished (`in_flight`),
at their arrival, before any of their work starts: the count is read and raised in one step
on the event loop (no await between), so a burst of simultaneous requests cannot all pass
the check before the first of them reaches the engine. A request is admitted while

    in_flight < seats + max_queued

`seats` are the requests the engine serves at once (`--max-num-seqs`; for image and video
models `--diffusion-max-batch`); `max_queued` (`--max-queued-requests`) the requests that may
wait beyond them. The rest get 429 with `Retry-After`. A request counts once (whatever its
`n`) until its response ends: the last byte of a stream, an error, the client closing the
connection; a video job until the job ends (completed, failed or deleted); a Realtime
`response.create` until its response is done.

Which requests: every POST to a route that creates engine work (`WORK_PATHS`, held by
`AdmissionMiddleware`) and the Realtime API's responses (`RealtimeSession._start_response`).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.server.errors import error_response

WORK_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/audio/transcriptions",
    "/v1/images/generations", "/v1/images/edits", "/v1/videos"})
RETRY_AFTER_S = 1
FULL_MESSAGE = ("the server is at its request bound ({seats} being served + {queued} queued); "
                "retry shortly")


class Ticket:
    """One admitted request's place; `release` (idempotent) gives it back."""

    def __init__(self, admission: "Admission"):
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= 1
            self._admission = None

    def hand_over(self) -> "Ticket":
        """A new ticket holding this place (for work that outlives the response, a video
        job); this one no longer releases it."""
        admission, self._admission = self._admission, None
        if admission is None:
            raise RuntimeError("the ticket was already released or handed over")
        return Ticket(admission)


class Admission:
    """Counts admitted-but-unfinished requests. Used on the event loop only."""

    def __init__(self, max_queued: int, seats: Callable[[], int]):
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_queued = max_queued
        self._seats = seats          # read on first use (the engine may be built later)
        self.in_flight = 0
        self.rejected = 0

    @property
    def seats(self) -> int:
        return self._seats()

    @property
    def queued(self) -> int:
        """Admitted requests beyond the seats: those waiting to be served."""
        return max(0, self.in_flight - self.seats)

    def try_acquire(self) -> Ticket | None:
        """A ticket, or None (counted as rejected) when the bound is reached."""
        if self.in_flight >= self.seats + self.max_queued:
            self.rejected += 1
            return None
        self.in_flight += 1
        return Ticket(self)

    def refusal_message(self) -> str:
        return FULL_MESSAGE.format(seats=self.seats, queued=self.max_queued)

    def metrics(self) -> list[tuple[str, str, str, float]]:
        return [
            ("omnistage_server_requests_in_flight", "gauge",
             "requests admitted by the server and not finished (served + queued)", self.in_flight),
            ("omnistage_server_requests_queued", "gauge",
             "admitted requests beyond the engine's seats (waiting to be served)", self.queued),
            ("omnistage_server_requests_rejected_total", "counter",
             "requests refused with 429 at the server's bound", self.rejected),
        ]


class AdmissionMiddleware:
    """ASGI: a POST to a work route takes a ticket on arrival (or gets 429 with Retry-After)
    and gives it back when the app has answered it, streams included (also when the client
    closed the connection). The ticket is `request.state.admission` for routes whose work
    outlives the response."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in WORK_PATHS:
            await self.app(scope, receive, send)
            return
        ticket = self.admission.try_acquire()
        if ticket is None:
            refusal = error_response(429, self.admission.refusal_message(),
                                     code="rate_limit_exceeded",
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})["admission"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.release()
