"""Qwen2.5-Omni's recipe: its stages, each buildable on its own (in this process, a child
process or a Ray actor), and the router that wires them.

    encoder (audio + vision towers) -> thinker (AR) -> talker (AR) -> token2wav (vocoder)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniToken2WavConfig

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.kernels.build import NativeBuildError
from omnistage.kernels.linear import native_linear_kernel
from omnistage.kernels.linear_w8a8 import W8A8Kernel
from omnistage.layers.checkpoint import (eos_token_ids, iter_weights, load_tokenizer, read_config,
                                         safetensors_files)
from omnistage.layers.linear import native_linears_for
from omnistage.layers.onednn import onednn_bf16_available
from omnistage.layers.snake import use_native_snake
from omnistage.layers.weights import load_prefixed, require_complete
from omnistage.llm.engine import LLMEngine
from omnistage.models.qwen2_5_omni.audio_encoder import AudioEncoder
from omnistage.models.qwen2_5_omni.bigvgan import use_native_activations, use_native_convolutions
from omnistage.models.qwen2_5_omni.encoders import OmniEncoders
from omnistage.models.qwen2_5_omni.loader import (bridge_constants, load_lm, load_speakers,
                                                  talker_tokens)
from omnistage.models.qwen2_5_omni.processor import MediaLimits
from omnistage.models.qwen2_5_omni.router import OmniRouter
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings, VocoderStage
from omnistage.stages.ar import ARStage
from omnistage.stages.base import Stage
from omnistage.stages.encoder import EncoderStage
from omnistage.stages.recipe import Recipe
from omnistage.runtime.process import apply_process_options

log = logging.getLogger(__name__)


@dataclass
class OmniSettings:
    audio_output: bool = True                 # load talker + token2wav
    vocoder: VocoderSettings = field(default_factory=VocoderSettings)
    limits: MediaLimits = field(default_factory=MediaLimits)
    encoder_budget: int = 16384               # audio frames + vision patches per encoder step
    audio_cache_chunks: int = 128             # 2 s audio chunks whose encoding is kept (LRU)


def thinker_config(model_dir: str | Path) -> Qwen2_5OmniThinkerConfig:
    """transformers' thinker config (audio and vision sub-configs). Built alone: the whole
    model's config also validates the talker's ids against its own vocabulary and warns about
    the thinker ids it carries by design."""
    return Qwen2_5OmniThinkerConfig(**read_config(model_dir)["thinker_config"])


def load_thinker_tokenizer(config: EngineConfig):
    """The thinker's tokenizer (`config.tokenizer`, else the model folder's). Given no config,
    transformers' AutoTokenizer builds the folder's whole Qwen2_5OmniConfig just to read its
    model type; that builds the talker's config, which checks every `*_token_id` field against
    the talker's own (codec) vocabulary and warns about the thinker-vocabulary ids it carries by
    design (tts_text_*, audio_*, vision_*: 14 warnings at every start). The thinker's config
    alone is all the tokenizer needs."""
    return load_tokenizer(config.tokenizer or config.model, config=thinker_config(config.model))


def token2wav_config(model_dir: str | Path) -> Qwen2_5OmniToken2WavConfig:
    return Qwen2_5OmniToken2WavConfig(**read_config(model_dir)["token2wav_config"])


def speaks(model_dir: str | Path, settings: OmniSettings) -> bool:
    return settings.audio_output and read_config(model_dir).get("enable_audio_output", True)


def stage_names(model_dir: str | Path, settings: OmniSettings) -> list[str]:
    """Upstream first."""
    names = ["encoder", "thinker"]
    return names + (["talker", "token2wav"] if speaks(model_dir, settings) else [])


def model_dtype(config: EngineConfig) -> torch.dtype:
    raw = read_config(config.model)
    return config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))


def build_stage(name: str, config: EngineConfig, settings: OmniSettings) -> Stage:
    """Build one stage from the folder, loading only the weights it needs."""
    dev, dtype, model_dir = config.torch_device, model_dtype(config), Path(config.model)
    apply_process_options(config)
    if name == "encoder":
        tc = thinker_config(model_dir)
        files = safetensors_files(model_dir)
        audio = AudioEncoder(tc.audio_config, dtype, dev)
        audio.load_weights(iter_weights(files))
        vision = Qwen2_5OmniVisionEncoder(tc.vision_config, dtype, dev)
        require_complete(vision, load_prefixed(vision, iter_weights(files), "thinker.visual."),
                         "thinker.visual")
        # The towers' linear layers through the native GEMM: faster than the default BLAS
        # path here, and a row's result no longer depends on the batch around it, so a
        # request's media embeds to the same bits however the stage batches it.
        native_linears_for(config, dev, dtype, audio, vision)
        encoders = OmniEncoders(audio.eval(), vision.eval(), dev, settings.audio_cache_chunks)
        return EncoderStage(name, encoders, settings.encoder_budget)
    if name == "thinker":
        tokenizer = load_thinker_tokenizer(config)
        engine = LLMEngine(config, load_lm(model_dir, "thinker", dtype, dev, pack_for=config), tokenizer,
                           eos_token_ids(config.model, tokenizer))
        return ARStage(name, engine)
    if name == "talker":
        # No text, stops on the codec stop ids. Its prompts are embeddings (the thinker's rows):
        # the prefix cache keys them by content, so the shared system prompt is reused.
        stop = talker_tokens(read_config(model_dir)).stop_ids
        engine = LLMEngine(config, load_lm(model_dir, "talker", dtype, dev, pack_for=config), None, set(stop))
        return ARStage(name, engine)
    if name == "token2wav":
        return token2wav_stage(name, config, settings, model_dir, dev)
    raise ValueError(f"Qwen2.5-Omni has no stage {name!r}")


def token2wav_stage(name: str, config: EngineConfig, settings: OmniSettings, model_dir: Path,
                    dev: torch.device) -> VocoderStage:
    """The vocoder stage: the DiT's products in float32, bf16 and / or int8 as settings ask
    (CPU: oneDNN's packed GEMMs and the native kernels), warmed up."""
    t2w = Token2Wav(token2wav_config(model_dir), torch.float32, dev)
    t2w.load_weights(iter_weights(safetensors_files(model_dir)))
    w8a8 = int8_dit_kernel(config, settings.vocoder, dev)
    bf16 = settings.vocoder.bf16_dit
    if bf16 and dev.type == "cpu" and config.linear_kernel != "matmul" and not onednn_bf16_available():
        # emulated bf16: the small checkpoint's DiT under autocast took 4.5x float32's time (Zen 3)
        log.warning("--token2wav-bf16: this CPU has no bfloat16 units (AVX-512 BF16 or AMX), where "
                    "bf16 matmuls are emulated and slower than float32: the DiT stays float32")
        bf16 = False
    # float32: the frame-row products in the native kernel where the linear kernel setting
    # allows it (auto, native), the blocks then in one native call (use_native_stack)
    native = None
    if (w8a8 is None and not bf16 and config.linear_kernel in ("auto", "native")
            and t2w.dit.stack_fits()):
        native, _ = native_linear_kernel(config.linear_kernel, dev, torch.float32)
    packed = 0
    if config.linear_kernel != "matmul":   # ~1.7x on the DiT's GEMMs on CPU (fp32); bf16 where
        # the CPU has bf16 dot products: weights and GEMM inputs rounded, ~1.3-1.8x more
        dtype = torch.bfloat16 if bf16 else torch.float32
        packed = t2w.dit.pack_for_onednn(dtype, w8a8, native)
        if w8a8 is not None and not packed:      # bf16 asked where the CPU has no bf16 units
            packed = t2w.dit.pack_for_onednn(torch.float32, w8a8)
    if bf16 and not packed:
        t2w.dit.bf16_matmuls = True        # autocast elsewhere (GPUs, the matmul kernel)
    if w8a8 is not None and not packed:
        raise InvalidRequestError("the int8 token2wav DiT needs oneDNN's packed GEMMs for its "
                                  "other products, which this torch build lacks", param="int8_dit")
    if config.linear_kernel != "matmul":
        t2w.dit.use_native_attention()     # each layer's block windows in one native call
        t2w.dit.use_native_stack()         # and, with int8 or native products, all blocks in one
        # BigVGAN's anti-aliased activations in one pass each; where that kernel does not
        # build, at least their SnakeBeta (the torch path then runs it)
        if not use_native_activations(t2w.vocoder):
            use_native_snake(t2w.vocoder)
        use_native_convolutions(t2w.vocoder)
    stage = VocoderStage(name, t2w.eval(), load_speakers(model_dir), settings.vocoder)
    stage.warm_up()
    return stage


def int8_dit_kernel(config: EngineConfig, vocoder: VocoderSettings, dev: torch.device) -> W8A8Kernel | None:
    """The W8A8 kernel for the DiT when the settings ask for it (None otherwise); a clear
    error where it cannot serve (another device, the plain matmul kernel, no C compiler)."""
    if not vocoder.int8_dit:
        return None
    if dev.type != "cpu" or config.linear_kernel == "matmul":
        raise InvalidRequestError(f"the int8 token2wav DiT is a CPU kernel (device {dev.type}, linear "
                                  f"kernel {config.linear_kernel}): use bf16_dit there", param="int8_dit")
    try:
        kernel = W8A8Kernel()
    except NativeBuildError as e:
        raise InvalidRequestError(f"the int8 token2wav DiT's kernel did not build: {e}", param="int8_dit") from e
    if not kernel.vnni:
        log.warning("int8 token2wav DiT: this CPU has no VNNI (AVX-512 VNNI or AVX-VNNI); its plain C "
                    "path is slower than float32 (bf16_dit alone serves this CPU better)")
    return kernel


def build_router(config: EngineConfig, settings: OmniSettings) -> OmniRouter:
    audio = speaks(config.model, settings)
    return OmniRouter(bridge_constants(config.model, audio, model_dtype(config)), audio)


def generation_defaults(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _message_types() -> list[type]:
    from omnistage.models.qwen2_5_omni.messages import (AudioChunk, CodecChunk, EncodedMedia,
                                                        EncodeJob)
    from omnistage.stages.ar import ARFeed, ARRequest, ARStepOutput

    return [ARRequest, ARFeed, ARStepOutput, EncodeJob, EncodedMedia, CodecChunk, AudioChunk]


RECIPE = Recipe(__name__, OmniSettings, stage_names, build_stage, build_router, _message_types)
