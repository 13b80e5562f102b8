"""Qwen3-Omni on our stage graph vs transformers' Qwen3OmniMoeForConditionalGeneration.generate
(the oracle), on two tiny shapes: the thinker's greedy tokens (text and audio prompts), the
talker's codes (all 16 codebooks, greedy talker and code predictor) and the waveform, on the
default kernels and on `matmul`; and 8 concurrent requests equal to each alone."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.engine_api import OutputOptions
from omnistage.kernels.linear import native_linear_kernel
from omnistage.layers.moe import MoeMLP

FRAMES = 9          # talker steps asked of both sides (min = max: no early end of speech)
SHAPES = {
    "tiny": {},
    "deeper": {"thinker_config": {"text_config": {"num_hidden_layers": 3, "num_experts": 8,
                                                  "num_experts_per_tok": 3, "moe_intermediate_size": 24}},
               "talker_config": {"accept_hidden_layer": 2,
                                 "text_config": {"num_hidden_layers": 3, "num_experts": 6},
                                 "code_predictor_config": {"num_hidden_layers": 2}}},
}
PROMPTS = [
    [{"role": "user", "content": "hi there, tell me"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the sea?"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three and four"}],
]


# The tiny shape stored as released checkpoints are (bfloat16): the default kernels keep its
# linear weights in bfloat16 panels (exact), transformers widens them to float32.
FOLDERS = {**{name: (overrides, "float32") for name, overrides in SHAPES.items()},
           "tiny-bf16": ({}, "bfloat16")}


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request, tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    overrides, weights_dtype = FOLDERS[request.param]
    return str(build_tiny("qwen3_omni", tmp_path_factory.mktemp(f"q3-{request.param}"), seed=1,
                          overrides=overrides, weights_dtype=weights_dtype))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    # float32 whatever the folder stores (transformers would compute in its dtype).
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["auto", "matmul"])
def omni(request, folder):
    with Omni(folder, linear_kernel=request.param, num_threads=1) as o:
        yield o


def talker_params(hf_model) -> SamplingParams:
    t = hf_model.config.talker_config
    vocab = t.text_config.vocab_size
    return SamplingParams(temperature=0, max_tokens=FRAMES, min_tokens=FRAMES, repetition_penalty=1.05,
                          suppress_token_ids=[i for i in range(vocab - 1024, vocab) if i != t.codec_eos_token_id])


def hf_generate(hf_model, ids: torch.Tensor, max_tokens: int, with_wav: bool = False, **media):
    """(thinker's new tokens, codes (16, F)[, waveform (S,)]) of transformers' greedy generate."""
    seen = []
    hook = hf_model.code2wav.register_forward_hook(lambda m, args, out: seen.append(args[0][0].clone()))
    try:
        seq, wav = hf_model.generate(ids, speaker="Ethan", thinker_max_new_tokens=max_tokens,
                                     thinker_do_sample=False, talker_do_sample=False,
                                     talker_max_new_tokens=FRAMES, talker_min_new_tokens=FRAMES, **media)
    finally:
        hook.remove()
    out = (seq[0, ids.shape[1]:].tolist(), seen[0])
    return out + (wav[0, 0].numpy(),) if with_wav else out


def ours_generate(omni, prompt, hf_model, max_tokens: int):
    """(our output, codes (16, F) as code2wav received them)."""
    model = omni.engine.graph.stages["code2wav"].model
    windows = []
    hook = model.register_forward_hook(lambda m, args, out: windows.append(args[0][0].clone()))
    try:
        [out] = omni.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                              output=OutputOptions(voice="Ethan", talker_params=talker_params(hf_model)))
    finally:
        hook.remove()
    stage = omni.engine.graph.stages["code2wav"].settings
    codes, done = [], 0
    for w in windows:                                 # each window: context + the chunk
        n = w.shape[1] - min(stage.left_context, done)
        codes.append(w[:, -n:])
        done += n
    return out, torch.cat(codes, dim=1)


def chunked_like_ours(hf_model, codes: torch.Tensor, settings) -> np.ndarray:
    """The waveform transformers' code2wav gives for `codes` decoded in our chunks."""
    pieces, start, i = [], 0, 0
    spf = int(hf_model.code2wav.total_upsample)
    with torch.no_grad():
        while start < codes.shape[1]:
            end = min(start + settings.chunk(i), codes.shape[1])
            ctx = min(settings.left_context, start)
            pieces.append(hf_model.code2wav(codes[None, :, start - ctx:end])[0, 0, ctx * spf:])
            start, i = end, i + 1
    return torch.cat(pieces).numpy()


def test_the_code_predictor_runs_where_the_kernels_put_it(omni):
    """On the default kernels the code predictor's passes run on the native stack (what the
    speech tests below then compare with transformers); on `matmul` per op."""
    predictor = omni.engine.graph.stages["talker"].parts.predictor
    native = omni.config.linear_kernel == "auto" and native_linear_kernel("auto", torch.device("cpu"),
                                                                          torch.float32)[0] is not None
    assert (predictor.native is not None) == native


def test_the_moe_layers_run_where_the_kernels_put_them(omni):
    """On the default kernels every MoE layer of the thinker and the talker runs its experts'
    grouping and sums as native calls (kernels/moe.py: what the tests below then compare with
    transformers); on `matmul` as tensor ops."""
    native = omni.config.linear_kernel == "auto" and native_linear_kernel("auto", torch.device("cpu"),
                                                                          torch.float32)[0] is not None
    for name in ("thinker", "talker"):
        layers = [m for m in omni.engine.graph.stages[name].engine.runner.model.modules() if isinstance(m, MoeMLP)]
        assert layers and all(m.runs_native == native for m in layers), name


def test_text_only_thinker_tokens_equal_transformers(omni, hf):
    hf_model, tok = hf
    for messages in PROMPTS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        want = hf_model.thinker.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        [out] = omni.generate(messages, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              output=OutputOptions(modalities=["text"]))
        assert out.token_ids == want[0, ids.shape[1]:].tolist()
        assert out.audio is None


def test_speech_codes_and_waveform_equal_transformers(omni, hf):
    """The streamed chunks join (seamless, the default) into the waveform transformers'
    generate returns: its whole-utterance decode."""
    hf_model, tok = hf
    for messages in PROMPTS[:2]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        want_tokens, want_codes, want_wav = hf_generate(hf_model, ids, 10, with_wav=True)
        out, codes = ours_generate(omni, messages, hf_model, 10)
        assert out.token_ids == want_tokens
        assert want_codes.shape == (16, FRAMES - 1)      # the last code 0 gets no frame
        assert torch.equal(codes, want_codes)            # all 16 codebooks
        assert omni.engine.graph.stages["code2wav"].settings.seamless
        assert out.audio.shape == want_wav.shape and out.sample_rate == 24000
        np.testing.assert_allclose(out.audio, want_wav, atol=1e-4)      # measured ~1e-6
        assert np.abs(want_wav).max() > 0.05                              # a real waveform


def test_chunked_decode_semantics_on_request(folder, hf):
    """seamless=False: each streamed chunk is what transformers' chunked_decode emits for it
    (the same windows), gaps at the boundaries included."""
    from omnistage.models.qwen3_omni.code2wav_stage import Code2WavSettings
    from omnistage.models.qwen3_omni.recipe import Qwen3OmniSettings

    hf_model, tok = hf
    settings = Qwen3OmniSettings(code2wav=Code2WavSettings(first_chunk=2, max_chunk=4, seamless=False,
                                                                  playback_margin_s=None))
    with Omni(folder, num_threads=1, omni_settings=settings) as omni:
        out, codes = ours_generate(omni, PROMPTS[0], hf_model, 10)
    want = chunked_like_ours(hf_model, codes, settings.code2wav)
    # chunks of 2, 4, 2 frames: each loses the 555 samples its window cannot end with
    assert out.audio.shape == want.shape == ((FRAMES - 1) * 1920 - 3 * 555,)
    np.testing.assert_allclose(out.audio, want, atol=1e-4)


def _wav_bytes(seconds: float, freq: float) -> bytes:
    import soundfile as sf

    t = np.arange(int(16000 * seconds)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def test_audio_prompt_thinker_tokens_and_speech_equal_transformers(omni, hf):
    """The clip through WhisperFeatureExtractor (the processor's padding=True) and transformers'
    audio tower; placeholders expanded by the processor's count."""
    import soundfile as sf
    from transformers import WhisperFeatureExtractor

    from omnistage.models.qwen3_omni.audio_encoder import num_audio_tokens

    hf_model, tok = hf
    for seconds, freq in ((1.3, 300.0), (2.61, 520.0)):
        wav = _wav_bytes(seconds, freq)
        samples, _ = sf.read(io.BytesIO(wav), dtype="float32")
        feats = WhisperFeatureExtractor(feature_size=128)(samples, sampling_rate=16000, padding=True,
                                                          truncation=False, return_attention_mask=True,
                                                          return_tensors="pt")
        n = num_audio_tokens(int(feats["attention_mask"].sum()), 50)
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hm?"}]}],
                                       tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok.encode(text.replace("<|audio_pad|>", "<|audio_pad|>" * n))])
        want_tokens, want_codes = hf_generate(hf_model, ids, 8, input_features=feats["input_features"],
                                              feature_attention_mask=feats["attention_mask"])
        prompt = [{"role": "user", "content": [{"type": "audio", "audio": wav}, {"type": "text", "text": "Hm?"}]}]
        out, codes = ours_generate(omni, prompt, hf_model, 8)
        assert out.token_ids == want_tokens
        assert torch.equal(codes, want_codes)


