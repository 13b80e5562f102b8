"""A stage running in its own OS process, seen from the graph as an ordinary Stage.

add/abort send messages; step returns what the child has sent since the last step. When the
child dies, every request it held fails with a clear error (StageFailure) and a fresh child
is started, up to `max_restarts`; past that the stage reports itself dead and fails every
new request at once (the pipeline is then unhealthy).
"""

from __future__ import annotations

import logging
import time

import msgspec

from omnistage.config import EngineConfig
from omnistage.errors import ModelLoadError
from omnistage.runtime.channel import ChannelConfig, PeerDeadError, spawn_child
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage
from omnistage.stages.worker import (Abort, Final, InitFailed, Ready, StageInit, message_types,
                                     worker_main)

log = logging.getLogger(__name__)


class _Target:
    """Module-level-importable callable for spawn: binds the recipe to the worker."""

    def __init__(self, recipe: str):
        self.recipe = recipe

    def __call__(self, spec: bytes) -> None:
        worker_main(spec, self.recipe)


class RemoteStage(Stage):
    def __init__(self, name: str, recipe: str, config: EngineConfig, settings,
                 start_timeout_s: float = 600.0, max_restarts: int = 3):
        self.name, self.recipe, self.config = name, recipe, config
        self._settings = msgspec.json.encode(settings)
        self._types = message_types(recipe)
        self.start_timeout_s, self.max_restarts = start_timeout_s, max_restarts
        self.restarts = 0
        self.dead: str | None = None          # why the stage is gone for good
        self._inflight: set[str] = set()
        self._final_next: set[str] = set()     # requests whose next payload is their last
        self._failed: list[StageOutput] = []   # failures to report on the next step
        self._child = None
        self._launch()

    # ---- process lifecycle ----------------------------------------------------------------
    def _spawn(self):
        """Start the child (without waiting for it); -> a handle with .channel, .alive(),
        .shutdown(timeout), .describe()."""
        return _ProcessHandle(spawn_child(_Target(self.recipe), self._types,
                                          ChannelConfig(handshake_timeout_s=self.start_timeout_s),
                                          name=f"omnistage-{self.name}", wait=False))

    def _launch(self) -> None:
        """Start the child without waiting for it: StageInit and whatever is added meanwhile
        wait in `_pending` until the child connects, and its Ready or InitFailed is read by
        wait_started() (at start: several stages start, import and load in parallel) or by
        step() (a restart: the graph keeps serving the other stages meanwhile)."""
        self._t0 = time.monotonic()
        self._starting = True
        self._pending = [StageInit(self.recipe, self.name, self.config, self._settings)]
        self._child = self._spawn()

    def wait_started(self) -> None:
        try:
            self._child.channel.wait_ready(self.start_timeout_s)
            self._flush_pending()
            reply = self._child.channel.recv(max(0.0, self._t0 + self.start_timeout_s - time.monotonic()))
        except PeerDeadError as e:
            reply = InitFailed(f"the {self._child.kind} exited while starting ({e})")
        except TimeoutError:
            reply = None
        if not isinstance(reply, Ready):
            why = (reply.message if isinstance(reply, InitFailed)
                   else f"no answer in {self.start_timeout_s} s{self._start_hint()}")
            self._child.shutdown()
            raise ModelLoadError(f"stage {self.name!r} could not start in its {self._child.kind}: {why}")
        self._started()

    def _start_hint(self) -> str:
        """What may keep a child from answering (appended to a start timeout's message)."""
        return " (its imports and model load included: raise start_timeout_s if it is slow)"

    def _started(self) -> None:
        self._starting = False
        log.info("stage %s ready in %s (%.1f s)", self.name, self._child.describe(),
                 time.monotonic() - self._t0)

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        for msg in pending:
            self._child.channel.send(msg)

    def _send(self, msg) -> None:
        """To the child, or (while a restarted child has not connected yet) kept for it."""
        if self._pending and self._child.channel.poll_ready():
            self._flush_pending()
        if self._pending:
            self._pending.append(msg)
        else:
            self.channel.send(msg)

    def _poll_restart(self) -> None:
        """Step while a restarted child starts: hand it what waited, read its Ready or
        InitFailed, and give up past the start timeout. PeerDeadError if it died."""
        if self._pending and self._child.channel.poll_ready():
            self._flush_pending()
        if not self._pending:
            reply = self.channel.recv(0)
            if isinstance(reply, Ready):
                self._started()
                return
            if isinstance(reply, InitFailed):
                self._give_up(f"stage {self.name!r} could not restart: {reply.message}")
                return
        if time.monotonic() - self._t0 > self.start_timeout_s:
            self._give_up(f"stage {self.name!r} could not restart: no answer in {self.start_timeout_s} s")

    def _fail_inflight(self, why: str) -> None:
        self._failed += [StageOutput(self.name, rid, StageFailure(rid, why), final=True)
                         for rid in sorted(self._inflight)]
        self._inflight.clear()
        self._final_next.clear()

    def _give_up(self, why: str) -> None:
        self.dead = why
        self._fail_inflight(why)
        self._pending = []
        self._child.shutdown(timeout=1.0)

    def _on_death(self, why: str) -> None:
        """Fail what the child held at once (reported by this step), then start a new child
        in the background (up to max_restarts)."""
        log.error("stage %s: %s died (%s); failing %d requests", self.name,
                  self._child.describe(), why, len(self._inflight))
        self._fail_inflight(f"stage {self.name!r} failed: its {self._child.kind} died ({why})")
        self._pending = []
        self._child.shutdown(timeout=1.0)
        if self.restarts >= self.max_restarts:
            self.dead = f"stage {self.name!r} died {self.restarts + 1} times; not restarting"
            return
        self.restarts += 1
        try:
            self._launch()
        except Exception as e:  # noqa: BLE001 - the stage stays dead; requests fail cleanly
            self.dead = f"stage {self.name!r} could not restart: {e}"

    def close(self) -> None:
        if self._child is not None:
            self._child.shutdown()

    @property
    def channel(self):
        return self._child.channel

    # ---- the Stage protocol ---------------------------------------------------------------
    def add(self, message) -> None:
        rid = message.request_id
        if self.dead:
            self._failed.append(StageOutput(self.name, rid, StageFailure(rid, self.dead), final=True))
            return
        self._inflight.add(rid)
        try:
            self._send(message)
        except PeerDeadError as e:
            self._on_death(str(e))

    def abort(self, request_id: str) -> None:
        if request_id in self._inflight and not self.dead:
            self._inflight.discard(request_id)
            self._final_next.discard(request_id)
            try:
                self._send(Abort(request_id))
            except PeerDeadError as e:
                self._on_death(str(e))

    def step(self) -> list[StageOutput]:
        out, self._failed = self._failed, []
        if self.dead:
            return out
        try:
            if self._starting:
                self._poll_restart()
            while not self._starting and not self.dead and (msg := self.channel.recv(0)) is not None:
                if isinstance(msg, Final):          # the next payload for it is its last
                    self._final_next.add(msg.request_id)
                else:
                    rid = msg.request_id
                    final = rid in self._final_next
                    self._final_next.discard(rid)
                    if rid in self._inflight:          # else: aborted meanwhile
                        out.append(StageOutput(self.name, rid, msg, final=final))
                    if final:
                        self._inflight.discard(rid)
        except PeerDeadError as e:
            self._on_death(str(e))
        else:
            if not self.dead and not self._child.alive():   # gone without a word (a killed Ray actor)
                self._on_death("it stopped responding")
        out += self._failed
        self._failed = []
        return out

    def has_work(self) -> bool:
        """Something to collect: a failure to report, or a message/death from the child."""
        if self._failed:
            return True
        if self.dead:
            return False
        if self._starting:
            if time.monotonic() - self._t0 > self.start_timeout_s:
                return True     # a restart that never answered: step() gives up on it
            try:
                if self._pending and self._child.channel.poll_ready():
                    return True     # connected: step() hands it what waited
            except PeerDeadError:
                return True
        return self.channel.readable() or not self._child.alive()

    def num_requests(self) -> int:
        return len(self._inflight)

    def metrics(self, replica: int | None = None) -> list[tuple[str, str, str, float]]:
        """Whether the stage's process (or actor) serves, and how often it was restarted."""
        labels = f'stage="{self.name}"' + ("" if replica is None else f',replica="{replica}"')
        return [(f"omnistage_stage_up{{{labels}}}", "gauge",
                 "1 while a stage in another process or Ray actor can serve, 0 once it is dead",
                 0.0 if self.dead else 1.0),
                (f"omnistage_stage_restarts_total{{{labels}}}", "counter",
                 "restarts of a stage's process or Ray actor after it died", float(self.restarts))]


class _ProcessHandle:
    kind = "process"                # what the stage runs in, for messages

    def __init__(self, child):
        self._child = child
        self.channel = child.channel

    def alive(self) -> bool:
        return self._child.process.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._child.shutdown(timeout)

    def describe(self) -> str:
        return f"process {self._child.process.pid}"


def remote_members(stages) -> list[RemoteStage]:
    """The remote stages among `stages`, replicas included."""
    from omnistage.stages.replicas import ReplicatedStage

    out = []
    for s in stages:
        members = s.replicas if isinstance(s, ReplicatedStage) else [s]
        out += [m for m in members if isinstance(m, RemoteStage)]
    return out


def wait_all_started(stages) -> None:
    """Collect the start-up answers of every remote stage (they start in parallel); on a
    failure, stop the others and raise."""
    remote = remote_members(stages)
    try:
        for s in remote:
            s.wait_started()
    except BaseException:
        for s in remote:
            s.close()
        raise
