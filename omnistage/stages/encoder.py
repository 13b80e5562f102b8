"""The encoder stage: modality towers (audio, vision) run over batches of requests.

Batching by token budget: each step takes queued jobs oldest first until their cost (the
number of encoder input frames/patches, as the model's `cost` says) reaches the budget; the
first job always goes, however large. The model-specific part is an `Encoders` object that
turns a batch of jobs into one output per job.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage


class Encoders(Protocol):
    def cost(self, job: Any) -> int:
        """Work units of one job (e.g. audio frames + image patches)."""

    def encode(self, jobs: list[Any]) -> list[Any]:
        """One output message per job, in order (the model decides how it batches them)."""


class EncoderStage(Stage):
    def __init__(self, name: str, encoders: Encoders, budget: int):
        self.name = name
        self.encoders = encoders
        self.dead: str | None = None   # local stages fail with the process
        self.budget = budget
        self._queue: OrderedDict[str, Any] = OrderedDict()   # request id -> job, oldest first

    def add(self, job: Any) -> None:
        self._queue[job.request_id] = job

    def step(self) -> list[StageOutput]:
        batch, spent = [], 0
        for rid, job in list(self._queue.items()):
            c = self.encoders.cost(job)
            if batch and spent + c > self.budget:
                break
            batch.append(job)
            spent += c
            del self._queue[rid]
        if not batch:
            return []
        outs = self.encoders.encode(batch)
        return [StageOutput(self.name, j.request_id, o, final=True) for j, o in zip(batch, outs)]

    def abort(self, request_id: str) -> None:
        self._queue.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._queue)

    def num_requests(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Nothing outside this process to release."""
