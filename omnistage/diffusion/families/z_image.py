"""Z-Image (text to image) on the diffusion stage: diffusers' ZImageTransformer2DModel,
AutoencoderKL, Qwen3 text encoder and FlowMatchEulerDiscreteScheduler, driven step by step
across requests; what ZImagePipeline.__call__ computes, cut into the stage's steps.

The transformer takes lists: one (C, 1, h, w) latent and one (T_i, D) caption per row, of any
sizes (it pads and masks inside). So jobs of different image sizes and prompt lengths share a
forward; the batching key only separates jobs with and without CFG (the brief's rule; the rows
themselves would mix). Latents: (1, C, h, w) float32, h = 2 * (H // (2 * vae_scale)).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from omnistage.diffusion.components import load_components
from omnistage.diffusion.families.qwen_image_common import to_pixels
from omnistage.diffusion.family import DenoiseJob, DiffusionFamily, cfg_rows, check_size
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import job_scheduler, resolution_shift, seeded_noise
from omnistage.errors import InvalidRequestError

MAX_SEQUENCE_LENGTH = 512    # prompt tokens kept (the pipeline's default)


@dataclass
class ZImageCond:
    """Conditioning of one request, shared by its samples."""

    embeds: torch.Tensor                  # (T, D) the prompt's caption features (padding dropped)
    neg_embeds: torch.Tensor | None       # (T', D); None: no CFG (guidance_scale == 0)
    scale: float                          # guidance_scale


class ZImageFamily(DiffusionFamily):
    name = "z_image"
    is_video = False
    default_steps = 50
    default_guidance = 5.0

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        load_components(self, folder, device, dtype)
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.vae_scale * 2          # pixels per 2x2 latent patch side
        self.default_size = 1024

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        num_images = len(prompt.images)   # prompt: DiffusionPrompt (images, mask)
        if num_images:
            raise InvalidRequestError("this model generates from text only; it takes no input image",
                                      param="image")
        if prompt.mask is not None:
            raise InvalidRequestError("Z-Image takes no mask; leave 'mask' out", param="mask")
        if params.true_cfg_scale is not None:
            raise InvalidRequestError("true_cfg_scale applies to Qwen-Image; Z-Image uses guidance_scale",
                                      param="true_cfg_scale")
        h, w = params.height or self.default_size, params.width or self.default_size
        check_size(h, w, self.multiple)
        g = self.default_guidance if params.guidance_scale is None else params.guidance_scale
        return msgspec.structs.replace(params, height=h, width=w, guidance_scale=g,
                                       num_inference_steps=params.num_inference_steps or self.default_steps)

    # ---- 1. encode prompt ------------------------------------------------------------------
    def _embed(self, text: str) -> torch.Tensor:
        """(T, D): the text encoder's second-to-last hidden states of the chat-templated prompt.
        Padded to 512 like the pipeline (so positions and kernels match it), padding dropped."""
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
        tok = self.tokenizer([chat], padding="max_length", max_length=MAX_SEQUENCE_LENGTH,
                             truncation=True, return_tensors="pt")
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return hidden[0][mask[0]]

    def encode(self, request: DiffusionRequest) -> ZImageCond:
        p = request.params
        cfg = p.guidance_scale > 0        # the pipeline's rule (not > 1)
        return ZImageCond(self._embed(request.prompt), self._embed(p.negative_prompt or "") if cfg else None,
                          p.guidance_scale)

    # ---- 2. prepare latents ----------------------------------------------------------------
    def prepare(self, request: DiffusionRequest, cond: ZImageCond) -> list[DenoiseJob]:
        p = request.params
        h, w = 2 * (p.height // self.multiple), 2 * (p.width // self.multiple)
        noise = seeded_noise((p.n, self.transformer.in_channels, h, w), p.seed, self.device, torch.float32)
        mu = resolution_shift((h // 2) * (w // 2), self.scheduler.config)
        # the pipeline's default sigmas, computed as it does (float32 linspace)
        sigmas = torch.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps).tolist()
        key = cond.neg_embeds is not None
        jobs = []
        for i in range(p.n):
            sched, timesteps = job_scheduler(self.scheduler, p.num_inference_steps, self.device,
                                             sigmas=sigmas, mu=mu)
            # job.cache stays None: the step cache is not supported for Z-Image (see the report)
            jobs.append(DenoiseJob(request.request_id, i, noise[i:i + 1], sched, timesteps, cond, key))
        return jobs

    # ---- 3. one batched forward --------------------------------------------------------------
    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        xs, caps, ts = [], [], []
        for job in jobs:
            c: ZImageCond = job.cond
            x = job.latents[0].to(self.transformer.dtype).unsqueeze(1)       # (C, 1, h, w)
            t = (1000 - job.t) / 1000                                        # 0 = noise, 1 = clean
            for embeds in (c.embeds, c.neg_embeds):
                if embeds is not None:
                    xs.append(x)
                    caps.append(embeds)
                    ts.append(t)
        out = self.transformer(xs, torch.stack(ts), caps, return_dict=False)[0]   # R x (C, 1, h, w)
        preds = []
        for job, r, rn in cfg_rows(jobs):
            pos = out[r].float()
            if rn is not None:
                pos = pos + job.cond.scale * (pos - out[rn].float())
            # the transformer predicts (clean - noise); the scheduler steps with its negation
            preds.append(-pos.squeeze(1).unsqueeze(0))                       # (1, C, h, w)
        return preds

    # ---- 4. decode --------------------------------------------------------------------------
    def decode(self, job: DenoiseJob) -> np.ndarray:
        cfg = self.vae.config
        lat = job.latents.to(self.vae.dtype) / cfg.scaling_factor + cfg.shift_factor   # (1, C, h, w)
        image = self.vae.decode(lat, return_dict=False)[0]                  # (1, 3, H, W) in [-1, 1]
        return to_pixels(image[0])
