"""GraphPipeline: the engine protocol's common part for every model served as a StageGraph.

It builds the stages a family's recipe names (each where the placement says: here, another
process, a Ray actor), wires them with the recipe's router, and answers step / abort /
health / metrics. A family's pipeline adds only what is its own: `recipe`, its abilities,
`prepare` (templates, media), `resolve` and `add_request` (its first stage message).
"""

from __future__ import annotations

from omnistage.config import EngineConfig
from omnistage.graph import StageGraph
from omnistage.outputs import Delta
from omnistage.stages.recipe import Placement, Recipe, build_here
from omnistage.stages.remote import wait_all_started


class GraphPipeline:
    recipe: Recipe      # set by each family's pipeline class

    def __init__(self, config: EngineConfig, settings=None, placement: Placement | None = None):
        """`placement(name, build) -> Stage` decides where each stage runs (default: here;
        see omnistage.deploy); `build()` builds the stage in the calling process."""
        self.config = config
        self.settings = self.recipe.check_settings(settings)
        place = placement or build_here
        stages = [place(name, lambda name=name: self.recipe.build_stage(name, config, self.settings))
                  for name in self.recipe.stage_names(config.model, self.settings)]
        wait_all_started(stages)     # stages in other processes start (load weights) in parallel
        self.graph = StageGraph(stages, self.recipe.build_router(config, self.settings))

    @property
    def requests(self) -> set[str]:
        return self.graph.requests

    def num_samples(self, params) -> int:
        return 1        # graph models serve one sample per request

    def step(self) -> list[Delta]:
        return self.graph.step()

    def abort_request(self, request_id: str) -> list[Delta]:
        return self.graph.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.graph.has_unfinished_requests()

    @property
    def num_aborted_requests(self) -> int:
        return self.graph.num_aborted_requests

    def close(self) -> None:
        """Stop stage processes / actors (no-op for an all-local graph)."""
        self.graph.close()

    def health(self) -> str | None:
        return self.graph.health()

    def metrics(self) -> list[tuple[str, str, str, float]]:
        out = [("omnistage_requests_in_engine", "gauge", "requests in the stage graph",
                len(self.graph.requests)),
               ("omnistage_requests_aborted_total", "counter", "requests aborted (client gone, or abort())",
                self.graph.num_aborted_requests)]
        return out + self.graph.metrics()
