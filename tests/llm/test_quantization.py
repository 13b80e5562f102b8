"""Quantized linear weights (`quantization`: bf16, int8, int4) end to end: accuracy against
float32 on a trained tiny model within stated bounds, batch invariance per format, every
stage of an omni model quantized, and clear errors where a format cannot serve.

The accuracy set (benchmarks/quant_accuracy.py): the `trained` tiny Qwen2, 32 prompts cut
from its corpus, 64 greedy tokens each. Measured when written (group size 64): tokens equal
to float32's 1.000 for every format; logits' max |diff| bf16 0.009-0.011, int8 0.078 (0.038
with float32 activations: int8-exact), int4 0.41-0.53 (logits up to ~11); KL mean bf16 8e-7,
int8 9e-6 (exact 6e-6), int4 1.3-4e-4, KL max int8 1.8e-4, int4 3e-3..1.7e-2; the bfloat16 KV
cache (float32 weights): tokens 1.000, logits 0.0098, KL mean 3e-8, max 2e-6. The bounds below
leave ~2-4x room over those figures."""

from __future__ import annotations

import logging

import pytest

from benchmarks.quant_accuracy import accuracy_prompts, measure
from omnistage import Omni, SamplingParams
from omnistage.config import EngineConfig
from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("c_compiler")

# quantization: (logits max |diff|, KL mean, KL max)
BOUNDS = {"bf16": (0.05, 1e-5, 1e-4), "int8": (0.15, 5e-5, 5e-4), "int4": (1.2, 2e-3, 5e-2),
          "kv-bf16": (0.03, 2e-7, 1e-5), "int8-exact": (0.1, 3e-5, 3e-4), "int4-exact": (1.2, 2e-3, 5e-2)}


