"""Qwen-Image-Layered (diffusers' QwenImageLayeredPipeline) on the diffusion stage: one RGBA
image in, `layers` RGBA layers out per sample.

What it computes, reproduced from the pipeline's __call__:
  - the input image (RGBA; RGB inputs get an opaque alpha) is resized to ~resolution^2 pixels
    at its aspect ratio (640 or 1024, multiples of 32), VAE-encoded (distribution mode; the
    VAE takes 4 channels), normalised by the latents mean/std and packed: the condition;
  - the output is layers + 1 frames of that size (frame 0 the recomposed image, then the
    layers), each packed like a Qwen-Image latent and concatenated along the sequence;
    the condition's tokens follow them in every forward (`img_shapes`: the layers + 1 frames,
    then the condition; the transformer's layer-3D rope gives the condition layer index -1);
  - the transformer's additional timestep condition is 0 (the pipeline's `is_rgb`) for all rows;
  - sigmas linspace(1, 0, steps + 1)[:-1] and mu = sqrt(condition tokens / 256) (not the
    resolution_shift line of the other Qwen-Image pipelines);
  - true CFG is neg + s * (cond - neg), without Qwen-Image's norm rescale (cfg_normalize=False);
  - decode: every frame but the first through the VAE -> (layers, H, W, 4) in [0, 1].
The output size always follows the input image and `resolution`; height/width may only
repeat it.

Blank prompts: the pipeline first writes a caption of the (resized) input image with the
text encoder's `generate` (its Chinese captioning template, the pipeline's default
use_en_prompt=False; up to 512 new tokens) and uses that as the prompt. We do the same in
`encode`, so it runs inside the stage's admission step: with a 7B text encoder that stalls the
other requests' denoising for the length of the generation. Unlike the pipeline (which
captions only "" and " "), every all-whitespace prompt is captioned. Greedy captions are cached
per image (content and size), like the VAE latents.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from PIL import Image

from omnistage.diffusion.families.qwen_image import QwenImageFamily
from omnistage.diffusion.families.qwen_image_common import QwenCond, pack, pad_rows, unpack
from omnistage.diffusion.families.qwen_image_edit import LatentCache, calculate_dimensions
from omnistage.diffusion.family import DenoiseJob, cfg_rows
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import seeded_noise
from omnistage.errors import InvalidRequestError, ModelLoadError

RESOLUTIONS = (640, 1024)     # the pipeline's buckets (it asserts one of them)
DEFAULT_RESOLUTION = 640
DEFAULT_LAYERS = 4
BASE_SEQ_LEN = 256 * 256 / 16 / 16   # mu = sqrt(condition tokens / this)
CAPTION_MAX_NEW_TOKENS = 512
CAPTION_TEMPLATE = (   # the pipeline's image_caption_prompt_cn, character for character
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n# 图像标注器\n"
    "你是一个专业的图像标注器。请基于输入图像，撰写图注:\n1.\n使用自然、描述性的语言撰写图注，不要使用结构化形式或富文本形式。\n"
    "2. 通过加入以下内容，丰富图注细节：\n - 对象的属性：如数量、颜色、形状、大小、位置、材质、状态、动作等\n -\n"
    "对象间的视觉关系：如空间关系、功能关系、动作关系、从属关系、比较关系、因果关系等\n - 环境细节：例如天气、光照、颜色、纹理、气氛等\n"
    " - 文字内容：识别图像中清晰可见的文字，不做翻译和解释，用引号在图注中强调\n3.\n保持真实性与准确性：\n - 不要使用笼统的描述\n -\n"
    "描述图像中所有可见的信息，但不要加入没有在图像中出现的内容\n<|vision_start|><|image_pad|><|vision_end|>"
    "<|im_end|>\n<|im_start|>assistant\n")


class QwenImageLayeredFamily(QwenImageFamily):
    """decode(job) -> float32 (layers, H, W, 4) RGBA in [0, 1] per sample (not (H, W, 3))."""

    name = "qwen_image_layered"
    input_channels = 4            # DiffusionPipeline.prepare keeps the images' alpha (H, W, 4)
    takes_layers = True           # DiffusionParams.layers / .resolution apply
    takes_strength = False
    captions_blank_prompt = True  # ... and lets a blank prompt through (captioned in encode)

    def __init__(self, folder, device: torch.device, dtype: torch.dtype):
        super().__init__(folder, device, dtype)
        if self.processor is None:
            raise ModelLoadError(f"{folder}: Qwen-Image-Layered needs a 'processor' component (the "
                                 "Qwen2.5-VL processor that captions the input image)")
        if not getattr(self.transformer.config, "use_layer3d_rope", False):
            raise ModelLoadError(f"{folder}: the transformer of a layered pipeline must have use_layer3d_rope")
        if not self.runner.needs_t_cond:
            raise ModelLoadError(f"{folder}: the transformer of a layered pipeline must have "
                                 "use_additional_t_cond")
        if self.vae.config.input_channels != 4:
            raise ModelLoadError(f"{folder}: the layered pipeline's VAE must take RGBA (input_channels 4)")
        from diffusers.image_processor import VaeImageProcessor

        self.image_processor = VaeImageProcessor(vae_scale_factor=self.multiple)
        self.latent_cache = LatentCache()
        # captions of blank-prompt requests, by image content and size: a retry or another
        # seed of the same image skips the generation (only when it is greedy, so exact)
        self.caption_cache = LatentCache(capacity=0 if self.text_encoder.generation_config.do_sample else 8)

    # ---- 0. request defaults ---------------------------------------------------------------
    def output_size(self, image: np.ndarray, resolution: int) -> tuple[int, int]:
        """(height, width) pixels of the output and of the VAE-encoded input."""
        width, height = calculate_dimensions(resolution * resolution, image.shape[1] / image.shape[0])
        if height < self.multiple or width < self.multiple:
            raise InvalidRequestError("the input image's aspect ratio is too extreme for this model; "
                                      "crop it", param="image")
        return height // self.multiple * self.multiple, width // self.multiple * self.multiple

    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        if len(prompt.images) != 1:
            raise InvalidRequestError("this model splits one image into layers: pass exactly one image "
                                      f"as the prompt's 'image' (got {len(prompt.images)})", param="image")
        if prompt.mask is not None:
            raise InvalidRequestError("this model takes no mask; leave 'mask' out", param="mask")
        if params.num_inference_steps == 1:
            # the scheduler's shift_terminal divides 0 by 0 with one step: NaN images
            raise InvalidRequestError("this model needs num_inference_steps >= 2", param="num_inference_steps")
        resolution = params.resolution or DEFAULT_RESOLUTION
        if resolution not in RESOLUTIONS:
            raise InvalidRequestError(f"resolution must be one of {list(RESOLUTIONS)} for this model, "
                                      f"got {resolution}", param="resolution")
        height, width = self.output_size(prompt.images[0], resolution)
        if (params.height or height, params.width or width) != (height, width):
            raise InvalidRequestError(
                f"this model's output size follows the input image and resolution={resolution} "
                f"({width}x{height}); leave height/width out, or choose `resolution`", param="size")
        return msgspec.structs.replace(
            params, height=height, width=width, resolution=resolution,
            layers=params.layers or DEFAULT_LAYERS,
            num_inference_steps=params.num_inference_steps or self.default_steps,
            true_cfg_scale=self.default_true_cfg if params.true_cfg_scale is None else params.true_cfg_scale)

    # ---- 1. encode prompt and image ---------------------------------------------------------
    def encode(self, request: DiffusionRequest) -> QwenCond:
        p = request.params
        height, width = p.height, p.width
        array = request.images[0]
        # (H, W, 3 | 4) uint8 -> the RGBA PIL image a diffusers user passes, at the output size
        image = self.image_processor.resize(Image.fromarray(array).convert("RGBA"), height, width)
        key = LatentCache.key(array, (height, width))
        text = (request.prompt if request.prompt.strip()
                else self.caption_cache.get(key, lambda: self.caption(image)))
        cfg = p.true_cfg_scale > 1 and p.negative_prompt is not None
        embeds = self._embed(text)
        neg = self._embed(p.negative_prompt) if cfg else None
        latents = self.latent_cache.get(key, lambda: self._encode_image(image, height, width))
        frame = (1, height // self.multiple, width // self.multiple)
        # output frames (the recomposed image, then the layers), then the condition image
        shapes = (frame,) * (p.layers + 1) + (frame,)
        return QwenCond(embeds, neg, p.true_cfg_scale, shapes, image_latents=latents,
                        extra={"prompt": text})

    def caption(self, image: Image.Image) -> str:
        """The pipeline's get_image_caption: the VL text encoder describes the image (greedy or
        sampled as its generation config says)."""
        inputs = self.processor(text=CAPTION_TEMPLATE, images=image, padding=True,
                                return_tensors="pt").to(self.device)
        ids = self.text_encoder.generate(**inputs, max_new_tokens=CAPTION_MAX_NEW_TOKENS)
        new = [out[len(prompt):] for prompt, out in zip(inputs.input_ids, ids)]
        return self.processor.batch_decode(new, skip_special_tokens=True,
                                           clean_up_tokenization_spaces=False)[0].strip()

    def _encode_image(self, image: Image.Image, height: int, width: int) -> torch.Tensor:
        """RGBA PIL image at (height, width) -> (1, h/2 * w/2, 4C) normalised packed latents."""
        x = self.image_processor.preprocess(image, height, width).unsqueeze(2)       # (1, 4, 1, H, W) in [-1, 1]
        x = x.to(self.text_encoder.dtype).to(self.device, self.dtype)
        lat = self.vae.encode(x).latent_dist.mode()                                 # (1, C, 1, h, w)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        return pack(((lat - mean) / std)[:, :, 0])

    # ---- 2. prepare latents ----------------------------------------------------------------
    def prepare(self, request: DiffusionRequest, cond: QwenCond) -> list[DenoiseJob]:
        p = request.params
        frames = p.layers + 1
        h, w = 2 * cond.img_shapes[0][1], 2 * cond.img_shapes[0][2]          # latent pixels
        c = self.latent_channels
        noise = seeded_noise((p.n, frames, c, h, w), p.seed, self.device, self.dtype)
        # each frame packed as a Qwen-Image latent, frames one after another: (n, F * h/2 * w/2, 4C)
        packed = pack(noise.reshape(p.n * frames, c, h, w)).reshape(p.n, frames * (h // 2) * (w // 2), 4 * c)
        mu = (cond.image_latents.shape[1] / BASE_SEQ_LEN) ** 0.5
        sigmas = np.linspace(1.0, 0, p.num_inference_steps + 1)[:-1]
        key = ("layered", cond.img_shapes, cond.neg_embeds is not None)
        return self._jobs(request, packed, cond, key, sigmas=sigmas, mu=mu)

    # ---- 3. one batched forward --------------------------------------------------------------
    def predict(self, jobs: list[DenoiseJob]) -> list[torch.Tensor]:
        rows_x, rows_txt, rows_t, owners = [], [], [], []
        for j, job in enumerate(jobs):
            c: QwenCond = job.cond
            x = torch.cat([job.latents, c.image_latents], 1)                  # (1, L_out + L_cond, 4C)
            for embeds in (c.embeds, c.neg_embeds):
                if embeds is not None:
                    rows_x.append(x)
                    rows_txt.append(embeds)
                    rows_t.append(job.t)
                    owners.append(j)
        x = torch.cat(rows_x)                                                  # (R, L, 4C)
        txt, mask = pad_rows(rows_txt)                                         # (R, T, D), (R, T) | None
        t = torch.stack(rows_t).to(x.dtype) / 1000                             # (R,)
        is_rgb = torch.zeros(len(rows_x), dtype=torch.long, device=x.device)  # the pipeline's constant 0
        img_shapes = [list(jobs[0].cond.img_shapes)] * len(rows_x)
        out = self.runner(x, txt, mask, t, img_shapes, jobs, owners, t_cond=is_rgb)
        out = out[:, : jobs[0].latents.shape[1]]                               # drop the condition's tokens
        preds = []
        for job, r, rn in cfg_rows(jobs):
            if rn is None:
                preds.append(out[r:r + 1])
            else:
                cond, neg = out[r:r + 1], out[rn:rn + 1]
                preds.append(neg + job.cond.cfg_scale * (cond - neg))         # no norm rescale
        return preds

    def after_step(self, job: DenoiseJob) -> None:
        """Nothing after a scheduler step (Qwen-Image's hook blends inpainting masks)."""

    # ---- 4. decode --------------------------------------------------------------------------
    def decode(self, job: DenoiseJob) -> np.ndarray:
        """-> float32 (layers, H, W, 4): RGBA layers in [0, 1] (the recomposed frame 0 dropped)."""
        h, w = job.cond.img_shapes[0][1:]
        frames = len(job.cond.img_shapes) - 1
        c4 = job.latents.shape[-1]
        tokens = job.latents.reshape(frames, h * w, c4)                        # one frame per row
        lat = unpack(tokens, h, w)[1:].unsqueeze(2).to(self.vae.dtype)         # (layers, C, 1, 2h, 2w)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(lat.device, lat.dtype)
        lat = lat / inv_std + mean                                             # (the pipeline's arithmetic)
        image = self.vae.decode(lat, return_dict=False)[0][:, :, 0]            # (layers, 4, H, W) in [-1, 1]
        return (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
