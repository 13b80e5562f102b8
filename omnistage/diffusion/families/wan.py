"""Wan (text to video, image to video) on the diffusion stage: diffusers' WanTransformer3DModel
(one, or Wan2.2's two experts), AutoencoderKLWan, UMT5 text encoder and the folder's scheduler
(UniPCMultistepScheduler for the Wan repos), driven step by step across requests; what
WanPipeline / WanImageToVideoPipeline.__call__ compute, cut into the stage's steps.

Wan2.2's experts: `transformer` denoises the steps with t >= boundary_ratio * num_train_timesteps
(high noise, guidance_scale), `transformer_2` the others (low noise, guidance_scale_2, which
defaults to guidance_scale). A job's expert therefore changes mid-run, so its batching key is
computed from its current step (`WanJob.key`).

Latent layout: (1, C, F_lat, h, w) float32 noise, F_lat = (F - 1) / temporal_scale + 1. Jobs
batch when their latent shapes, expert and CFG use are equal; prompts are always 512 tokens
(zero-padded, as the pipeline does), so rows stack without masks. Image to video adds, per
request, the condition channels (first-frame mask + VAE latents of the image, zeros after it)
concatenated to the latents; Wan2.1's CLIP image embeddings when the folder has an image encoder.
"""

from __future__ import annotations

import copy
import html
import math
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import regex
import torch
from diffusers.video_processor import VideoProcessor
from PIL import Image

from omnistage.diffusion.cache import StepCache, cached_stack
from omnistage.diffusion.components import load_component
from omnistage.diffusion.family import DenoiseJob, DiffusionFamily, cfg_rows, check_size
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import seeded_noise
from omnistage.errors import InvalidRequestError, ModelLoadError
from omnistage.layers.checkpoint import read_model_index

MAX_SEQUENCE_LENGTH = 512    # prompt tokens, zero-padded to this (the pipelines' default)


def clean_prompt(text: str) -> str:
    """The pipelines' prompt cleaning: ftfy when installed, HTML entities, whitespace runs."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()


@dataclass
class WanCond:
    """Conditioning of one request, shared by its samples."""

    embeds: torch.Tensor                     # (512, D) prompt embeddings, zero-padded
    neg_embeds: torch.Tensor | None          # (512, D); None: no CFG (guidance_scale <= 1)
    scales: tuple[float, float]              # guidance of expert 0 (high noise), expert 1 (low noise)
    latent_shape: tuple[int, int, int, int]  # (C, F_lat, h, w)
    condition: torch.Tensor | None = None    # i2v: (1, T + C, F_lat, h, w) mask + image latents
    image_embeds: torch.Tensor | None = None  # Wan2.1 i2v: (1, 257, D_img) CLIP hidden states


@dataclass
class WanJob(DenoiseJob):
    """A DenoiseJob whose batching key includes the expert of its current step: `key` is set to
    the request's static part (shape, CFG) and read back as (static part, expert now)."""

    experts: tuple[int, ...] = ()            # expert index per step, fixed by the schedule

    @property
    def key(self) -> Hashable:
        return (self._static_key, self.expert)

    @key.setter
    def key(self, value: Hashable) -> None:
        self._static_key = value

    @property
    def expert(self) -> int:
        return self.experts[min(self.step, len(self.experts) - 1)]


