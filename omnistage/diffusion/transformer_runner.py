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
        rows_of = [[r for r, o in enumerate(owners) if o == j] for j in range(len(jobs))]
        run: list[int] = []
        for j, job in enumerate(jobs):
            c, rows = job.cache, rows_of[j]
            if c is None:
                run += rows
                continue
            r0 = rows[0]   # the job's conditional row decides for all its rows
            if c.kind == "teacache":
                shift, scale, _ = first.img_mod(temb[r0:r0 + 1]).chunk(6, dim=-1)[0:3]
                signal = first.img_norm1(h0[r0:r0 + 1]) * (1 + scale[:, None]) + shift[:, None]
            else:
                signal = h[r0:r0 + 1] - h0[r0:r0 + 1]
            if c.skip(job.step, signal):
                h[rows] = h[rows] + c.residual
            else:
                run += rows
        if run:
            idx = torch.tensor(run, device=h.device)
            hs, es = h[idx], e[idx]
            ms, ts = (None if mask is None else mask[idx]), temb[idx]
            start = hs
            for blk in blocks[1:]:
                es, hs = blk(hidden_states=hs, encoder_hidden_states=es, encoder_hidden_states_mask=ms,
                             temb=ts, image_rotary_emb=rope)
            h[idx] = hs
            at = {r: i for i, r in enumerate(run)}
            for j, job in enumerate(jobs):
                if job.cache is not None and rows_of[j][0] in at:
                    sel = [at[r] for r in rows_of[j]]
                    job.cache.residual = hs[sel] - start[sel]
        return tr.proj_out(tr.norm_out(h, temb))
