"""Qwen2.5-Omni through the public APIs: Omni.generate returns text + speech; concurrent mixed
requests give what each gives alone; aborting mid-stream frees every stage's state."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> str:
    from omnistage.tiny import build_tiny

    return str(build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("omni-api"), seed=1))


def _wav(seconds: float, freq: float) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * 16000)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 52, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _talker(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, min_tokens=20, repetition_penalty=1.05, seed=seed)


def _requests(n: int):
    """Mixed: text-only, text+speech, audio in, image in."""
    out = []
    for i in range(n):
        kind = i % 4
        content: list | str = f"Question number {i}: what do you see and hear?"
        if kind == 2:
            content = [{"type": "audio", "audio": _wav(0.5 + 0.1 * i, 200 + 30 * i)}, {"type": "text", "text": "Hm?"}]
        elif kind == 3:
            content = [{"type": "image", "image": _png(i)}, {"type": "text", "text": "Describe."}]
        modalities = ["text"] if kind == 0 else ["text", "audio"]
        out.append(([{"role": "user", "content": content}],
                    SamplingParams(temperature=0, max_tokens=6 + i % 5),
                    OutputOptions(modalities=modalities, talker_params=_talker(100 + i))))
    return out


def test_generate_returns_text_and_speech(omni_dir, omni_deploy):
    omni = Omni(omni_dir, deploy_config=omni_deploy, linear_kernel="matmul")
    [out] = omni.generate([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=8),
                          output=OutputOptions(talker_params=_talker(0)))
    assert len(out.token_ids) == 8 and out.text
    assert out.sample_rate == 24000 and out.audio.dtype == np.float32
    assert out.audio.size >= 20 * 2 * 240 and np.isfinite(out.audio).all() and np.abs(out.audio).max() > 0
    [text_only] = omni.generate("Hello!", SamplingParams(temperature=0, max_tokens=4),
                                output=OutputOptions(modalities=["text"]))
    assert text_only.audio is None and len(text_only.token_ids) == 4
    omni.close()


def test_concurrent_mixed_requests_equal_alone(omni_dir, omni_deploy):
    reqs = _requests(16)
    omni = AsyncOmni(omni_dir, deploy_config=omni_deploy, max_num_seqs=16)

    async def one(prompt, params, opts):
        tokens, audio = [], []
        async for d in omni.generate(prompt, params, output=opts):
            tokens += d.token_ids
            if d.audio is not None:
                audio.append(d.audio)
        return tokens, (np.concatenate(audio) if audio else None)

    async def alone():
        return [await one(*r) for r in reqs]

    async def together():
        return await asyncio.gather(*(one(*r) for r in reqs))

    try:
        solo = asyncio.run(alone())
        both = asyncio.run(together())
    finally:
        omni.shutdown()
    for i, ((t1, a1), (t2, a2)) in enumerate(zip(solo, both)):
        assert t1 == t2, f"request {i}: tokens differ"
        assert (a1 is None) == (a2 is None), f"request {i}"
        if a1 is None:
            continue
        # Same codes (the talker reads the thinker's hidden states, the same bits alone and
        # batched: native kernels, batch-invariant encoders), same noise; the batched DiT's rows
        # sum in another order, so the waveforms agree to float noise.
        assert a1.shape == a2.shape, f"request {i}"
        np.testing.assert_allclose(a1, a2, atol=1e-4, rtol=1e-3, err_msg=f"request {i}")


def test_abort_mid_stream_frees_every_stage(omni_dir, local_only):
    omni = Omni(omni_dir, linear_kernel="matmul")
    pipe = omni.engine
    thinker, talker = pipe.graph.stages["thinker"].engine, pipe.graph.stages["talker"].engine
    free = (thinker.num_free_blocks, talker.num_free_blocks)
    params = SamplingParams(temperature=0, max_tokens=64)
    opts = OutputOptions(talker_params=SamplingParams(temperature=0, max_tokens=400, min_tokens=300))
    audio_chunks = 0
    for d in omni.stream([{"role": "user", "content": "Talk for a long time."}], params, opts):
        audio_chunks += d.audio is not None
        if audio_chunks == 1:
            break          # leaving the stream aborts the request
    assert audio_chunks == 1
    assert (thinker.num_free_blocks, talker.num_free_blocks) == free
    assert not thinker.requests and not talker.requests
    assert all(s.num_requests() == 0 for s in pipe.graph.stages.values())
    assert not pipe.has_unfinished_requests() and pipe.num_aborted_requests == 1


def test_forced_answer_is_spoken(omni_dir):
    """Teacher forcing (what /v1/audio/speech uses): the thinker's answer is exactly the given
    tokens, and the talker speaks from its hidden states over them."""
    omni = Omni(omni_dir, linear_kernel="matmul")
    tok = omni.tokenizer
    forced = tok.encode("the sea and the sky", add_special_tokens=False) + [omni.engine.abilities.end_of_turn_id]
    [out] = omni.generate([{"role": "user", "content": "Read this aloud."}],
                          SamplingParams(temperature=0, max_tokens=len(forced), forced_token_ids=forced),
                          output=OutputOptions(talker_params=_talker(4)))
    assert out.token_ids == forced and out.text.startswith("the sea and the sky")
    assert out.audio is not None and out.audio.size >= 20 * 2 * 240


@pytest.mark.parametrize("kernel", ["matmul", "auto"])
def test_bf16_dit_opt_in_stays_close_to_float32(omni_dir, kernel):
    """matmul: bf16 autocast around the DiT; auto: oneDNN's packed bf16 GEMMs where the CPU has
    bf16 dot products, else float32 (emulated bf16 is slower): then the same audio."""
    from omnistage.layers.onednn import onednn_bf16_available
    from omnistage.models.qwen2_5_omni.recipe import OmniSettings
    from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings

    prompt, params = [{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=6)
    opts = OutputOptions(talker_params=_talker(3))
    [ref] = Omni(omni_dir, linear_kernel=kernel).generate(prompt, params, output=opts)
    fast = Omni(omni_dir, linear_kernel=kernel, omni_settings=OmniSettings(vocoder=VocoderSettings(bf16_dit=True)))
    dit = fast.engine.graph.stages["token2wav"].model.dit
    packed = kernel == "auto" and onednn_bf16_available()
    autocast = kernel == "matmul"
    assert dit.bf16_matmuls == autocast
    assert (dit.transformer_blocks[0].attn.qkv is not None
            and dit.transformer_blocks[0].attn.qkv.packed_dtype == torch.bfloat16) == packed
    [out] = fast.generate(prompt, params, output=opts)
    assert out.token_ids == ref.token_ids and out.audio.shape == ref.audio.shape
    rel = np.sqrt(np.mean((out.audio - ref.audio) ** 2) / np.mean(ref.audio ** 2))
    if packed or autocast:
        assert 0 < rel < 0.05, rel      # not the same numerics, but the same speech
    else:
        assert rel == 0, rel            # no bf16 units: the float32 DiT, as without the flag


def test_int8_dit_opt_in_stays_close_to_float32(omni_dir):
    """The DiT's frame-row products in int8 (with bf16 for its other products): the same text,
    the speech within a few percent RMS; the plain matmul kernel refuses it by name."""
    from omnistage.models.qwen2_5_omni.recipe import OmniSettings
    from omnistage.models.qwen2_5_omni.vocoder_stage import VocoderSettings

    prompt, params = [{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=6)
    opts = OutputOptions(talker_params=_talker(3))
    [ref] = Omni(omni_dir).generate(prompt, params, output=opts)
    settings = OmniSettings(vocoder=VocoderSettings(int8_dit=True, bf16_dit=True))
    fast = Omni(omni_dir, omni_settings=settings)
    assert fast.engine.graph.stages["token2wav"].model.dit.transformer_blocks[0].attn.qkv.w8a8 is not None
    [out] = fast.generate(prompt, params, output=opts)
    assert out.token_ids == ref.token_ids and out.audio.shape == ref.audio.shape
    rel = np.sqrt(np.mean((out.audio - ref.audio) ** 2) / np.mean(ref.audio ** 2))
    assert 0 < rel < 0.05, rel
    with pytest.raises(InvalidRequestError, match="int8"):
        Omni(omni_dir, linear_kernel="matmul", omni_settings=settings)


def test_prefill_only_warms_the_caches_and_changes_no_bit(omni_dir, local_only):
    """The Realtime API's streamed input: the turn so far is prefilled (prefill_only) while
    the user speaks; the final request then reuses the encoder's chunks and the thinker's
    prefix, and answers with the very tokens and samples of a cold engine."""
    audio = _wav(4.5, 330)                       # three 2 s encoder chunks
    messages = [{"role": "user", "content": [{"type": "audio", "audio": audio},
                                             {"type": "text", "text": "Hm?"}]}]
    params = SamplingParams(temperature=0, max_tokens=6)
    opts = OutputOptions(talker_params=_talker(7))
    cold = Omni(omni_dir, linear_kernel="matmul")
    [want] = cold.generate(messages, params, output=opts)
    cold.close()

    omni = Omni(omni_dir, linear_kernel="matmul")
    graph = omni.engine.graph
    encoders, thinker = graph.stages["encoder"].encoders, graph.stages["thinker"].engine
    [warm] = omni.generate(messages, params, output=OutputOptions(talker_params=_talker(7),
                                                                   prefill_only=True))
    assert len(warm.token_ids) <= 1 and warm.audio is None
    hits, hit_tokens = encoders.cache.hits, thinker.block_manager.num_prefix_hit_tokens
    [got] = omni.generate(messages, params, output=opts)
    omni.close()
    assert encoders.cache.hits - hits == 3 and thinker.block_manager.num_prefix_hit_tokens > hit_tokens
    assert got.token_ids == want.token_ids
    np.testing.assert_array_equal(got.audio, want.audio)
