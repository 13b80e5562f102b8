"""A stage in its own OS process: the child's loop, and the control messages around the
stage's own ones. Everything crosses as msgspec messages (tensors as raw bytes / shared
memory); the stage is built in the child from its recipe module, config and settings.

Parent -> child: StageInit (once), the stage's input messages, Abort, (closing = shutdown).
Child -> parent: Ready | InitFailed (once), the stage's output payloads, Final (just before
a request's last output; a StageFailure, when the stage refused the request or lost it, is
one such last output and keeps its client_error/param across the boundary).
"""

from __future__ import annotations

import logging
import traceback

import msgspec

from omnistage.config import EngineConfig
from omnistage.errors import OmniStageError
from omnistage.runtime.channel import Channel, PeerDeadError
from omnistage.runtime.process import freeze_loaded_heap
from omnistage.stage_messages import StageFailure
from omnistage.stages.recipe import load_recipe

log = logging.getLogger(__name__)


class StageInit(msgspec.Struct):
    recipe: str            # the module whose RECIPE builds the stage (stages/recipe.py)
    name: str
    config: EngineConfig
    settings: bytes        # msgspec JSON of the recipe's settings dataclass


class Ready(msgspec.Struct):
    name: str


class InitFailed(msgspec.Struct):
    message: str


class Abort(msgspec.Struct):
    request_id: str


class Final(msgspec.Struct):
    request_id: str


CONTROL_TYPES = [StageInit, Ready, InitFailed, Abort, Final, StageFailure]


def message_types(recipe: str) -> list[type]:
    return CONTROL_TYPES + list(load_recipe(recipe).message_types())


def worker_main(spec: bytes, recipe: str) -> None:
    """Child entry point (spawned): connect, build the stage, serve until the parent closes."""
    channel = Channel.connect(spec, message_types(recipe))
    try:
        init = channel.recv()
        recipe = load_recipe(init.recipe)
        try:
            settings = msgspec.json.decode(init.settings, type=recipe.settings_type)
            stage = recipe.build_stage(init.name, init.config, settings)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            channel.send(InitFailed(f"building stage {init.name!r} failed: {e!r}\n{traceback.format_exc()}"))
            return
        freeze_loaded_heap()         # the stage lives as long as this process
        channel.send(Ready(init.name))
        _serve(channel, stage)
    except PeerDeadError:
        pass   # the parent closed the channel or died: nothing left to serve
    finally:
        channel.close()


def _serve(channel: Channel, stage) -> None:
    while True:
        # Idle: wait for the next message, or until a stage that holds work back (the vocoder
        # keeping later chunks for a newcomer's first audio) says it may run again.
        msg = channel.recv(0 if stage.has_work() else stage.wake_after())
        while msg is not None:             # apply everything queued before stepping
            if isinstance(msg, Abort):
                stage.abort(msg.request_id)
            else:
                try:
                    stage.add(msg)
                except OmniStageError as e:   # refused on arrival: fails as a refusal in step() does
                    _send(channel, msg.request_id, StageFailure.of(msg.request_id, e), final=True)
            msg = channel.recv(0)
        if stage.has_work():
            for out in stage.step():
                _send(channel, out.request_id, out.payload, out.final)


def _send(channel: Channel, request_id: str, payload, final: bool) -> None:
    if final:   # announced first: the parent is done with the request as soon as it reads the payload
        channel.send(Final(request_id))
    channel.send(payload)
