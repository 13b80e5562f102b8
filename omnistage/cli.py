"""The `omnistage` command line.

Each subcommand is a `Subcommand`: a function that declares its arguments and a function that
runs it. Adding one (`generate`, `serve`, `bench`) is one entry in `SUBCOMMANDS` plus its two
functions; heavy imports stay inside `run` so `omnistage --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the process exit code


def _tiny_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arch", help="architecture to build, e.g. qwen2")
    parser.add_argument("outdir", help="folder to write the checkpoint into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    parser.add_argument("--size", default="tiny", help="tiny (tests) or small (benchmarks); default: tiny")
    parser.add_argument("--weights-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="how the weights are stored: bfloat16 as released models are (default: float32)")


def _tiny_run(args: argparse.Namespace) -> int:
    from omnistage.tiny import build_tiny

    print(build_tiny(args.arch, args.outdir, seed=args.seed, size=args.size, weights_dtype=args.weights_dtype))
    return 0


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="HF-format model folder, or tiny:ARCH for a built-in tiny model")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as one user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables (default: -1)")
    parser.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                        help="sampling seed (default: none)")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--audio-out", default=None, metavar="WAV",
                        help="speech models: write the spoken answer to this WAV file (asks for "
                             "text + audio; default: text only)")
    parser.add_argument("--voice", default=None, help="speech models: the speaker (default: the model's first)")
    _engine_arguments(parser)
    _omni_arguments(parser)
    from omnistage.diffusion.cli import add_generate_arguments

    add_generate_arguments(parser)
    _diffusion_arguments(parser)


def _omni_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("omni models (stage graphs)")
    g.add_argument("--deploy-config", default=None, metavar="YAML",
                   help="where each stage runs: local (default), process (its own OS process) or "
                        "ray (a Ray actor); see docs/architecture.md")
    g.add_argument("--token2wav-steps", type=int, default=10,
                   help="ODE steps of the speech decoder per chunk (default: 10)")
    g.add_argument("--token2wav-first-chunk", type=int, default=None, metavar="CODES",
                   help="Qwen2.5-Omni: codec codes in a request's first speech-decoder chunk "
                        "(default: 2 DiT blocks plus the vocoder's context, 48 on the released "
                        "model: the first audio lasts until the second chunk is decoded on a CPU; "
                        "24: first audio ~0.1 s sooner, for where the DiT is fast, e.g. a GPU)")
    g.add_argument("--token2wav-first-chunk-busy", type=int, default=None, metavar="CODES",
                   help="Qwen2.5-Omni, opt-in for live voice on a CPU: codes in the first chunk of a "
                        "request whose speech starts while others' is being decoded (default: "
                        "as alone). 72 on the released model gives those listeners 1.08 s of first "
                        "speech (48: 0.6 s) to play while the decoder serves every stream; a lone "
                        "request's first audio is unchanged; the audio then depends on timing "
                        "within ~1e-5")
    g.add_argument("--token2wav-bf16", action="store_true",
                   help="speech decoder DiT GEMMs in bfloat16: oneDNN's bf16 GEMMs on CPUs with bf16 "
                        "dot products (1.3x float32 on an AMD Zen 5), autocast on GPUs and with "
                        "--linear-kernel matmul; ignored with a warning on CPUs without bf16 units (emulated "
                        "bf16 took 4.5x float32's time); mel within ~0.2%% RMS of float32 (default: float32, "
                        "as the reference)")
    g.add_argument("--token2wav-int8", action="store_true",
                   help="Qwen2.5-Omni, opt-in speed for quality: the speech decoder DiT's products over "
                        "frame rows in int8 (weights per output column, activations per row; VNNI's "
                        "int8 dot products where the CPU has them: ~1.8x bf16 on an AMD Zen 5; a "
                        "slow plain path elsewhere); with --token2wav-bf16 its other products in "
                        "bf16. Mel within 0.04%% RMS of float32 (0.2%% with --token2wav-bf16) on "
                        "random-weight checkpoints (default: float32, as the reference)")
    g.add_argument("--token2wav-catch-up", action="store_true",
                   help="Qwen2.5-Omni, opt-in throughput under overload: while a listener has run "
                        "dry, every request's next speech-decoder chunk is the largest, so fewer "
                        "windows recompute the DiT's context (+15-20%% audio per second at 16 "
                        "requests on 2 cores); audio then depends on timing within ~1e-5 "
                        "(default: chunks by the codes alone)")
    g.add_argument("--code2wav-playback-margin", type=_margin, default=0.6, metavar="SECONDS|off",
                   help="Qwen3-Omni: a listener with less than this much sent speech left to play "
                        "gets the frames its request has at once instead of the next chunk size "
                        "(default: 0.6). The chunk boundaries then depend on timing, and the audio "
                        "on them by float rounding; 'off': chunk sizes only, the same audio bytes "
                        "in every run")


def _margin(value: str) -> float | None:
    """--code2wav-playback-margin: seconds >= 0, or off."""
    if value.strip().lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'off', got {value!r}")
    return seconds


def omni_options(args: argparse.Namespace, model_dir: str) -> dict:
    """The omni family's settings for the folder (Qwen3-Omni's or Qwen2.5-Omni's; text models
    ignore them; the cascade keeps its defaults) and the deploy config."""
    from omnistage.layers.checkpoint import architecture_of, read_config

    architecture = architecture_of(read_config(model_dir))
    if architecture == "OmnistageCascade":          # cascade:ASR+LLM+TTS: its defaults
        return {"deploy_config": args.deploy_config}
    if architecture == "Qwen3OmniMoeForConditionalGeneration":
        from omnistage.models.qwen3_omni.recipe import Qwen3OmniSettings

        from omnistage.models.qwen3_omni.code2wav_stage import Code2WavSettings

        code2wav = Code2WavSettings(playback_margin_s=args.code2wav_playback_margin)
        return {"deploy_config": args.deploy_config, "omni_settings": Qwen3OmniSettings(code2wav=code2wav)}
    from omnistage.models.qwen2_5_omni.recipe import OmniSettings
    from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings

    return {"deploy_config": args.deploy_config,
            "omni_settings": OmniSettings(vocoder=VocoderSettings(steps=args.token2wav_steps,
                                                                  bf16_dit=args.token2wav_bf16,
                                                                  int8_dit=args.token2wav_int8,
                                                                  first_chunk=args.token2wav_first_chunk,
                                                                  first_chunk_busy=args.token2wav_first_chunk_busy,
                                                                  catch_up=args.token2wav_catch_up))}


def _diffusion_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("image and video models (diffusers folders)")
    g.add_argument("--max-image-pixels", type=int, default=2048 * 1024,
                   help="largest width x height of a generated image or video frame; larger "
                        "sizes get 400 (default: 2097152 = 2048x1024)")
    g.add_argument("--max-images-per-request", type=int, default=4,
                   help="largest n (images per request) (default: 4)")
    g.add_argument("--max-diffusion-steps", type=int, default=100,
                   help="largest num_inference_steps a request may ask for (default: 100)")
    g.add_argument("--max-video-frames", type=int, default=81,
                   help="largest number of frames of a generated video (default: 81)")
    g.add_argument("--diffusion-cache", default="none", choices=["none", "teacache", "fbcache"],
                   help="step cache for requests that do not choose one: reuses the transformer's "
                        "residual on steps where its input barely changed; faster, slightly "
                        "different images (default: none)")
    g.add_argument("--diffusion-max-batch", type=int, default=8,
                   help="denoising jobs (images / videos of equal shape) batched into one "
                        "transformer forward (default: 8)")
    g.add_argument("--max-video-jobs", type=int, default=32,
                   help="video jobs the server remembers; beyond it the oldest finished ones "
                        "and their MP4s are forgotten (default: 32)")


def model_settings(args: argparse.Namespace, model_dir: str) -> dict:
    """omni_settings and deploy_config for the model at `model_dir`: DiffusionSettings from
    the diffusion flags for a diffusers folder (model_index.json), else the omni options."""
    from pathlib import Path

    if not (Path(model_dir) / "model_index.json").is_file():
        return omni_options(args, model_dir)
    from omnistage.diffusion.params import DiffusionLimits
    from omnistage.diffusion.recipe import DiffusionSettings
    from omnistage.diffusion.stage import DiffusionStageSettings

    for flag in ("max_image_pixels", "max_images_per_request", "max_diffusion_steps",
                 "max_video_frames", "diffusion_max_batch", "max_video_jobs"):
        if getattr(args, flag) < 1:
            from omnistage.errors import InvalidRequestError

            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be >= 1, "
                                      f"got {getattr(args, flag)}")
    settings = DiffusionSettings(
        limits=DiffusionLimits(max_pixels=args.max_image_pixels, max_n=args.max_images_per_request,
                               max_steps=args.max_diffusion_steps, max_frames=args.max_video_frames),
        stage=DiffusionStageSettings(max_batch=args.diffusion_max_batch),
        default_cache=args.diffusion_cache)
    return {"deploy_config": args.deploy_config, "omni_settings": settings}


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that loads a model (see EngineConfig)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default: auto: "
                   "the checkpoint's dtype on GPU, float32 on CPU)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="per-step token budget for prefill chunks + decodes (default: 2048)")
    g.add_argument("--max-background-tokens", type=int, default=64,
                   help="of that budget, the most a step gives background prefills (Realtime turns "
                        "prefilled while still spoken), so that a response arriving meanwhile "
                        "waits at most one short step (default: 64)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: sized "
                   "from --kv-cache-memory-gb)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="KV pool memory cap (default: 2)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="how K and V are stored: bfloat16 halves the pool's bytes per token "
                        "(values rounded to 8 significant bits; attention still computes in the "
                        "model's dtype). Default: auto (the model's dtype)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse KV blocks of identical prompt prefixes")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--host-memory", default="retain", choices=["retain", "system"],
                   help="retain: glibc's malloc keeps freed memory for the next step (blocks up to "
                        "32 MiB from the heap, up to 1 GiB kept free at its top) instead of "
                        "faulting in fresh pages for every large activation; resident memory stays "
                        "at its high-water mark. system: the C library's defaults (default: retain)")
    _kernel_arguments(g)
    g.add_argument("--engine-seed", dest="seed", type=int, default=0,
                   help="seed of unseeded sampling and of unseeded speech noise (default: 0)")


def _kernel_arguments(g: argparse._ArgumentGroup) -> None:
    """The engine options that choose the kernels and how weights are stored."""
    g.add_argument("--linear-kernel", default="auto", choices=["auto", "native", "onednn", "matmul"],
                   help="linear layers of the LLM stages: our native CPU kernel (fp32, compiled on "
                        "first use), oneDNN's packed GEMM (fp32 on CPU) or plain matmul (default: "
                        "auto: native where it builds, else onednn where available, else matmul; "
                        "diffusion stages use onednn for anything but matmul)")
    g.add_argument("--attention-kernel", default="auto", choices=["auto", "native", "torch"],
                   help="attention: the native CPU kernels (fp32, compiled on first use with the "
                        "machine's C compiler) or plain PyTorch (default: auto: native where "
                        "they build)")
    g.add_argument("--quantization", default="none", choices=["none", "bf16", "int8", "int4"],
                   help="how linear layers store their weights on CPU (native kernel; for the "
                        "activations int8 and int4 multiply see --int8/--int4-activations): bf16 (half the bytes, rounding error ~0.4%% per weight), "
                        "int8 (a quarter; one scale per output channel), int4 (an eighth; one "
                        "scale per --quantization-group-size inputs). Quantized once at load from "
                        "the checkpoint. Default: none (nothing rounded: float32, or bfloat16 for "
                        "a bf16 checkpoint's weights, exactly)")
    g.add_argument("--quantization-group-size", type=int, default=64,
                   help="inputs sharing one int4 scale (default: 64; smaller: more accurate, "
                        "more scale bytes)")
    g.add_argument("--int4-activations", default="int8", choices=["int8", "float32"],
                   help="what int4 weights multiply (their inputs and groups multiples of 32): "
                        "int8 rounds each block of 32 activations to int8 steps and uses integer "
                        "dot products (llama.cpp's q4_0 x q8_0 numerics, ~2x faster); float32 "
                        "multiplies the dequantized weights exactly (default: int8)")
    g.add_argument("--int8-activations", default="int8", choices=["int8", "float32"],
                   help="what int8 weights (and GGUF q8_0 weights) multiply (their inputs "
                        "multiples of 32): int8 rounds each block of 32 activations to int8 "
                        "steps and uses integer dot products (llama.cpp's q8_0 x q8_0 numerics, "
                        "~1.1x faster single rows); float32 multiplies the dequantized weights "
                        "exactly (default: int8)")


def engine_options(args: argparse.Namespace) -> dict:
    from omnistage.config import EngineConfig

    return {k: getattr(args, k) for k in EngineConfig.option_names() if hasattr(args, k)}


def _generate_run(args: argparse.Namespace) -> int:
    from omnistage import Omni, SamplingParams
    from omnistage.engine_api import OutputOptions
    from omnistage.entrypoints.model_source import resolve_model

    model = resolve_model(args.model)
    llm = Omni(model, **engine_options(args), **model_settings(args, model))
    if llm.engine.abilities.makes_pixels:      # an image / video model
        from omnistage.diffusion.cli import run_generate

        with llm:
            return run_generate(args, llm)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    speak = args.audio_out is not None
    prompt = [{"role": "user", "content": args.prompt}] if (args.chat or speak) else args.prompt
    opts = OutputOptions(modalities=["text", "audio"] if speak else ["text"], voice=args.voice)
    with llm:
        if args.stream:
            audio = []
            for delta in llm.stream(prompt, params, opts):
                print(delta.text, end="", flush=True)
                if delta.audio is not None:
                    audio.append(delta.audio)
            print()
            wav, rate = (_concat(audio), 24000) if audio else (None, None)
        else:
            out = llm.generate(prompt, params, output=opts)[0]
            print(out.text)
            wav, rate = out.audio, out.sample_rate
    if speak:
        import soundfile

        if wav is None:
            print("omnistage generate: the model produced no audio", file=sys.stderr)
            return 1
        soundfile.write(args.audio_out, wav, rate)
        print(f"wrote {wav.size / rate:.2f} s of audio to {args.audio_out}", file=sys.stderr)
    return 0


def _concat(chunks):
    import numpy as np

    return np.concatenate(chunks)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="HF-format model folder, or tiny:ARCH for a built-in tiny model")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (and "
                             "/metrics with --metrics-auth open). The command line shows in ps: "
                             "prefer --api-key-file or the environment variable OMNISTAGE_API_KEY, "
                             "which either flag overrides (default: no key)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API key from this file (surrounding whitespace stripped; "
                             "unreadable, empty, or given with --api-key is an error)")
    parser.add_argument("--metrics-auth", default="key", choices=["key", "open"],
                        help="with an API key: 'key' asks for it on /metrics too, 'open' lets "
                             "Prometheus scrape without it (the metrics name no request or "
                             "client; default: key). /health never asks for the key")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the MODEL argument)")
    parser.add_argument("--log-level", default="info",
                        help="log level of the server and uvicorn; 'info' includes one access line "
                             "per request on the logger omnistage.access (default: info)")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="leave out the per-request access lines (default: logged at info)")
    parser.add_argument("--allowed-origins", nargs="*", default=[],
                        help="CORS origins allowed to call the API from a browser (default: none)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests that may wait beyond those being served: the server admits "
                             "a request (counted on arrival until its response ends) while fewer "
                             "than --max-num-seqs (image/video models: --diffusion-max-batch) + "
                             "this many are in flight, and answers the rest 429 with Retry-After; "
                             "0: no waiting line (default: 256)")
    parser.add_argument("--max-body-mb", type=float, default=16.0,
                        help="largest request body accepted, in MiB; larger gets 413 (default: 16)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish (default: 30)")
    parser.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose http(s) media URLs (image_url, audio, video) are fetched: "
                             "example.com matches that host only, *.example.com its subdomains; "
                             "private addresses never (default: none: data: URLs only)")
    parser.add_argument("--max-media-mb", type=float, default=32.0,
                        help="largest fetched media file, in MiB (default: 32)")
    parser.add_argument("--realtime-streamed-input", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="Realtime API: while a turn is spoken, prefill the conversation and "
                             "the audio so far (about every second of speech, one request in "
                             "flight per session), so that at the end of the turn only its last "
                             "second and the answer remain to compute; the answer is the same "
                             "either way. Costs the repeated prefill of each turn's last part "
                             "(default: on)")
    _engine_arguments(parser)
    _omni_arguments(parser)
    _diffusion_arguments(parser)


def _server_limits(args: argparse.Namespace, model_dir: str):
    from pathlib import Path

    from omnistage.errors import InvalidRequestError
    from omnistage.media.fetch import MediaFetchPolicy
    from omnistage.server.app import ServerLimits

    if args.max_queued_requests < 0:
        raise InvalidRequestError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    diffusers = (Path(model_dir) / "model_index.json").is_file()
    return ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20),
                        max_queued_requests=args.max_queued_requests,
                        seats=args.diffusion_max_batch if diffusers else args.max_num_seqs,
                        metrics_auth=args.metrics_auth,
                        allowed_origins=tuple(args.allowed_origins),
                        media=MediaFetchPolicy(allowed_domains=tuple(args.allowed_media_domains),
                                               max_bytes=int(args.max_media_mb * 2**20)),
                        max_video_jobs=args.max_video_jobs,
                        realtime_streamed_input=args.realtime_streamed_input)


def serve_parts(args: argparse.Namespace, api_key: str | None):
    """What `omnistage serve` runs: (the engine, the app around it, uvicorn's config). Also the
    demo's own server. The engine is built here (weights loaded) before this returns."""
    import uvicorn

    from omnistage import AsyncOmni
    from omnistage.entrypoints.model_source import resolve_model
    from omnistage.runtime.process import freeze_loaded_heap
    from omnistage.server.app import build_app
    from omnistage.server.realtime_events import WS_MAX_MESSAGE_BYTES

    model_dir = resolve_model(args.model)      # tiny:ARCH built here, once
    limits = _server_limits(args, model_dir)
    engine = AsyncOmni(model_dir, **engine_options(args), **model_settings(args, model_dir))
    freeze_loaded_heap()      # the server's objects so far live as long as it: out of the GC's walks
    app = build_app(engine, args.served_model_name or args.model, api_key, limits)
    # over uvicorn's 16 MiB: an oversized Realtime event is an error event, not a close (1009)
    # access_log off: omnistage.access logs each request when it ends (uvicorn's at its start)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
                            ws_max_size=WS_MAX_MESSAGE_BYTES)
    return engine, app, config


