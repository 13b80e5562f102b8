"""Ovis-Image (text to image) on the diffusion stage: diffusers' OvisImageTransformer2DModel,
AutoencoderKL, Qwen3 text encoder and FlowMatchEulerDiscreteScheduler, driven step by step
across requests; what OvisImagePipeline.__call__ computes, cut into the stage's steps.

Latent layout (Flux's, shared with LongCat-Image, which subclasses this family): the VAE's
(C, h, w) latents are cut into 2x2 patches and packed as a sequence, (1, h/2 * w/2, 4C). The
transformer takes no attention mask and one (txt_ids, img_ids) rotary table for the whole batch,
so jobs batch when their token grids and text lengths are equal (`key`). Ovis prompts are always
256 embeddings (padded to max_length, as the pipeline does), so only the image size separates
jobs; with and without CFG rows mix freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from omnistage.diffusion.components import load_components
from omnistage.diffusion.families.qwen_image_common import pack, to_pixels, unpack
from omnistage.diffusion.family import DenoiseJob, DiffusionFamily, cfg_rows, check_size
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import job_scheduler, resolution_shift, seeded_noise
from omnistage.errors import InvalidRequestError

SYSTEM_PROMPT = ("Describe the image by detailing the color, quantity, text, shape, size, texture, spatial "
                 "relationships of the objects and background: ")
USER_PROMPT_BEGIN = 28       # templated-prompt tokens dropped from the embeddings (pipeline constant)
MAX_SEQUENCE_LENGTH = 256    # embeddings kept per prompt (the pipeline's default and maximum)


@dataclass
class PackedCond:
    """Conditioning of one request, shared by its samples (Ovis-Image and LongCat-Image)."""

    embeds: torch.Tensor                  # (T, D) prompt embeddings
    neg_embeds: torch.Tensor | None       # (T, D) negative prompt embeddings; None: no CFG
    scale: float                          # guidance_scale
    grid: tuple[int, int]                 # (h, w): packed output tokens (latent size / 2)
    txt_ids: torch.Tensor                 # (T, 3) rotary positions of the text tokens
    img_ids: torch.Tensor                 # (L (+ L_in), 3) of the output (+ input image) tokens
    image_latents: torch.Tensor | None = None   # (1, L_in, 4C) packed input-image latents (edits)
    renorm: bool = False                  # LongCat: rescale the guided prediction to the cond norm


class OvisImageFamily(DiffusionFamily):
    name = "ovis_image"
    is_video = False
    default_steps = 50
    default_guidance = 5.0

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        load_components(self, folder, device, dtype)
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.multiple = self.vae_scale * 2          # pixels per packed latent token side
        self.latent_channels = self.transformer.config.in_channels // 4
        self.default_size = 128 * self.vae_scale    # the pipelines' default_sample_size

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        if prompt.images or prompt.mask is not None:
            raise InvalidRequestError("this model generates from text only; it takes no input image",
                                      param="image")
        self._check_common(params)
        h, w = params.height or self.default_size, params.width or self.default_size
        check_size(h, w, self.multiple)
        return self._with_defaults(params, height=h, width=w)

    def _check_common(self, params: DiffusionParams) -> None:
        if params.true_cfg_scale is not None:
            raise InvalidRequestError(f"true_cfg_scale applies to Qwen-Image; {self.name} uses guidance_scale",
                                      param="true_cfg_scale")
        # (strength, layers, resolution and num_frames: DiffusionPipeline.resolve refuses them here)

    def _with_defaults(self, params: DiffusionParams, **updates) -> DiffusionParams:
        g = self.default_guidance if params.guidance_scale is None else params.guidance_scale
        return msgspec.structs.replace(params, guidance_scale=g, **updates,
                                       num_inference_steps=params.num_inference_steps or self.default_steps)

    # ---- 1. encode prompt ------------------------------------------------------------------
    def _embed(self, text: str) -> torch.Tensor:
        """(256, D): Qwen3's last hidden states of the chat-templated prompt (system text in the
        user turn, thinking off), padded to 28 + 256 tokens, padding zeroed, first 28 dropped."""
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": SYSTEM_PROMPT + text}],
                                                  tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        tok = self.tokenizer([chat], padding="max_length", truncation=True, return_tensors="pt",
                             max_length=MAX_SEQUENCE_LENGTH + USER_PROMPT_BEGIN, add_special_tokens=False)
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return (hidden * mask[..., None])[0, USER_PROMPT_BEGIN:]

    def encode(self, request: DiffusionRequest) -> PackedCond:
        p = request.params
        cfg = p.guidance_scale > 1                    # the pipeline's rule; negative "" by default
        embeds = self._embed(request.prompt)
        neg = self._embed(p.negative_prompt or "") if cfg else None
        grid = (p.height // self.multiple, p.width // self.multiple)
        return PackedCond(embeds, neg, p.guidance_scale, grid, self._txt_ids(embeds.shape[0]),
                          self._img_ids(*grid))

    def _txt_ids(self, length: int) -> torch.Tensor:
        """(T, 3): (0, i, i) for text token i, in the text encoder's dtype as the pipeline."""
        ids = torch.zeros(length, 3)
        ids[:, 1] = ids[:, 2] = torch.arange(length)
        return ids.to(self.device, self.dtype)

    def _img_ids(self, h: int, w: int) -> torch.Tensor:
        """(h * w, 3): (0, row, col) per packed latent token, row-major."""
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        return ids.reshape(h * w, 3).to(self.device, self.dtype)

    # ---- 2. prepare latents ----------------------------------------------------------------
    def initial_noise(self, p: DiffusionParams, shape: tuple[int, ...]) -> torch.Tensor:
        return seeded_noise(shape, p.seed, self.device, self.dtype)

    def prepare(self, request: DiffusionRequest, cond: PackedCond) -> list[DenoiseJob]:
        p = request.params
        h, w = cond.grid
        noise = self.initial_noise(p, (p.n, self.latent_channels, 2 * h, 2 * w))
        packed = pack(noise)                                              # (n, L, 4C)
        mu = resolution_shift(packed.shape[1], self.scheduler.config)
        # rows of one forward share the rotary table: equal output grid, text and input lengths
        key = (cond.grid, cond.txt_ids.shape[0], cond.img_ids.shape[0])
        jobs = []
        for i in range(p.n):
            sched, timesteps = job_scheduler(self.scheduler, p.num_inference_steps, self.device, mu=mu)
            # job.cache stays None: no step cache here (it lives in the Qwen-Image and Wan
            # forwards; this transformer runs as diffusers' module), requests run every block
            jobs.append(DenoiseJob(request.request_id, i, packed[i:i + 1], sched, timesteps, cond, key))
        return jobs

    # ---- 3. one batched forward --------------------------------------------------------------
    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        rows_x, rows_txt, rows_t = [], [], []
        for job in jobs:
            c: PackedCond = job.cond
            x = job.latents if c.image_latents is None else torch.cat([job.latents, c.image_latents], 1)
            for embeds in (c.embeds, c.neg_embeds):
                if embeds is not None:
                    rows_x.append(x)
                    rows_txt.append(embeds)
                    rows_t.append(job.t.to(x.dtype) / 1000)
        c0: PackedCond = jobs[0].cond                                     # same key: same ids
        out = self.transformer(hidden_states=torch.cat(rows_x), encoder_hidden_states=torch.stack(rows_txt),
                               timestep=torch.stack(rows_t), img_ids=c0.img_ids, txt_ids=c0.txt_ids,
                               return_dict=False)[0]                      # (R, L (+ L_in), 4C)
        out = out[:, : jobs[0].latents.shape[1]]
        preds = []
        for job, r, rn in cfg_rows(jobs):
            pos = out[r:r + 1]
            if rn is not None:
                pos = self.guide(pos, out[rn:rn + 1], job.cond)
            preds.append(pos)
        return preds

    def guide(self, pos: torch.Tensor, neg: torch.Tensor, cond: PackedCond) -> torch.Tensor:
        """Classifier-free guidance of one job's (1, L, 4C) predictions."""
        return neg + cond.scale * (pos - neg)

    # ---- 4. decode --------------------------------------------------------------------------
    def decode(self, job: DenoiseJob) -> np.ndarray:
        cfg = self.vae.config
        lat = unpack(job.latents, *job.cond.grid).to(self.vae.dtype)      # (1, C, 2h, 2w)
        image = self.vae.decode(lat / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
        return to_pixels(image[0])                                        # (H, W, 3) in [0, 1]
