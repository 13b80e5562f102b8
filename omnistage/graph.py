"""StageGraph: a model's stages wired by its recipe's edges, run in this process.

A family's pipeline (`graph_pipeline.GraphPipeline`) puts it behind the engine protocol. Each
`step()` steps every stage that has work, upstream first,
and routes what they emit along the recipe's edges at once: a chunk moves on in the same
step it was made, so stages overlap within a request and across requests.

The recipe's router is the only model-specific part: it turns a request into the first
stage messages, and each stage output into messages for downstream stages and deltas for
the client. The graph checks every routed message against the declared edges.

One step gives each stage one batched pass, so a stage whose passes are long (a vocoder's
ODE interval over several streams: 40-100 ms) would hold the stages feeding it to one pass
per round: a 50 Hz talker then makes ~10-25 codes a second per stream while its listeners
need 50, and the vocoder ends up waiting for codes it starved. So while a stage is
`starving` (waiting for input), the stages with an edge into it get extra passes, until each
has spent as long as the round's longest pass or has nothing to do. They run at the start of
the next step, so that the round's outputs (a first audio chunk) reach the caller first. A
stage so fed that is starving itself (a talker whose requests wait for the thinker's next
reply vector) has its own producers fed too, upstream first in each pass, for as long as it
is fed itself; one that is fed without starving has its producers that hold work of their
own (newcomers at an encoder) stepped first in each feeding pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from omnistage.errors import InvalidRequestError, OmniStageError, StageFailedError
from omnistage.outputs import Delta
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage

CLIENT = "client"     # the edge target that means "back to the caller"
MAX_FEED_PASSES = 64  # extra passes of a starving stage's producers per round (a bound)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str          # a stage name or CLIENT


@dataclass
class FailureDelta(Delta):
    """The last delta of a request a stage failed (finish_reason "error", `error` its message),
    with the stage's StageFailure: whether the stage refused the request (a client error
    naming a param) or lost it."""

    failure: StageFailure | None = None


def failure_error(delta: Delta) -> OmniStageError:
    """What a caller raises for a delta that finished with "error": InvalidRequestError (a 4xx
    naming the param) when a stage refused the request, else StageFailedError."""
    if isinstance(delta, FailureDelta) and delta.failure is not None:
        return delta.failure.exception()
    return StageFailedError(delta.error or "a stage failed")


class Router(Protocol):
    edges: list[Edge]

    def start(self, request: Any) -> list[tuple[str, Any]]:
        """(stage, message) pairs that begin a request (the router keeps its state)."""

    def route(self, out: StageOutput) -> list[tuple[str, Any]]:
        """(stage or CLIENT, message) pairs for one stage output; CLIENT messages are Deltas."""

    def forget(self, request_id: str) -> None:
        """Drop a request's routing state (finished or aborted)."""

    def unfinished(self) -> set[str]:
        """Requests the router still tracks."""


