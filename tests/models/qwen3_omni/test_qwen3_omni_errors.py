"""Qwen3-Omni's bad input: folders that cannot serve (a missing component, a talker that does
not fit its thinker) fail to load with a typed error naming what is wrong; bad requests (an
unknown voice, speech without a chat turn, audio from a text-only folder) are client errors
naming the field, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage import Omni, SamplingParams
from omnistage.engine_api import OutputOptions
from omnistage.errors import CheckpointError, InvalidRequestError, ModelLoadError
from omnistage.models.qwen3_omni.messages import TEXT, TalkerStart, TalkerText


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3-errors"), seed=0))


def _copy(folder, tmp_path, edit_config=None, drop_prefix=None):
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop_prefix is not None:
        weights = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if not k.startswith(drop_prefix)}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    return str(out)


def test_missing_code2wav_weights_name_the_component(folder, tmp_path):
    broken = _copy(folder, tmp_path, drop_prefix="code2wav.")
    with pytest.raises(CheckpointError, match="code2wav"):
        Omni(broken)


def test_talker_that_does_not_fit_its_thinker(folder, tmp_path):
    def edit(cfg):
        cfg["talker_config"]["thinker_hidden_size"] = 96
    with pytest.raises(ModelLoadError, match="thinker_hidden_size"):
        Omni(_copy(folder, tmp_path, edit_config=edit))


def test_accept_layer_beyond_the_thinker(folder, tmp_path):
    def edit(cfg):
        cfg["talker_config"]["accept_hidden_layer"] = 9
    with pytest.raises(ModelLoadError, match="accept_hidden_layer"):
        Omni(_copy(folder, tmp_path, edit_config=edit))


def test_bad_requests_are_client_errors_and_the_engine_goes_on(folder):
    with Omni(folder, num_threads=1) as omni:
        chat = [{"role": "user", "content": "hi"}]
        with pytest.raises(InvalidRequestError) as e:
            omni.generate(chat, SamplingParams(max_tokens=2), output=OutputOptions(voice="Nobody"))
        assert e.value.param == "voice"
        with pytest.raises(InvalidRequestError) as e:        # speech needs the assistant's turn
            omni.generate("plain text", SamplingParams(max_tokens=2), output=OutputOptions(voice="Ethan"))
        assert e.value.param == "messages"
        with pytest.raises(InvalidRequestError) as e:
            omni.generate(chat, SamplingParams(max_tokens=2, n=2))
        assert e.value.param == "n"
        [ok] = omni.generate(chat, SamplingParams(max_tokens=3, temperature=0), output=OutputOptions(voice="aiden"))
        assert len(ok.token_ids) >= 1


def test_text_only_folder_serves_text_and_refuses_audio(folder, tmp_path):
    def edit(cfg):
        cfg["enable_audio_output"] = False
    with Omni(_copy(folder, tmp_path, edit_config=edit), num_threads=1) as omni:
        assert list(omni.engine.graph.stages) == ["encoder", "thinker"]
        assert not omni.engine.abilities.audio_output
        [out] = omni.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))
        assert out.token_ids and out.audio is None
        with pytest.raises(InvalidRequestError) as e:
            omni.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                          output=OutputOptions(modalities=["text", "audio"]))
        assert e.value.param in ("modalities", "audio")


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_every_tiny_size_is_a_consistent_folder(size):
    """The builder's sizes pass the checks a real folder must pass (no weights built)."""
    from omnistage.models.qwen3_omni.loader import check_config
    from omnistage.tiny.qwen3_omni import SIZES, make_config
    from omnistage.tiny.qwen3_omni_files import build_qwen3_omni_tokenizer

    _, ids = build_qwen3_omni_tokenizer(SIZES[size].text.vocab_size, 32768)
    check_config(make_config(size, {}, ids).to_dict(), f"tiny {size}")


def test_talker_refusing_a_prompt_fails_that_request_only(folder):
    """The talker's prompt is the thinker's and a few rows more (10 tokens -> 16 rows here): one
    that fits the thinker's context but not the talker's fails as a client error (the talker
    takes its new requests at its next step, batched), and the engine goes on serving."""
    chat = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=3, temperature=0)
    with Omni(folder, num_threads=1) as omni:
        [text] = omni.generate(chat, params, output=OutputOptions(modalities=["text"]))
    limit = len(text.prompt_token_ids) + params.max_tokens + 1     # the thinker's whole request fits
    with Omni(folder, num_threads=1, max_model_len=limit) as omni:
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            omni.generate(chat, params, output=OutputOptions(voice="aiden"))
        [again] = omni.generate(chat, params, output=OutputOptions(modalities=["text"]))
        assert again.token_ids == text.token_ids and again.audio is None
        assert not omni.engine.has_unfinished_requests()


def test_a_request_aborted_before_the_talker_steps_leaves_nothing(folder):
    """The talker takes a new request at its next step: aborted before that, it never reaches
    the engine, its reply rows are dropped, and the stage has no work left."""
    with Omni(folder, num_threads=1) as omni:
        talker = omni.engine.graph.stages["talker"]
        config = json.loads((Path(folder) / "config.json").read_text())
        width = config["talker_config"]["thinker_hidden_size"]
        start = TalkerStart("gone", torch.randn(6, width), [TEXT] * 6, [-1] * 6,
                            SamplingParams(max_tokens=4, temperature=0))
        talker.add(start)
        talker.add(TalkerText("gone", torch.randn(1, width)))
        assert talker.has_work() and talker.num_requests() == 1
        talker.abort("gone")
        assert talker.step() == []
        assert not talker.has_work() and talker.num_requests() == 0
        assert "gone" not in talker.engine.requests
