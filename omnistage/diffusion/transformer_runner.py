"""The Qwen-Image transformer's forward, run from its own submodules so that a batch can be
split mid-stack: every row runs the first block, then only the rows whose job's step cache
says "compute" run the rest (see omnistage/diffusion/cache.py). With no cache it is the
plain forward of QwenImageTransformer2DModel (the parity tests hold it to diffusers).

Variants it runs: the plain rope (Qwen-Image, the edits) and Qwen-Image-Layered's: its layer-3D
rope is the transformer's own `pos_embed` module, which takes the same per-row `img_shapes`
(output layers, then the condition image last), and its additional timestep condition
(`use_additional_t_cond`: an embedding of a per-row class id added to the timestep embedding)
comes in as `t_cond`. `zero_cond_t` (a second modulation for the condition-image tokens,
Qwen-Image-Edit-2511) is refused.
"""

from __future__ import annotations

import torch

from omnistage.diffusion.cache import cached_stack
from omnistage.diffusion.family import DenoiseJob


class QwenImageRunner:
    def __init__(self, transformer):
        self.tr = transformer
        cfg = transformer.config
        if getattr(cfg, "zero_cond_t", False):
            from omnistage.errors import ModelLoadError

            raise ModelLoadError("Qwen-Image transformers with zero_cond_t are not supported yet")
        # Layered: temb = time embedding + addition_t_embedding(t_cond)
        self.needs_t_cond = bool(getattr(cfg, "use_additional_t_cond", False))

    def __call__(self, x: torch.Tensor, txt: torch.Tensor, mask: torch.Tensor | None,
                 t: torch.Tensor, img_shapes: list, jobs: list[DenoiseJob], owners: list[int],
                 t_cond: torch.Tensor | None = None) -> torch.Tensor:
        """x (R, L, C_in), txt (R, T, D_txt), mask (R, T) bool | None, t (R,) in [0, 1];
        owners[r] = index into jobs of row r; t_cond (R,) long, required exactly when the
        transformer has use_additional_t_cond (Layered: 0 for every row, its RGBA input).
        -> (R, L, C_out)."""
        tr = self.tr
        if (t_cond is not None) != self.needs_t_cond:
            raise ValueError("t_cond must be given exactly when the transformer has use_additional_t_cond "
                             f"(it has {self.needs_t_cond})")
        h = tr.img_in(x)                                                   # (R, L, D)
        if t_cond is None:
            temb = tr.time_text_embed(t.to(h.dtype), h)                    # (R, D)
        else:
            temb = tr.time_text_embed(t.to(h.dtype), h, t_cond)            # (R, D)
        e = tr.txt_in(tr.txt_norm(txt))                                    # (R, T, D)
        rope = tr.pos_embed(img_shapes, max_txt_seq_len=e.shape[1], device=h.device)
        blocks = tr.transformer_blocks
        if all(job.cache is None for job in jobs):
            for blk in blocks:
                e, h = blk(hidden_states=h, encoder_hidden_states=e, encoder_hidden_states_mask=mask,
                           temb=temb, image_rotary_emb=rope)
            return tr.proj_out(tr.norm_out(h, temb))
        return self._cached(h, e, mask, temb, rope, jobs, owners)

    def _cached(self, h, e, mask, temb, rope, jobs, owners) -> torch.Tensor:
        tr, blocks = self.tr, self.tr.transformer_blocks
        first = blocks[0]
        h0 = h
        e, h = first(hidden_states=h, encoder_hidden_states=e, encoder_hidden_states_mask=mask,
                     temb=temb, image_rotary_emb=rope)

        def teacache_signal(r: int) -> torch.Tensor:      # the first block's modulated input
            shift, scale, _ = first.img_mod(temb[r:r + 1]).chunk(6, dim=-1)[0:3]
            return first.img_norm1(h0[r:r + 1]) * (1 + scale[:, None]) + shift[:, None]

        def run_rest(idx: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
            es, ms, ts = e[idx], (None if mask is None else mask[idx]), temb[idx]
            for blk in blocks[1:]:
                es, hs = blk(hidden_states=hs, encoder_hidden_states=es, encoder_hidden_states_mask=ms,
                             temb=ts, image_rotary_emb=rope)
            return hs

        h = cached_stack(h0, h, jobs, owners, teacache_signal, run_rest)
        return tr.proj_out(tr.norm_out(h, temb))
