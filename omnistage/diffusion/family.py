"""The contract between the diffusion stage (our serving loop) and one model family.

A family wraps a diffusers-format folder's components (transformer, VAE, scheduler, text
encoder, tokenizer: diffusers/transformers classes, used as dependencies) and exposes the
numbered stages of a diffusers pipeline, cut so that the denoising loop can run across
requests:

    1. encode(request)          prompt (and input image) conditioning, once per request
    2. prepare(request, cond)   initial noise + this request's own scheduler -> DenoiseJobs
    3. predict(jobs)            ONE transformer forward for jobs of equal `key`, both CFG
                                halves inside the batch -> the guided output per job
       (the stage then calls each job's scheduler.step: steps are per job)
       after_step(job)          optional, after each job's scheduler.step (see DiffusionFamily)
    4. decode(job)              VAE decode + postprocess -> float32 pixels in [0, 1]

Seeds follow diffusers: a request's noise is drawn for all its n samples at once from
`torch.Generator("cpu").manual_seed(seed)`, so a request's images do not depend on what else
shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Protocol

import numpy as np
import torch

from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InvalidRequestError


@dataclass
class DenoiseJob:
    """One output (image or video) being denoised; a request with n=2 has two jobs."""

    request_id: str
    index: int                      # sample index within the request
    latents: torch.Tensor           # (1, ...) in the family's latent layout
    scheduler: Any                  # this job's own scheduler instance (holds its step index)
    timesteps: torch.Tensor         # (num_steps,) as the scheduler set them
    cond: Any                       # the family's conditioning for this job
    key: Hashable                   # jobs with equal keys can share one transformer forward
    step: int = 0                   # steps done
    cache: Any = None               # step-cache state (omnistage.diffusion.cache), or None
    extra: dict[str, Any] = field(default_factory=dict)   # family-private per-job state

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def t(self) -> torch.Tensor:
        return self.timesteps[self.step]


class DiffusionFamily(Protocol):
    """A family subclasses DiffusionFamily: it defines `name`, `is_video` and the numbered
    methods, and inherits the defaults of the optional abilities below (the pipeline reads
    them before admitting a request; none is probed)."""

    name: str
    is_video: bool
    input_channels: int = 3             # 4: input images keep their alpha (Qwen-Image-Layered)
    captions_blank_prompt: bool = False  # a blank prompt is allowed: the family captions the image
    takes_strength: bool = False        # reads DiffusionParams.strength (image-to-image, inpainting)
    supports_cache: bool = False        # step caches (diffusion/cache.py) apply
    takes_layers: bool = False          # reads DiffusionParams.layers / resolution (layered models)

    def after_step(self, job: DenoiseJob) -> None:
        """Called after every scheduler step of every job the stage steps (right after
        `job.latents = job.scheduler.step(...)`, job.step not yet incremented): per-job
        post-processing of the stepped latents (Qwen-Image inpainting blends the re-noised
        input image back into the region the mask keeps). Default: nothing."""

    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        """Fill the model's defaults and check what only the model knows (size multiples,
        frame counts, which input images / mask it takes: `prompt` is the DiffusionPrompt,
        .images uint8 (H, W, 3) arrays, .mask); raise InvalidRequestError."""

    def encode(self, request: DiffusionRequest) -> Any:
        """Conditioning for the request (prompt embeddings, negative ones, image latents)."""

    def prepare(self, request: DiffusionRequest, cond: Any) -> list[DenoiseJob]:
        """Initial noise and schedule: one job per sample."""

    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        """One batched forward at each job's current timestep -> what its scheduler steps with."""

    def decode(self, job: DenoiseJob) -> np.ndarray:
        """float32 pixels in [0, 1]: (H, W, 3) for an image, (F, H, W, 3) for a video."""


def cfg_rows(jobs: list[DenoiseJob]) -> Iterator[tuple[DenoiseJob, int, int | None]]:
    """The rows of a batched forward, as every family lays them out: each job's conditional
    row, then its unconditional row when it runs CFG (`job.cond.neg_embeds` is not None).
    Yields (job, conditional row, unconditional row or None)."""
    r = 0
    for job in jobs:
        if job.cond.neg_embeds is None:
            yield job, r, None
            r += 1
        else:
            yield job, r, r + 1
            r += 2


def check_size(height: int, width: int, multiple: int) -> None:
    """Output sizes must be whole latent patches: both sides multiples of `multiple` pixels."""
    if height % multiple or width % multiple:
        raise InvalidRequestError(f"size {width}x{height}: width and height must be multiples of "
                                  f"{multiple} for this model", param="size")