@pytest.fixture(scope="module")
def trained_qwen2(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2", tmp_path_factory.mktemp("trained"), size="trained"))


def test_accuracy_against_float32(trained_qwen2):
    results = measure(trained_qwen2, accuracy_prompts(trained_qwen2))
    for r in results:
        max_abs, kl_mean, kl_max = BOUNDS[r.name]
        assert r.tokens_equal >= 0.9, r
        assert r.logits_max_abs <= max_abs and r.kl_mean <= kl_mean and r.kl_max <= kl_max, r
    # The formats are what they claim: fewer bits, larger (still bounded) error.
    errors = [r.logits_max_abs for r in results]
    assert 0 < errors[0] < errors[1] < errors[2]
    # int8 weights against float32 activations err less than against int8-rounded ones.
    by_name = {r.name: r for r in results}
    assert by_name["int8-exact"].kl_mean < by_name["int8"].kl_mean


@pytest.mark.parametrize("quantization", ["bf16", "int8", "int4"])
def test_request_alone_equals_request_in_batch(trained_qwen2, quantization):
    """With quantized weights too, a request's logprobs are the same bits alone as among 16
    others that prefill and decode in the same steps."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    omni = Omni(trained_qwen2, quantization=quantization, enable_prefix_caching=False,
                quantization_group_size=32)
    assert omni.engine.llm.linear_kernel == f"native {quantization}"
    prompts = [{"prompt_token_ids": p} for p in accuracy_prompts(trained_qwen2, 17)]
    [alone] = omni.generate(prompts[5:6], params)
    batch = omni.generate(prompts, params)

    def values(out):
        return [(t.token_id, t.logprob, t.top) for t in out.outputs[0].logprobs]

    assert batch[5].token_ids == alone.token_ids and values(batch[5]) == values(alone)


def test_int4_keeps_the_output_head_in_int8(trained_qwen2):
    omni = Omni(trained_qwen2, quantization="int4")
    model = omni.engine.llm.model
    assert model.lm_head.panels.format == "int8k"                # int8 activations (default)
    assert model.layers[0].mlp.down.panels.format == "int4k"
    exact = Omni(trained_qwen2, quantization="int4", int4_activations="float32").engine.llm.model
    assert exact.lm_head.panels.format == "int8"                 # the head follows int4's choice
    assert model.layers[0].mlp.down.panels.group_size == 64


def test_every_omni_stage_quantizes(tiny_omni):
    """Thinker, talker and the encoders' towers take the format; text and speech come out."""
    with Omni(tiny_omni, quantization="int8") as omni:
        stages = omni.engine.graph.stages
        assert stages["thinker"].engine.linear_kernel == "native int8"
        assert stages["talker"].engine.linear_kernel == "native int8"
        towers = stages["encoder"].encoders
        formats = {m.panels.format for tower in (towers.audio, towers.vision)
                   for m in tower.modules() if hasattr(m, "panels") and m.panels is not None}
        assert formats == {"int8k"}
        [out] = omni.generate("Say something.", SamplingParams(temperature=0.0, max_tokens=8),
                              output=OutputOptions(modalities=["text", "audio"]))
        assert out.outputs[0].token_ids and out.audio is not None and out.audio.size > 0


def test_options_are_checked(tiny_qwen2, tmp_path, monkeypatch, caplog):
    with pytest.raises(InvalidRequestError, match="quantization must be one of none, bf16"):
        EngineConfig(model=str(tiny_qwen2), quantization="fp8")
    with pytest.raises(InvalidRequestError, match="quantization_group_size must be a positive"):
        EngineConfig(model=str(tiny_qwen2), quantization="int4", quantization_group_size=0)
    with pytest.raises(InvalidRequestError, match="linear_kernel=matmul reads float weights"):
        EngineConfig(model=str(tiny_qwen2), quantization="int8", linear_kernel="matmul")
    # No compiler: float32 falls back to oneDNN, a quantized format cannot (and says why).
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(InvalidRequestError, match="quantization=int8 needs the native linear kernel"):
        Omni(tiny_qwen2, quantization="int8")
    with caplog.at_level(logging.INFO, logger="omnistage"):
        assert Omni(tiny_qwen2).engine.llm.linear_kernel in ("onednn", "matmul")


def test_layers_pack_while_loading(trained_qwen2):
    """With a quantization, each layer drops its float32 copy as soon as its weights are in;
    output heads pack with the rest, later."""
    import torch

    from omnistage.models.loader import load_model

    config = EngineConfig(model=trained_qwen2, quantization="int8")
    model = load_model(trained_qwen2, torch.float32, torch.device("cpu"), pack_for=config)
    for layer in model.layers:
        for m in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            assert m.panels.format == "int8k" and m.weight_t.numel() == 0
    assert model.lm_head.panels is None and model.lm_head.weight_t.numel() > 0
    with pytest.raises(ValueError, match="loaded .and packed. already"):
        model.layers[0].mlp.down.load_weight(torch.zeros(128, 384))


def test_qwen3_omni_stages_quantize(tmp_path):
    """The MoE thinker and talker (experts packed as they load), the code predictor and the
    projections take int4; text and speech come out."""
    from omnistage.tiny import build_tiny

    folder = str(build_tiny("qwen3_omni", tmp_path / "q3", seed=0))
    with Omni(folder, quantization="int4", quantization_group_size=32) as omni:
        stages = omni.engine.graph.stages
        assert stages["thinker"].engine.linear_kernel == "native int4"
        assert stages["talker"].engine.linear_kernel == "native int4"
        [out] = omni.generate([{"role": "user", "content": "Say something."}],
                              SamplingParams(temperature=0.0, max_tokens=8),
                              output=OutputOptions(modalities=["text", "audio"]))
        assert out.outputs[0].token_ids and out.audio is not None and out.audio.size > 0


def test_bf16_checkpoint_is_kept_in_bf16_exactly(trained_qwen2, tmp_path):
    """With no quantization, a bf16 checkpoint's linear weights are stored as bfloat16 (half
    of float32's bytes) as they load, and nothing changes: greedy tokens are transformers'
    (float32 over the same folder) and the float32 matmul path's."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from omnistage.models.loader import load_model
    from omnistage.tiny.storage import store_as_bfloat16

    folder = str(shutil.copytree(trained_qwen2, tmp_path / "bf16"))
    store_as_bfloat16(tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 for f in (tmp_path / "bf16").glob("*.safetensors")
               for t in load_file(f).values())
    model = load_model(folder, torch.float32, torch.device("cpu"), pack_for=EngineConfig(model=folder))
    for layer in model.layers:
        for m in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            assert m.panels.format == "bfloat16" and m.weight_t.numel() == 0
    prompts = accuracy_prompts(trained_qwen2)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for kernel in ("auto", "matmul"):
        with Omni(folder, linear_kernel=kernel) as omni:
            outs = omni.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs[kernel] = [o.token_ids for o in outs]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    never = hf.config.vocab_size
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=24, do_sample=False, eos_token_id=never,
                            pad_token_id=never)[0, len(p):].tolist() for p in prompts]
    assert runs["auto"] == runs["matmul"] == want


def test_qwen3_omni_bf16_checkpoint_keeps_every_linear_in_bf16(tmp_path):
    """Every linear layer of the stages that take a weight format (thinker and talker experts,
    attention, heads, code predictor, projections, encoder towers; code2wav, a vocoder, stays
    float32 as with any quantization) is stored in bfloat16 from a bf16 folder, none left
    float32 (their outputs equal transformers': the parity tests' tiny-bf16 folder)."""
    from torch import nn

    from omnistage.layers.linear import NativeLinear, TransposedLinear
    from omnistage.tiny import build_tiny

    folder = str(build_tiny("qwen3_omni", tmp_path / "q3", seed=0, weights_dtype="bfloat16"))
    with Omni(folder) as omni:
        formats: dict[str, set[str]] = {}
        for name, stage in omni.engine.graph.stages.items():
            for module in _stage_modules(stage) if name != "code2wav" else []:
                for m in module.modules():
                    assert type(m) is not nn.Linear, f"{name}: a float32 nn.Linear left"
                    if isinstance(m, (TransposedLinear, NativeLinear)) and m.panels is not None:
                        formats.setdefault(name, set()).add(m.panels.format)
        assert set(formats) >= {"encoder", "thinker", "talker"}, formats
        assert all(f == {"bfloat16"} for f in formats.values()), formats


def _stage_modules(stage) -> list:
    """The torch modules a stage object holds, found through its attributes (a few levels)."""
    from torch import nn

    found, seen, todo = [], set(), [(stage, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
        elif depth < 3 and hasattr(obj, "__dict__"):
            todo += [(v, depth + 1) for v in vars(obj).values()]
    return found