def _serve_logging(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.access_log:
        logging.getLogger("omnistage.access").setLevel(logging.WARNING)


def _serve_run(args: argparse.Namespace) -> int:
    from omnistage.runtime.process import serial_torch_thread
    from omnistage.server.serve import DrainingServer, resolve_api_key

    # Before any torch work here: the engine's thread keeps the process's one OpenMP team.
    serial_torch_thread()
    _serve_logging(args)
    api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ.get("OMNISTAGE_API_KEY"))
    engine, app, config = serve_parts(args, api_key)
    try:
        DrainingServer(config, app, engine, args.shutdown_timeout).run()
    finally:
        engine.shutdown()
    return 0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model to serve for the demo (folder, tiny:ARCH or cascade:ASR+LLM+TTS); "
                             "not needed with --api-base")
    parser.add_argument("--api-base", default=None,
                        help="an omnistage server's URL (e.g. http://127.0.0.1:8000/v1); default: "
                             "serve MODEL in the demo's own process (as `omnistage serve MODEL` "
                             "with its defaults would) on a free loopback port")
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: $OMNISTAGE_API_KEY; the demo's own "
                             "server gets a fresh random key)")
    parser.add_argument("--host", default="127.0.0.1", help="address the page listens on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860, help="port of the page (default: 7860)")


def _demo_run(args: argparse.Namespace) -> int:
    import secrets

    from omnistage.demo import LocalServer, run_demo

    if args.api_base is None and args.model is None:
        from omnistage.errors import InvalidRequestError

        raise InvalidRequestError("give a MODEL to serve, or --api-base of a running server", param="model")
    api_key = args.api_key or os.environ.get("OMNISTAGE_API_KEY")
    if args.api_base is not None:
        return run_demo(args.api_base, api_key, args.host, args.port)
    from omnistage.runtime.process import serial_torch_thread

    serial_torch_thread()        # as in `serve`: the engine's thread keeps the one OpenMP team
    serve_args = build_parser().parse_args(["serve", args.model, "--log-level", "warning"])
    _serve_logging(serve_args)
    api_key = api_key or secrets.token_urlsafe(24)     # the page's own server is never open
    engine, _, config = serve_parts(serve_args, api_key)
    server = LocalServer(config, engine)
    try:
        return run_demo(server.url, api_key, args.host, args.port)
    finally:
        server.stop(serve_args.shutdown_timeout)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        help="serve a model over the OpenAI API (chat completions with audio, completions, "
             "audio speech and transcriptions, models; images and videos for diffusers models)",
        add_arguments=_serve_arguments,
        run=_serve_run,
    ),
    "generate": Subcommand(
        help="generate text for one prompt and print it",
        add_arguments=_generate_arguments,
        run=_generate_run,
    ),
    "demo": Subcommand(
        help="a web page (Gradio) in front of a server: text and voice chat, speech, "
             "transcription, images; needs the demo extra",
        add_arguments=_demo_arguments,
        run=_demo_run,
    ),
    "tiny": Subcommand(
        help="build a tiny random HF-format checkpoint (weights, config, tokenizer) offline",
        add_arguments=_tiny_arguments,
        run=_tiny_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="omnistage: serve omni-modal models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from omnistage.errors import InvalidRequestError, ModelLoadError

    try:
        return SUBCOMMANDS[args.command].run(args)
    except (InvalidRequestError, ModelLoadError) as exc:
        # A user mistake: say what to change, no traceback.
        print(f"omnistage {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
