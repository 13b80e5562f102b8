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

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NoReturn

from omnistage.errors import InvalidRequestError

WHERE = ("local", "process", "ray")


@dataclass
class StagePlacement:
    where: str = "local"                 # local | process | ray
    num_threads: int | None = None       # torch threads in that process (process/ray)
    replicas: int = 1                    # copies of the stage (process/ray); requests spread over them

    def __post_init__(self) -> None:
        if not isinstance(self.where, str) or self.where not in WHERE:
            raise InvalidRequestError(f"deploy config: where must be one of {WHERE}, got {self.where!r}",
                                      param="deploy_config")
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool)
                                             or self.num_threads < 1):
            raise InvalidRequestError(f"deploy config: num_threads must be a positive integer, "
                                      f"got {self.num_threads!r}", param="deploy_config")
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise InvalidRequestError(f"deploy config: replicas must be a positive integer, got "
                                      f"{self.replicas!r}", param="deploy_config")
        if self.replicas > 1 and self.where == "local":
            raise InvalidRequestError("deploy config: replicas > 1 needs where: process or ray",
                                      param="deploy_config")


_FIELDS = tuple(f.name for f in fields(StagePlacement))


def _bad(message: str) -> NoReturn:
    raise InvalidRequestError(f"deploy config: {message}", param="deploy_config")


def _kind(value) -> str:
    """How a YAML value that should be a mapping reads in a message."""
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _stage_name(name) -> str:
    if not isinstance(name, str):
        _bad(f"stage names must be strings, got {name!r}")
    return name


def _placement(name: str, spec) -> StagePlacement:
    """One stage's entry of 'stages' (None: the defaults) -> its StagePlacement."""
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        _bad(f"stages.{name} must be a mapping such as {{where: process}}, got {_kind(spec)}")
    unknown = set(spec) - set(_FIELDS)
    if unknown:
        _bad(f"stages.{name} has unknown keys {sorted(map(str, unknown))}; its keys are "
             f"{', '.join(_FIELDS)}")
    return StagePlacement(**spec)


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
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise InvalidRequestError(f"cannot read deploy config {path}: {e}", param="deploy_config") from e
        raw = {} if raw is None else raw                  # an empty file: every stage local
        if not isinstance(raw, dict):
            _bad(f"{path} must be a mapping with a 'stages' key (stages: {{NAME: {{where: "
                 f"process}}}}), got {_kind(raw)}")
        unknown = set(raw) - {"stages"}
        if unknown:
            _bad(f"unknown keys {sorted(map(str, unknown))}; the only key is 'stages'")
        stages = {} if raw.get("stages") is None else raw["stages"]
        if not isinstance(stages, dict):
            _bad(f"'stages' must be a mapping of stage name to placement ({{NAME: {{where: "
                 f"process}}}}), got {_kind(stages)}")
        return cls({_stage_name(name): _placement(name, spec) for name, spec in stages.items()})

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
