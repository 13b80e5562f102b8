"""The diffusion stage's serving loop: requests join between steps, progress, abort frees
everything, the step cache is per request."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import Omni
from omnistage.diffusion.cache import StepCache
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError


@pytest.fixture(scope="module")
def omni():
    with Omni(str(tiny_checkpoint("qwen_image"))) as o:
        yield o


def stage_of(omni):
    return omni.engine.graph.stages["diffusion"]


def submit(omni, rid, prompt, **kw):
    eng = omni.engine
    eng.add_request(rid, eng.prepare(prompt), DiffusionParams(height=32, width=32, **kw))


def drain(engine):
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return deltas


def test_requests_join_between_steps_and_report_progress(omni):
    eng, stage = omni.engine, stage_of(omni)
    submit(omni, "a", "a cat", num_inference_steps=6, seed=1)
    eng.step()                         # admits a (and steps it)
    eng.step()
    submit(omni, "b", "a dog", num_inference_steps=3, seed=2)
    batches = []
    deltas = []
    while eng.has_unfinished_requests():
        deltas += eng.step()
        batches.append(stage.last_batch_jobs)
    assert 2 in batches                # b joined a's batch mid-run
    prog = {rid: [d.progress for d in deltas if d.request_id == rid and d.progress] for rid in "ab"}
    assert prog["b"][-1] == (2, 3)     # the last progress before the result
    assert [s for s, _ in prog["b"]] == sorted(s for s, _ in prog["b"])
    done = {d.request_id: d for d in deltas if d.finished}
    assert set(done) == {"a", "b"} and done["a"].images[0].shape == (32, 32, 3)
    # joining mid-run changed nothing: b equals b alone
    alone = omni.generate("a dog", DiffusionParams(height=32, width=32, num_inference_steps=3, seed=2))[0]
    assert np.abs(alone.pixels[0] - done["b"].images[0]).max() <= 1e-5


def test_abort_frees_jobs(omni):
    eng, stage = omni.engine, stage_of(omni)
    submit(omni, "x", "a cat", num_inference_steps=20, seed=3, n=2)
    submit(omni, "y", "a cat", num_inference_steps=20, seed=4)
    eng.step()
    eng.step()
    assert stage.num_jobs() == 3
    eng.abort_request("x")
    assert stage.num_jobs() == 1
    eng.abort_request("y")
    assert stage.num_jobs() == 0 and stage.num_requests() == 0 and not eng.requests
    submit(omni, "z", "queued only", num_inference_steps=2, seed=5)
    eng.abort_request("z")             # aborted before it was admitted
    assert stage.num_requests() == 0 and not eng.has_unfinished_requests()


def test_stream_break_aborts(omni):
    stage = stage_of(omni)
    for d in omni.stream("a cat", DiffusionParams(height=32, width=32, num_inference_steps=10, seed=1)):
        if d.progress and d.progress[0] >= 2:
            break
    assert stage.num_jobs() == 0 and not omni.engine.requests


def test_step_cache_is_per_request(omni):
    base = dict(height=32, width=32, num_inference_steps=8, seed=11)
    plain = omni.generate("a cat", DiffusionParams(**base))[0].pixels[0]
    # threshold 0 never skips: identical to no cache
    for kind in ("teacache", "fbcache"):
        same = omni.generate("a cat", DiffusionParams(**base, cache=kind, cache_threshold=0.0))[0].pixels[0]
        assert np.abs(same - plain).max() <= 1e-5
    # a huge threshold skips every middle step; batched with an uncached request, which stays exact
    stage = stage_of(omni)
    cached, other = omni.generate(["a cat", "a cat"], [
        DiffusionParams(**base, cache="fbcache", cache_threshold=10.0),
        DiffusionParams(**base)])
    assert np.abs(other.pixels[0] - plain).max() <= 1e-5
    assert np.abs(cached.pixels[0] - plain).max() > 1e-4     # the cache did skip work
    assert stage.num_jobs() == 0


def test_step_cache_state_machine():
    import torch

    c = StepCache.for_request("teacache", 0.5, num_steps=5)
    sig = torch.ones(4)
    assert c.skip(0, sig) is False          # first step always runs
    c.residual = torch.zeros(1)
    assert c.skip(1, sig * 1.1) is True     # change 0.1 < 0.5
    assert c.skip(2, sig * 1.1 * 1.5) is False   # accumulated 0.1 + 0.5 >= 0.5: runs, resets
    assert c.skip(3, sig * 1.1 * 1.5) is True
    assert c.skip(4, sig) is False          # last step always runs
    assert (c.hits, c.misses) == (2, 3)
    assert StepCache.for_request("none", None, 5) is None


def test_large_outputs_decode_tiled():
    from omnistage.diffusion.recipe import DiffusionSettings
    from omnistage.diffusion.stage import DiffusionStageSettings

    folder = str(tiny_checkpoint("qwen_image"))
    p = DiffusionParams(height=320, width=320, num_inference_steps=2, seed=5)
    small = DiffusionSettings(stage=DiffusionStageSettings(vae_tiling_pixels=256 * 256))
    with Omni(folder, omni_settings=small) as tiled_omni:
        tiled = tiled_omni.generate("a cat", p)[0].pixels[0]
        assert stage_of(tiled_omni).family.vae.use_tiling
    with Omni(folder) as whole_omni:
        whole = whole_omni.generate("a cat", p)[0].pixels[0]
        assert not stage_of(whole_omni).family.vae.use_tiling
    assert tiled.shape == whole.shape == (320, 320, 3)
    diff = np.abs(tiled - whole)
    assert 0 < diff.max() < 0.5 and diff.mean() < 0.02    # tiles blend: close, not identical


def test_async_omni_streams_progress_then_all_images():
    import asyncio

    from omnistage import AsyncOmni

    async def main(engine):
        deltas = [d async for d in engine.generate(
            "a cat", DiffusionParams(height=32, width=32, num_inference_steps=3, seed=1, n=2))]
        return deltas

    with AsyncOmni(str(tiny_checkpoint("qwen_image"))) as engine:
        deltas = asyncio.run(asyncio.wait_for(main(engine), 60))
    assert [d.progress for d in deltas[:-1]] == [(0, 3), (1, 3), (2, 3)]
    last = deltas[-1]
    assert last.finished and len(last.images) == 2 and last.seed == 1


def test_metrics_report_jobs_cache_and_phases(omni):
    omni.generate("a cat", DiffusionParams(height=32, width=32, num_inference_steps=6, seed=1,
                                           cache="teacache", cache_threshold=10.0))
    names = {name: value for name, _, _, value in omni.engine.metrics()}
    assert names['omnistage_diffusion_jobs{stage="diffusion"}'] == 0
    assert names['omnistage_diffusion_cache_skipped_steps_total{stage="diffusion"}'] >= 4
    assert names['omnistage_diffusion_seconds_total{stage="diffusion",phase="denoise"}'] > 0


def test_an_internal_fault_fails_only_the_requests_it_touched(omni):
    eng, stage = omni.engine, stage_of(omni)
    real = stage.family.predict

    def faulty(jobs):                   # fault injection: the forward breaks for one request
        if any(j.request_id == "boom" for j in jobs):
            raise RuntimeError("simulated kernel failure")
        return real(jobs)

    stage.family.predict = faulty
    try:
        submit(omni, "boom", "a cat", num_inference_steps=3, seed=1)
        eng.add_request("fine", eng.prepare("a dog"),
                        DiffusionParams(height=48, width=48, num_inference_steps=3, seed=2))
        deltas = drain(eng)
    finally:
        stage.family.predict = real
    done = {d.request_id: d for d in deltas if d.finished}
    assert done["boom"].finish_reason == "error" and "simulated kernel failure" in done["boom"].error
    assert done["fine"].finish_reason == "stop" and done["fine"].images[0].shape == (48, 48, 3)
    assert stage.num_jobs() == 0 and not eng.requests and stage.dead is None


def test_preview_steps_spread_over_the_run():
    from omnistage.diffusion.params import preview_steps

    assert preview_steps(20, 3) == (5, 10, 15)
    assert preview_steps(6, 3) == (2, 3, 4)
    assert preview_steps(20, 0) == ()
    assert preview_steps(2, 3) == (1,)           # few steps: fewer previews, never step 0 or N
    assert preview_steps(1, 3) == ()


def test_partial_images_only_where_asked_and_not_for_bad_counts(omni):
    eng = omni.engine
    submit(omni, "plain", "a cat", num_inference_steps=4, seed=1)
    submit(omni, "two", "a cat", num_inference_steps=4, seed=1, partial_images=2, n=2)
    deltas = drain(eng)
    plain = [d for d in deltas if d.request_id == "plain"]
    two = [d for d in deltas if d.request_id == "two" and d.partial_image is not None]
    assert all(d.partial_image is None for d in plain)
    # each of the two samples: previews after steps 1 and 3 (round(4/3), round(8/3))
    assert sorted((d.index, d.partial_image_index) for d in two) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    final = {d.request_id: d for d in deltas if d.finished}
    np.testing.assert_array_equal(final["plain"].images[0], final["two"].images[0])   # unchanged
    with pytest.raises(InvalidRequestError) as e:
        submit(omni, "bad", "a cat", partial_images=4)
    assert e.value.param == "partial_images"
