"""Image-to-image and inpainting for text-to-image Qwen-Image folders: what diffusers'
QwenImageImg2ImgPipeline (one image) and QwenImageInpaintPipeline (one image and a mask)
compute from the same folder, on the diffusion stage. QwenImageFamily delegates here when a
request brings an input image; the prompt encoding, the forward and the decode are its own.

Reproduced from the pipelines' __call__:
  - the image is resized to the output size and normalised to [-1, 1] by VaeImageProcessor
    (PIL lanczos) and VAE-encoded; its latent is SAMPLED from the VAE's distribution (the
    pipelines' retrieve_latents default, sample_mode="sample"), with the request's generator,
    before the noise is drawn from that same generator; then normalised as
    (x - latents_mean) * (1 / latents_std) and packed;
  - the schedule is text-to-image's (sigmas linspace(1, 1/steps, steps), mu from the output
    size) cut by `strength`: it starts at index t_start = int(steps - min(steps * strength,
    steps)) (get_timesteps), which also becomes the scheduler's begin index, so a request
    runs steps - t_start steps;
  - the initial latents are scheduler.scale_noise(image latents, first kept timestep, noise)
    = sigma * noise + (1 - sigma) * image, sigma of the first kept step;
  - inpainting only: the mask goes through the pipeline's mask processor (grayscale, resized
    to the output size, binarised at 0.5: 1 = repaint), is resized (nearest) to the latent
    grid and packed like the latents; after every scheduler step the kept region is replaced
    by the image latents re-noised to the next timestep (clean after the last step):
    latents = (1 - mask) * image' + mask * latents  (`blend_known_region`, the stage's
    after_step hook).
The inpainting pipeline also VAE-encodes the masked image (drawing from the generator after
the noise), but its 16-channel transformer never reads those latents: skipped here.

Masks: ours (DiffusionPrompt.mask, 255 = may change; the server maps OpenAI's transparent
pixels to 255) and the pipeline's mask_image (white = repaint) have the same polarity, so the
mask goes to the mask processor as a greyscale image unchanged.

Defaults: strength 0.6, as both pipelines. The output size defaults to the input image's size
rounded down to multiples of 16 (the pipelines default to 1024x1024 whatever the image).

Batching: a job's key is text-to-image's (output shape, CFG or not): the forward is the same,
so image-to-image, inpainting and text-to-image jobs of one size share forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from omnistage.diffusion.cache import StepCache
from omnistage.diffusion.families.qwen_image_common import QwenCond, pack
from omnistage.diffusion.family import DenoiseJob
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import job_scheduler, resolution_shift
from omnistage.errors import InvalidRequestError

DEFAULT_STRENGTH = 0.6     # both pipelines' default


@dataclass
class SourceImage:
    """A request's input image, encoded once (QwenCond.extra["source"])."""

    latent_dist: Any                 # the VAE's DiagonalGaussianDistribution over (1, C, 1, h, w)
    mask: torch.Tensor | None        # (1, L, 4C) packed {0, 1}, 1 = repaint; None: image-to-image


@dataclass
class KnownRegion:
    """One inpainting job's blend inputs (DenoiseJob.extra["known"])."""

    image_latents: torch.Tensor      # (1, L, 4C) normalised, packed input-image latents
    noise: torch.Tensor              # (1, L, 4C) this job's initial noise
    mask: torch.Tensor               # (1, L, 4C) 1 = repaint, 0 = keep the image


def first_step(num_steps: int, strength: float) -> int:
    """Index of the first timestep kept for `strength` (the pipelines' get_timesteps)."""
    init = min(num_steps * strength, num_steps)
    return int(max(num_steps - init, 0))


