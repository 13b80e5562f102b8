"""GGUF files as model sources (omnistage/layers/gguf.py) against transformers' GGUF loading,
the oracle: the tiny Qwen2 written as f32 / q8_0 / q4_0 / q4_1 GGUF (benchmarks/gguf_export.py,
gguf-py's reference quantizers), loaded by both. q8_0 and q4_0 weights stay as stored (int8g,
int4 codes and scales) and give transformers' logits within float32 summation error; other
types are re-quantized to int8g within a stated bound; errors are clear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gguf_export import export
from omnistage import Omni, SamplingParams
from omnistage.errors import ModelLoadError, ModelNotFoundError
from omnistage.layers.gguf import GGUFFile, gguf_config

gguf = pytest.importorskip("gguf")
needs_cc = pytest.mark.usefixtures("c_compiler")
PROMPTS = [[5, 17, 33, 99, 200, 7, 8], [300, 2, 45], list(range(40, 90))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_files(tiny_qwen2, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {t: export(Path(tiny_qwen2), out / f"tiny-{t}.gguf", gguf, t)
            for t in ("f32", "q8_0", "q4_0", "q4_1")}


def _ours(path: Path, **options) -> tuple[Omni, list[list[int]], list[torch.Tensor]]:
    omni = Omni(str(path), enable_prefix_caching=False, **options)
    tokens = [o.token_ids for o in omni.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    probe = omni.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=1), return_hidden_states=True)
    model = omni.engine.llm.model
    logits = [model.compute_logits(o.outputs[0].hidden_states[:len(p)]) for p, o in zip(PROMPTS, probe)]
    return omni, tokens, logits


def _transformers(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        tokens = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
        logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
    return tokens, logits


def _formats(omni: Omni) -> set[str]:
    return {m.panels.format for m in omni.engine.llm.model.modules() if getattr(m, "panels", None) is not None}


@needs_cc
@pytest.mark.parametrize("file_type,stored", [("f32", "float32"), ("q8_0", "int8g"), ("q4_0", "int4")])
def test_equals_transformers_on_the_same_file(gguf_files, file_type, stored):
    """Every matrix (the head too, tied to the q4_0 / q8_0 embedding table) in the file's own
    format, float activations: transformers' greedy tokens, its logits within float32 rounding
    (measured 1.3-2.1e-5 with logits up to ~17)."""
    omni, tokens, logits = _ours(gguf_files[file_type], int4_activations="float32",
                                 int8_activations="float32")
    assert omni.engine.llm.linear_kernel == "native" and _formats(omni) == {stored}
    ref_tokens, ref_logits = _transformers(gguf_files[file_type])
    assert tokens == ref_tokens
    for ours, theirs in zip(logits, ref_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@needs_cc
@pytest.mark.parametrize("file_type,dots,exact_format", [("q4_0", "int4k", "int4"), ("q8_0", "int8k", "int8g")])
def test_int8_activations_by_default(gguf_files, file_type, dots, exact_format):
    """By default q4_0 and q8_0 weights multiply int8-rounded activations (int4k / int8k,
    llama.cpp's own numerics; their accuracy is measured on the trained model,
    test_quantization.py): every layer holds the file's codes and scales, in the layout for
    integer dot products. (On this random model the activations' rounding moves logits by up
    to ~4: it is built chaotic.)"""
    default = Omni(str(gguf_files[file_type]))
    exact = Omni(str(gguf_files[file_type]), int4_activations="float32", int8_activations="float32")
    assert _formats(default) == {dots} and _formats(exact) == {exact_format}
    pairs = [(a, b) for a, b in zip(default.engine.llm.model.modules(), exact.engine.llm.model.modules())
             if getattr(a, "panels", None) is not None]
    assert len(pairs) == 4 * 2 + 1
    for a, b in pairs:
        assert torch.equal(a.panels.codes(), b.panels.codes())
        assert torch.equal(a.panels.group_scales, b.panels.group_scales)


@needs_cc
def test_stored_codes_are_the_files_values(gguf_files):
    """The merged q|k|v panels of a q4_0 layer compute with exactly gguf-py's dequantized
    values of the three tensors."""
    omni = Omni(str(gguf_files["q4_0"]))
    qkv = omni.engine.llm.model.layers[1].self_attn.qkv
    assert qkv.panels.format == "int4k"
    tensors = {t.name: t for t in GGUFFile(gguf_files["q4_0"]).tensors}
    parts = [gguf.quants.dequantize(tensors[f"blk.1.attn_{x}.weight"].data.reshape(
        tensors[f"blk.1.attn_{x}.weight"].shape[0], -1), gguf.GGMLQuantizationType.Q4_0) for x in "qkv"]
    want = torch.cat([torch.from_numpy(p.copy()) for p in parts])         # (out, in)
    assert torch.equal(qkv.panels.dequantize(), want.t())


@needs_cc
def test_other_types_are_requantized_within_bound(gguf_files):
    """q4_1 has no exact format here: int8g groups of 32, each weight within half a step
    (1/127 of its block's largest magnitude) of gguf-py's value."""
    omni = Omni(str(gguf_files["q4_1"]))
    assert _formats(omni) == {"int8k"}                 # against int8 activations (default)
    down = omni.engine.llm.model.layers[0].mlp.down
    t = next(t for t in GGUFFile(gguf_files["q4_1"]).tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(t.data.reshape(t.shape[0], -1),
                                                   gguf.GGMLQuantizationType.Q4_1).copy())
    blocks = want.view(want.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    bound = (blocks / 127 / 2 * 1.001 + 1e-7).expand(-1, -1, 32).reshape(want.shape)
    assert ((down.panels.dequantize().t() - want).abs() <= bound).all()


@needs_cc
def test_other_kernels_and_explicit_quantization_dequantize(gguf_files):
    """Without the native kernel (`linear_kernel=matmul`, or a GPU) the weights load as floats
    (the same values: the same tokens); an explicit `quantization` re-packs them."""
    _, native_tokens, _ = _ours(gguf_files["q4_0"], int4_activations="float32")
    plain, tokens, _ = _ours(gguf_files["q4_0"], linear_kernel="matmul")
    assert plain.engine.llm.linear_kernel == "matmul" and tokens == native_tokens
    int8 = Omni(str(gguf_files["q4_0"]), quantization="int8")
    assert int8.engine.llm.linear_kernel == "native int8"
    assert _formats(int8) == {"int8k"}


def test_config_from_metadata(gguf_files, tiny_qwen2):
    import json

    hf = json.loads((Path(tiny_qwen2) / "config.json").read_text())
    cfg = gguf_config(gguf_files["q4_0"])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        assert cfg[key] == hf[key], key
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])


def test_clear_errors(gguf_files, tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_files["q4_0"].read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        Omni(str(truncated))
    other = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(other), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'llama' is not served"):
        Omni(str(other))
    with pytest.raises(ModelNotFoundError, match="not a folder or a .gguf file"):
        Omni(str(tmp_path / "missing.gguf"))
