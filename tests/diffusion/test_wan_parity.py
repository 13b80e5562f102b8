"""Wan on our diffusion stage vs diffusers' WanPipeline / WanImageToVideoPipeline.__call__ (the
oracles): same folder, same seed -> the same frames, alone and batched with other requests;
Wan2.2's expert switch happens inside the runs; bad inputs are typed errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion.params import DiffusionParams
from omnistage.entrypoints.model_source import tiny_checkpoint
from omnistage.errors import InvalidRequestError

ATOL = 1e-4   # the bound on [0, 1] pixels; measured: ~3e-6 (batching changes GEMM order)
SIZE, FRAMES, STEPS = 32, 5, 4


def load(arch):
    from diffusers import DiffusionPipeline

    folder = tiny_checkpoint(arch)
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return folder, pipe


@pytest.fixture(scope="module")
def t2v():
    folder, pipe = load("wan")
    with Omni(str(folder)) as omni:
        yield pipe, omni


@pytest.fixture(scope="module")
def i2v():
    folder, pipe = load("wan_i2v")
    with Omni(str(folder)) as omni:
        yield pipe, omni


def image(seed, h=40, w=48):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def generator(seed):
    return torch.Generator("cpu").manual_seed(seed)


def t2v_reference(pipe, prompt, seed, negative, n, guidance, steps=STEPS):
    return pipe(prompt, negative_prompt=negative, height=SIZE, width=SIZE, num_frames=FRAMES,
                num_inference_steps=steps, guidance_scale=guidance, num_videos_per_prompt=n,
                generator=generator(seed), output_type="np").frames


def i2v_reference(pipe, prompt, seed, negative, n, guidance, first, last=None):
    # WanImageToVideoPipeline's prompt cleaning calls ftfy even when it is not installed
    # (diffusers 0.42); its T5 encoding is WanPipeline's, so the embeddings come from there.
    from diffusers import WanPipeline

    embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt, n, 512)
    neg = WanPipeline._get_t5_prompt_embeds(pipe, negative or "", n, 512) if guidance > 1 else None
    return pipe(image=first, last_image=last, prompt_embeds=embeds, negative_prompt_embeds=neg, height=SIZE,
                width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
                generator=generator(seed), output_type="np").frames


def params(seed, negative, n, guidance, **kw):
    kw = {"num_inference_steps": STEPS, **kw}
    return DiffusionParams(negative_prompt=negative, height=SIZE, width=SIZE, num_frames=FRAMES,
                           guidance_scale=guidance, seed=seed, n=n, **kw)


def record_forwards(omni):
    """Wrap this Omni's family.predict: returns the list of (jobs' experts, latent shapes) per forward."""
    family = omni.engine.graph.stages["diffusion"].family
    seen, predict = [], type(family).predict

    def spy(jobs):
        seen.append(({j.expert for j in jobs}, len(jobs)))
        return predict(family, jobs)

    family.predict = spy        # an attribute of this test's own family instance
    return seen


def assert_close(ref, out, frames=FRAMES):
    assert len(out.pixels) == len(ref)
    for a, b in zip(ref, out.pixels):
        assert b.shape == (frames, SIZE, SIZE, 3) and b.dtype == np.float32
        assert np.abs(a - b).max() <= ATOL
    assert ref[0].std() > 0.01               # a non-trivial video, so the comparison means something


def test_the_expert_switch_happens_inside_the_run(t2v, i2v):
    for pipe, _ in (t2v, i2v):
        assert pipe.transformer_2 is not None and pipe.config.boundary_ratio is not None
        pipe.scheduler.set_timesteps(STEPS)
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        assert {bool(t >= boundary) for t in pipe.scheduler.timesteps} == {True, False}


T2V_CASES = [  # (prompt, seed, negative prompt, n, guidance_scale, steps)
    ("a red cat", 1, None, 1, 5.0, STEPS),                       # CFG with "" as negative
    ("a blue dog on a long walk in the park at dawn", 2, "blurry", 2, 4.0, STEPS),
    ("x", 3, None, 1, 1.0, STEPS),                               # no CFG
    ("a green house", 4, None, 1, 5.0, 7),   # other steps: its expert switch comes at another step
]


@pytest.fixture(scope="module")
def t2v_refs(t2v):
    return [t2v_reference(t2v[0], *case) for case in T2V_CASES]


@pytest.mark.parametrize("i", [0, 2])
def test_t2v_alone_matches_diffusers(t2v, t2v_refs, i):
    prompt, seed, negative, n, guidance, steps = T2V_CASES[i]
    out = t2v[1].generate(prompt, params(seed, negative, n, guidance, num_inference_steps=steps))[0]
    assert out.seed == seed
    assert_close(t2v_refs[i], out)


def test_t2v_batched_matches_diffusers(t2v, t2v_refs):
    omni = t2v[1]
    forwards = record_forwards(omni)
    try:
        outs = omni.generate([c[0] for c in T2V_CASES],
                             [params(*c[1:5], num_inference_steps=c[5]) for c in T2V_CASES])
    finally:
        del omni.engine.graph.stages["diffusion"].family.predict
    for ref, out in zip(t2v_refs, outs):
        assert_close(ref, out)
    assert all(len(experts) == 1 for experts, _ in forwards)      # a forward runs one expert
    assert {e for experts, _ in forwards for e in experts} == {0, 1}
    assert max(n for _, n in forwards) > 1                        # requests did share forwards
    assert np.abs(outs[1].pixels[0] - outs[1].pixels[1]).max() > 0.01   # n=2: different noise


def test_i2v_matches_diffusers_alone_and_batched(i2v):
    pipe, omni = i2v
    cases = [  # (prompt, seed, negative, n, guidance, images)
        ("a cat walks", 1, None, 1, 5.0, [image(0)]),
        ("waves on a beach", 2, "static", 2, 3.0, [image(1, 32, 32)]),
        ("from here to there", 3, None, 1, 1.0, [image(2), image(3, 24, 64)]),   # first + last frame
    ]
    refs = [i2v_reference(pipe, *c[:5], *c[5]) for c in cases]
    alone = omni.generate({"prompt": cases[0][0], "image": cases[0][5][0]}, params(*cases[0][1:5]))[0]
    assert_close(refs[0], alone)
    outs = omni.generate([{"prompt": c[0], "image": c[5]} for c in cases], [params(*c[1:5]) for c in cases])
    for ref, out in zip(refs, outs):
        assert_close(ref, out)
    # the first frame follows the input image: another image gives another video
    other = i2v_reference(pipe, *cases[0][:5], image(9))
    assert np.abs(other[0] - refs[0][0]).max() > 0.01


@pytest.mark.parametrize("index_edit", [
    {"boundary_ratio": None, "transformer_2": [None, None]},     # Wan2.1: one transformer
    {"expand_timesteps": True},                                 # TI2V-5B style: a timestep per token
])
def test_model_index_variants_match_diffusers(tmp_path, index_edit):
    from diffusers import WanPipeline

    folder = tmp_path / "wan"
    shutil.copytree(tiny_checkpoint("wan"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **index_edit}))
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert (pipe.transformer_2 is None) == ("transformer_2" in index_edit)
    ref = t2v_reference(pipe, "a red cat", 1, "ugly", 1, 5.0)
    with Omni(str(folder)) as omni:
        assert_close(ref, omni.generate("a red cat", params(1, "ugly", 1, 5.0))[0])


def test_wan21_i2v_with_clip_image_encoder_matches_diffusers(tmp_path):
    """Wan2.1-I2V's layout: one transformer that also attends to CLIP image tokens."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = WanImageToVideoPipeline.from_pretrained(tiny_checkpoint("wan_i2v"))
    inner = base.transformer.config.num_attention_heads * base.transformer.config.attention_head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel.from_config(
            {**base.transformer.config, "image_dim": 24, "added_kv_proj_dim": inner})
        encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=28, patch_size=14))
    processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                            scheduler=base.scheduler, transformer=transformer, image_encoder=encoder,
                            image_processor=processor).save_pretrained(tmp_path)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    ref = i2v_reference(pipe, "a cat walks", 1, None, 1, 5.0, image(0))
    with Omni(str(tmp_path)) as omni:
        assert_close(ref, omni.generate({"prompt": "a cat walks", "image": image(0)}, params(1, None, 1, 5.0))[0])
        with pytest.raises(InvalidRequestError):       # no last frame for this layout
            omni.generate({"prompt": "a cat", "image": [image(0), image(1)]}, params(1, None, 1, 5.0))


