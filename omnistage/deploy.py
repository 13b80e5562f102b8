"""Where each stage of a model runs: the deploy config (YAML, optional).

    ray:                                 # only for stages placed on Ray (all keys optional)
      address: auto                      # an existing cluster (default: $RAY_ADDRESS, else a
                                         # local ray.init())
      bind_host: 10.0.0.1                # the address of this process the actors connect to
                                         # (default: Ray's node IP with an address, else 127.0.0.1)
    stages:
      token2wav: {where: process}        # its own OS process
      talker:    {where: ray, num_cpus: 2, resources: {node_b: 1}}   # a Ray actor, pinned
      thinker:   {where: local}          # this process (the default for unlisted stages)
      encoder:   {where: process, replicas: 2, num_threads: 1}   # two copies, requests spread

Ray stages take the actor's resources (`num_cpus`, default 0; `num_gpus`; `resources`, Ray
custom resources, e.g. one a node was started with to pin a stage to it), `model_path` (the
checkpoint as that node sees it; weights never travel through the channel) and
`start_timeout_s` (actor scheduled, connected and loaded; default 600). Ray replicas are
spread over the nodes: as Ray's SPREAD strategy can (`spread: best_effort`, the default), or
one per node (`spread: strict`: a STRICT_SPREAD placement group; with fewer nodes than
replicas the start fails after start_timeout_s).

Placement is deployment, not code: the recipe builds the same stage wherever it runs, and
the graph talks to it through the same Stage protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NoReturn

from omnistage.errors import InvalidRequestError
from omnistage.stages.ray_cluster import RayCluster

WHERE = ("local", "process", "ray")


@dataclass
class StagePlacement:
    where: str = "local"                 # local | process | ray
    num_threads: int | None = None       # torch threads in that process (process/ray)
    replicas: int = 1                    # copies of the stage (process/ray); requests spread over them
    num_cpus: float | None = None        # ray: the actor's CPUs (default 0)
    num_gpus: float | None = None        # ray: the actor's GPUs
    resources: dict[str, float] | None = None   # ray: custom resources, e.g. {node_b: 1}
    model_path: str | None = None        # ray: the checkpoint's path on the actor's node
    start_timeout_s: float = 600.0       # process/ray: start to ready (imports, load)
    spread: str = "best_effort"          # ray replicas: best_effort (Ray's SPREAD) | strict (one per node)

    def __post_init__(self) -> None:
        self._check_common()
        self._check_ray()

    def _check_common(self) -> None:
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
        if not _number(self.start_timeout_s) or self.start_timeout_s <= 0:
            _bad(f"start_timeout_s must be a number of seconds > 0, got {self.start_timeout_s!r}")

    def _check_ray(self) -> None:
        given = [k for k in ("num_cpus", "num_gpus", "resources", "model_path")
                 if getattr(self, k) is not None]
        if given and self.where != "ray":
            _bad(f"{', '.join(given)} apply to where: ray only (this stage: {self.where})")
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            if value is not None and (not _number(value) or value < 0):
                _bad(f"{key} must be a number >= 0, got {value!r}")
        if self.resources is not None:
            if not isinstance(self.resources, dict) or not all(
                    isinstance(k, str) and _number(v) and v > 0 for k, v in self.resources.items()):
                _bad(f"resources must map resource names to amounts > 0, e.g. {{node_b: 1}}; "
                     f"got {self.resources!r}")
        if self.model_path is not None and (not isinstance(self.model_path, str) or not self.model_path):
            _bad(f"model_path must be a path, got {self.model_path!r}")
        if self.spread not in ("best_effort", "strict"):
            _bad(f"spread must be best_effort or strict, got {self.spread!r}")
        if self.spread == "strict" and (self.where != "ray" or self.replicas < 2):
            _bad("spread: strict places Ray replicas on different nodes: it needs where: ray "
                 "and replicas >= 2")

    def ray_options(self) -> dict:
        """The Ray actor options this placement asks for."""
        options = {"num_cpus": self.num_cpus or 0}
        if self.num_gpus is not None:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.replicas > 1 and self.spread == "best_effort":
            options["scheduling_strategy"] = "SPREAD"
        return options


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    ray: RayCluster = field(default_factory=RayCluster)

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
        unknown = set(raw) - {"stages", "ray"}
        if unknown:
            _bad(f"unknown keys {sorted(map(str, unknown))}; the keys are 'stages' and 'ray'")
        ray = {} if raw.get("ray") is None else raw["ray"]
        if not isinstance(ray, dict) or set(ray) - {"address", "bind_host"}:
            _bad(f"'ray' must be a mapping with keys address, bind_host; got {ray!r}")
        stages = {} if raw.get("stages") is None else raw["stages"]
        if not isinstance(stages, dict):
            _bad(f"'stages' must be a mapping of stage name to placement ({{NAME: {{where: "
                 f"process}}}}), got {_kind(stages)}")
        return cls({_stage_name(name): _placement(name, spec) for name, spec in stages.items()},
                   RayCluster(**ray))

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
                from omnistage.stages.remote import RemoteStage

                copies = [RemoteStage(name, recipe, cfg, settings, spec.start_timeout_s)
                          for _ in range(spec.replicas)]
            else:
                from omnistage.stages.ray_stage import RayStage

                from omnistage.stages.ray_stage import StrictSpread

                if spec.model_path is not None:
                    cfg = replace(cfg, model=spec.model_path)
                group = StrictSpread(spec.replicas, spec.ray_options()) if spec.spread == "strict" else None
                copies = [RayStage(name, recipe, cfg, settings, spec.start_timeout_s,
                                   actor_options=spec.ray_options(), cluster=self.ray,
                                   spread=None if group is None else (group, i))
                          for i in range(spec.replicas)]
            if len(copies) == 1:
                return copies[0]
            from omnistage.stages.replicas import ReplicatedStage

            return ReplicatedStage(name, copies)

        return place
