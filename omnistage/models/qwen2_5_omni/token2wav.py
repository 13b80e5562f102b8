"""Qwen2.5-Omni token2wav: codec codes -> 24 kHz waveform, by flow matching (a DiT integrated
with RK4 from noise at t=0 to mel at t=1, classifier-free guidance) then BigVGAN.

`Token2Wav.decode_batch` decodes whole utterances: requests of different lengths share each DiT
pass, with their conditional and unconditional rows. Streaming is in token2wav_stream.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from omnistage.errors import InvalidRequestError
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN
from omnistage.models.qwen2_5_omni.token2wav_dit import BatchLayout, DiTModel, SpeakerTerms

# Guidance below this is treated as off (no unconditional row), as the reference does.
MIN_GUIDANCE = 1e-5


@dataclass
class Token2WavRequest:
    """One utterance to decode."""
    codes: torch.Tensor                          # (T,) codec ids in [0, num_embeds]
    cond: torch.Tensor                           # (1, enc_emb_dim) speaker vector
    ref_mel: torch.Tensor                        # (1, R, mel_dim) speaker's reference mel
    noise: torch.Tensor | torch.Generator        # (1, T*repeats, mel_dim) ODE start, or its source
    guidance_scale: float = 0.5


@dataclass
class DiTJob:
    """One row group of a batched ODE solve: a whole utterance or one stream window."""
    codes: torch.Tensor          # (T,) long, on the model's device
    noise: torch.Tensor          # (T*repeats, mel_dim) initial state
    speaker: SpeakerTerms
    guidance_scale: float
    frame_offset: int = 0        # absolute frame of the first frame; a multiple of block_size


class NoiseSource:
    """Initial-state frames by absolute index: slices of a caller's tensor, or drawn from a
    generator one DiT block at a time (so a frame's noise is the same whether the utterance is
    decoded whole or in stream windows), keeping only blocks from `release()`'s frame on."""

    def __init__(self, noise: torch.Tensor | torch.Generator, mel_dim: int, block: int,
                 device: torch.device, dtype: torch.dtype):
        self.mel_dim, self.block, self.device, self.dtype = mel_dim, block, device, dtype
        self.generator = noise if isinstance(noise, torch.Generator) else None
        if self.generator is None and not (isinstance(noise, torch.Tensor) and noise.dim() == 3
                                           and noise.shape[0] == 1 and noise.shape[2] == mel_dim):
            raise InvalidRequestError(f"noise must be a torch.Generator or a tensor (1, frames, {mel_dim})",
                                      param="noise")
        self.tensor = None if self.generator is not None else noise[0].to(device, dtype)
        self.blocks: list[torch.Tensor] = []    # drawn blocks, the first one is block `first`
        self.first = 0

    def frames(self, start: int, end: int) -> torch.Tensor:
        """(end - start, mel_dim)."""
        if self.tensor is not None:
            if end > self.tensor.shape[0]:
                raise InvalidRequestError(f"noise has {self.tensor.shape[0]} frames but {end} are needed "
                                          f"(codes x repeats); pass a longer noise tensor", param="noise")
            return self.tensor[start:end]
        while (self.first + len(self.blocks)) * self.block < end:
            self.blocks.append(torch.randn(self.block, self.mel_dim, generator=self.generator,
                                           device=self.generator.device).to(self.device, self.dtype))
        base = self.first * self.block
        return torch.cat(self.blocks)[start - base:end - base]

    def release(self, before: int) -> None:
        """Forget generator blocks that end at or before frame `before`."""
        drop = min(before // self.block - self.first, len(self.blocks))
        if drop > 0:
            self.blocks = self.blocks[drop:]
            self.first += drop


def time_grid(steps: int, sway: float | None, device: torch.device) -> torch.Tensor:
    """steps points from 0 to 1, bent towards t=0 by sway sampling (sway < 0)."""
    t = torch.linspace(0, 1, steps, device=device, dtype=torch.float32)
    if sway is not None:
        t = t + sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


@torch.no_grad()
def solve(dit: DiTModel, jobs: list[DiTJob], steps: int, sway: float | None) -> list[torch.Tensor]:
    """Integrate every job's ODE together; returns each job's mel (frames, mel_dim)."""
    ode = OdeSolve(dit, jobs, steps, sway)
    ode.advance()
    return ode.result()


class OdeSolve:
    """A batched ODE solve that can stop between RK4 intervals and go on later (the vocoder
    stage advances long solves a few intervals per step, so that other work runs in between).

    Rows: one conditional row per job, then one unconditional row per job with guidance. Each
    DiT evaluation is one forward over all rows (padded to a multiple of block_size frames).
    Whatever the pieces, the arithmetic is that of one uninterrupted solve."""

    @torch.no_grad()
    def __init__(self, dit: DiTModel, jobs: list[DiTJob], steps: int, sway: float | None):
        dev, bs, n = jobs[0].noise.device, dit.block_size, len(jobs)
        self.dit, self.n = dit, n
        self.lengths = lengths = [j.noise.shape[0] for j in jobs]
        frames = math.ceil(max(lengths) / bs) * bs
        cfg = [i for i, j in enumerate(jobs) if j.guidance_scale >= MIN_GUIDANCE]
        rows = list(range(n)) + cfg
        layout = BatchLayout([lengths[i] for i in rows], [jobs[i].frame_offset for i in rows], frames)

        self.x = torch.zeros(n, frames, dit.mel_dim, device=dev, dtype=jobs[0].noise.dtype)  # (N, T, mel)
        self.static = torch.zeros(len(rows), frames, dit.config.hidden_size, device=dev, dtype=self.x.dtype)
        for i, job in enumerate(jobs):
            self.x[i, :lengths[i]] = job.noise
            self.static[i, :lengths[i]] = dit.code_terms(job.codes) + job.speaker.cond
        for r, i in enumerate(cfg, start=n):
            self.static[r, :lengths[i]] = jobs[i].speaker.uncond
        valid = (torch.arange(frames, device=dev) < torch.tensor(lengths, device=dev).view(-1, 1))
        self.valid = valid.unsqueeze(-1).to(self.x.dtype)      # padding frames stay 0 (finite) forever
        self.cfg = cfg
        self.cfg_idx = torch.tensor(cfg, device=dev, dtype=torch.long)
        self.scale = torch.tensor([jobs[i].guidance_scale for i in cfg], device=dev,
                                  dtype=self.x.dtype).view(-1, 1, 1)
        self.rope, self.windows = dit.rope_angles(layout, dev), dit.windows_for(layout, dev)
        self.all_cfg = len(cfg) == n
        self.grid = time_grid(steps, sway, dev)
        self.interval = 0                       # RK4 intervals done (of len(grid) - 1)

    @property
    def done(self) -> bool:
        return self.interval >= len(self.grid) - 1

    def _velocity(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, cfg = self.n, self.cfg
        xr = torch.cat([x, x if self.all_cfg else x[self.cfg_idx]]) if cfg else x
        out = self.dit(xr, self.static, t, self.rope, self.windows)
        v = out[:n]
        if self.all_cfg:
            v = v + (v - out[n:]) * self.scale
        elif cfg:
            v = v.index_copy(0, self.cfg_idx, v[self.cfg_idx] + (v[self.cfg_idx] - out[n:]) * self.scale)
        return v * self.valid

    @torch.no_grad()
    def advance(self, intervals: int | None = None) -> bool:
        """Run up to `intervals` more RK4 intervals (None: to the end); True once done."""
        third, x, grid = 1 / 3, self.x, self.grid
        end = len(grid) - 1 if intervals is None else min(len(grid) - 1, self.interval + intervals)
        for i in range(self.interval, end):          # RK4, 3/8 rule
            t0, t1 = grid[i], grid[i + 1]
            dt = t1 - t0
            k1 = self._velocity(t0, x)
            k2 = self._velocity(t0 + dt * third, x + dt * k1 * third)
            k3 = self._velocity(t0 + dt * (2 / 3), x + dt * (k2 - k1 * third))
            k4 = self._velocity(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        self.x, self.interval = x, max(self.interval, end)
        return self.done

    def result(self) -> list[torch.Tensor]:
        """Each job's mel (frames, mel_dim); only once done."""
        if not self.done:
            raise RuntimeError("the ODE solve has not reached t=1 yet")
        return [self.x[i, :self.lengths[i]] for i in range(self.n)]


class Token2Wav(nn.Module):
    """Built from `Qwen2_5OmniToken2WavConfig`; runs in float32 only (as the reference requires)."""

    def __init__(self, config, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if dtype != torch.float32:
            raise ValueError(f"token2wav runs in float32 (the reference's requirement); got {dtype}")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.code2wav_dit_model = DiTModel(config.dit_config, dtype, self.device)
        self.code2wav_bigvgan_model = BigVGAN(config.bigvgan_config, dtype, self.device)

    @property
    def dit(self) -> DiTModel:
        return self.code2wav_dit_model

    @property
    def vocoder(self) -> BigVGAN:
        return self.code2wav_bigvgan_model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     prefix: str = "token2wav.") -> set[str]:
        """Fill every parameter from checkpoint tensors named `prefix + our name`. Derived tensors
        some checkpoints carry (rotary inv_freq, resampling FIR filters) are recomputed, not read."""
        derived = (".rotary_embed.inv_freq", ".filter")
        kept = ((k, w) for k, w in weights if not k.endswith(derived))
        self.dit._time_cache.clear()     # time terms of the old weights
        loaded = load_prefixed(self, kept, prefix)
        require_complete(self, loaded, "token2wav")
        return loaded

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor,
               noise: torch.Tensor | torch.Generator, steps: int = 10, guidance_scale: float = 0.5,
               sway: float | None = -1.0) -> torch.Tensor:
        """codes (T,) -> waveform (T * repeats * hop,) float32 on the model's device."""
        return self.decode_batch([Token2WavRequest(codes, cond, ref_mel, noise, guidance_scale)],
                                 steps, sway)[0]

    @torch.no_grad()
    def decode_batch(self, requests: list[Token2WavRequest], steps: int = 10,
                     sway: float | None = -1.0) -> list[torch.Tensor]:
        mels = self.mel_batch(requests, steps, sway)
        # Vocoded one by one: a padded batch would change the samples near each utterance's end.
        return [self.vocoder(mel.T.unsqueeze(0))[0] for mel in mels]

    @torch.no_grad()
    def mel_batch(self, requests: list[Token2WavRequest], steps: int = 10,
                  sway: float | None = -1.0) -> list[torch.Tensor]:
        """Each request's mel (frames, mel_dim): ln-amplitudes, as BigVGAN takes them."""
        jobs = []
        for req in requests:
            codes = self.check_codes(req.codes, whole=True)
            speaker = self.speaker_terms(req.cond, req.ref_mel)
            noise = NoiseSource(req.noise, self.dit.mel_dim, self.dit.block_size, self.device, self.dtype)
            jobs.append(DiTJob(codes, noise.frames(0, codes.numel() * self.dit.repeats), speaker,
                               check_settings(steps, sway, req.guidance_scale)))
        return solve(self.dit, jobs, steps, sway) if jobs else []

    def check_codes(self, codes, whole: bool = False) -> torch.Tensor:
        """-> (T,) long on the device. whole: a whole utterance (non-empty, within the DiT's length)."""
        codes, c = torch.as_tensor(codes), self.config.dit_config
        codes = codes.reshape(1) if codes.dim() == 0 else codes
        if codes.dim() != 1 or codes.is_floating_point() or codes.is_complex():
            raise InvalidRequestError(f"codes must be a 1-D integer sequence; got shape "
                                      f"{tuple(codes.shape)} of {codes.dtype}", param="codes")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > c.num_embeds):
            raise InvalidRequestError(f"codec ids must be in [0, {c.num_embeds}]", param="codes")
        if whole and codes.numel() == 0:
            raise InvalidRequestError("codes is empty; send at least one codec id", param="codes")
        self.check_frames(codes.numel() * c.repeats if whole else 0)
        return codes.to(self.device, torch.long)

    @torch.no_grad()
    def speaker_terms(self, cond: torch.Tensor, ref_mel: torch.Tensor) -> SpeakerTerms:
        c = self.config.dit_config
        if not isinstance(cond, torch.Tensor) or tuple(cond.shape) != (1, c.enc_emb_dim):
            raise InvalidRequestError(f"cond (the speaker vector) must have shape (1, {c.enc_emb_dim})",
                                      param="cond")
        min_ref = max((k - 1) * d // 2 for k, d in zip(c.enc_kernel_sizes, c.enc_dilations)) + 1
        if (not isinstance(ref_mel, torch.Tensor) or ref_mel.dim() != 3 or ref_mel.shape[0] != 1
                or ref_mel.shape[2] != c.mel_dim or ref_mel.shape[1] < min_ref):
            raise InvalidRequestError(f"ref_mel must have shape (1, R, {c.mel_dim}) with R >= {min_ref}",
                                      param="ref_mel")
        return self.dit.speaker_terms(cond.to(self.device, self.dtype), ref_mel.to(self.device, self.dtype))

    def check_frames(self, frames: int) -> None:
        limit = self.config.dit_config.max_position_embeddings
        if frames > limit:
            raise InvalidRequestError(f"{frames} mel frames exceed the DiT's {limit}; send fewer codes",
                                      param="codes")


def check_settings(steps: int, sway: float | None, guidance_scale: float = 0.0) -> float:
    """Validates the ODE settings; returns guidance_scale as a float."""
    if not isinstance(steps, int) or steps < 2:
        raise InvalidRequestError("steps must be an integer >= 2 (time points from 0 to 1)", param="steps")
    if sway is not None and not math.isfinite(sway):
        raise InvalidRequestError("sway must be a finite number or None", param="sway")
    if not math.isfinite(guidance_scale) or guidance_scale < 0:
        raise InvalidRequestError("guidance_scale must be a finite number >= 0", param="guidance_scale")
    return float(guidance_scale)
