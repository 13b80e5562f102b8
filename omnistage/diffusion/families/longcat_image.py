"""LongCat-Image (text to image, LongCatImagePipeline) and LongCat-Image-Edit (one input image,
LongCatImageEditPipeline) on the diffusion stage: diffusers' LongCatImageTransformer2DModel,
AutoencoderKL (16 latent channels), Qwen2.5-VL text encoder and FlowMatchEulerDiscreteScheduler.

The denoising is Ovis-Image's (Flux's packed layout, `OvisImageFamily`); what differs, from the
pipelines' __call__:
  - prompts: text inside quotes ('...', "...", ‘...’, “...”) is tokenized one character at a
    time (apostrophes inside words such as "don't" are not quotes), the tokens are cut at 512
    and padded to 512 (the tokenizer's pad), wrapped in a system template, and the text
    encoder's last hidden states of those 512 positions are the embeddings (no mask: pads too);
  - rotary positions carry a modality: text (0, i, i), output tokens (1, T + row, T + col),
    edit input-image tokens (2, T + row, T + col), T the number of text embeddings;
  - text to image: noise drawn in float32, guidance with "CFG renorm" (the guided prediction
    rescaled per token to at most the conditional one's norm: enable_cfg_renorm=True,
    cfg_renorm_min=0.0, the pipeline's defaults);
  - edit: the output size is the input image's aspect ratio at ~1024x1024 (calculate_dimensions,
    multiples of 16; no height/width parameters); the text encoder also sees the image at half
    that size (its vision tokens are part of the embeddings), the VAE encodes it at full size
    (distribution mode, Flux shift/scale) and its packed latents follow the output tokens in
    every forward; plain guidance.

Prompt rewriting: LongCatImagePipeline by default (enable_prompt_rewrite=True) first asks its
text encoder, a 7B VLM, to rewrite every prompt with `generate(max_new_tokens=512)`: up to 512
decode steps of the 7B model per request, on the admission path of every denoising batch. Not
cheap, so this family skips it and encodes the prompt as given (enable_prompt_rewrite=False);
clients who want richer prompts rewrite them before sending.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from PIL import Image

from omnistage.diffusion.components import load_component
from omnistage.diffusion.families.ovis_image import OvisImageFamily, PackedCond
from omnistage.diffusion.families.qwen_image_common import pack
from omnistage.diffusion.families.qwen_image_edit import LatentCache
from omnistage.diffusion.messages import DiffusionRequest
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.schedule import seeded_noise
from omnistage.errors import InvalidRequestError, ModelLoadError

LATENT_CHANNELS = 16         # the pipelines hard-code num_channels_latents = 16
TOKENIZER_MAX = 512          # prompt tokens, cut and padded to this (pipeline constant)
T2I_PREFIX = ("<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based "
              "on an image content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n")
EDIT_PREFIX = ("<|im_start|>system\nAs an image editing expert, first analyze the content and attributes of "
               "the input image(s). Then, based on the user's editing instructions, clearly and precisely "
               "determine how to modify the given image(s), ensuring that only the specified parts are "
               "altered and all other aspects remain consistent with the original(s).<|im_end|>\n"
               "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PAD, VISION_START = "<|image_pad|>", "<|vision_start|>"
EDIT_AREA = 1024 * 1024      # pixels of the edit output (and of the VAE-encoded input)
RENORM_MIN = 0.0             # cfg_renorm_min (pipeline default)

_CONTRACTION = re.compile(r"[a-zA-Z]+'[a-zA-Z]+")
_QUOTES = (("'", "'"), ('"', '"'), ("\u2018", "\u2019"), ("\u201c", "\u201d"))
# a quote pair around the shortest run of text free of both quote characters
_QUOTED = re.compile("|".join(f"{re.escape(a)}[^{re.escape(a + b)}]*?{re.escape(b)}" for a, b in _QUOTES))


def quote_pieces(text: str) -> list[tuple[str, bool]]:
    """`text` cut into (piece, quoted) pieces, in order; quoted pieces keep their quotes.

    Apostrophes inside words (letters ' letters) are hidden from the quote search behind a
    character the text does not contain. (diffusers hides each distinct such word behind
    placeholders that are prefixes of one another and restores them in hash order, which
    mangles prompts with two different ones, e.g. "don't ... it's"; here they stay intact.)"""
    hidden = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    chars = list(text)
    for m in _CONTRACTION.finditer(text):
        chars[text.index("'", m.start())] = hidden
    masked, pieces, pos = "".join(chars), [], 0
    for m in _QUOTED.finditer(masked):
        if m.start() > pos:
            pieces.append((masked[pos:m.start()], False))
        pieces.append((m.group(), True))
        pos = m.end()
    if pos < len(masked):
        pieces.append((masked[pos:], False))
    return [(piece.replace(hidden, "'"), quoted) for piece, quoted in pieces]


def edit_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of an edit's output: ~1024x1024 pixels at the input's aspect ratio,
    each rounded UP to a multiple of 16 (the edit pipeline's calculate_dimensions)."""
    ratio = width / height
    w = math.sqrt(EDIT_AREA * ratio)
    h = w / ratio
    return int(w if w % 16 == 0 else (w // 16 + 1) * 16), int(h if h % 16 == 0 else (h // 16 + 1) * 16)


def text_ids(length: int) -> torch.Tensor:
    """(T, 3) float32: (0, i, i) for text token i (modality 0)."""
    ids = torch.zeros(length, 3)
    ids[:, 1] = ids[:, 2] = torch.arange(length)
    return ids


def image_ids(modality: int, start: int, h: int, w: int) -> torch.Tensor:
    """(h * w, 3) float32: (modality, start + row, start + col) per packed token, row-major."""
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = modality
    ids[..., 1] = start + torch.arange(h)[:, None]
    ids[..., 2] = start + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


class LongCatImageFamily(OvisImageFamily):
    name = "longcat_image"
    default_guidance = 4.5
    prefix = T2I_PREFIX
    renorm = True

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        super().__init__(folder, device, dtype)
        if self.transformer.config.in_channels != 4 * LATENT_CHANNELS:
            raise ModelLoadError(f"{folder}: the LongCat pipelines take 16 latent channels (transformer "
                                 f"in_channels 64), got in_channels {self.transformer.config.in_channels}")
        self.latent_channels = LATENT_CHANNELS

    # ---- 1. encode prompt ------------------------------------------------------------------
    def _prompt_tokens(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(512,) token ids and attention mask: quoted text char by char, cut, padded."""
        tokens: list[int] = []
        for piece, quoted in quote_pieces(text):
            for part in (piece if quoted else [piece]):
                tokens += self.tokenizer(part, add_special_tokens=False)["input_ids"]
        padded = self.tokenizer.pad({"input_ids": [tokens[:TOKENIZER_MAX]]}, max_length=TOKENIZER_MAX,
                                    padding="max_length", return_attention_mask=True, return_tensors="pt")
        return padded.input_ids[0], padded.attention_mask[0]

    def _embed(self, text: str, prefix: str | None = None, vision: dict | None = None) -> torch.Tensor:
        """(T, D): last hidden states of prefix + prompt tokens + suffix over the prompt's 512
        positions (and, for edits, the vision tokens from <|vision_start|> on)."""
        ids, mask = self._prompt_tokens(text)
        prefix_ids = self.tokenizer(prefix or self.prefix, add_special_tokens=False)["input_ids"]
        suffix_ids = self.tokenizer(SUFFIX, add_special_tokens=False)["input_ids"]
        start = prefix_ids.index(self.tokenizer.convert_tokens_to_ids(VISION_START)) if vision else len(prefix_ids)
        ids = torch.cat([torch.tensor(prefix_ids, dtype=ids.dtype), ids, torch.tensor(suffix_ids, dtype=ids.dtype)])
        mask = torch.cat([mask.new_ones(len(prefix_ids)), mask, mask.new_ones(len(suffix_ids))])
        # the decoder's last hidden state (= the pipeline's hidden_states[-1]; no lm_head needed)
        out = self.text_encoder.model(input_ids=ids[None].to(self.device), attention_mask=mask[None].to(self.device),
                                      **(vision or {}))
        return out.last_hidden_state[0, start:-len(suffix_ids)]

    def encode(self, request: DiffusionRequest) -> PackedCond:
        p = request.params
        cfg = p.guidance_scale > 1                    # the pipeline's rule; negative "" by default
        embeds = self._embed(request.prompt)
        neg = self._embed(p.negative_prompt or "") if cfg else None
        grid = (p.height // self.multiple, p.width // self.multiple)
        t = embeds.shape[0]
        return PackedCond(embeds, neg, p.guidance_scale, grid, text_ids(t).to(self.device),
                          image_ids(1, t, *grid).to(self.device), renorm=self.renorm)

    # ---- 2. prepare latents ----------------------------------------------------------------
    def initial_noise(self, p: DiffusionParams, shape: tuple[int, ...]) -> torch.Tensor:
        # the text-to-image pipeline draws float32 noise, then casts it
        return seeded_noise(shape, p.seed, self.device, torch.float32).to(self.dtype)

    # ---- 3. guidance ------------------------------------------------------------------------
    def guide(self, pos: torch.Tensor, neg: torch.Tensor, cond: PackedCond) -> torch.Tensor:
        comb = neg + cond.scale * (pos - neg)
        if not cond.renorm:
            return comb
        scale = torch.norm(pos, dim=-1, keepdim=True) / (torch.norm(comb, dim=-1, keepdim=True) + 1e-8)
        return comb * scale.clamp(min=RENORM_MIN, max=1.0)


class LongCatImageEditFamily(LongCatImageFamily):
    """LongCatImageEditPipeline: exactly one input image; the output takes its aspect ratio."""

    name = "longcat_image_edit"
    prefix = EDIT_PREFIX
    renorm = False

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        super().__init__(folder, device, dtype)
        self.text_processor = load_component(folder, "text_processor", dtype, device)
        if self.text_processor is None or getattr(self.text_processor, "image_processor", None) is None:
            raise ModelLoadError(f"{folder}: the edit pipeline needs a 'text_processor' component with a "
                                 "Qwen2-VL image processor (it shows the input image to the text encoder)")
        from diffusers.image_processor import VaeImageProcessor

        # the pipeline's own resize/normalise (PIL lanczos, [-1, 1]), for bit-equal inputs
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.multiple)
        self.latent_cache = LatentCache()

    # ---- 0. request defaults ---------------------------------------------------------------
    def resolve(self, params: DiffusionParams, prompt) -> DiffusionParams:
        if len(prompt.images) != 1:
            raise InvalidRequestError(f"this edit model takes exactly one input image (the prompt's 'image'), "
                                      f"got {len(prompt.images)}", param="image")
        if prompt.mask is not None:
            raise InvalidRequestError("this edit model takes no mask (inpainting is not supported); leave "
                                      "'mask' out: the instruction edits the whole image", param="mask")
        self._check_common(params)
        source = prompt.images[0]
        width, height = edit_size(source.shape[1], source.shape[0])
        if (params.height or height, params.width or width) != (height, width):
            raise InvalidRequestError(f"this edit model's output size follows the input image ({width}x{height} "
                                      "for this one); leave height and width out", param="size")
        return self._with_defaults(params, height=height, width=width)

    # ---- 1. encode prompt and image ----------------------------------------------------------
    def encode(self, request: DiffusionRequest) -> PackedCond:
        p, array = request.params, request.images[0]
        size = (p.height, p.width)                     # resolve set them from the image
        image = self.image_processor.resize(Image.fromarray(array), *size)
        prompt_image = self.image_processor.resize(image, p.height // 2, p.width // 2)
        vision = self._vision_inputs(prompt_image)
        prefix = self._vision_prefix(vision["image_grid_thw"])
        cfg = p.guidance_scale > 1
        embeds = self._embed(request.prompt, prefix, vision)
        neg = self._embed(p.negative_prompt or "", prefix, vision) if cfg else None
        latents = self.latent_cache.get(LatentCache.key(array, size), lambda: self._encode_image(image, size))
        grid = (p.height // self.multiple, p.width // self.multiple)
        t = embeds.shape[0]
        img_ids = torch.cat([image_ids(1, t, *grid), image_ids(2, t, *grid)]).to(self.device)
        return PackedCond(embeds, neg, p.guidance_scale, grid, text_ids(t).to(self.device), img_ids,
                          image_latents=latents, renorm=False)

    def _vision_inputs(self, image: Image.Image) -> dict:
        raw = self.text_processor.image_processor(images=image, return_tensors="pt")
        return {"pixel_values": raw["pixel_values"].to(self.device, self.dtype),
                "image_grid_thw": raw["image_grid_thw"].to(self.device)}

    def _vision_prefix(self, grid_thw: torch.Tensor) -> str:
        """The template with one <|image_pad|> per merged vision token."""
        count = int(grid_thw.prod()) // self.text_processor.image_processor.merge_size ** 2
        return EDIT_PREFIX.replace(IMAGE_PAD, IMAGE_PAD * count)

    def _encode_image(self, image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
        """-> (1, H/16 * W/16, 4C): VAE latents (mode) of the image at size = (H, W), Flux-normalised, packed."""
        x = self.image_processor.preprocess(image, *size).to(self.device, self.dtype)   # (1, 3, H, W) in [-1, 1]
        lat = self.vae.encode(x).latent_dist.mode()                                      # (1, C, H/8, W/8)
        cfg = self.vae.config
        return pack((lat - cfg.shift_factor) * cfg.scaling_factor)

    # ---- 2. prepare latents ----------------------------------------------------------------
    def initial_noise(self, p: DiffusionParams, shape: tuple[int, ...]) -> torch.Tensor:
        # the edit pipeline draws the noise in the model dtype directly
        return seeded_noise(shape, p.seed, self.device, self.dtype)
