"""Per-request noise and schedules, as diffusers' flow-matching pipelines set them up."""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor


def resolution_shift(image_seq_len: int, scheduler_config) -> float:
    """`mu` of dynamic shifting: linear in the number of image tokens between the scheduler's
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    lo_len = scheduler_config.get("base_image_seq_len", 256)
    hi_len = scheduler_config.get("max_image_seq_len", 4096)
    lo, hi = scheduler_config.get("base_shift", 0.5), scheduler_config.get("max_shift", 1.15)
    slope = (hi - lo) / (hi_len - lo_len)
    return image_seq_len * slope + (lo - slope * lo_len)


def job_scheduler(base, num_steps: int, device: torch.device, **set_timesteps_kwargs):
    """A fresh scheduler for one job (its step index and history are its own) and its
    timesteps. `sigmas` default to linspace(1, 1/steps, steps), the flow-matching pipelines' default."""
    sched = copy.deepcopy(base)
    if "sigmas" not in set_timesteps_kwargs:
        set_timesteps_kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
    sched.set_timesteps(device=device, **set_timesteps_kwargs)   # steps = len(sigmas)
    sched.set_begin_index(0)
    return sched, sched.timesteps


def seeded_noise(shape: tuple[int, ...], seed: int, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
    """Noise exactly as diffusers draws it with generator=torch.Generator("cpu").manual_seed(seed)."""
    gen = torch.Generator("cpu").manual_seed(seed)
    return randn_tensor(shape, generator=gen, device=device, dtype=dtype)