class WanFamily(DiffusionFamily):
    """WanPipeline (text to video)."""

    name = "wan"
    is_video = True
    takes_images = (0, 0)          # (fewest, most) input images
    default_size = (480, 832)      # (height, width): the pipelines' defaults
    default_frames = 81
    default_steps = 50
    default_guidance = 5.0
    sets_begin_index = True        # WanPipeline calls scheduler.set_begin_index(0)
    supports_cache = True          # step caches (run_transformer)

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        index = read_model_index(folder)
        self.device, self.dtype = device, dtype

        def load(name: str):
            return load_component(folder, name, dtype, device, index)

        self.experts = [load("transformer"), load("transformer_2")]
        self.vae, self.text_encoder = load("vae"), load("text_encoder")
        self.tokenizer, self.scheduler = load("tokenizer"), load("scheduler")
        if self.experts[0] is None:
            raise ModelLoadError("Wan folders without `transformer` are not supported")
        ratio = index.get("boundary_ratio")
        self.boundary = None if ratio is None else ratio * self.scheduler.config.num_train_timesteps
        if self.boundary is not None and self.experts[1] is None:
            raise ModelLoadError("model_index.json sets boundary_ratio but the folder has no transformer_2")
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        cfg = self.vae.config
        self.t_scale, self.s_scale = cfg.scale_factor_temporal, cfg.scale_factor_spatial
        patch = self.experts[0].config.patch_size
        # the pipeline rejects sizes that are not multiples of 16 and rounds down to patches
        self.multiple = math.lcm(16, self.s_scale * patch[1], self.s_scale * patch[2])
        self.video_processor = VideoProcessor(vae_scale_factor=self.s_scale)
        self.latent_channels = self.experts[0].config.in_channels     # WanPipeline's noise channels
        self._init_images(folder, index)

    def _init_images(self, folder: str | Path, index: dict) -> None:
        """Image to video loads its image parts here (text to video has none; a TI2V-5B folder,
        WanPipeline with expand_timesteps, is served from text only)."""

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        num_images = len(prompt.images)   # prompt: DiffusionPrompt (images, mask)
        if prompt.mask is not None:
            raise InvalidRequestError("Wan models take no mask; leave 'mask' out", param="mask")
        lo, hi = self.takes_images
        if num_images < lo:
            raise InvalidRequestError("this image-to-video model needs an input image (the first "
                                      "frame); pass {'prompt': ..., 'image': ...}", param="image")
        if num_images > hi:
            what = {0: "no input image: it generates video from text (use an image-to-video model)",
                    1: "one input image (the first frame)",
                    2: "at most two input images (the first frame and the last frame)"}[hi]
            raise InvalidRequestError(f"this model takes {what}; got {num_images}", param="image")
        if params.true_cfg_scale is not None:
            raise InvalidRequestError("true_cfg_scale applies to Qwen-Image; Wan uses guidance_scale",
                                      param="true_cfg_scale")
        frames = self.default_frames if params.num_frames is None else params.num_frames
        if frames % self.t_scale != 1 % self.t_scale:
            k = (frames - 1) // self.t_scale
            raise InvalidRequestError(
                f"num_frames must be {self.t_scale}k+1 for this model (e.g. {self.t_scale * k + 1} or "
                f"{self.t_scale * (k + 1) + 1}), got {frames}", param="num_frames")
        if num_images == 2 and frames < 2:
            raise InvalidRequestError("a first and a last frame need num_frames > 1", param="num_frames")
        h, w = params.height or self.default_size[0], params.width or self.default_size[1]
        check_size(h, w, self.multiple)
        g = self.default_guidance if params.guidance_scale is None else params.guidance_scale
        return msgspec.structs.replace(params, height=h, width=w, num_frames=frames, guidance_scale=g,
                                       num_inference_steps=params.num_inference_steps or self.default_steps)

    # ---- 1. encode prompt (and image) ------------------------------------------------------
    def _embed(self, text: str) -> torch.Tensor:
        """(512, D): UMT5 last hidden states of the prompt's tokens, zeros after them."""
        tok = self.tokenizer([clean_prompt(text)], padding="max_length", max_length=MAX_SEQUENCE_LENGTH,
                             truncation=True, add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt")
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state[0].to(self.experts[0].dtype)
        out = torch.zeros_like(hidden)
        n = int(mask.gt(0).sum())
        out[:n] = hidden[:n]
        return out

    def encode(self, request: DiffusionRequest) -> WanCond:
        p = request.params
        cfg = p.guidance_scale > 1.0
        g2 = p.guidance_scale_2
        shape = (self.latent_channels, (p.num_frames - 1) // self.t_scale + 1,
                 p.height // self.s_scale, p.width // self.s_scale)
        cond = WanCond(self._embed(request.prompt), self._embed(p.negative_prompt or "") if cfg else None,
                       (p.guidance_scale, p.guidance_scale if g2 is None else g2), shape)
        self._encode_images(request, cond)
        return cond

    def _encode_images(self, request: DiffusionRequest, cond: WanCond) -> None:
        """Image to video adds its image conditioning here."""

    # ---- 2. prepare latents ----------------------------------------------------------------
    def _job_scheduler(self, num_steps: int):
        sched = copy.deepcopy(self.scheduler)
        sched.set_timesteps(num_steps, device=self.device)    # the pipelines' own call: no sigmas
        if self.sets_begin_index:
            sched.set_begin_index(0)
        return sched

    def prepare(self, request: DiffusionRequest, cond: WanCond) -> list[DenoiseJob]:
        p = request.params
        noise = seeded_noise((p.n, *cond.latent_shape), p.seed, self.device, torch.float32)
        key = (cond.latent_shape, cond.neg_embeds is not None)
        jobs = []
        for i in range(p.n):
            sched = self._job_scheduler(p.num_inference_steps)
            ts = sched.timesteps
            # compared as the pipelines do: tensor timesteps >= a Python float (promoted by torch)
            experts = (0,) * len(ts) if self.boundary is None else \
                tuple(0 if high else 1 for high in (ts >= self.boundary).tolist())
            cache = StepCache.for_request(p.cache, p.cache_threshold, len(ts))
            jobs.append(WanJob(request.request_id, i, noise[i:i + 1], sched, ts, cond, key,
                               cache=cache, experts=experts))
        return jobs

    # ---- 3. one batched forward --------------------------------------------------------------
    def _model_input(self, job: DenoiseJob) -> torch.Tensor:
        """(1, C_in, F_lat, h, w) in the transformer's dtype."""
        c: WanCond = job.cond
        x = job.latents if c.condition is None else torch.cat([job.latents, c.condition], 1)
        return x.to(self.experts[0].dtype)

    def _timestep(self, job: DenoiseJob) -> torch.Tensor:
        """() or, with expand_timesteps (TI2V-5B), (F_lat * ceil(h/2) * ceil(w/2),): one per token."""
        if not self.expand_timesteps:
            return job.t
        _, f, h, w = job.cond.latent_shape
        return (torch.ones(f, h, w, device=job.latents.device)[:, ::2, ::2] * job.t).flatten()

    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        expert = jobs[0].expert                      # equal keys: one expert for the group
        model = self.experts[expert]
        rows_x, rows_txt, rows_t, rows_img, owners = [], [], [], [], []
        for j, job in enumerate(jobs):
            c: WanCond = job.cond
            x, t = self._model_input(job), self._timestep(job)
            for embeds in (c.embeds, c.neg_embeds):
                if embeds is not None:
                    rows_x.append(x)
                    rows_txt.append(embeds)
                    rows_t.append(t)
                    rows_img.append(c.image_embeds)
                    owners.append(j)
        img = None if rows_img[0] is None else torch.cat(rows_img)       # (R, 257, D_img)
        out = run_transformer(model, torch.cat(rows_x), torch.stack(rows_t), torch.stack(rows_txt),
                              img, jobs, owners)                          # (R, C, F_lat, h, w)
        preds = []
        for job, r, rn in cfg_rows(jobs):
            if rn is None:
                preds.append(out[r:r + 1])
                continue
            cond, uncond = out[r:r + 1], out[rn:rn + 1]
            preds.append(uncond + job.cond.scales[expert] * (cond - uncond))
        return preds

    # ---- 4. decode --------------------------------------------------------------------------
    def decode(self, job: DenoiseJob) -> np.ndarray:
        lat = job.latents.to(self.vae.dtype)                   # (1, C, F_lat, h, w)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
        video = self.vae.decode(lat / inv_std + mean, return_dict=False)[0]  # (1, 3, F, H, W) in [-1, 1]
        return self.video_processor.postprocess_video(video, output_type="np")[0]   # (F, H, W, 3)


class WanImageToVideoFamily(WanFamily):
    """WanImageToVideoPipeline: the first frame (and optionally the last) is given."""

    name = "wan_i2v"
    takes_images = (1, 2)
    # WanImageToVideoPipeline sets no begin index (the first step finds its index by timestep);
    # mirrored, so a schedule with a repeated first timestep steps the same way
    sets_begin_index = False

    def _init_images(self, folder, index) -> None:
        if self.expand_timesteps:
            raise ModelLoadError("WanImageToVideoPipeline folders with expand_timesteps (Wan2.2 TI2V-5B) "
                                 "are not supported yet")
        self.image_encoder = None
        if self.experts[0].config.image_dim is not None:            # Wan2.1 I2V: CLIP image tokens
            self.image_encoder = load_component(folder, "image_encoder", self.dtype, self.device, index)
            self.image_processor = load_component(folder, "image_processor", self.dtype, self.device, index)
            if self.image_encoder is None or self.image_processor is None:
                raise ModelLoadError("the transformer takes image embeddings (image_dim) but the folder "
                                     "has no image_encoder / image_processor")
            self.takes_images = (1, 1)
        self.latent_channels = self.vae.config.z_dim    # in_channels also counts the condition

    def _encode_images(self, request: DiffusionRequest, cond: WanCond) -> None:
        p = request.params
        pil = [Image.fromarray(a) for a in request.images]
        if self.image_encoder is not None:
            pixels = self.image_processor(images=pil[0], return_tensors="pt").pixel_values
            pixels = pixels.to(self.device, self.image_encoder.dtype)
            hidden = self.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
            cond.image_embeds = hidden.to(self.experts[0].dtype)                # (1, 257, D_img)
        frames = [self.video_processor.preprocess(im, height=p.height, width=p.width)
                  .to(self.device, torch.float32).unsqueeze(2) for im in pil]   # (1, 3, 1, H, W) each
        gap = p.num_frames - len(frames)
        video = torch.cat([frames[0], frames[0].new_zeros(1, 3, gap, p.height, p.width), *frames[1:]], 2)
        latent = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode().to(torch.float32)
        zc = self.vae.config
        mean = torch.tensor(zc.latents_mean).view(1, zc.z_dim, 1, 1, 1).to(latent.device)
        inv_std = 1.0 / torch.tensor(zc.latents_std).view(1, zc.z_dim, 1, 1, 1).to(latent.device)
        latent = (latent - mean) * inv_std                                      # (1, C, F_lat, h, w)
        # which frames are given, per pixel frame; the first is repeated to fill its latent frame
        _, f_lat, h, w = cond.latent_shape
        given = torch.zeros(1, 1, p.num_frames, h, w)
        given[:, :, 0] = 1
        if len(frames) == 2:
            given[:, :, -1] = 1
        given = torch.cat([given[:, :, :1].repeat_interleave(self.t_scale, 2), given[:, :, 1:]], 2)
        mask = given.view(1, f_lat, self.t_scale, h, w).transpose(1, 2).to(latent.device)
        cond.condition = torch.cat([mask, latent], 1)                            # (1, T + C, F_lat, h, w)



def run_transformer(model, x: torch.Tensor, t: torch.Tensor, txt: torch.Tensor, img: torch.Tensor | None,
                    jobs: list[DenoiseJob], owners: list[int]) -> torch.Tensor:
    """x (R, C_in, F, h, w), t (R,) or (R, L), txt (R, 512, D) -> (R, C_out, F, h, w).
    Without step caches: the model's own forward. With them, see `_cached_forward`."""
    if all(job.cache is None for job in jobs):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=txt,
                     encoder_hidden_states_image=img, return_dict=False)[0]
    return _cached_forward(model, x, t, txt, img, jobs, owners)


def _cached_forward(tr, x, t, txt, img, jobs, owners) -> torch.Tensor:
    """WanTransformer3DModel.forward from its submodules, with the step cache between the first
    block and the rest (omnistage/diffusion/cache.py). A job's cache state belongs to one expert:
    when its expert changes, the state restarts (that step runs in full)."""
    b, _, f, hh, ww = x.shape
    pt, ph, pw = tr.config.patch_size
    rope = tr.rope(x)
    h = tr.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()            # (R, L, D)
    seq = t.shape[1] if t.ndim == 2 else None
    temb, proj, enc, enc_img = tr.condition_embedder(t.flatten(), txt, img, timestep_seq_len=seq)
    proj = proj.unflatten(2 if seq else 1, (6, -1))
    if enc_img is not None:
        enc = torch.cat([enc_img, enc], 1)
    first, rest = tr.blocks[0], tr.blocks[1:]
    h0, h = h, first(h, enc, proj, rope)
    for job in jobs:
        c = job.cache
        if c is not None and job.extra.get("cache_expert") != job.expert:   # another expert's residual
            c.residual, c.prev_signal, c.accumulated = None, None, 0.0
            job.extra["cache_expert"] = job.expert

    def teacache_signal(r: int) -> torch.Tensor:      # the first block's modulated input
        mod = (first.scale_shift_table + proj[r:r + 1].float()).chunk(6, dim=-2)
        shift, scale = mod[0].squeeze(-2), mod[1].squeeze(-2)
        return first.norm1(h0[r:r + 1].float()) * (1 + scale) + shift

    def run_rest(idx: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        for blk in rest:
            hs = blk(hs, enc[idx], proj[idx], rope)       # rope: (1, L, 1, d) pairs, shared
        return hs

    h = cached_stack(h0, h, jobs, owners, teacache_signal, run_rest)
    if temb.ndim == 3:    # per-token timesteps (TI2V)
        shift, scale = (tr.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    h = tr.proj_out((tr.norm_out(h.float()) * (1 + scale) + shift).type_as(h))
    h = h.reshape(b, f // pt, hh // ph, ww // pw, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)
