"""DiffusionStage: denoising steps batched across requests.

Each `step()`:
  1. admits up to `admit_per_step` new requests (encode prompt, draw noise, set schedule);
  2. picks the compatible group (equal job `key`: same latent shape and model expert) whose
     oldest job has waited longest, up to `max_batch` jobs, and runs ONE transformer forward for
     it (classifier-free guidance's two halves ride in the same batch);
  3. steps each job's own scheduler (then the family's optional `after_step(job)`, e.g. an
     inpainting blend), decodes the previews that are due (`partial_images`), reports progress,
     and decodes the jobs that finished.
New requests therefore join between steps, and requests of other sizes take turns.

A preview (partial image) is the job's prediction of its final latents, decoded: after a step
to sigma s with velocity v, x0 ~ x_s - s * v (the flow-matching schedulers of the image
families; video models take no partial images). It costs one VAE decode, and nothing for a
request that asks for none.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from omnistage.diffusion.family import DenoiseJob, DiffusionFamily
from omnistage.diffusion.messages import (DiffusionPreview, DiffusionProgress, DiffusionRequest,
                                          DiffusionResult)
from omnistage.diffusion.params import preview_steps
from omnistage.errors import InvalidRequestError
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.base import Stage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiffusionStageSettings:
    max_batch: int = 8          # jobs per transformer forward (x2 rows with CFG)
    admit_per_step: int = 2     # new requests encoded per step (bounds the stall of running ones)
    vae_tiling_pixels: int = 2048 * 2048   # outputs larger than this decode tiled (bounded memory)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.admit_per_step < 1:
            raise ValueError("max_batch and admit_per_step must be >= 1")


@dataclass
class _Running:
    request: DiffusionRequest
    jobs: list[DenoiseJob]
    outputs: dict[int, object]     # sample index -> decoded pixels
    reported: int = -1             # last progress step sent
    preview_at: tuple[int, ...] = ()   # steps after which each sample's preview is decoded


class DiffusionStage(Stage):
    def __init__(self, name: str, family: DiffusionFamily,
                 settings: DiffusionStageSettings = DiffusionStageSettings()):
        self.name, self.family, self.settings = name, family, settings
        self.dead: str | None = None
        self._pending: OrderedDict[str, DiffusionRequest] = OrderedDict()
        self._running: OrderedDict[str, _Running] = OrderedDict()
        self._waited: dict[int, int] = {}   # id(job) -> the step counter when it last ran
        self._clock = 0
        self.last_batch_jobs = 0
        self.cache_hits = 0          # job-steps served by a step cache (all time)
        # seconds spent per phase (all time): where the stage's time goes
        self.timings = {"encode": 0.0, "denoise": 0.0, "decode": 0.0}

    # ---- Stage protocol ------------------------------------------------------------------
    def add(self, message: DiffusionRequest) -> None:
        self._pending[message.request_id] = message

    def abort(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        run = self._running.pop(request_id, None)
        if run is not None:
            for job in run.jobs:
                self._waited.pop(id(job), None)

    def has_work(self) -> bool:
        return bool(self._pending or self._running)

    def num_requests(self) -> int:
        return len(self._pending.keys() | self._running.keys())

    def num_jobs(self) -> int:
        """Samples being denoised (the tests count them after abort)."""
        return sum(len(r.jobs) for r in self._running.values())

    def close(self) -> None:
        pass

    def metrics(self) -> list[tuple[str, str, str, float]]:
        label = f'stage="{self.name}"'
        out = [(f"omnistage_diffusion_jobs{{{label}}}", "gauge", "samples being denoised", self.num_jobs()),
               (f"omnistage_diffusion_cache_skipped_steps_total{{{label}}}", "counter",
                "job-steps served by a step cache", self.cache_hits)]
        for phase, seconds in self.timings.items():
            out.append((f'omnistage_diffusion_seconds_total{{{label},phase="{phase}"}}', "counter",
                        "seconds spent encoding prompts, denoising and decoding", seconds))
        return out

    @torch.inference_mode()
    def step(self) -> list[StageOutput]:
        self._clock += 1
        outs: list[StageOutput] = []
        for rid in list(self._pending)[: self.settings.admit_per_step]:
            # left in _pending until admitted: other threads reading num_requests() (metrics)
            # never see the request missing while its prompt is being encoded
            outs += self._admit(self._pending[rid])
            self._pending.pop(rid, None)
        batch = self._pick()
        self.last_batch_jobs = len(batch)
        if batch:
            rids = {j.request_id for j in batch}
            try:
                outs += self._denoise(batch)
                outs += self._progress_and_finish(rids)
            except Exception as e:      # an internal fault fails the requests it touched, only
                outs += self._fail(rids, e)
        return outs

    def _denoise(self, batch: list[DenoiseJob]) -> list[StageOutput]:
        """One batched step of `batch`; -> the previews it made due."""
        t0 = time.perf_counter()
        preds = self.family.predict(batch)
        due = []
        for job, pred in zip(batch, preds):
            job.latents = job.scheduler.step(pred, job.t, job.latents, return_dict=False)[0]
            self.family.after_step(job)
            job.step += 1
            self._waited[id(job)] = self._clock
            if job.step in self._running[job.request_id].preview_at:
                due.append((job, pred))
        self.timings["denoise"] += time.perf_counter() - t0
        return [self._preview(job, pred) for job, pred in due]

    def _preview(self, job: DenoiseJob, pred: torch.Tensor) -> StageOutput:
        t0 = time.perf_counter()
        sigma = job.scheduler.sigmas[job.scheduler.step_index]     # where the step landed
        pixels = self.family.decode(replace(job, latents=job.latents - sigma * pred))
        self.timings["decode"] += time.perf_counter() - t0
        order = self._running[job.request_id].preview_at.index(job.step)
        return StageOutput(self.name, job.request_id,
                           DiffusionPreview(job.request_id, job.index, order, job.step, pixels))

    def _fail(self, rids: set[str], error: Exception) -> list[StageOutput]:
        log.exception("diffusion stage: requests %s failed", sorted(rids))
        outs = []
        for rid in sorted(rids):
            self.abort(rid)
            msg = f"internal error while generating: {type(error).__name__}: {error}"
            outs.append(StageOutput(self.name, rid, StageFailure(rid, msg), True))
        return outs

    # ---- internals -----------------------------------------------------------------------
    def _admit(self, req: DiffusionRequest) -> list[StageOutput]:
        t0 = time.perf_counter()
        try:
            self._set_tiling(req)          # input images are VAE-encoded here: same rule as decode
            cond = self.family.encode(req)
            jobs = self.family.prepare(req, cond)
        except InvalidRequestError as e:     # the family refused the input: the client's to fix
            return [StageOutput(self.name, req.request_id, StageFailure.refused(req.request_id, e), True)]
        except Exception as e:
            return self._fail({req.request_id}, e)
        finally:
            self.timings["encode"] += time.perf_counter() - t0
        for job in jobs:
            self._waited[id(job)] = self._clock
        previews = preview_steps(jobs[0].num_steps, req.params.partial_images) if jobs else ()
        self._running[req.request_id] = _Running(req, jobs, {}, preview_at=previews)
        return self._progress_and_finish({req.request_id})   # 0-step requests finish here

    def _set_tiling(self, req: DiffusionRequest) -> None:
        """Tiled VAE decode (diffusers' own) for large outputs only: below the threshold the
        decode is whole, exactly as the pipelines decode by default."""
        vae = getattr(self.family, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            return
        p = req.params
        if (p.height or 0) * (p.width or 0) > self.settings.vae_tiling_pixels:
            vae.enable_tiling()
        else:
            vae.disable_tiling()

    def _pick(self) -> list[DenoiseJob]:
        jobs = [j for r in self._running.values() for j in r.jobs if not j.done]
        if not jobs:
            return []
        oldest = min(jobs, key=lambda j: self._waited[id(j)])
        group = [j for j in jobs if j.key == oldest.key]
        group.sort(key=lambda j: self._waited[id(j)])
        return group[: self.settings.max_batch]

    def _progress_and_finish(self, rids: set[str]) -> list[StageOutput]:
        outs: list[StageOutput] = []
        for rid in rids:
            run = self._running.get(rid)
            if run is None:
                continue
            for job in run.jobs:
                if job.done and job.index not in run.outputs:
                    t0 = time.perf_counter()
                    self._set_tiling(run.request)
                    run.outputs[job.index] = self.family.decode(job)
                    self.timings["decode"] += time.perf_counter() - t0
                    self._waited.pop(id(job), None)
                    self.cache_hits += job.cache.hits if job.cache is not None else 0
            if len(run.outputs) == len(run.jobs):
                del self._running[rid]
                images = [run.outputs[i] for i in sorted(run.outputs)]
                outs.append(StageOutput(self.name, rid, DiffusionResult(rid, images, run.request.params.seed), True))
                continue
            done = min(j.step for j in run.jobs)
            if done != run.reported:
                run.reported = done
                total = run.jobs[0].num_steps
                outs.append(StageOutput(self.name, rid, DiffusionProgress(rid, done, total)))
        return outs
