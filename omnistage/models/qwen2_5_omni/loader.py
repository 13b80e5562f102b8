"""Load a Qwen2.5-Omni folder (Qwen2_5OmniForConditionalGeneration layout) into its parts:
the thinker and talker language models (for AR stages), the audio and vision towers (the
encoder stage), token2wav (the vocoder stage), the speakers, and the constants the router
needs. The safetensors are read once per part; each part takes the tensors under its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.errors import CheckpointError, ModelLoadError
from omnistage.models.loader import fill_model, iter_weights, read_config, safetensors_files
from omnistage.models.qwen2_5_omni.router import BridgeConstants
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerLM, TalkerConfig, TalkerTokens
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerLM


@dataclass
class Speaker:
    bos_token: int                 # thinker token id whose embedding opens the talker's reply
    cond: torch.Tensor             # (1, enc_emb_dim) speaker embedding for token2wav
    ref_mel: torch.Tensor          # (1, frames, mel_dim) reference mel for token2wav


@dataclass
class OmniParts:
    config: dict
    thinker: Qwen2_5OmniThinkerLM
    talker: Qwen2_5OmniTalkerLM | None
    tokens: TalkerTokens
    speakers: dict[str, Speaker]


def load_speakers(model_dir: Path) -> dict[str, Speaker]:
    path = model_dir / "spk_dict.pt"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; Qwen2.5-Omni needs it for speech output")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)   # tensors and ints only
    except Exception as e:  # noqa: BLE001 - any unreadable file is a checkpoint fault
        raise CheckpointError(f"{path} is not a readable speaker file ({e})") from e
    try:
        return {name: Speaker(int(v["bos_token"]), v["cond"].float(), v["ref_mel"].float())
                for name, v in raw.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: each speaker needs bos_token, cond and ref_mel ({e!r})") from e


def load_lm_parts(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                  with_talker: bool) -> OmniParts:
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    try:
        thinker = Qwen2_5OmniThinkerLM(Qwen2_5OmniThinkerLM.config_from_omni(cfg), dtype, device)
        talker = None
        if with_talker:
            talker = Qwen2_5OmniTalkerLM(TalkerConfig.from_omni(cfg), dtype, device)
        tokens = TalkerTokens.from_talker_config(cfg["talker_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: not a usable Qwen2.5-Omni config ({e!r})") from e
    files = safetensors_files(model_dir)
    for part in filter(None, (thinker, talker)):
        part.to_empty(device=device)
        fill_model(part, iter_weights(files), str(model_dir))
        part.eval()
    speakers = load_speakers(model_dir) if with_talker else {}
    return OmniParts(cfg, thinker, talker, tokens, speakers)


def bridge_constants(parts: OmniParts) -> BridgeConstants:
    """The embedding rows the router splices into the talker's input, read once."""
    th, tk, t = parts.thinker, parts.talker, parts.tokens
    tc = parts.config["thinker_config"]

    def row(model, token: int) -> torch.Tensor:
        return model.embed_tokens[token].detach().clone()

    return BridgeConstants(
        tokens=t, audio_token_id=tc["audio_token_index"], image_token_id=tc["image_token_index"],
        video_token_id=tc["video_token_index"],
        text_eos_embed=row(th, t.text_eos), text_pad_embed=row(th, t.text_pad),
        speaker_bos={n: s.bos_token for n, s in parts.speakers.items()},
        speaker_bos_embed={n: row(th, s.bos_token) for n, s in parts.speakers.items()},
        codec_bos_embed=row(tk, t.codec_bos) if tk is not None else None,
        codec_pad_embed=row(tk, t.codec_pad) if tk is not None else None)
