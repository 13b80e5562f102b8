"""`--code2wav-playback-margin`: seconds or off, into Qwen3-Omni's code2wav settings; other
values refused by the parser (exit 2 with the reason), never a crash later. And
`--token2wav-catch-up` into Qwen2.5-Omni's vocoder settings."""

from __future__ import annotations

import pytest

from omnistage.cli import build_parser, omni_options
from omnistage.tiny import build_tiny


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> str:
    return str(build_tiny("qwen3_omni", tmp_path_factory.mktemp("q3cli"), seed=0))


@pytest.mark.parametrize("value, want", [(None, 0.6), ("0.25", 0.25), ("0", 0.0), ("off", None), ("OFF", None)])
def test_margin_reaches_the_code2wav_settings(qwen3_folder, value, want):
    argv = ["serve", qwen3_folder] + ([] if value is None else ["--code2wav-playback-margin", value])
    settings = omni_options(build_parser().parse_args(argv), qwen3_folder)["omni_settings"]
    assert settings.code2wav.playback_margin_s == want


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_bad_margins_are_refused_by_the_parser(qwen3_folder, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", qwen3_folder, "--code2wav-playback-margin", value])
    assert e.value.code == 2
    assert "seconds >= 0 or 'off'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, want", [([], False), (["--token2wav-catch-up"], True)])
def test_catch_up_reaches_the_vocoder_settings(tiny_omni, flag, want):
    settings = omni_options(build_parser().parse_args(["serve", tiny_omni] + flag), tiny_omni)["omni_settings"]
    assert settings.vocoder.catch_up is want
