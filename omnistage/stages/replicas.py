"""Several copies of one stage (each in its own process or Ray actor) behind one Stage.

A request goes to the replica holding the fewest requests when its first message arrives and
stays there (its state: KV blocks, streams, lives in that replica). Steps collect what every
replica has produced.
"""

from __future__ import annotations

from typing import Any

from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage


class ReplicatedStage(Stage):
    def __init__(self, name: str, replicas: list[Stage]):
        if not replicas:
            raise ValueError("a replicated stage needs at least one replica")
        self.name, self.replicas = name, replicas
        self._owner: dict[str, Stage] = {}      # request id -> the replica serving it

    @property
    def dead(self) -> str | None:
        """Dead only when no replica can serve (a dead replica's requests already failed)."""
        reasons = [r.dead for r in self.replicas]
        return "; ".join(reasons) if all(reasons) else None

    def add(self, message: Any) -> None:
        rid = message.request_id
        replica = self._owner.get(rid)
        if replica is None:
            live = [r for r in self.replicas if not r.dead] or self.replicas
            replica = self._owner[rid] = min(live, key=lambda r: r.num_requests())
        replica.add(message)

    def step(self) -> list[StageOutput]:
        out = []
        for replica in self.replicas:
            if replica.has_work():
                out += replica.step()
        for o in out:
            if o.final:
                self._owner.pop(o.request_id, None)
        return out

    def abort(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.replicas)

    def num_requests(self) -> int:
        return sum(r.num_requests() for r in self.replicas)

    def starving(self) -> bool:
        return any(r.starving() for r in self.replicas)

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """Each replica's own, labelled with its index."""
        return [m for i, r in enumerate(self.replicas) for m in r.metrics(replica=i)]
