"""Tiny diffusers-format checkpoints: diffusers' own pipelines load and run them, and builds are
deterministic for a seed.

diffusers is the oracle here: each folder is loaded with `Pipeline.from_pretrained(folder)` and
run for 2 steps at a small size, as a user of the real checkpoint would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.tiny import SUPPORTED_TINY_ARCHS, build_tiny
from omnistage.tiny.diffusers_folder import parameter_counts


def _image(size: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def _wan_i2v_embeds(pipe: Any, prompt: str) -> dict[str, torch.Tensor]:
    """diffusers 0.42's WanImageToVideoPipeline calls `ftfy.fix_text` on prompts unconditionally
    and ftfy is not installed here; WanPipeline's encoder is the same code with ftfy optional,
    so the prompt goes in as embeddings computed from the folder's own tokenizer/text encoder."""
    encoder = diffusers.WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                    scheduler=pipe.scheduler)
    positive, negative = encoder.encode_prompt(prompt, negative_prompt="", do_classifier_free_guidance=True,
                                               max_sequence_length=32)
    return {"prompt_embeds": positive, "negative_prompt_embeds": negative}


@dataclass(frozen=True)
class Case:
    pipeline_class: str
    inputs: Callable[[Any], dict[str, Any]]  # pipeline -> call kwargs (besides steps/generator/output_type)
    shape: tuple[int, ...]  # of the output array (layered: of its first element)


PROMPT = "a red cube on a wooden table"
CASES: dict[str, Case] = {
    "qwen_image": Case("QwenImagePipeline", lambda p: {"prompt": PROMPT, "height": 64, "width": 64},
                       (1, 64, 64, 3)),
    "qwen_image_edit": Case("QwenImageEditPipeline",
                            lambda p: {"prompt": PROMPT, "image": _image(64), "height": 64, "width": 64},
                            (1, 64, 64, 3)),
    "qwen_image_edit_plus": Case("QwenImageEditPlusPipeline",
                                 lambda p: {"prompt": PROMPT, "image": [_image(64), _image(64, seed=1)],
                                            "height": 64, "width": 64},
                                 (1, 64, 64, 3)),
    # The pipeline fixes the size: 640x640 (its smallest bucket), one RGBA image per layer.
    "qwen_image_layered": Case("QwenImageLayeredPipeline",
                               lambda p: {"prompt": PROMPT, "image": _image(64, "RGBA"), "layers": 1},
                               (1, 640, 640, 4)),
    "z_image": Case("ZImagePipeline", lambda p: {"prompt": PROMPT, "height": 64, "width": 64}, (1, 64, 64, 3)),
    "wan": Case("WanPipeline", lambda p: {"prompt": PROMPT, "height": 32, "width": 32, "num_frames": 5,
                                          "max_sequence_length": 32},
                (1, 5, 32, 32, 3)),
    "wan_i2v": Case("WanImageToVideoPipeline",
                    lambda p: {**_wan_i2v_embeds(p, PROMPT), "image": _image(32), "height": 32, "width": 32,
                               "num_frames": 5},
                    (1, 5, 32, 32, 3)),
}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(folder: Path, case: Case) -> np.ndarray:
    pipe = getattr(diffusers, case.pipeline_class).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**case.inputs(pipe), num_inference_steps=2, generator=torch.Generator().manual_seed(0),
               output_type="np")
    result = out.frames if hasattr(out, "frames") else out.images
    return np.asarray(result[0] if isinstance(result, list) else result)


def test_every_diffusion_arch_is_registered():
    assert set(CASES) <= set(SUPPORTED_TINY_ARCHS)


@pytest.mark.parametrize("arch", list(CASES))
def test_pipeline_loads_and_runs_and_builds_are_deterministic(arch, tmp_path):
    case = CASES[arch]
    first = build_tiny(arch, tmp_path / "a", seed=0)
    index = json.loads((first / "model_index.json").read_text())
    assert index["_class_name"] == case.pipeline_class

    output = _run(first, case)
    assert output.shape == case.shape
    assert np.isfinite(output).all()
    assert output.std() > 0.01, "the output image is (nearly) constant"

    second = build_tiny(arch, tmp_path / "b", seed=0)
    files_a, files_b = _files(first), _files(second)
    assert any(name.endswith(".safetensors") for name in files_a)
    assert files_a.keys() == files_b.keys()
    differing = [name for name in files_a if files_a[name] != files_b[name]]
    assert not differing, f"same seed, different bytes: {differing}"


