"""A stage hosted by a Ray actor, on any node of a Ray cluster (a local ray.init() by default).

The actor runs the same stage worker as a child process does and talks to the graph over the
same msgspec channel (authenticated and encrypted, runtime/channel.py), on TCP: the front
binds an address the actor's node can reach (the deploy config's `ray.bind_host`, else Ray's
node IP of this process when it joined an existing cluster, else loopback). No shared memory
across nodes, and no message goes through Ray's (pickle-based) object transport: Ray places
the actor (its resources from the deploy config) and reports its end.

Death: a watcher thread waits on the actor's serve call; when it ends (the actor died, was
killed, or its node went away) the thread makes a pipe readable, and the channel polls that
pipe beside its socket as it polls a child process's sentinel: the graph, waiting on its
channels, wakes at once and fails the stage's requests (StageFailure), then restarts it.

Priority: Ray starts its worker processes at niceness 15 (`worker_niceness`), below every
ordinary process: on a node whose cores are busy a stage's actor then gets a small share of
them (a 2-core machine under load: its start alone took minutes). A local Ray that omnistage
starts runs its workers at 0; a stage on a cluster started without RAY_worker_niceness=0
logs a warning, in the actor's Ray worker log and, at the stage's first start, in this
process's log (docs/cluster.md).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

from omnistage.stages.ray_cluster import RayCluster
from omnistage.errors import ModelLoadError
from omnistage.runtime.channel import Channel, ChannelConfig
from omnistage.stages.remote import RemoteStage
from omnistage.stages.worker import worker_main

log = logging.getLogger(__name__)

# The system config of a local Ray this process starts: its workers (the stages' actors) at
# the niceness of ordinary processes, not Ray's default 15 (module doc).
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
# How long the front waits for a started actor's niceness (it answers beside `serve`: ms)
NICENESS_TIMEOUT_S = 10.0


def _actor_class():
    import ray

    # Two calls at once: `node_ip` and `niceness` answer while `serve` runs.
    @ray.remote(num_cpus=0, max_concurrency=2)
    class StageActor:
        def serve(self, spec: bytes, recipe: str) -> None:
            _warn_if_niced()
            worker_main(spec, recipe)    # returns when the graph closes the channel

        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def niceness(self) -> int:
            return _niceness()

    return StageActor


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


# What both warnings (the actor's and the front's) tell the operator
NICED_ADVICE = ("busy cores serve it last; start the cluster's nodes with RAY_worker_niceness=0 "
                "(docs/cluster.md)")


def _warn_if_niced() -> None:
    """In the actor's own log (Ray's worker log on its node: log_to_driver is off)."""
    niceness = _niceness()
    if niceness > 0:
        log.warning("this stage's Ray worker runs at niceness %d (Ray's worker_niceness): %s",
                    niceness, NICED_ADVICE)


class NicenessSource(Protocol):
    """What warn_if_stage_niced asks (a _RayHandle)."""

    def niceness(self, timeout: float = ...) -> int: ...

    def describe(self) -> str: ...


def warn_if_stage_niced(name: str, handle: NicenessSource) -> None:
    """In the front's log: the actor's own warning lands in its Ray worker log on its node,
    which operators seldom read. A check, not a start condition: an actor that does not answer
    in NICENESS_TIMEOUT_S is only noted (at debug level)."""
    try:
        niceness = handle.niceness(timeout=NICENESS_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - Ray's errors vary; the stage itself has started
        log.debug("stage %s: could not read its actor's niceness: %s", name, e)
        return
    if niceness > 0:
        log.warning("stage %s runs in a Ray worker at niceness %d (%s; Ray's worker_niceness): %s",
                    name, niceness, handle.describe(), NICED_ADVICE)


class _DeathPipe:
    """A pipe whose read end turns readable once `ref` (the actor's serve call) is done."""

    def __init__(self, ref):
        self.read_fd, self._write_fd = os.pipe()
        self._thread = threading.Thread(target=self._watch, args=(ref,), daemon=True,
                                        name="omnistage-ray-watch")
        self._thread.start()

    def _watch(self, ref) -> None:
        import ray

        try:
            ray.wait([ref], num_returns=1, timeout=None)
        except Exception:  # noqa: BLE001 - Ray itself gone: the actor is as good as dead
            pass
        try:
            os.write(self._write_fd, b"x")
        except OSError:                    # closed meanwhile (shutdown)
            pass
        finally:
            os.close(self._write_fd)

    def close(self) -> None:
        """Idempotent (a stage that failed to start is shut down, then closed)."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


class _RayHandle:
    kind = "Ray actor"              # what the stage runs in, for messages

    def __init__(self, channel: Channel, actor, ref):
        self.channel, self._actor, self._ref = channel, actor, ref
        self._death = _DeathPipe(ref)
        channel.watch(self._death.read_fd)

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
        self._death.close()

    def node_ip(self, timeout: float = 30.0) -> str:
        """The address of the node the actor runs on."""
        import ray

        return ray.get(self._actor.node_ip.remote(), timeout=timeout)

    def niceness(self, timeout: float = 30.0) -> int:
        """The niceness the actor's process runs at (module doc: Priority)."""
        import ray

        return ray.get(self._actor.niceness.remote(), timeout=timeout)

    def describe(self) -> str:
        return f"Ray actor {self._actor._actor_id.hex()[:12]}"


class StrictSpread:
    """One bundle per replica in a STRICT_SPREAD placement group (Ray's own way to put each
    replica on a node of its own), made on first use (after ray.init). A restarted replica
    goes back into its bundle: the same node."""

    def __init__(self, replicas: int, actor_options: dict):
        # A bundle must ask for something: the actor's CPUs (at least a sliver) and resources.
        self._bundle = {"CPU": max(float(actor_options.get("num_cpus") or 0), 0.001),
                        "GPU": float(actor_options.get("num_gpus") or 0),
                        **actor_options.get("resources", {})}
        self._bundle = {k: v for k, v in self._bundle.items() if v > 0}
        self._replicas = replicas
        self._group = None
        self._closed = 0

    def strategy(self, index: int):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._group is None:
            self._group = placement_group([dict(self._bundle)] * self._replicas, strategy="STRICT_SPREAD")
        return PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)

    def closed_one(self) -> None:
        """A replica has shut down; the last one gives the group's reservation back."""
        self._closed += 1
        if self._closed == self._replicas and self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None


