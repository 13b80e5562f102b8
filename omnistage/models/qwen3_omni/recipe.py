"""Qwen3-Omni's recipe: its stages, each buildable on its own (in this process, a child process
or a Ray actor), and the router that wires them.

    encoder (audio + vision towers) -> thinker (MoE, AR) -> talker (MoE, AR, + code predictor)
        -> code2wav (causal ConvNet vocoder)

A folder with enable_audio_output false (Thinking / Captioner) has no talker and no code2wav.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Qwen2Config

from omnistage.config import EngineConfig
from omnistage.layers.checkpoint import (eos_token_ids, iter_weights, load_tokenizer, read_config,
                                         safetensors_files)
from omnistage.layers.linear import native_linears_for
from omnistage.layers.snake import use_native_snake
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.llm.engine import LLMEngine
from omnistage.models.qwen2_5_omni.loader import embedding_rows
from omnistage.models.qwen2_5_omni.processor import MediaLimits
from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.code2wav import Code2Wav, use_native_convolutions, use_native_units
from omnistage.models.qwen3_omni.code2wav_stage import Code2WavSettings, Code2WavStage
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.models.qwen3_omni.encoders import Qwen3OmniEncoders
from omnistage.models.qwen3_omni.loader import load_lm
from omnistage.models.qwen3_omni.router import BridgeIds, Qwen3OmniRouter
from omnistage.models.qwen3_omni.talker_stage import ResizeMLP, TalkerParts, TalkerStage
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder
from omnistage.stages.ar import ARStage
from omnistage.stages.base import Stage
from omnistage.stages.encoder import EncoderStage
from omnistage.stages.recipe import Recipe
from omnistage.runtime.process import apply_process_options

THINKER_EMBED = "thinker.model.embed_tokens.weight"
PREDICTOR_ROWS = 64      # frames the code predictor's native caches hold from the start


@dataclass
class Qwen3OmniSettings:
    audio_output: bool = True                 # load talker + code2wav (when the folder has them)
    code2wav: Code2WavSettings = field(default_factory=Code2WavSettings)
    limits: MediaLimits = field(default_factory=MediaLimits)
    encoder_budget: int = 16384               # audio frames + vision patches per encoder step
    audio_cache_windows: int = 64             # audio attention windows (8 s) whose encoding is kept


def speaks(model_dir: str | Path, settings: Qwen3OmniSettings) -> bool:
    return settings.audio_output and read_config(model_dir).get("enable_audio_output", True)


def stage_names(model_dir: str | Path, settings: Qwen3OmniSettings) -> list[str]:
    return ["encoder", "thinker"] + (["talker", "code2wav"] if speaks(model_dir, settings) else [])


def model_dtype(config: EngineConfig) -> torch.dtype:
    raw = read_config(config.model)
    return config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))


def load_thinker_tokenizer(config: EngineConfig):
    """The tokenizer, told the model type (Qwen2 tokenizer files) without building the whole
    Qwen3OmniMoeConfig, whose sub-configs warn about keys they do not declare."""
    return load_tokenizer(config.tokenizer or config.model, config=Qwen2Config())


def build_stage(name: str, config: EngineConfig, settings: Qwen3OmniSettings) -> Stage:
    """Build one stage from the folder, loading only the weights it needs."""
    dev, dtype, model_dir = config.torch_device, model_dtype(config), Path(config.model)
    apply_process_options(config)
    cfg = read_config(model_dir)
    if name == "encoder":
        return EncoderStage(name, _encoders(config, cfg, dtype, dev, settings.audio_cache_windows),
                            settings.encoder_budget)
    if name == "thinker":
        tokenizer = load_thinker_tokenizer(config)
        accept = cfg["talker_config"]["accept_hidden_layer"] if speaks(model_dir, settings) else None
        engine = LLMEngine(config, load_lm(model_dir, "thinker", dtype, dev, export_layer=accept, pack_for=config),
                           tokenizer, eos_token_ids(config.model, tokenizer))
        return ARStage(name, engine)
    if name == "talker":
        engine = LLMEngine(config, load_lm(model_dir, "talker", dtype, dev, pack_for=config), None,
                           {cfg["talker_config"]["codec_eos_token_id"]})
        return TalkerStage(name, engine, _talker_parts(config, cfg, dtype, dev))
    if name == "code2wav":
        model = Code2Wav(cfg["code2wav_config"], torch.float32, dev)
        model.load_weights(iter_weights(safetensors_files(model_dir)))
        if config.linear_kernel != "matmul":
            use_native_snake(model)        # SnakeBeta in one pass each (~30% of its time)
            use_native_units(model)        # and each residual unit in one (~25% of the rest)
            use_native_convolutions(model)  # the other convolutions where the kernel serves them
        stage = Code2WavStage(name, model.eval(), settings.code2wav)
        stage.warm_up()
        return stage
    raise ValueError(f"Qwen3-Omni has no stage {name!r}")


def _encoders(config: EngineConfig, cfg: dict, dtype: torch.dtype, dev: torch.device,
              cache_windows: int) -> Qwen3OmniEncoders:
    th, files = cfg["thinker_config"], safetensors_files(Path(config.model))
    audio = Qwen3OmniAudioEncoder(th["audio_config"], dtype, dev)
    audio.load_weights(iter_weights(files))
    vision = Qwen3OmniVisionEncoder(th["vision_config"], dtype, dev)
    require_complete(vision, load_prefixed(vision, iter_weights(files), "thinker.visual."), "thinker.visual")
    # batch-invariant rows, faster than the default BLAS path here
    native_linears_for(config, dev, dtype, audio, vision)
    return Qwen3OmniEncoders(audio.eval(), vision.eval(), dev, cache_windows)


def _talker_parts(config: EngineConfig, cfg: dict, dtype: torch.dtype, dev: torch.device) -> TalkerParts:
    files, t = safetensors_files(Path(config.model)), cfg["talker_config"]
    sizes = (t["thinker_hidden_size"], t["text_config"]["intermediate_size"], t["text_config"]["hidden_size"])
    projections = [ResizeMLP(*sizes, dtype, dev) for _ in range(2)]
    for proj, name in zip(projections, ("text_projection", "hidden_projection")):
        require_complete(proj, load_prefixed(proj, iter_weights(files), f"talker.{name}."), f"talker.{name}")
    predictor = CodePredictor(t["code_predictor_config"], dtype, dev)
    predictor.load_weights(iter_weights(files))
    # The code predictor reads all its weights 15 times per frame (one token at a time):
    # matrix-vector products at memory speed, where F.linear streams at half of it.
    native_linears_for(config, dev, dtype, predictor, *projections)
    # and each pass's layers in one call, where it serves, bound for a full talker batch (up to
    # 64 frames: a few MB of caches) so that no step pays a rebinding
    predictor.use_native_stack(rows=min(config.max_num_seqs, PREDICTOR_ROWS))
    end, pad = embedding_rows(files, THINKER_EMBED, [cfg["tts_eos_token_id"], cfg["tts_pad_token_id"]])
    return TalkerParts(projections[0].eval(), projections[1].eval(), predictor.eval(),
                       end.to(dev, dtype), pad.to(dev, dtype), prompt_id=t["codec_pad_id"])


def bridge_ids(model_dir: str | Path, dtype: torch.dtype) -> BridgeIds:
    cfg = read_config(model_dir)
    th, t = cfg["thinker_config"], cfg.get("talker_config", {})
    rows = embedding_rows(safetensors_files(Path(model_dir)), THINKER_EMBED,
                          [cfg["tts_pad_token_id"], cfg["tts_bos_token_id"]])
    codec = {k: t.get(f"codec_{k}_id") for k in ("nothink", "think_bos", "think_eos", "pad", "bos")}
    return BridgeIds(cfg["im_start_token_id"], cfg["user_token_id"], cfg["assistant_token_id"],
                     (th["audio_token_id"], th["image_token_id"], th["video_token_id"]), codec,
                     rows[0].to(dtype), rows[1].to(dtype))


def build_router(config: EngineConfig, settings: Qwen3OmniSettings) -> Qwen3OmniRouter:
    return Qwen3OmniRouter(bridge_ids(config.model, model_dtype(config)), speaks(config.model, settings))


def _message_types() -> list[type]:
    from omnistage.models.qwen2_5_omni.messages import AudioChunk, EncodeJob
    from omnistage.models.qwen3_omni.messages import CodecFrames, EncodedMedia, TalkerStart, TalkerText
    from omnistage.stages.ar import ARFeed, ARRequest, ARStepOutput

    return [ARRequest, ARFeed, ARStepOutput, EncodeJob, EncodedMedia, TalkerStart, TalkerText,
            CodecFrames, AudioChunk]


RECIPE = Recipe(__name__, Qwen3OmniSettings, stage_names, build_stage, build_router, _message_types)
