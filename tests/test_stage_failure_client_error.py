"""A stage's refusal (InvalidRequestError while it steps) reaches the caller as
InvalidRequestError naming the param, over every hop: stage -> StageFailure -> (the stage
process's msgspec channel) -> StageGraph -> FailureDelta -> failure_error; a stage's crash
stays a StageFailedError.

This module is also the recipe of a toy stage (its RECIPE: settings, messages, build_stage), so a
real stage process (RemoteStage, spawned) can build it: the hop under test is the protocol,
not a model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import pytest

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError, StageFailedError
from omnistage.graph import CLIENT, Edge, FailureDelta, StageGraph, failure_error
from omnistage.outputs import Delta
from omnistage.runtime.codec import Codec
from omnistage.stages.worker import message_types
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage
from omnistage.stages.recipe import Recipe

STAGE = "toy"


# ---- the toy recipe ------------------------------------------------------------------------

class Job(msgspec.Struct):
    request_id: str
    action: str       # ok | refuse-on-add | refuse-in-step | fail-in-step | raise-in-add


class Done(msgspec.Struct):
    request_id: str




@dataclass
class Settings:
    pass


class ToyStage(Stage):
    """Serves a Job in one step; refuses or fails it as its action says."""

    def __init__(self, name: str):
        self.name, self.dead, self._queue = name, None, []

    def add(self, job: Job) -> None:
        if job.action == "refuse-on-add":
            raise InvalidRequestError("voice 'nobody' is not offered; choose another", param="voice")
        self._queue.append(job)

    def step(self) -> list[StageOutput]:
        jobs, self._queue = self._queue, []
        return [StageOutput(self.name, j.request_id, self._result(j), True) for j in jobs]

    @staticmethod
    def _result(job: Job):
        rid = job.request_id
        if job.action == "refuse-in-step":       # what DiffusionStage._admit does
            return StageFailure.refused(rid, InvalidRequestError("an input image's aspect ratio is too "
                                                                 "extreme; crop it", param="image"))
        if job.action == "fail-in-step":
            return StageFailure(rid, "internal error: boom")
        return Done(rid)

    def abort(self, request_id: str) -> None:
        self._queue = [j for j in self._queue if j.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._queue)

    def num_requests(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        pass


def build_stage(name: str, config: EngineConfig, settings: Settings) -> ToyStage:
    return ToyStage(name)


class Router:
    def __init__(self):
        self.edges = [Edge(STAGE, CLIENT)]
        self._live: set[str] = set()

    def start(self, job: Job) -> list[tuple[str, object]]:
        self._live.add(job.request_id)
        return [(STAGE, job)]

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        return [(CLIENT, Delta(out.request_id, 0, "", [], finished=True, finish_reason="stop"))]

    def forget(self, request_id: str) -> None:
        self._live.discard(request_id)

    def unfinished(self) -> set[str]:
        return set(self._live)


RECIPE = Recipe(__name__, Settings, lambda model, settings: [STAGE], build_stage,
                lambda config, settings: Router(), lambda: [Job, Done])


# ---- tests ---------------------------------------------------------------------------------

REFUSED = {"refuse-in-step": "image", "refuse-on-add": "voice"}     # request -> the param named


def _run(stage, actions: list[str]) -> dict[str, Delta]:
    graph = StageGraph([stage], Router())
    for action in actions:
        graph.add_request(action, Job(action, action))
    finals: dict[str, Delta] = {}
    deadline = time.monotonic() + 30
    while graph.has_unfinished_requests():
        assert time.monotonic() < deadline, f"still unfinished: {graph.requests}"
        finals.update({d.request_id: d for d in graph.step(wait_s=0.5) if d.finished})
    assert set(finals) == set(actions)
    return finals


def _check(finals: dict[str, Delta]) -> None:
    assert finals["ok"].finish_reason == "stop"
    for rid in set(REFUSED) & set(finals):
        d = finals[rid]
        assert d.finish_reason == "error" and isinstance(d, FailureDelta), d
        assert d.failure.client_error and d.failure.param == REFUSED[rid]
        err = failure_error(d)
        assert type(err) is InvalidRequestError and err.param == REFUSED[rid] and str(err) == d.error
    crash = failure_error(finals["fail-in-step"])
    assert type(crash) is StageFailedError and "boom" in str(crash)
    assert not finals["fail-in-step"].failure.client_error


def test_in_process_refusal_is_a_client_error():
    # in this process a refusal on add raises at once, out of the caller's add_request
    with pytest.raises(InvalidRequestError) as e:
        StageGraph([ToyStage(STAGE)], Router()).add_request("x", Job("x", "refuse-on-add"))
    assert e.value.param == "voice"
    _check(_run(ToyStage(STAGE), ["ok", "refuse-in-step", "fail-in-step"]))


class RelayRouter(Router):
    """toy -> late and toy -> other -> client: `late` refuses, on arrival, the jobs whose id
    says so (what the thinker does with a prompt over max_model_len it sees after the
    encoders)."""

    def __init__(self):
        super().__init__()
        self.edges = [Edge(STAGE, "late"), Edge(STAGE, "other"), Edge("late", CLIENT),
                      Edge("other", CLIENT)]

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        rid = out.request_id
        if out.stage == STAGE:
            late = "refuse-on-add" if rid.startswith("refuse") else "ok"
            return [("late", Job(rid, late)), ("other", Job(rid, "ok"))]
        final = out.stage == "other"
        return [(CLIENT, Delta(rid, 0, "", [], finished=final, finish_reason="stop" if final else None))]


def test_a_refusal_downstream_fails_that_request_and_the_graph_goes_on():
    stages = [ToyStage(STAGE), ToyStage("late"), ToyStage("other")]
    graph = StageGraph(stages, RelayRouter())
    for rid in ("ok", "refuse-downstream", "ok-2"):
        graph.add_request(rid, Job(rid, "ok"))
    finals = {}
    for _ in range(10):                 # three hops: a few steps serve everything
        finals.update({d.request_id: d for d in graph.step(wait_s=0) if d.finished})
    assert set(finals) == {"ok", "refuse-downstream", "ok-2"}
    assert finals["ok"].finish_reason == finals["ok-2"].finish_reason == "stop"
    err = failure_error(finals["refuse-downstream"])
    assert type(err) is InvalidRequestError and err.param == "voice"
    # the refused job's message to `other` was never delivered: no stage holds anything
    assert not graph.has_unfinished_requests() and all(s.num_requests() == 0 for s in stages)


def test_stage_process_carries_client_error_and_param():
    """The spawned stage process refuses (on add and in step) without dying: the failures
    cross the channel as StageFailure, fields intact, and the process serves on."""
    from omnistage.stages.remote import RemoteStage

    stage = RemoteStage(STAGE, __name__, EngineConfig(model="unused", device="cpu"), Settings(),
                        start_timeout_s=60, max_restarts=0)
    try:
        stage.wait_started()
        _check(_run(stage, ["ok", *REFUSED, "fail-in-step"]))
        assert stage.restarts == 0 and stage.dead is None      # refusals are no crashes
        assert _run(stage, ["ok"])["ok"].finish_reason == "stop"
    finally:
        stage.close()


def test_old_form_failure_still_decodes():
    """A StageFailure from a process that predates the fields decodes with the defaults (a
    crash), and the new fields survive the codec."""
    codec = Codec(message_types(__name__))
    old = msgspec.msgpack.encode(("StageFailure", {"request_id": "r", "message": "died"}))
    got = codec.decode([old])
    assert got == StageFailure("r", "died") and not got.client_error and got.param is None
    new = StageFailure.refused("r", InvalidRequestError("crop it", param="image"))
    assert codec.decode(codec.encode(new).frames) == new
    assert type(new.exception()) is InvalidRequestError and new.exception().param == "image"
    assert type(StageFailure("r", "died").exception()) is StageFailedError


def test_offline_omni_raises_invalid_request_for_a_refused_edit():
    """The real refusal through Omni: a 1 x 600 px image passes every check on arrival, then
    Qwen-Image-Edit-Plus's encode finds its condition image would be 0 px wide."""
    import numpy as np

    from omnistage import Omni
    from omnistage.diffusion.params import DiffusionParams
    from omnistage.entrypoints.model_source import tiny_checkpoint

    params = DiffusionParams(height=32, width=32, num_inference_steps=2, seed=1)
    with Omni(str(tiny_checkpoint("qwen_image_edit_plus")), num_threads=1) as omni:
        with pytest.raises(InvalidRequestError, match="aspect ratio") as e:
            omni.generate({"prompt": "make it blue", "image": np.zeros((600, 1, 3), np.uint8)}, params)
        assert e.value.param == "image" and not omni.engine.requests
        out = omni.generate({"prompt": "make it blue", "image": np.zeros((32, 32, 3), np.uint8)}, params)
        assert out[0].pixels[0].shape == (32, 32, 3)