class ImageToImage:
    """The image-to-image / inpainting side of a QwenImageFamily (`family.image_to_image`)."""

    def __init__(self, family):
        from diffusers.image_processor import VaeImageProcessor

        self.family = family
        channels = family.vae.config.z_dim
        # the pipelines' own processors (bit-equal resizes, normalisation, binarisation)
        self.image_processor = VaeImageProcessor(vae_scale_factor=family.multiple,
                                                 vae_latent_channels=channels)
        self.mask_processor = VaeImageProcessor(vae_scale_factor=family.multiple, vae_latent_channels=channels,
                                                do_normalize=False, do_binarize=True,
                                                do_convert_grayscale=True)

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        if len(prompt.images) != 1:
            if not prompt.images:
                raise InvalidRequestError("a mask needs the image it applies to: pass the image to "
                                          "inpaint as the prompt's 'image'", param="image")
            raise InvalidRequestError(f"this model takes one input image (image-to-image, or "
                                      f"inpainting with a mask), got {len(prompt.images)}", param="image")
        m = self.family.multiple
        h, w = prompt.images[0].shape[:2]
        params = msgspec.structs.replace(
            params, height=params.height or max(m, h // m * m), width=params.width or max(m, w // m * m),
            strength=DEFAULT_STRENGTH if params.strength is None else params.strength)
        params = self.family._resolve_size(params)
        steps = params.num_inference_steps
        if first_step(steps, params.strength) >= steps:
            raise InvalidRequestError(f"strength {params.strength} with num_inference_steps {steps} "
                                      "leaves no denoising step; raise strength or the steps",
                                      param="strength")
        return params

    # ---- 1. encode the image (and mask) -------------------------------------------------------
    def encode(self, request: DiffusionRequest, cond: QwenCond) -> QwenCond:
        """Adds the input image's VAE distribution and the packed mask to the text cond."""
        fam, p = self.family, request.params
        # uint8 (H, W, 3) -> RGB PIL: what a diffusers user passes as `image`
        x = self.image_processor.preprocess(Image.fromarray(request.images[0]), height=p.height,
                                            width=p.width).to(torch.float32)       # (1, 3, H, W) in [-1, 1]
        x = x.unsqueeze(2).to(fam.device, fam.dtype)                                 # (1, 3, 1, H, W)
        dist = fam.vae.encode(x).latent_dist                                         # over (1, C, 1, H/8, W/8)
        mask = None
        if request.mask is not None:
            h, w = 2 * cond.img_shapes[0][1], 2 * cond.img_shapes[0][2]              # latent grid
            m = self.mask_processor.preprocess(Image.fromarray(request.mask), height=p.height,
                                               width=p.width)                        # (1, 1, H, W) {0, 1}
            m = F.interpolate(m, size=(h, w)).to(fam.device, fam.dtype)              # nearest
            mask = pack(m.repeat(1, fam.latent_channels, 1, 1))                      # (1, L, 4C)
        cond.extra["source"] = SourceImage(dist, mask)
        return cond

    # ---- 2. prepare latents ----------------------------------------------------------------
    def prepare(self, request: DiffusionRequest, cond: QwenCond) -> list[DenoiseJob]:
        fam, p = self.family, request.params
        source: SourceImage = cond.extra["source"]
        h, w = 2 * cond.img_shapes[0][1], 2 * cond.img_shapes[0][2]
        # one generator, drawn in the pipelines' order: the VAE latent sample, then the noise
        gen = torch.Generator("cpu").manual_seed(p.seed)
        sample = source.latent_dist.sample(gen)                                    # (1, C, 1, h, w)
        cfg = fam.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(sample.device, sample.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(sample.device, sample.dtype)
        image = pack(((sample - mean) * inv_std)[:, :, 0]).to(fam.dtype)           # (1, L, 4C)
        noise = randn_tensor((p.n, 1, fam.latent_channels, h, w), generator=gen, device=fam.device,
                             dtype=fam.dtype)
        noise = pack(noise[:, 0])                                                   # (n, L, 4C)
        mu = resolution_shift(noise.shape[1], fam.scheduler.config)
        start = first_step(p.num_inference_steps, p.strength)
        key = (cond.img_shapes, cond.neg_embeds is not None)     # = text-to-image's key
        jobs = []
        for i in range(p.n):
            sched, timesteps = job_scheduler(fam.scheduler, p.num_inference_steps, fam.device, mu=mu)
            timesteps = timesteps[start:]
            sched.set_begin_index(start)
            # no step taken yet: scale_noise uses sigma[begin index], the first kept timestep's
            latents = sched.scale_noise(image, timesteps[:1], noise[i:i + 1])
            cache = StepCache.for_request(p.cache, p.cache_threshold, len(timesteps))
            job = DenoiseJob(request.request_id, i, latents, sched, timesteps, cond, key, cache=cache)
            if source.mask is not None:
                job.extra["known"] = KnownRegion(image, noise[i:i + 1], source.mask)
            jobs.append(job)
        return jobs

    # ---- 3b. after each scheduler step -------------------------------------------------------
    def after_step(self, job: DenoiseJob) -> None:
        blend_known_region(job)


def blend_known_region(job: DenoiseJob) -> None:
    """Inpainting, after each scheduler step (job.step not yet incremented): the kept region
    becomes the image latents re-noised to the next timestep, or the clean latents after the
    last step. A no-op for jobs without a mask."""
    known: KnownRegion | None = job.extra.get("known")
    if known is None:
        return
    image = known.image_latents
    nxt = job.step + 1
    if nxt < job.num_steps:
        # the scheduler's step index now points at `nxt`: scale_noise takes that step's sigma
        image = job.scheduler.scale_noise(image, job.timesteps[nxt:nxt + 1], known.noise)
    job.latents = (1 - known.mask) * image + known.mask * job.latents