def test_eight_concurrent_requests_equal_each_alone(omni, hf):
    hf_model, _ = hf
    opts = OutputOptions(voice="Ethan", talker_params=talker_params(hf_model))
    prompts = [[{"role": "user", "content": f"question number {i}: why {'so ' * i}?"}] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=7)
    alone = [omni.generate(p, params, output=opts)[0] for p in prompts]
    together = omni.generate(prompts, params, output=opts)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        # (an answer that ends at its first token has no speech, as transformers cannot make one)
        assert (a.audio is None) == (b.audio is None) == (len(a.token_ids) == 1)
        if a.audio is not None:
            assert a.audio.shape == b.audio.shape
            np.testing.assert_allclose(a.audio, b.audio, atol=1e-5)
    assert len({tuple(a.token_ids) for a in alone}) > 4          # the prompts differ in their answers
    assert sum(a.audio is not None for a in alone) >= 6


def _png_bytes(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _mp4_bytes(frames: int = 8, fps: int = 4, size: int = 64) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        rng = np.random.default_rng(2)
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_media(pp) -> dict:
    """Our preprocessed media (held to the HF processors by their own tests) as generate's kwargs."""
    kw, images, videos = {}, [m for m in pp.media if m.kind == "image"], [m for m in pp.media if m.kind == "video"]
    audios = [m.features for m in pp.media if m.kind == "audio"]
    if audios:
        kw["input_features"] = audios[0][None]
        kw["feature_attention_mask"] = torch.ones(1, audios[0].shape[-1], dtype=torch.long)
    if images:
        kw["pixel_values"] = torch.cat([m.features for m in images])
        kw["image_grid_thw"] = torch.tensor([list(m.grid_thw) for m in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([m.features for m in videos])
        kw["video_grid_thw"] = torch.tensor([list(m.grid_thw) for m in videos])
        kw["video_second_per_grid"] = torch.tensor([v.second_per_grid for v in pp.items if hasattr(v, "second_per_grid")])
    return kw


MEDIA = {
    "image": [{"type": "image", "image": _png_bytes(80, 48, 1)}, {"type": "text", "text": "What is it?"}],
    "video": [{"type": "video", "video": _mp4_bytes()}, {"type": "text", "text": "What happens?"}],
    "two-images-and-audio": [{"type": "image", "image": _png_bytes(64, 64, 2)},
                             {"type": "audio", "audio": _wav_bytes(0.9, 440.0)},
                             {"type": "image", "image": _png_bytes(32, 96, 3)}, {"type": "text", "text": "And?"}],
}


@pytest.mark.parametrize("kind", list(MEDIA))
def test_vision_prompts_tokens_and_codes_equal_transformers(omni, hf, kind):
    """Images and videos: DeepStack rows, 3-D positions in the thinker and in the talker."""
    hf_model, _ = hf
    prompt = [{"role": "user", "content": MEDIA[kind]}]
    pp = omni.engine.prepare(prompt, OutputOptions(voice="Ethan"))
    assert pp.positions is not None                        # 3-D positions: the vision path
    ids = torch.tensor([pp.token_ids])
    if "audio" in kind:
        # transformers' talker cannot place audio beside images (its get_rope_index reads
        # talker_config.audio_config, which does not exist): the thinker alone is the oracle
        want = hf_model.thinker.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **hf_media(pp))
        [out] = omni.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              output=OutputOptions(modalities=["text"]))
        assert out.token_ids == want[0, ids.shape[1]:].tolist()
        return
    want_tokens, want_codes = hf_generate(hf_model, ids, 8, **hf_media(pp))
    out, codes = ours_generate(omni, prompt, hf_model, 8)
    assert out.token_ids == want_tokens
    assert torch.equal(codes, want_codes)


def test_sampled_token_rows_equal_the_rows_the_thinker_feeds(omni):
    """ARRequest.embed_sampled (what lets the talker start right after the thinker's prefill):
    each step's sampled_embeds are bit for bit the input embeddings the next step feeds for
    those tokens, and the token that ends the request has none (the reference has no row for
    it)."""
    from omnistage.stages.ar import ARRequest, ARStage

    stage = ARStage("probe", omni.engine.graph.stages["thinker"].engine)
    stage.add(ARRequest("probe-0", [5, 17, 99, 250, 7], SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True),
                        return_hidden_states=True, embed_sampled=True))
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o.payload for o in stage.step() if o.request_id == "probe-0"]
    sampled = [o for o in outs if o.token_ids]
    assert len(sampled) == 6 and sampled[-1].finished and sampled[-1].sampled_embeds is None
    for now, fed_next in zip(sampled[:-1], sampled[1:]):
        assert now.sampled_embeds.shape[0] == len(now.token_ids) == 1
        assert torch.equal(now.sampled_embeds, fed_next.input_embeds[-1:])
