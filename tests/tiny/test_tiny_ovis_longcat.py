"""Tiny Ovis-Image and LongCat-Image(-Edit) checkpoints: diffusers' own pipelines load and run
them, and builds are a pure function of the seed.

diffusers is the oracle: each folder is loaded with `Pipeline.from_pretrained(folder)` and run
for 2 steps (64x64 for text to image; the edit pipeline always works at ~1024x1024).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.tiny import SUPPORTED_TINY_ARCHS, TINY_ARCHS, build_tiny
from omnistage.tiny.diffusers_folder import parameter_counts

PIPELINES = {"ovis_image": "OvisImagePipeline", "longcat_image": "LongCatImagePipeline",
             "longcat_image_edit": "LongCatImageEditPipeline"}
PROMPT = 'a red cube on a wooden table, a sign reads "hi"'


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(folder: Path, arch: str, prompt: str = PROMPT, seed: int = 0) -> tuple[np.ndarray, float]:
    pipe = getattr(diffusers, PIPELINES[arch]).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if arch == "longcat_image_edit":
        pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        kw = {"image": Image.fromarray(pixels)}
    else:
        kw = {"height": 64, "width": 64}
        if arch == "longcat_image":
            kw["enable_prompt_rewrite"] = False   # the rewrite is the 7B text encoder generating text
    t0 = time.perf_counter()
    out = pipe(prompt=prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
               output_type="np", **kw).images
    return np.asarray(out), time.perf_counter() - t0


def test_archs_are_registered():
    assert set(PIPELINES) <= set(SUPPORTED_TINY_ARCHS)
    assert all(TINY_ARCHS[arch].sizes == ("tiny",) for arch in PIPELINES)


@pytest.mark.parametrize("arch", list(PIPELINES))
def test_pipeline_runs_and_builds_are_deterministic(arch, tmp_path):
    first = build_tiny(arch, tmp_path / "a", seed=0)
    index = json.loads((first / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[arch]

    image, seconds = _run(first, arch)
    # text to image: 64x64; edit: the 4:3 input at ~1024x1024, sides rounded up to 16
    assert image.shape == ((1, 896, 1184, 3) if arch == "longcat_image_edit" else (1, 64, 64, 3))
    assert np.isfinite(image).all()
    assert image.std() > 0.01, "the output image is (nearly) constant"
    print(f"{arch}: 2 steps in {seconds:.2f}s")            # measured: ~0.1 s (64x64), ~2 s (edit, CFG)

    second = build_tiny(arch, tmp_path / "b", seed=0)
    files_a, files_b = _files(first), _files(second)
    assert any(name.endswith(".safetensors") for name in files_a)
    assert files_a.keys() == files_b.keys()
    differing = [name for name in files_a if files_a[name] != files_b[name]]
    assert not differing, f"same seed, different bytes: {differing}"


@pytest.mark.parametrize("arch", ["ovis_image", "longcat_image"])
def test_seed_changes_every_model_component(arch, tmp_path):
    a = _files(build_tiny(arch, tmp_path / "a", seed=0))
    b = _files(build_tiny(arch, tmp_path / "b", seed=1))
    weights = [name for name in a if name.endswith(".safetensors")]
    assert {name.split("/")[0] for name in weights} == {"transformer", "vae", "text_encoder"}
    assert all(a[name] != b[name] for name in weights)
    assert a["tokenizer/tokenizer.json"] == b["tokenizer/tokenizer.json"]  # seed-independent


def test_folders_have_the_pipelines_components(tmp_path):
    ovis = json.loads((build_tiny("ovis_image", tmp_path / "o") / "model_index.json").read_text())
    assert ovis["transformer"] == ["diffusers", "OvisImageTransformer2DModel"]
    assert ovis["text_encoder"] == ["transformers", "Qwen3Model"]
    folder = build_tiny("longcat_image_edit", tmp_path / "l")
    longcat = json.loads((folder / "model_index.json").read_text())
    assert longcat["transformer"] == ["diffusers", "LongCatImageTransformer2DModel"]
    assert longcat["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert longcat["text_processor"][0] == "transformers"
    preprocessor = json.loads((folder / "text_processor" / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"
    vae = json.loads((folder / "vae" / "config.json").read_text())
    assert vae["latent_channels"] == 16                         # the LongCat pipelines hard-code it
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and (scheduler["base_shift"], scheduler["max_shift"]) == (0.5, 1.15)


def test_the_prompt_reaches_the_image(tmp_path):
    folder = build_tiny("longcat_image", tmp_path / "l")
    a, b = (_run(folder, "longcat_image", prompt)[0] for prompt in ("a red cube", "two green birds"))
    assert np.abs(a - b).max() > 1e-2


def test_overrides_follow_through_to_the_transformer(tmp_path):
    """A narrower text encoder: the transformer's joint_attention_dim follows, and it runs."""
    folder = build_tiny("ovis_image", tmp_path / "o", overrides={"text_encoder": {"hidden_size": 32},
                                                                 "transformer": {"num_single_layers": 2}})
    config = json.loads((folder / "transformer" / "config.json").read_text())
    assert (config["joint_attention_dim"], config["num_single_layers"]) == (32, 2)
    image, _ = _run(folder, "ovis_image")
    assert image.shape == (1, 64, 64, 3) and image.std() > 0.01


def test_sizes_are_tiny(tmp_path):
    for arch in ("ovis_image", "longcat_image"):
        pipe = getattr(diffusers, PIPELINES[arch]).from_pretrained(build_tiny(arch, tmp_path / arch))
        assert 0 < sum(parameter_counts(pipe.components).values()) < 1_000_000