class StageGraph:
    def __init__(self, stages: list[Stage], router: Router, clock: Callable[[], float] = time.perf_counter):
        """`clock`: seconds, for the time stages spend in a round (see step)."""
        self.clock = clock
        self.stages = {s.name: s for s in stages}     # insertion order = upstream first
        self.router = router
        names = set(self.stages) | {CLIENT}
        bad = [e for e in router.edges if e.src not in self.stages or e.dst not in names]
        if bad:
            raise ValueError(f"edges name unknown stages: {bad}; stages: {sorted(self.stages)}")
        self._allowed = {(e.src, e.dst) for e in router.edges}
        self._last_round: dict[str, float] = {}     # seconds each stage stepped in the last round
        # stage -> the stages with an edge into it, upstream first (see step)
        self._producers = {name: [e.src for e in router.edges if e.dst == name and e.src in self.stages]
                           for name in self.stages}
        self._sinks = {name for name in self.stages           # stages whose outputs leave the graph
                       if not any(e.src == name and e.dst in self.stages for e in router.edges)}
        self.num_aborted_requests = 0
        self.last_batch = {name: 0 for name in self.stages}   # requests in each stage's last step

    # ---- the engine interface ------------------------------------------------------------
    @property
    def requests(self) -> set[str]:
        return self.router.unfinished()

    def add_request(self, request_id: str, request: Any) -> None:
        if request_id in self.router.unfinished():
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        for dst, msg in self.router.start(request):
            self._deliver("<entry>", dst, msg, [])

    def step(self, wait_s: float = 0.02) -> list[Delta]:
        """Step every stage with work, after the extra passes the last round earned for the
        producers of starving stages (module docstring). When no stage has work but stages
        in other processes are busy, wait (up to `wait_s`) until one of them sends something."""
        deltas: list[Delta] = []
        if self._last_round:                 # the extra passes the last round earned
            self._feed_starving(self._last_round, deltas)
        spent: dict[str, float] = {}         # seconds each stage stepped in this round
        for stage in self.stages.values():
            if stage.has_work():
                spent[stage.name] = self._step_stage(stage, deltas)
        self._last_round = spent
        if not spent and not deltas:
            self._wait_remote(wait_s)
        return deltas

    def _step_stage(self, stage: Stage, deltas: list[Delta]) -> float:
        """One pass of `stage`, its outputs routed; returns the seconds it took."""
        start = self.clock()
        outs = stage.step()
        self.last_batch[stage.name] = len({o.request_id for o in outs})
        for out in outs:
            if isinstance(out.payload, StageFailure):
                deltas += self._fail(out.payload)
                continue
            for dst, msg in self.router.route(out):
                if not self._deliver(stage.name, dst, msg, deltas):
                    break          # refused downstream: the request is gone everywhere
        return self.clock() - start

    def _feed_starving(self, spent: dict[str, float], deltas: list[Delta]) -> None:
        """Extra passes for the producers of starving stages (module docstring), each while
        its time in the round `spent` (updated) is below that round's longest pass."""
        budget = max(spent.values())
        for _ in range(MAX_FEED_PASSES):
            pulls, fed = self._pulls(), False
            for name, stage in self.stages.items():     # upstream first: a pass feeds the next
                if name in pulls and self._within(name, pulls[name], spent, budget) and stage.has_work():
                    spent[name] = spent.get(name, 0.0) + self._step_stage(stage, deltas)
                    fed = True
            if not fed:
                return

    def _pulls(self) -> dict[str, set[str]]:
        """The producers of starving stages, each with the stages that pull it, found
        downstream first: a starving sink (the vocoder short of codes) pulls its producers, and
        a pulled stage that is starving itself (a talker whose requests wait for the thinker's
        next reply vector) pulls its own (the talker's extra passes alone would advance only
        the requests the thinker is done with). A pulled stage that is not starving pulls
        those of its producers that have work of their own: their passes go first in a
        feeding pass, and the pulled stage's passes carry what they bring (an encoder holding
        newcomers' audio while the thinker and talker are fed for another request's first
        chunk; left to the round after the feeding passes, seven of eight Realtime sessions
        committing together waited ~0.17 s for their last window's encoding). A starving
        stage that nothing pulls pulls nothing."""
        pulls: dict[str, set[str]] = {}
        for name in reversed(self.stages):
            pulled = name in pulls
            if (name in self._sinks or pulled) and self.stages[name].starving():
                producers = self._producers[name]
            elif pulled:         # its producers with work of their own (docstring)
                producers = [p for p in self._producers[name] if self.stages[p].has_work()]
            else:
                continue
            for producer in producers:
                pulls.setdefault(producer, set()).add(name)
        return pulls

    def _within(self, name: str, pullers: set[str], spent: dict[str, float], budget: float) -> bool:
        """Whether `name` may take another extra pass: its time in the round is below the
        round's longest pass, or a fed stage that pulls it still is (its passes wait on this
        one's: capped apart, the thinker at ~5 ms a pass stopped after ~25 while the talker
        went on alone for the requests the thinker was done with, and the ones waiting on the
        thinker, newcomers before their first audio, waited. Eight Realtime sessions of 6 s on
        2 cores: first audio p50 lower in 8 of 9 A B pairs, median 1.23 -> 1.09 s)."""
        return spent.get(name, 0.0) < budget or any(
            spent.get(p, 0.0) < budget for p in pullers if p not in self._sinks)

    def _wait_remote(self, timeout: float) -> None:
        from omnistage.runtime.channel import wait_any
        from omnistage.stages.remote import remote_members

        channels = [s.channel for s in remote_members(self.stages.values())
                    if not s.dead and s.num_requests()]
        if channels:
            wait_any(channels, timeout)

    def _drop(self, request_id: str) -> bool:
        """Stop a request in every stage and forget it; False if it was not in flight."""
        if request_id not in self.router.unfinished():
            return False
        for stage in self.stages.values():
            stage.abort(request_id)
        self.router.forget(request_id)
        return True

    def _fail(self, failure: StageFailure) -> list[Delta]:
        """A stage lost a request: stop it everywhere; the caller gets the error."""
        rid = failure.request_id
        if not self._drop(rid):
            return []
        return [FailureDelta(rid, 0, "", [], finished=True, finish_reason="error", error=failure.message,
                             failure=failure)]

    def health(self) -> str | None:
        """None when every stage can serve, else why not (a stage past its restarts)."""
        dead = [s.dead for s in self.stages.values() if s.dead]
        return "; ".join(dead) if dead else None

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """Per-stage gauges: requests held, last batch, and each stage's own (a local AR
        stage's KV pool, the diffusion stage's jobs)."""
        out = []
        for name, stage in self.stages.items():
            out.append((f'omnistage_stage_requests{{stage="{name}"}}', "gauge",
                        "requests a stage holds (queued, running or waiting for input)",
                        stage.num_requests()))
            out.append((f'omnistage_stage_batch_size{{stage="{name}"}}', "gauge",
                        "requests served by a stage's last step", self.last_batch[name]))
            out += stage.metrics()
        return out

    def close(self) -> None:
        """Stop stages that run in other processes."""
        for stage in self.stages.values():
            stage.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.router.unfinished())

    def abort_request(self, request_id: str) -> list[Delta]:
        if not self._drop(request_id):
            return []
        self.num_aborted_requests += 1
        return [Delta(request_id, 0, "", [], finished=True, finish_reason="abort")]

    # ---- routing --------------------------------------------------------------------------
    def _deliver(self, src: str, dst: str, msg: Any, deltas: list[Delta]) -> bool:
        """Hands `msg` to `dst`; False when a stage refused it (the request failed)."""
        if src != "<entry>" and (src, dst) not in self._allowed:
            raise RuntimeError(f"recipe routed {type(msg).__name__} along {src} -> {dst}, "
                               f"which is not a declared edge")
        if dst == CLIENT:
            deltas.append(msg)
            if msg.finished:
                self.router.forget(msg.request_id)
            return True
        try:
            self.stages[dst].add(msg)
        except OmniStageError as e:
            # refused on arrival, e.g. a prompt over max_model_len that only the thinker sees
            # (after the encoders): this request fails, the engine goes on -- as a stage in
            # another process answers (stages/worker.py)
            if src == "<entry>":
                self._drop(msg.request_id)
                raise
            deltas += self._fail(StageFailure.of(msg.request_id, e))
            return False
        return True
