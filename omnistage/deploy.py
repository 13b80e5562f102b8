"""Where each stage of a model runs: the deploy config (YAML, optional).

    stages:
      token2wav: {where: process}        # its own OS process
      talker:    {where: ray}            # a Ray actor (ray.init() or an existing cluster)
      thinker:   {where: local}          # this process (the default for unlisted stages)
      encoder:   {where: process, replicas: 2, num_threads: 1}   # two copies, requests spread

Placement is deployment, not code: the recipe builds the same stage wherever it runs, and
the graph talks to it through the same Stage protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omnistage.errors import InvalidRequestError

WHERE = ("local", "process", "ray")


@dataclass
class StagePlacement:
    where: str = "local"                 # local | process | ray
    num_threads: int | None = None       # torch threads in that process (process/ray)
    replicas: int = 1                    # copies of the stage (process/ray); requests spread over them

    def __post_init__(self) -> None:
        if self.where not in WHERE:
            raise InvalidRequestError(f"deploy config: where must be one of {WHERE}, got {self.where!r}",
                                      param="deploy_config")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidRequestError(f"deploy config: replicas must be a positive integer, got "
                                      f"{self.replicas!r}", param="deploy_config")
        if self.replicas > 1 and self.where == "local":
            raise InvalidRequestError("deploy config: replicas > 1 needs where: process or ray",
                                      param="deploy_config")


@dataclass
class DeployConfig:
    stages: dict[str, StagePlacement] = field(default_factory=dict)

    @classmethod
    def everywhere(cls, where: str, names: list[str]) -> "DeployConfig":
        return cls({n: StagePlacement(where) for n in names})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "DeployConfig":
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise InvalidRequestError(f"cannot read deploy config {path}: {e}", param="deploy_config") from e
        stages = raw.get("stages") or {}
        if not isinstance(raw, dict) or not isinstance(stages, dict):
            raise InvalidRequestError("deploy config: expected a mapping with a 'stages' mapping",
                                      param="deploy_config")
        unknown = set(raw) - {"stages"}
        if unknown:
            raise InvalidRequestError(f"deploy config: unknown keys {sorted(unknown)}", param="deploy_config")
        try:
            return cls({name: StagePlacement(**(spec or {})) for name, spec in stages.items()})
        except TypeError as e:
            raise InvalidRequestError(f"deploy config: {e}", param="deploy_config") from e

    def check(self, stage_names: list[str]) -> None:
        unknown = set(self.stages) - set(stage_names)
        if unknown:
            raise InvalidRequestError(f"deploy config names stages this model does not have: "
                                      f"{sorted(unknown)}; its stages: {stage_names}",
                                      param="deploy_config")

    def placement(self, recipe: str, config, settings):
        """-> place(name, build) for the pipeline: build here, or start the stage elsewhere."""
        from dataclasses import replace

        def place(name: str, build):
            spec = self.stages.get(name, StagePlacement())
            if spec.where == "local":
                return build()
            cfg = replace(config, num_threads=spec.num_threads or config.num_threads)
            if spec.where == "process":
                from omnistage.stages.remote import RemoteStage as kind
            else:
                from omnistage.stages.ray_stage import RayStage as kind
            copies = [kind(name, recipe, cfg, settings) for _ in range(spec.replicas)]
            if len(copies) == 1:
                return copies[0]
            from omnistage.stages.replicas import ReplicatedStage

            return ReplicatedStage(name, copies)

        return place
