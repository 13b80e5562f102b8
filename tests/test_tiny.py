"""The offline tiny-checkpoint builder: files, config, tokenizer, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen2ForCausalLM

from omnistage.cli import main
from omnistage.errors import InvalidRequestError
from omnistage.tiny import SUPPORTED_TINY_ARCHS, build_tiny
from omnistage.tiny.qwen2 import make_config
from omnistage.tiny.tokenizer import build_qwen_tokenizer

MULTILINGUAL = "Grüße, café! 你好，世界。 こんにちは 😀👍🏽 €3.50 — done."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights |= load_file(path)
    return weights


def test_supported_archs() -> None:
    assert SUPPORTED_TINY_ARCHS[:2] == ("qwen2", "qwen2_5_omni")
    assert {"qwen_image", "qwen_image_edit", "qwen_image_edit_plus", "qwen_image_layered", "z_image",
            "wan", "wan_i2v"} <= set(SUPPORTED_TINY_ARCHS)


def test_folder_files(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert "model.safetensors.index.json" not in names  # ~0.4 MB: one file


def test_config_fields(tiny_model: Qwen2ForCausalLM) -> None:
    cfg = tiny_model.config
    expected = {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 509,
        "eos_token_id": 511,
    }
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert tiny_model.dtype == torch.float32
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()


def test_config_json_on_disk(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["dtype"] == "float32" and config["model_type"] == "qwen2"
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [511, 509]
    assert generation["pad_token_id"] == 509 and generation["bos_token_id"] == 509
    assert "do_sample" not in generation and "temperature" not in generation
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_weights_are_not_hf_defaults(tiny_dir: Path) -> None:
    weights = load_weights(tiny_dir)
    assert "lm_head.weight" not in weights  # tied to the embedding
    assert weights["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0  # biases are exercised
    norm = weights["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # norm gains are exercised


def test_tokenizer_layout(tiny_tokenizer) -> None:
    assert len(tiny_tokenizer) == 512  # fills the model vocab exactly, specials included
    ids = tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [509, 510, 511]
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.bos_token is None
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(MULTILINGUAL)) == MULTILINGUAL
    # A model vocab may be larger than the tokenizer: such ids decode to nothing, no crash.
    assert tiny_tokenizer.decode([600, 100_000]) == ""


def test_chat_template(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages, {"role": "assistant", "content": "Hello"}]
    text = tiny_tokenizer.apply_chat_template(with_system, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and text.endswith("Hello<|im_end|>\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert tiny_tokenizer.apply_chat_template(parts, tokenize=False) == tiny_tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    tail = tiny_tokenizer.encode("<|im_start|>assistant\n")
    assert ids[0] == 510 and ids[-len(tail) :] == tail and tail[0] == 510


@pytest.mark.parametrize("vocab_size", [300, 4000])
def test_tokenizer_reaches_requested_size(vocab_size: int) -> None:
    tokenizer = build_qwen_tokenizer(vocab_size, extra_special_tokens=["<|AUDIO|>"])
    assert len(tokenizer) == vocab_size
    assert tokenizer.convert_tokens_to_ids("<|AUDIO|>") == vocab_size - 1
    assert tokenizer.decode(tokenizer.encode(MULTILINGUAL)) == MULTILINGUAL


def test_tokenizer_too_small() -> None:
    with pytest.raises(InvalidRequestError, match="at least 259"):
        build_qwen_tokenizer(258)


def test_tokenizer_training_is_deterministic() -> None:
    # The BPE trainer uses Rust hash maps whose keys differ per map (and per process): the
    # result must not depend on them. (Checked across fresh processes too when this was written.)
    first = build_qwen_tokenizer(4000).backend_tokenizer.to_str()
    assert build_qwen_tokenizer(4000).backend_tokenizer.to_str() == first


def test_greedy_decoding_is_informative(tiny_model: Qwen2ForCausalLM, tiny_tokenizer) -> None:
    """Engine-vs-HF greedy comparisons need varied tokens and well-separated top-2 logits."""
    prompts = ["The market opens at eight.", "def mean(values):", "你好，世界", "Q: Why is the sky blue?\nA:"]
    gaps = []
    for prompt in prompts:
        ids = torch.tensor([tiny_tokenizer.encode(prompt)])
        out = tiny_model.generate(
            ids, max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 8, new  # not one token (or a short loop) repeated
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append((top2[0] - top2[1]).item())
    gaps_t = torch.tensor(gaps)
    assert gaps_t.median() > 0.1
    assert gaps_t.min() > 1e-4


def test_same_seed_same_bytes_and_other_seed_differs(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny("qwen2", tmp_path / "again")
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = load_weights(build_tiny("qwen2", tmp_path / "other", seed=1))
    base = load_weights(tiny_dir)
    assert other.keys() == base.keys()
    assert not torch.equal(other["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(other["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny("qwen2", tmp_path / "rng")
    assert torch.equal(torch.rand(3), expected)


def test_overrides_make_a_second_shape(tmp_path: Path) -> None:
    overrides = {"num_hidden_layers": 3, "hidden_size": 96, "head_dim": 24, "intermediate_size": 160, "vocab_size": 600}
    folder = build_tiny("qwen2", tmp_path / "shape2", overrides=overrides)
    model = Qwen2ForCausalLM.from_pretrained(folder)
    assert {k: getattr(model.config, k) for k in overrides} == overrides
    assert len(model.config.layer_types) == 3
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 24, 96)
    assert len(AutoTokenizer.from_pretrained(folder)) == 600


def test_sharded_checkpoint_matches_unsharded(tiny_dir: Path, tmp_path: Path) -> None:
    folder = build_tiny("qwen2", tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    sharded, single = load_weights(folder), load_weights(tiny_dir)
    assert sharded.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    Qwen2ForCausalLM.from_pretrained(folder)

    # Rebuilding unsharded in the same folder leaves no stale shard or index behind.
    build_tiny("qwen2", folder)
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]


def test_bfloat16_storage(tiny_dir: Path, tmp_path: Path) -> None:
    """weights_dtype=bfloat16: every floating tensor stored as bfloat16 (the float32 build's
    values rounded), the shard index's total size and the config's dtype to match; transformers
    loads it (the CLI flag builds the same bytes)."""
    folder = build_tiny("qwen2", tmp_path / "bf16", max_shard_size="100KB", weights_dtype="bfloat16")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stored, full = load_weights(folder), load_weights(tiny_dir)
    assert stored.keys() == full.keys()
    assert all(stored[k].dtype == torch.bfloat16 and torch.equal(stored[k], full[k].bfloat16()) for k in full)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in stored.values())
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).lm_head.weight.dtype == torch.float32
    assert main(["tiny", "qwen2", str(tmp_path / "cli"), "--weights-dtype", "bfloat16"]) == 0
    assert all(torch.equal(t, full[k].bfloat16()) for k, t in load_weights(tmp_path / "cli").items())
    with pytest.raises(InvalidRequestError, match="weights_dtype must be one of"):
        build_tiny("qwen2", tmp_path / "x", weights_dtype="float16")


def test_small_config_shape() -> None:
    config = make_config("small", {}, {"<|endoftext|>": 31997, "<|im_end|>": 31999})
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 57_300_480
    assert config.rope_parameters["rope_theta"] == 1e6 and config.tie_word_embeddings


@pytest.mark.slow
def test_small_build(tmp_path: Path) -> None:
    folder = build_tiny("qwen2", tmp_path / "small", size="small")
    assert (folder / "model.safetensors.index.json").exists()  # 229 MB in 100 MB shards
    assert len(AutoTokenizer.from_pretrained(folder)) == 32000
    Qwen2ForCausalLM.from_pretrained(folder)


def test_unknown_arch_and_size(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="choose one of: qwen2"):
        build_tiny("llama", tmp_path / "x")
    with pytest.raises(InvalidRequestError, match="choose one of: tiny, small"):
        build_tiny("qwen2", tmp_path / "x", size="huge")


def test_cli_tiny(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outdir = tmp_path / "cli"
    assert main(["tiny", "qwen2", str(outdir), "--seed", "0", "--size", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(outdir)
    assert (outdir / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert main(["tiny", "llama", str(tmp_path / "bad")]) == 2
    assert "choose one of: qwen2" in capsys.readouterr().err
