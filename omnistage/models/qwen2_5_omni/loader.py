"""Load a Qwen2.5-Omni folder (Qwen2_5OmniForConditionalGeneration layout) into its parts:
the thinker and talker language models (for AR stages), the audio and vision towers (the
encoder stage), token2wav (the vocoder stage), the speakers, and the constants the router
needs. The safetensors are read once per part; each part takes the tensors under its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from omnistage.config import EngineConfig
from omnistage.errors import CheckpointError, ModelLoadError
from omnistage.layers.checkpoint import iter_weights, read_config, safetensors_files
from omnistage.layers.weights import fill_model, materialize
from omnistage.models.qwen2_5_omni.router import BridgeConstants
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerLM, TalkerConfig, TalkerTokens
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerLM


@dataclass
class Speaker:
    bos_token: int                 # thinker token id whose embedding opens the talker's reply
    cond: torch.Tensor             # (1, enc_emb_dim) speaker embedding for token2wav
    ref_mel: torch.Tensor          # (1, frames, mel_dim) reference mel for token2wav


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


def load_lm(model_dir: str | Path, which: str, dtype: torch.dtype, device: torch.device,
            pack_for: EngineConfig | None = None) -> Qwen2_5OmniThinkerLM | Qwen2_5OmniTalkerLM:
    """The thinker's or the talker's language model, filled from the folder (`pack_for`:
    packing its linear layers for that config's weight format as they load)."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    try:
        if which == "thinker":
            model = Qwen2_5OmniThinkerLM(Qwen2_5OmniThinkerLM.config_from_omni(cfg), dtype, device)
        else:
            model = Qwen2_5OmniTalkerLM(TalkerConfig.from_omni(cfg), dtype, device)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: not a usable Qwen2.5-Omni config ({e!r})") from e
    materialize(model, device)
    fill_model(model, iter_weights(safetensors_files(model_dir)), str(model_dir), pack_for=pack_for)
    return model.eval()


def talker_tokens(cfg: dict) -> TalkerTokens:
    try:
        return TalkerTokens.from_talker_config(cfg["talker_config"])
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"config.json: the talker config lacks its special ids ({e!r})") from e


def embedding_rows(files: list[Path], name: str, ids: list[int]) -> list[torch.Tensor]:
    """Rows of one embedding table, read as slices (the table itself is never loaded)."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            if name in st.keys():
                table = st.get_slice(name)
                return [table[i:i + 1][0].clone() for i in ids]
    raise CheckpointError(f"the checkpoint has no {name}")


def bridge_constants(model_dir: str | Path, audio_output: bool, dtype: torch.dtype) -> BridgeConstants:
    """The ids and embedding rows the router splices into the talker's input, read straight
    from the checkpoint (the router's process holds no model)."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    t, tc = talker_tokens(cfg), cfg["thinker_config"]
    files = safetensors_files(model_dir)
    speakers = load_speakers(model_dir) if audio_output else {}
    names = sorted(speakers)
    text_ids = [t.text_eos, t.text_pad] + [speakers[n].bos_token for n in names]
    rows = [r.to(dtype) for r in embedding_rows(files, "thinker.model.embed_tokens.weight", text_ids)]
    codec = [None, None]
    if audio_output:
        codec = [r.to(dtype) for r in embedding_rows(files, "talker.model.embed_tokens.weight",
                                                      [t.codec_bos, t.codec_pad])]
    return BridgeConstants(
        tokens=t, audio_token_id=tc["audio_token_index"], image_token_id=tc["image_token_index"],
        video_token_id=tc["video_token_index"], text_eos_embed=rows[0], text_pad_embed=rows[1],
        speaker_bos={n: speakers[n].bos_token for n in names},
        speaker_bos_embed=dict(zip(names, rows[2:])),
        codec_bos_embed=codec[0], codec_pad_embed=codec[1])
