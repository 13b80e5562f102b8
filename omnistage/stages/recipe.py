"""The one recipe protocol: what a model family served as a stage graph declares, so that the
graph pipeline (`omnistage/graph_pipeline.py`), a deploy config and a stage process
(`stages/worker.py`) can build any of its stages anywhere without knowing the family.

A family's recipe module ends with `RECIPE = Recipe(__name__, ...)`; a stage process is told
the module's name and imports it to reach RECIPE (nothing else crosses the process boundary
but msgspec data).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Stage

# place(stage name, build) -> the Stage: build() builds it in this process; a placement may
# instead start it in another process or a Ray actor (omnistage.deploy).
Placement = Callable[[str, Callable[[], Stage]], Stage]


@dataclass(frozen=True)
class Recipe:
    module: str                                              # the module holding RECIPE (importable)
    settings_type: type                                      # the family's settings dataclass
    stage_names: Callable[[str, Any], list[str]]             # (model dir, settings) -> upstream first
    build_stage: Callable[[str, EngineConfig, Any], Stage]   # (name, config, settings): loads only its weights
    build_router: Callable[[EngineConfig, Any], Any]         # (config, settings) -> its graph.Router
    message_types: Callable[[], list[type]]                  # msgspec types its stages exchange

    def check_settings(self, settings: Any) -> Any:
        """`settings`, or the defaults when None; another family's settings are refused."""
        settings = self.settings_type() if settings is None else settings
        if not isinstance(settings, self.settings_type):
            raise InvalidRequestError(f"this model takes {self.settings_type.__name__}, not "
                                      f"{type(settings).__name__}", param="omni_settings")
        return settings


def build_here(name: str, build: Callable[[], Stage]) -> Stage:
    """The default placement: every stage in this process."""
    return build()


def load_recipe(module: str) -> Recipe:
    """The RECIPE of a recipe module named in a stage process's init message."""
    recipe = getattr(importlib.import_module(module), "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{module} defines no RECIPE = Recipe(...)")
    return recipe
