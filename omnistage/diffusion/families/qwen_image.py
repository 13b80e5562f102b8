"""Qwen-Image (text to image) on the diffusion stage: diffusers' QwenImageTransformer2DModel,
AutoencoderKLQwenImage, Qwen2.5-VL text encoder and FlowMatchEulerDiscreteScheduler, driven
step by step across requests.

Latent layout: the VAE's (C, 1, h, w) latents are cut into 2x2 patches and packed as a
sequence, (1, h/2 * w/2, 4C). Jobs batch together when their image shapes are equal (the
rotary table is shared by the batch); prompts of different lengths are right-padded and
masked. The edit variants (an input image's latents appended to the sequence) build on this
class (qwen_image_edit.py). A request with one input image is image-to-image, with a mask too
inpainting (diffusers' QwenImageImg2ImgPipeline / QwenImageInpaintPipeline on the same folder):
`image_to_image` (qwen_image_inpaint.py) prepares those; the forward and decode are shared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omnistage.diffusion.cache import StepCache
from omnistage.diffusion.components import load_component, load_components
from omnistage.diffusion.families.qwen_image_common import (QwenCond, pack, pad_rows, to_pixels,
                                                            unpack)
from omnistage.diffusion.families.qwen_image_inpaint import ImageToImage
from omnistage.diffusion.family import DenoiseJob, DiffusionFamily, cfg_rows, check_size
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import job_scheduler, resolution_shift, seeded_noise
from omnistage.diffusion.transformer_runner import QwenImageRunner
from omnistage.errors import InvalidRequestError, ModelLoadError

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
                   "texture, quantity, text, spatial relationships of the objects and background:"
                   "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34           # template tokens dropped from the embeddings (pipeline constant)
TOKENIZER_MAX = 1024         # prompt tokens kept (before the drop)
MAX_SEQUENCE_LENGTH = 512    # embeddings kept per prompt (diffusers' default)


class QwenImageFamily(DiffusionFamily):
    name = "qwen_image"
    is_video = False
    default_steps = 50
    default_true_cfg = 4.0
    takes_strength = True        # with an input image: image-to-image / inpainting (qwen_image_inpaint.py)
    supports_cache = True        # step caches (transformer_runner.py)

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        index = load_components(self, folder, device, dtype)
        self.processor = load_component(folder, "processor", dtype, device, index) if "processor" in index else None
        if self.transformer.config.guidance_embeds:
            raise ModelLoadError("guidance-distilled Qwen-Image transformers (guidance_embeds) are not supported")
        self.vae_scale = 2 ** len(self.vae.temperal_downsample)
        self.multiple = self.vae_scale * 2          # pixels per packed latent token side
        self.latent_channels = self.transformer.config.in_channels // 4
        self.default_size = 128 * self.vae_scale
        self.runner = QwenImageRunner(self.transformer)
        self.image_to_image = ImageToImage(self)

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        if prompt.images or prompt.mask is not None:
            return self.image_to_image.resolve(params, prompt)
        # (strength without an input image: DiffusionPipeline.resolve refuses it first)
        return self._resolve_size(params)

    def _resolve_size(self, params: DiffusionParams) -> DiffusionParams:
        import msgspec

        if params.num_inference_steps == 1:
            # Qwen-Image's scheduler (shift_terminal) divides 0 by 0 with one step: NaN images
            raise InvalidRequestError("this model needs num_inference_steps >= 2", param="num_inference_steps")
        h, w = params.height or self.default_size, params.width or self.default_size
        check_size(h, w, self.multiple)
        return msgspec.structs.replace(
            params, height=h, width=w,
            num_inference_steps=params.num_inference_steps or self.default_steps,
            true_cfg_scale=self.default_true_cfg if params.true_cfg_scale is None else params.true_cfg_scale)

    # ---- 1. encode prompt ------------------------------------------------------------------
    def _embed(self, text: str) -> torch.Tensor:
        """(T, D): the text encoder's last hidden states of the templated prompt, template dropped."""
        tok = self.tokenizer([PROMPT_TEMPLATE.format(text)], max_length=TOKENIZER_MAX + TEMPLATE_DROP,
                             truncation=True, return_tensors="pt").to(self.device)
        # .model: the hidden states without the LM head (Qwen2.5-VL-7B's head would add
        # ~1 GFLOP per prompt token for logits nobody reads)
        out = self.text_encoder.model(input_ids=tok.input_ids, attention_mask=tok.attention_mask,
                                      output_hidden_states=True)
        return out.hidden_states[-1][0, TEMPLATE_DROP:][:MAX_SEQUENCE_LENGTH].to(self.dtype)

    def encode(self, request: DiffusionRequest) -> QwenCond:
        p = request.params
        cfg = p.true_cfg_scale > 1 and p.negative_prompt is not None
        h, w = p.height // self.multiple, p.width // self.multiple
        cond = QwenCond(self._embed(request.prompt), self._embed(p.negative_prompt) if cfg else None,
                        p.true_cfg_scale, ((1, h, w),))
        return self.image_to_image.encode(request, cond) if request.images else cond

    # ---- 2. prepare latents ----------------------------------------------------------------
    def prepare(self, request: DiffusionRequest, cond: QwenCond) -> list[DenoiseJob]:
        if "source" in cond.extra:        # an input image (set by image_to_image.encode)
            return self.image_to_image.prepare(request, cond)
        p = request.params
        # latent size from the conditioning's output shape (packed tokens x 2): equal to
        # params.height/width // vae_scale here; edit models derive it from the input image
        h, w = 2 * cond.img_shapes[0][1], 2 * cond.img_shapes[0][2]
        noise = seeded_noise((p.n, 1, self.latent_channels, h, w), p.seed, self.device, self.dtype)
        packed = pack(noise[:, 0])                                        # (n, L, 4C)
        mu = resolution_shift(packed.shape[1], self.scheduler.config)
        return self._jobs(request, packed, cond, (cond.img_shapes, cond.neg_embeds is not None), mu=mu)

    def _jobs(self, request: DiffusionRequest, packed: torch.Tensor, cond: QwenCond, key,
              **schedule) -> list[DenoiseJob]:
        """One job per sample of `packed` (n, L, 4C) noise, each with its own scheduler
        (`schedule`: set_timesteps arguments, e.g. mu, sigmas) and step cache."""
        p = request.params
        jobs = []
        for i in range(p.n):
            sched, timesteps = job_scheduler(self.scheduler, p.num_inference_steps, self.device, **schedule)
            cache = StepCache.for_request(p.cache, p.cache_threshold, len(timesteps))
            jobs.append(DenoiseJob(request.request_id, i, packed[i:i + 1], sched, timesteps, cond, key,
                                   cache=cache))
        return jobs

    # ---- 3. one batched forward --------------------------------------------------------------
    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        rows_x, rows_txt, rows_t, owners = [], [], [], []
        for j, job in enumerate(jobs):
            c: QwenCond = job.cond
            x = job.latents if c.image_latents is None else torch.cat([job.latents, c.image_latents], 1)
            for embeds in (c.embeds, c.neg_embeds):
                if embeds is None:
                    continue
                rows_x.append(x)
                rows_txt.append(embeds)
                rows_t.append(job.t)
                owners.append(j)
        x = torch.cat(rows_x)                                              # (R, L(+L_in), 4C)
        txt, mask = pad_rows(rows_txt)                                     # (R, T, D), (R, T) | None
        t = (torch.stack(rows_t).to(x.dtype) / 1000)                       # (R,)
        img_shapes = [list(jobs[0].cond.img_shapes)] * len(rows_x)
        out = self.runner(x, txt, mask, t, img_shapes, jobs, owners)       # (R, L(+L_in), 4C)
        out = out[:, : jobs[0].latents.shape[1]]
        preds = []
        for job, r, rn in cfg_rows(jobs):
            if rn is None:
                preds.append(out[r:r + 1])
                continue
            cond, neg = out[r:r + 1], out[rn:rn + 1]
            comb = neg + job.cond.cfg_scale * (cond - neg)
            # keep the conditional prediction's norm per token (Qwen-Image's true CFG)
            preds.append(comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True)))
        return preds

    def after_step(self, job: DenoiseJob) -> None:
        """The stage's hook after each scheduler step: inpainting re-imposes the kept region."""
        self.image_to_image.after_step(job)

    # ---- 4. decode --------------------------------------------------------------------------
    def decode(self, job: DenoiseJob) -> np.ndarray:
        h, w = job.cond.img_shapes[0][1:]
        lat = unpack(job.latents, h, w).unsqueeze(2).to(self.vae.dtype)   # (1, C, 1, 2h, 2w)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=lat.device, dtype=lat.dtype).view(1, -1, 1, 1, 1)
        image = self.vae.decode(lat * std + mean, return_dict=False)[0][:, :, 0]   # (1, 3, H, W) in [-1, 1]
        return to_pixels(image[0])