@pytest.mark.parametrize("kind", ["fbcache", "teacache"])
def test_step_cache(t2v, kind):
    """Threshold 0 never skips: the cached forward (first block, then the rest) is the plain one,
    across the expert switch; the default threshold skips some steps and stays close."""
    omni = t2v[1]
    steps = 8
    base = omni.generate("a cat", params(5, None, 1, 5.0, num_inference_steps=steps))[0].pixels[0]
    never = omni.generate("a cat", params(5, None, 1, 5.0, num_inference_steps=steps, cache=kind,
                                          cache_threshold=0.0))[0].pixels[0]
    assert np.abs(base - never).max() <= 1e-6
    stage = omni.engine.graph.stages["diffusion"]
    hits = []
    predict = type(stage.family).predict

    def spy(jobs):
        hits.append(jobs[0].cache.hits)
        return predict(stage.family, jobs)

    stage.family.predict = spy
    try:
        cached = omni.generate("a cat", params(5, None, 1, 5.0, num_inference_steps=steps, cache=kind,
                                               cache_threshold=1.0))[0].pixels[0]
    finally:
        del stage.family.predict
    assert hits[-1] > 0 and np.abs(base - cached).mean() < 0.05


@pytest.mark.parametrize("which, prompt, bad, param", [
    ("t2v", "a cat", {"num_frames": 4}, "num_frames"),          # not 4k+1
    ("t2v", "a cat", {"num_frames": 6}, "num_frames"),
    ("t2v", "a cat", {"height": 40}, "size"),                   # not a multiple of 16
    ("t2v", "a cat", {"true_cfg_scale": 4.0}, "true_cfg_scale"),
    ("t2v", {"prompt": "a cat", "image": image(0)}, {}, "image"),          # t2v takes no image
    ("i2v", "a cat", {}, "image"),                                          # i2v needs one
    ("i2v", {"prompt": "a cat", "image": [image(0)] * 3}, {}, "image"),    # at most first + last
])
def test_bad_input_raises_typed_errors(t2v, i2v, which, prompt, bad, param):
    omni = (t2v if which == "t2v" else i2v)[1]
    with pytest.raises(InvalidRequestError) as e:
        omni.generate(prompt, DiffusionParams(**{"height": SIZE, "width": SIZE, "num_frames": FRAMES,
                                                 "num_inference_steps": 2, **bad}))
    assert e.value.param == param
    if param == "num_frames":
        assert "k+1" in str(e.value) and str(bad["num_frames"]) in str(e.value)
    assert not omni.engine.requests                    # nothing left behind
