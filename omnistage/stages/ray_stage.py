"""A stage hosted by a Ray actor (any node of a Ray cluster; tests use a local ray.init()).

The actor runs the same stage worker as a child process does and talks to the graph over the
same msgspec channel, on TCP (no shared memory across nodes). Ray only starts the actor and
reports its death: no message goes through Ray's (pickle-based) object transport.
"""

from __future__ import annotations

from omnistage.errors import ModelLoadError
from omnistage.runtime.channel import Channel, ChannelConfig
from omnistage.stages.remote import RemoteStage
from omnistage.stages.worker import worker_main


def _actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class StageActor:
        def serve(self, spec: bytes, recipe: str) -> None:
            worker_main(spec, recipe)    # returns when the graph closes the channel

    return StageActor


class _RayHandle:
    def __init__(self, channel: Channel, actor, ref):
        self.channel, self._actor, self._ref = channel, actor, ref

    def alive(self) -> bool:
        import ray

        done, _ = ray.wait([self._ref], timeout=0)
        return not done

    def shutdown(self, timeout: float = 5.0) -> None:
        import ray

        self.channel.close()
        try:
            ray.get(self._ref, timeout=timeout)
        except Exception:  # noqa: BLE001 - dead or stuck: kill it either way
            pass
        ray.kill(self._actor)

    def describe(self) -> str:
        return f"Ray actor {self._actor._actor_id.hex()[:12]}"


class RayStage(RemoteStage):
    def _spawn(self) -> _RayHandle:
        try:
            import ray
        except ImportError as e:
            raise ModelLoadError("a stage is placed on Ray but ray is not installed: pip install ray") from e
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        channel, spec = Channel.listen(self._types, ChannelConfig(
            transport="tcp", shm_capacity=0, handshake_timeout_s=self.start_timeout_s))
        actor = _actor_class().remote()
        ref = actor.serve.remote(spec, self.recipe)
        return _RayHandle(channel, actor, ref)   # the first recv waits for its handshake