class RayStage(RemoteStage):
    def __init__(self, name: str, recipe: str, config, settings, start_timeout_s: float = 600.0,
                 max_restarts: int = 3, actor_options: dict | None = None,
                 cluster: RayCluster | None = None, spread: tuple[StrictSpread, int] | None = None):
        self._actor_options = actor_options or {"num_cpus": 0}
        self._cluster = cluster or RayCluster()
        self._spread = spread                 # (the replicas' group, this replica's bundle)
        super().__init__(name, recipe, config, settings, start_timeout_s, max_restarts)

    def close(self) -> None:
        super().close()
        if self._spread is not None:
            group, self._spread = self._spread[0], None      # counted once, however often closed
            group.closed_one()

    def wait_started(self) -> None:
        super().wait_started()
        # At the first start only: a restart is read inside the graph's step, which must not
        # wait on Ray (a restarted actor that runs niced still says so in its own log).
        warn_if_stage_niced(self.name, self._child)

    def _start_hint(self) -> str:
        return (f" (a Ray actor waits unscheduled while no node has what it asks for: "
                f"{self._actor_options}; or raise start_timeout_s if its load is slow)")

    def _spawn(self) -> _RayHandle:
        try:
            import ray
        except ImportError as e:
            raise ModelLoadError("a stage is placed on Ray but ray is not installed: pip install ray") from e
        address = self._cluster.address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            # A cluster's own system config is set when it starts: only a local one takes ours.
            extra = {} if address else {"_system_config": LOCAL_RAY_SYSTEM_CONFIG}
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **extra)
        host = self._cluster.bind_host or (ray.util.get_node_ip_address() if address else "127.0.0.1")
        channel, spec = Channel.listen(self._types, ChannelConfig(
            transport="tcp", host=host, shm_capacity=0, handshake_timeout_s=self.start_timeout_s))
        options = dict(self._actor_options)
        if self._spread is not None:
            group, index = self._spread
            options["scheduling_strategy"] = group.strategy(index)
        try:
            actor = _actor_class().options(**options).remote()
            ref = actor.serve.remote(spec, self.recipe)
            return _RayHandle(channel, actor, ref)   # the first recv waits for its handshake
        except BaseException:
            channel.close()
            raise
