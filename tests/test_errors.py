"""Every bad input gives a typed error (omnistage.errors) whose message says what to change;
nothing hangs; and the same Omni keeps serving good requests, with the same greedy output,
leaking no request and no KV block."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from omnistage import Omni, SamplingParams
from omnistage.cli import main
from omnistage.errors import (
    CheckpointError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    OmniStageError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)

MAX_LEN = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GOOD = ["hello world", {"prompt_token_ids": [3, 14, 15, 92, 65]}]


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return Omni(tiny_qwen2, max_model_len=MAX_LEN, block_size=4)


@pytest.fixture(scope="module")
def baseline(llm):
    return [o.token_ids for o in llm.generate(GOOD, GREEDY)]


def assert_still_serves(llm: Omni, baseline) -> None:
    engine = llm.engine.llm
    assert engine.requests == {}, "a failed request was left in the engine"
    assert not engine.scheduler.has_work()
    assert engine.num_free_blocks == engine.num_blocks, "a failed request leaked KV blocks"
    assert [o.token_ids for o in llm.generate(GOOD, GREEDY)] == baseline


def raises(exc_type, *words, param: str | None = None):
    """pytest.raises plus: the message names each of `words` (what to change)."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc_type)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            if not self.ctx.__exit__(*exc):
                return False                # another exception type: let it propagate
            err = self.info.value
            assert isinstance(err, OmniStageError)
            msg = str(err)
            for w in words:
                assert w in msg, f"message {msg!r} does not mention {w!r}"
            if param is not None:
                assert err.param == param, f"param {err.param!r}, expected {param!r}"
            return True
    return _Check()


# ---- bad requests ---------------------------------------------------------------------------

