"""The Ray cluster stages are placed on: the deploy config's `ray` section (deploy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.errors import InvalidRequestError


@dataclass(frozen=True)
class RayCluster:
    address: str | None = None           # None: $RAY_ADDRESS, else a local ray.init()
    bind_host: str | None = None         # None: Ray's node IP with an address, else 127.0.0.1

    def __post_init__(self) -> None:
        for key in ("address", "bind_host"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"deploy config: ray.{key} must be a string, got {value!r}",
                                          param="deploy_config")