def test_seed_changes_every_model_component(tmp_path):
    a = _files(build_tiny("wan", tmp_path / "a", seed=0))
    b = _files(build_tiny("wan", tmp_path / "b", seed=1))
    weights = [name for name in a if name.endswith(".safetensors")]
    assert {name.split("/")[0] for name in weights} == {"transformer", "transformer_2", "vae", "text_encoder"}
    assert all(a[name] != b[name] for name in weights)
    assert a["tokenizer/tokenizer.json"] == b["tokenizer/tokenizer.json"]  # the tokenizer is seed-independent


def test_model_index_and_scheduler_match_the_real_checkpoints(tmp_path):
    wan = json.loads((build_tiny("wan", tmp_path / "wan") / "model_index.json").read_text())
    assert wan["boundary_ratio"] == 0.875 and wan["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    i2v = json.loads((build_tiny("wan_i2v", tmp_path / "i2v") / "model_index.json").read_text())
    assert i2v["boundary_ratio"] == 0.9 and i2v["image_encoder"] == [None, None]

    qwen = build_tiny("qwen_image_edit", tmp_path / "qwen")
    scheduler = json.loads((qwen / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and scheduler["time_shift_type"] == "exponential"
    assert (scheduler["base_shift"], scheduler["max_shift"], scheduler["shift_terminal"]) == (0.5, 0.9, 0.02)
    assert (scheduler["base_image_seq_len"], scheduler["max_image_seq_len"]) == (256, 8192)
    preprocessor = json.loads((qwen / "processor" / "preprocessor_config.json").read_text())
    assert preprocessor["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (preprocessor["patch_size"], preprocessor["merge_size"]) == (14, 2)

    z_image = build_tiny("z_image", tmp_path / "z")
    scheduler = json.loads((z_image / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["shift"] == 3.0 and not scheduler["use_dynamic_shifting"]


def test_rebuild_replaces_the_previous_build(tmp_path):
    """A sharded build, then an unsharded one (and another architecture) into the same folder:
    no stale shard, index or component folder survives."""
    folder = tmp_path / "m"
    build_tiny("wan", folder, max_shard_size="20KB")
    assert list(folder.glob("transformer/*.safetensors.index.json"))
    build_tiny("z_image", folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"]
    assert not list(folder.glob("*/*.index.json"))
    assert [p.name for p in (folder / "transformer").glob("*.safetensors")] == ["diffusion_pytorch_model.safetensors"]


def test_the_prompt_changes_the_image(tmp_path):
    """The prompt must reach the image: two prompts, same noise, different outputs."""
    folder = build_tiny("qwen_image", tmp_path / "q")
    pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    outputs = [pipe(prompt=p, height=64, width=64, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images for p in ("a red cube", "two green birds")]
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-3


def test_unknown_size_is_rejected(tmp_path):
    with pytest.raises(InvalidRequestError, match="choose one of: tiny"):
        build_tiny("wan", tmp_path, size="huge")


@pytest.mark.slow
def test_small_qwen_image_has_benchmark_sizes(tmp_path):
    folder = build_tiny("qwen_image", tmp_path / "small", size="small")
    pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
    counts = parameter_counts(pipe.components)
    print({name: f"{n / 1e6:.1f}M" for name, n in counts.items()})
    for name, target in {"transformer": 77e6, "vae": 10e6, "text_encoder": 45e6}.items():
        assert abs(counts[name] - target) <= 0.15 * target, (name, counts[name])
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=PROMPT, height=128, width=128, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 128, 128, 3) and np.isfinite(image).all() and image.std() > 0.01


def test_wan_tokenizer_rejects_an_unreachable_vocab_size(tmp_path):
    with pytest.raises(InvalidRequestError, match="use at most"):
        build_tiny("wan", tmp_path, overrides={"text_encoder": {"vocab_size": 100_000}})