BAD_PROMPTS = {
    "empty_string": ("", InvalidRequestError, ["empty"], "prompt"),
    "empty_token_list": ({"prompt_token_ids": []}, InvalidRequestError, ["empty"], "prompt"),
    "too_long": ({"prompt_token_ids": [5] * MAX_LEN}, PromptTooLongError,
                 [str(MAX_LEN), "max_model_len", "shorten"], "prompt"),
    "much_too_long": ("hello " * 500, PromptTooLongError, ["max_model_len"], "prompt"),
    "token_id_too_big": ({"prompt_token_ids": [1, 2, 512]}, InvalidRequestError, ["[0, 512)"], "prompt"),
    "token_id_negative": ({"prompt_token_ids": [-1, 2]}, InvalidRequestError, ["[0, 512)"], "prompt"),
    "token_ids_not_ints": ({"prompt_token_ids": [1, 2.5]}, InvalidRequestError, ["integers"],
                           "prompt_token_ids"),
    "token_ids_a_string": ({"prompt_token_ids": "1 2 3"}, InvalidRequestError, ["integers"],
                           "prompt_token_ids"),
    "unknown_chat_role": ([{"role": "wizard", "content": "hi"}], InvalidRequestError,
                          ["'wizard'", "role"], "messages[0].role"),
    "chat_message_not_a_dict": ({"messages": ["hi"]}, InvalidRequestError, ["role", "content"],
                                "messages[0]"),
    "dict_without_a_prompt": ({"text": "hi"}, InvalidRequestError,
                              ["prompt", "messages", "prompt_token_ids"], "prompt"),
    "not_a_prompt_in_a_list": ([7], InvalidRequestError, ["string", "int"], "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_a_typed_error_and_the_engine_keeps_serving(llm, baseline, case):
    prompt, exc_type, words, param = BAD_PROMPTS[case]
    with raises(exc_type, *words, param=param):
        llm.generate(prompt, GREEDY)
    assert_still_serves(llm, baseline)


@pytest.mark.parametrize("case", ["empty_string", "too_long", "token_id_too_big"])
def test_one_bad_prompt_in_a_batch_fails_the_call_and_leaks_nothing(llm, baseline, case):
    prompt, exc_type, words, _ = BAD_PROMPTS[case]
    with raises(exc_type, *words):
        llm.generate([GOOD[0], GOOD[1], prompt], GREEDY)
    assert_still_serves(llm, baseline)


@pytest.mark.parametrize("prompt", [123, None, [{"role": "user", "content": 5}]],
                         ids=["int", "none", "chat_content_int"])
def test_prompt_of_a_wrong_type_is_a_typed_error(llm, baseline, prompt):
    with raises(InvalidRequestError):
        llm.generate(prompt, GREEDY)
    assert_still_serves(llm, baseline)


BAD_PARAMS = {
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens", "positive"),
    "max_tokens_negative": ({"max_tokens": -3}, "max_tokens", "positive"),
    "temperature_negative": ({"temperature": -0.5}, "temperature", ">= 0"),
    "temperature_nan": ({"temperature": math.nan}, "temperature", ">= 0"),
    "top_p_zero": ({"top_p": 0.0}, "top_p", "(0, 1]"),
    "top_p_above_one": ({"top_p": 1.5}, "top_p", "(0, 1]"),
    "top_k_below_minus_one": ({"top_k": -2}, "top_k", "-1"),
    "n_zero": ({"n": 0}, "n", ">= 1"),
    "min_tokens_above_max": ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens"),
    "empty_stop_string": ({"stop": [""]}, "stop", "non-empty"),
    "negative_stop_token": ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    "logprobs_too_many": ({"logprobs": 21}, "logprobs", "[0, 20]"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_are_typed_errors(llm, baseline, case):
    kwargs, param, hint = BAD_PARAMS[case]
    with raises(InvalidRequestError, param, hint, param=param):
        SamplingParams(**kwargs)
    assert_still_serves(llm, baseline)


def test_sampling_params_count_must_match_the_prompts(llm, baseline):
    with raises(InvalidRequestError, "2 sampling_params for 3 prompts", "one per prompt",
                param="sampling_params"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    assert_still_serves(llm, baseline)


@pytest.mark.parametrize("options, param, words", [
    ({"max_num_seq": 4}, "max_num_seq", ["unknown engine option", "max_num_seqs"]),
    ({"block_size": 0}, "block_size", ["positive integer"]),
    ({"dtype": "float8"}, "dtype", ["float32", "bfloat16"]),
    ({"device": "nonsense"}, "device", ["torch device"]),
    ({"max_model_len": 4096}, "max_model_len", ["2048", "max_position_embeddings"]),
], ids=["unknown_option", "block_size_zero", "bad_dtype", "bad_device", "max_model_len_too_big"])
def test_bad_engine_options_are_typed_errors(tiny_qwen2, options, param, words):
    with raises(InvalidRequestError, *words, param=param):
        Omni(tiny_qwen2, **options)


def test_kv_pool_too_small_for_max_model_len(tiny_qwen2):
    with raises(InvalidRequestError, "max_model_len=64", "num_kv_blocks", "at least 5 blocks",
                param="num_kv_blocks"):
        Omni(tiny_qwen2, num_kv_blocks=3, block_size=16, max_model_len=64)
    with raises(InvalidRequestError, "kv_cache_memory_gb"):
        Omni(tiny_qwen2, kv_cache_memory_gb=1e-6, max_model_len=64)
    Omni(tiny_qwen2, num_kv_blocks=5, block_size=16, max_model_len=64)   # just enough


# ---- broken model folders -------------------------------------------------------------------

@pytest.fixture
def broken(tiny_qwen2, tmp_path) -> Path:
    """A private copy of the tiny checkpoint to damage."""
    return Path(shutil.copytree(tiny_qwen2, tmp_path / "model"))


WEIGHTS = "model.safetensors"


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with raises(ModelNotFoundError, missing, "config.json", "omnistage tiny"):
        Omni(missing)
    with pytest.raises(FileNotFoundError):   # also catchable as the builtin
        Omni(missing)


def test_folder_without_config_json(broken):
    (broken / "config.json").unlink()
    with raises(ModelNotFoundError, "config.json"):
        Omni(str(broken))


def test_config_json_not_json(broken):
    (broken / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], ')
    with raises(ModelLoadError, "config.json", "not valid JSON"):
        Omni(str(broken))


def test_config_json_not_an_object(broken):
    (broken / "config.json").write_text("[1, 2]")
    with raises(ModelLoadError, "JSON object"):
        Omni(str(broken))


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_lists_the_supported_ones(broken):
    _edit_config(broken, architectures=["LlamaForCausalLM"])
    with raises(UnsupportedArchitectureError, "'LlamaForCausalLM'", "Qwen2ForCausalLM"):
        Omni(str(broken))


def test_config_without_architectures(broken):
    _edit_config(broken, architectures=[])
    with raises(ModelLoadError, "architectures", "Qwen2ForCausalLM"):
        Omni(str(broken))


def test_config_missing_a_field(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with raises(ModelLoadError, "config.json", "hidden_size"):
        Omni(str(broken))


def test_missing_safetensors_file(broken):
    (broken / WEIGHTS).unlink()
    with raises(CheckpointError, "model.safetensors", "index.json"):
        Omni(str(broken))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_file(broken, damage):
    f = broken / WEIGHTS
    data = f.read_bytes()
    f.write_bytes({"truncated": data[:len(data) * 2 // 3], "garbage": b"\x07not safetensors" * 64,
                   "empty": b""}[damage])
    with raises(CheckpointError, str(f), "re-create"):
        Omni(str(broken))


def _shard(folder: Path) -> list[str]:
    """Split the weights into two shards + an index, as big checkpoints come."""
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    names = sorted(tensors)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    half = len(names) // 2
    weight_map = {}
    for shard, part in zip(shards, (names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def test_sharded_checkpoint_loads_and_matches(broken, llm, baseline):
    _shard(broken)
    sharded = Omni(str(broken), max_model_len=MAX_LEN, block_size=4)
    assert [o.token_ids for o in sharded.generate(GOOD, GREEDY)] == baseline


def test_index_referencing_a_missing_shard(broken):
    shards = _shard(broken)
    (broken / shards[1]).unlink()
    with raises(CheckpointError, shards[1], "missing"):
        Omni(str(broken))


def test_index_not_json(broken):
    _shard(broken)
    (broken / "model.safetensors.index.json").write_text("{weight_map")
    with raises(CheckpointError, "model.safetensors.index.json", "index"):
        Omni(str(broken))


def test_checkpoint_missing_a_tensor(broken):
    tensors = load_file(broken / WEIGHTS)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / WEIGHTS, metadata={"format": "pt"})
    with raises(CheckpointError, "layers.1.mlp.gate_up", "incomplete"):
        Omni(str(broken))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
                                  "model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.bias"])
def test_tensor_with_a_wrong_shape(broken, name):
    tensors = load_file(broken / WEIGHTS)
    t = tensors[name]
    tensors[name] = t.new_zeros((t.shape[0] + 1, *t.shape[1:]))
    save_file(tensors, broken / WEIGHTS, metadata={"format": "pt"})
    with raises(CheckpointError, name, "shape", str(tuple(t.shape))):
        Omni(str(broken))


def test_folder_without_tokenizer_files(broken):
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    with raises(ModelLoadError, "tokenizer"):
        Omni(str(broken))


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_generate_with_a_missing_model_exits_2_with_a_message(capsys):
    assert main(["generate", "/nonexistent", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "error" in err and "/nonexistent" in err and "config.json" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, word", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--block-size", "0"], "block_size"),
    (["--max-model-len", "99999"], "max_model_len"),
])
def test_cli_generate_with_bad_options_exits_2(tiny_qwen2, capsys, argv, word):
    assert main(["generate", tiny_qwen2, "hi", *argv]) == 2
    _out, err = capsys.readouterr()
    assert word in err and "Traceback" not in err


def test_cli_generate_prints_the_greedy_text(tiny_qwen2, llm, capsys):
    expected = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=5))[0].text
    assert main(["generate", tiny_qwen2, "hello", "--max-tokens", "5"]) == 0
    out, _err = capsys.readouterr()
    assert out == expected + "\n"
    assert main(["generate", tiny_qwen2, "hello", "--max-tokens", "5", "--max-model-len", "64",
                 "--stream"]) == 0
    assert capsys.readouterr().out == expected + "\n"
