"""Reading a Qwen3-Omni folder: its language models, the talker's small modules, its voices."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.config import EngineConfig
from omnistage.errors import CheckpointError, ModelLoadError
from omnistage.layers.checkpoint import iter_weights, read_config, safetensors_files
from omnistage.layers.weights import fill_model, materialize
from omnistage.models.qwen3_omni.lms import Qwen3OmniTalkerLM, Qwen3OmniThinkerLM


def load_lm(model_dir: str | Path, which: str, dtype: torch.dtype, device: torch.device,
            export_layer: int | None = None,
            pack_for: EngineConfig | None = None) -> Qwen3OmniThinkerLM | Qwen3OmniTalkerLM:
    """The thinker's (`export_layer`: the layer whose output it hands out) or the talker's
    language model, filled from the folder (`pack_for`: packing its linear layers for that
    config's weight format as they load)."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    cls = Qwen3OmniThinkerLM if which == "thinker" else Qwen3OmniTalkerLM
    try:
        model = cls(cls.config_from_omni(cfg), dtype, device)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: not a usable Qwen3-Omni {which} config ({e!r})") from e
    if export_layer is not None and not 0 <= export_layer <= model.config.num_hidden_layers:
        raise ModelLoadError(f"{model_dir / 'config.json'}: talker_config.accept_hidden_layer "
                             f"{export_layer} is not a layer of the thinker's {model.config.num_hidden_layers}")
    model.export_layer = export_layer
    materialize(model, device)
    fill_model(model, iter_weights(safetensors_files(model_dir)), str(model_dir), pack_for=pack_for)
    return model.eval()


def speakers(cfg: dict) -> dict[str, int]:
    """Voice name (as the folder spells it, e.g. "ethan") -> its codec id."""
    raw = cfg.get("talker_config", {}).get("speaker_id") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
        raise CheckpointError("config.json: talker_config.speaker_id must map voice names to codec ids")
    return dict(raw)


def voice_order(voices) -> list[str]:
    """transformers' default voice ("ethan") first -- the default here too -- then the others
    by name."""
    return sorted(voices, key=lambda name: (name != "ethan", name))


def check_config(cfg: dict, where: str) -> None:
    """The parts of a Qwen3-Omni config.json that must agree, checked before any weight is
    read: ModelLoadError naming the field that does not fit."""
    try:
        text = cfg["thinker_config"]["text_config"]
        if not cfg.get("enable_audio_output", True):
            return
        t, c2w = cfg["talker_config"], cfg["code2wav_config"]
        pairs = [
            ("talker_config.thinker_hidden_size", t["thinker_hidden_size"], text["hidden_size"],
             "the thinker's hidden_size"),
            ("talker_config.code_predictor_config.hidden_size", t["code_predictor_config"]["hidden_size"],
             t["text_config"]["hidden_size"], "the talker's hidden_size"),
            ("talker_config.num_code_groups", t["num_code_groups"], c2w["num_quantizers"],
             "code2wav_config.num_quantizers"),
            ("talker_config.code_predictor_config.vocab_size", t["code_predictor_config"]["vocab_size"],
             c2w["codebook_size"], "code2wav_config.codebook_size"),
        ]
        for name, got, want, what in pairs:
            if got != want:
                raise ModelLoadError(f"{where}: {name} is {got}, but {what} is {want}; the folder's "
                                     f"talker does not fit its thinker")
        layer = t["accept_hidden_layer"]
        if not 0 <= layer <= text["num_hidden_layers"]:
            raise ModelLoadError(f"{where}: talker_config.accept_hidden_layer {layer} is not a layer of "
                                 f"the thinker's {text['num_hidden_layers']}")
        speakers(cfg)
    except KeyError as e:
        raise ModelLoadError(f"{where}: a Qwen3-Omni config needs {e.args[0]!r}") from None
