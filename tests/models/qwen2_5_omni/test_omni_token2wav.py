"""token2wav (DiT flow matching + BigVGAN) against transformers' Qwen2.5-Omni (the oracle), plus
batching across requests and streaming.

The tiny model: DiT hidden 64, 4 layers (layer 0 and 3 look back a block, layer 2 looks ahead),
8-frame blocks, 2 frames per code, 20 mel bins; BigVGAN with the real upsampling (240 samples
per frame). transformers initialises linears and convs with std 0.02, which makes attention
mix frames so weakly and BigVGAN so quiet that errors could hide; the fixture re-initialises
them with PyTorch's default (fan-in scaled) init and randomises the SnakeBeta parameters.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5OmniToken2WavConfig, Qwen2_5OmniToken2WavModel

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.qwen2_5_omni.bigvgan import (AntiAliasedSnake, VocoderStream, use_native_activations,
                                                   use_native_convolutions)
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavRequest
from omnistage.models.qwen2_5_omni.token2wav_stream import StreamConfig, Token2WavStream, step_streams
from omnistage.models.qwen2_5_omni.token2wav_dit import BatchLayout

DIT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16, ff_mult=2,
           emb_dim=32, block_size=8, look_ahead_layers=[2], look_backward_layers=[0, 3], repeats=2,
           num_embeds=100, mel_dim=20, enc_emb_dim=24, enc_dim=16, enc_channels=[32, 32, 32, 64],
           enc_kernel_sizes=[5, 3, 3, 1], enc_dilations=[1, 2, 3, 1], enc_attention_channels=16,
           enc_res2net_scale=2, enc_se_channels=16, dropout=0.0)
BIGVGAN = dict(mel_dim=20, upsample_initial_channel=64, resblock_kernel_sizes=[3, 7],
               resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]])
MEL = 20


@pytest.fixture(scope="module")
def models():
    cfg = Qwen2_5OmniToken2WavConfig(dit_config=DIT, bigvgan_config=BIGVGAN)
    torch.manual_seed(0)
    hf = Qwen2_5OmniToken2WavModel(cfg).eval()
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.reset_parameters()
        for name, p in hf.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.normal_(0, 0.3)
    ours = Token2Wav(cfg)
    ours.load_weights((f"token2wav.{k}", v) for k, v in hf.state_dict().items())
    return hf, ours


def utterance(n_codes: int, seed: int, ref_frames: int = 30):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, DIT["num_embeds"] + 1, (n_codes,), generator=g),
            torch.randn(1, DIT["enc_emb_dim"], generator=g), torch.randn(1, ref_frames, MEL, generator=g))


# ---------------------------------------------------------------- parity with transformers

def seeded_noise_and_hf_wav(hf, codes, cond, ref, seed: int, guidance: float = 0.5):
    """The ODE's start noise (1, 2T, mel) and transformers' waveform from the same noise:
    `sample` draws it with torch.randn as its first random op, so seeding before each gives
    both the same tensor."""
    torch.manual_seed(seed)
    noise = torch.randn(1, 2 * codes.numel(), MEL)
    with torch.no_grad():
        torch.manual_seed(seed)
        wav = hf(codes[None], cond, ref, num_steps=10, guidance_scale=guidance, sway_coefficient=-1.0)
    return noise, wav


@pytest.mark.parametrize("guidance", [0.5, 0.0])
def test_decode_matches_transformers(models, guidance):
    """Same initial noise by seeding: transformers draws it with torch.randn([1, 2T, mel]) as the
    first random op of `sample`, so torch.manual_seed(s) before it and before our own randn gives
    both the same tensor. Tolerance atol 1e-5 / rtol 1e-5 on mel (|mel| <= 4.5) and atol 1e-5 on
    the waveform (peak 0.51): fp32 with a different summation order (input projection split into
    per-pass and per-request parts, fused LayerNorm affine, block-gathered attention instead of a
    masked T x T matrix, interleaved instead of de-interleaved RoPE), compounded over 36
    evaluations; measured max differences: 8e-7 (mel) and 4e-7 (waveform)."""
    hf, ours = models
    codes, cond, ref = utterance(37, seed=1)
    torch.manual_seed(5)
    noise = torch.randn(1, 2 * codes.numel(), MEL)
    with torch.no_grad():
        torch.manual_seed(5)
        mel_hf = hf.code2wav_dit_model.sample(cond, ref, codes[None], num_steps=10,
                                              guidance_scale=guidance, sway_coefficient=-1.0)
        torch.manual_seed(5)
        wav_hf = hf(codes[None], cond, ref, num_steps=10, guidance_scale=guidance, sway_coefficient=-1.0)
    mel = ours.mel_batch([Token2WavRequest(codes, cond, ref, noise, guidance)])[0]
    wav = ours.decode(codes, cond, ref, noise, steps=10, guidance_scale=guidance, sway=-1.0)
    torch.testing.assert_close(mel, mel_hf[0].T, atol=1e-5, rtol=1e-5)
    assert wav.dtype == torch.float32 and wav.shape == (codes.numel() * 2 * 240,)
    assert wav.abs().max() > 0.05           # a real signal, not a silent net
    torch.testing.assert_close(wav, wav_hf, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def native_vocoder(models):
    """A token2wav whose vocoder runs as the serving recipe builds it on the CPU: each
    anti-aliased activation as one native pass (use_native_activations) and every convolution
    in the native time-major kernel (use_native_convolutions; at these widths it serves all,
    the upsamplers as their phases' convolutions)."""
    hf, _ = models
    t2w = Token2Wav(hf.config)
    t2w.load_weights((f"token2wav.{k}", v) for k, v in hf.state_dict().items())
    voc = t2w.vocoder
    assert use_native_activations(voc) == len([m for m in voc.modules() if isinstance(m, AntiAliasedSnake)]) > 0
    assert use_native_convolutions(voc) == len(voc.resblocks) + 1
    runs = voc.runs + [run for block in voc.resblocks for run in block.runs]
    assert all(run.packed() is not None for run in runs)
    return t2w


def test_native_vocoder_matches_transformers(models, native_vocoder):
    """The vocoder with its activations and convolutions in the native kernels against
    transformers' waveform; atol 1e-5 (peak ~0.5)."""
    hf, _ = models
    codes, cond, ref = utterance(29, seed=7)
    noise, wav_hf = seeded_noise_and_hf_wav(hf, codes, cond, ref, seed=9)
    wav = native_vocoder.decode(codes, cond, ref, noise, steps=10, guidance_scale=0.5, sway=-1.0)
    assert wav.abs().max() > 0.05
    torch.testing.assert_close(wav, wav_hf, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [False, True])
def test_no_vocoder_convolution_reaches_onednn(models, native_vocoder, native):
    """Neither the native kernels nor the matrix products (the path without them: CUDA, the
    `matmul` kernels) run BigVGAN's convolutions in PyTorch's: oneDNN keeps a primitive for
    every input shape, and a stream's windows bring ever new ones. Without the native
    activations their resampling filters still do (two depthwise convolutions each)."""
    voc = native_vocoder.vocoder if native else models[1].vocoder
    mel = torch.randn(2, MEL, 30, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autograd.profiler.profile() as prof:
        voc(mel, emit=(10, 20))
    ops = [e.name for e in prof.function_events]
    assert ops.count("aten::mm") + ops.count("aten::matmul") > 0 or native   # the profile saw it
    activations = len([m for m in voc.modules() if isinstance(m, AntiAliasedSnake)])
    want = {} if native else {"aten::conv2d": activations, "aten::conv_transpose2d": activations}
    public = ("aten::conv1d", "aten::conv2d", "aten::conv_transpose1d", "aten::conv_transpose2d")
    assert {name: ops.count(name) for name in public if name in ops} == want


def test_native_dit_attention_matches_transformers(models):
    """The DiT with each layer's attention as one native call (use_native_attention, as the
    serving recipe builds it) against transformers' waveform; atol 1e-5 (peak ~0.5)."""
    hf, _ = models
    native = Token2Wav(hf.config)
    native.load_weights((f"token2wav.{k}", v) for k, v in hf.state_dict().items())
    assert native.dit.use_native_attention() == DIT["num_hidden_layers"]
    codes, cond, ref = utterance(29, seed=7)
    noise, wav_hf = seeded_noise_and_hf_wav(hf, codes, cond, ref, seed=9)
    wav = native.decode(codes, cond, ref, noise, steps=10, guidance_scale=0.5, sway=-1.0)
    assert wav.abs().max() > 0.05
    torch.testing.assert_close(wav, wav_hf, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("offset_blocks", [0, 3])
def test_dit_pass_matches_transformers(models, offset_blocks, native):
    """One guided DiT evaluation over 74 frames (not a block multiple: padding is exercised);
    the frame offset shifts RoPE positions, which attention must not see (RoPE is relative).
    atol/rtol 1e-5 as above (|v| <= 2; measured max difference 7e-7). `native`: the attention
    as one native call per layer (use_native_attention)."""
    hf, ours = models
    if native:
        ours = Token2Wav(hf.config)
        ours.load_weights((f"token2wav.{k}", v) for k, v in hf.state_dict().items())
        assert ours.dit.use_native_attention() == DIT["num_hidden_layers"]
    codes, cond, ref = utterance(37, seed=2)
    frames = 2 * codes.numel()
    x = torch.randn(1, frames, MEL, generator=torch.Generator().manual_seed(3))
    t = torch.tensor(0.37)
    with torch.no_grad():
        want = hf.code2wav_dit_model(hidden_states=x, condition_vector=ref,
                                     speaker_embedding=cond.unsqueeze(1).repeat(1, frames, 1),
                                     quantized_code=codes[None], time_step=t, apply_cfg=True)
        dit, spk = ours.dit, ours.speaker_terms(cond, ref)
        padded = 80
        layout = BatchLayout([frames, frames], [offset_blocks * 8] * 2, padded)
        static = torch.zeros(2, padded, 64)
        static[0, :frames] = dit.code_terms(codes) + spk.cond
        static[1, :frames] = spk.uncond
        xr = torch.zeros(2, padded, MEL)
        xr[:, :frames] = x
        got = dit(xr, static, t, dit.rope_angles(layout, xr.device), dit.windows_for(layout, xr.device))
    torch.testing.assert_close(got[:, :frames], want, atol=1e-5, rtol=1e-5)


def test_load_weights_needs_every_tensor(models):
    hf, ours = models
    state = {f"token2wav.{k}": v for k, v in hf.state_dict().items()}
    fresh = Token2Wav(ours.config)
    loaded = fresh.load_weights(list(state.items()) + [
        ("token2wav.code2wav_dit_model.rotary_embed.inv_freq", torch.ones(8)),      # derived: skipped
        ("thinker.lm_head.weight", torch.ones(3))])                                # other prefix
    assert loaded == set(fresh.state_dict())
    del state["token2wav.code2wav_bigvgan_model.conv_post.weight"]
    with pytest.raises(CheckpointError, match="lacks weights"):
        Token2Wav(ours.config).load_weights(state.items())
    state["token2wav.code2wav_dit_model.proj_out.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="shape"):
        Token2Wav(ours.config).load_weights(state.items())


# ---------------------------------------------------------------- batching

def test_batch_equals_each_alone(models):
    """Four requests of different code and reference lengths, one without guidance (no
    unconditional row), in one DiT pass per evaluation; each gets what it gets alone (the
    padding is masked and held at zero; measured: bit-identical here). atol 1e-5 leaves room
    for GEMM blocking that depends on the batch size on other machines."""
    _, ours = models
    reqs = []
    for i, (n, r, g) in enumerate([(13, 20, 0.5), (40, 31, 0.5), (27, 12, 0.0), (33, 25, 1.5)]):
        codes, cond, ref = utterance(n, seed=10 + i, ref_frames=r)
        reqs.append(Token2WavRequest(codes, cond, ref, torch.randn(1, 2 * n, MEL), g))
    batched = ours.decode_batch(reqs)
    for req, wav in zip(reqs, batched):
        alone = ours.decode(req.codes, req.cond, req.ref_mel, req.noise, guidance_scale=req.guidance_scale)
        torch.testing.assert_close(wav, alone, atol=1e-5, rtol=0)


def test_onednn_packing_stays_close(models):
    """The packed oneDNN GEMM sums in another order: same result to fp32 noise (atol 1e-4 on
    mel of magnitude ~4 after 36 passes)."""
    _, ours = models
    packed = Token2Wav(ours.config)
    packed.load_weights(((f"token2wav.{k}", v) for k, v in ours.state_dict().items()))
    if packed.dit.pack_for_onednn() == 0:
        pytest.skip("oneDNN packed linear is not available in this torch build")
    codes, cond, ref = utterance(25, seed=4)
    req = [Token2WavRequest(codes, cond, ref, torch.randn(1, 50, MEL))]
    torch.testing.assert_close(packed.mel_batch(req)[0], ours.mel_batch(req)[0], atol=1e-4, rtol=1e-4)


def test_int8_products_stay_close_and_keep_batch_invariance(models):
    """The opt-in int8 DiT (frame-row products in W8A8, the rest in oneDNN's float32): the
    mel within 1% RMS of float32 after 36 passes, and a request's mel the same bits alone as
    in a batch (integer sums are exact; every row is quantized on its own)."""
    from omnistage.kernels.linear_w8a8 import W8A8Kernel

    _, ours = models
    int8 = Token2Wav(ours.config)
    int8.load_weights(((f"token2wav.{k}", v) for k, v in ours.state_dict().items()))
    if int8.dit.pack_for_onednn(torch.float32, W8A8Kernel()) == 0:
        pytest.skip("oneDNN packed linear is not available in this torch build")
    attn, ff = int8.dit.transformer_blocks[0].attn, int8.dit.transformer_blocks[0].ff.ff
    assert attn.qkv.w8a8 is not None and attn.to_out[0].w8a8 is not None and ff["0"].w8a8 is not None
    assert int8.dit.proj_out.w8a8 is None and int8.dit.proj_out.packed is not None
    reqs = []
    for i, (n, r) in enumerate([(25, 20), (40, 31), (13, 12)]):
        codes, cond, ref = utterance(n, seed=20 + i, ref_frames=r)
        reqs.append(Token2WavRequest(codes, cond, ref, torch.randn(1, 2 * n, MEL)))
    batch, want = int8.mel_batch(reqs), ours.mel_batch(reqs)
    for req, got, ref_mel in zip(reqs, batch, want):
        rel = ((got - ref_mel).pow(2).mean() / ref_mel.pow(2).mean()).sqrt().item()
        assert 1e-6 < rel < 0.01, rel
        assert torch.equal(int8.mel_batch([req])[0], got)


def test_int8_native_stack_is_the_per_block_path(models):
    """The int8 DiT's blocks as one native call per evaluation (use_native_stack): the same
    kernels with the same arguments as one call per kernel, so the same bits, for a batch of
    requests of different lengths with and without guidance; bad shapes are refused before
    the C code reads them."""
    from omnistage.kernels.linear_w8a8 import W8A8Kernel

    _, ours = models
    int8 = Token2Wav(ours.config)
    int8.load_weights(((f"token2wav.{k}", v) for k, v in ours.state_dict().items()))
    if int8.dit.pack_for_onednn(torch.float32, W8A8Kernel()) == 0:
        pytest.skip("oneDNN packed linear is not available in this torch build")
    if not int8.dit.use_native_attention():
        pytest.skip("the window attention kernel does not build here")
    reqs = []
    for i, (n, r, g) in enumerate([(25, 20, 0.5), (40, 31, 0.0), (13, 12, 0.5)]):
        codes, cond, ref = utterance(n, seed=30 + i, ref_frames=r)
        reqs.append(Token2WavRequest(codes, cond, ref, torch.randn(1, 2 * n, MEL), guidance_scale=g))
    per_block = int8.mel_batch(reqs)
    assert int8.dit.use_native_stack()
    stacked = int8.mel_batch(reqs)
    for a, b in zip(stacked, per_block):
        assert torch.equal(a, b)
    assert torch.equal(int8.mel_batch(reqs[:1])[0], stacked[0])
    stack, hidden = int8.dit.stack, DIT["hidden_size"]
    mods = int8.dit._bound_cache[next(iter(int8.dit._bound_cache))]
    rope = torch.ones(1, 8, 1, DIT["head_dim"] // 2, dtype=torch.complex64)
    for h, lengths in [(torch.zeros(1, 7, hidden), torch.tensor([7])),             # not whole blocks
                       (torch.zeros(1, 8, hidden), torch.tensor([8], dtype=torch.int32)),
                       (torch.zeros(1, 8, hidden + 1), torch.tensor([8]))]:
        with pytest.raises(ValueError, match="dit stack"):
            stack(h, mods, lengths, rope)


def test_float32_native_stack_stays_close_and_keeps_batch_invariance(models):
    """float32 with the native products (pack_for_onednn(native=...)) and the blocks in one
    native call (use_native_stack, as the recipe builds the default DiT): the mel within fp32
    noise of the reference forward (atol 1e-4 after 36 passes), and a request's mel the same
    bits alone as in a batch (every product, norm and residual is per row)."""
    from omnistage.kernels.build import NativeBuildError
    from omnistage.kernels.linear import NativeLinearKernel

    _, ours = models
    native = Token2Wav(ours.config)
    native.load_weights(((f"token2wav.{k}", v) for k, v in ours.state_dict().items()))
    try:
        kernel = NativeLinearKernel()
    except NativeBuildError as e:
        pytest.skip(f"the native linear kernel does not build here: {e}")
    assert native.dit.stack_fits()
    if native.dit.pack_for_onednn(torch.float32, None, kernel) == 0 or not native.dit.use_native_attention():
        pytest.skip("oneDNN packed linear or the window attention kernel is not available here")
    assert native.dit.transformer_blocks[0].ff.ff["0"].native is not None
    assert native.dit.use_native_stack()
    reqs = []
    for i, (n, r, g) in enumerate([(25, 20, 0.5), (40, 31, 0.0), (13, 12, 0.5)]):
        codes, cond, ref = utterance(n, seed=40 + i, ref_frames=r)
        reqs.append(Token2WavRequest(codes, cond, ref, torch.randn(1, 2 * n, MEL), guidance_scale=g))
    batch, want = native.mel_batch(reqs), ours.mel_batch(reqs)
    for req, got, ref_mel in zip(reqs, batch, want):
        torch.testing.assert_close(got, ref_mel, atol=1e-4, rtol=1e-4)
        assert torch.equal(native.mel_batch([req])[0], got)


# ---------------------------------------------------------------- streaming

def test_vocoder_windows_are_exact(models):
    """BigVGAN in pieces with receptive_field() frames of context equals one run (atol 1e-6,
    fp32 noise from other conv lengths); with 2 frames of context it does not."""
    _, ours = models
    voc = ours.vocoder
    mel = torch.randn(MEL, 150, generator=torch.Generator().manual_seed(6))
    whole = voc(mel.unsqueeze(0))[0]
    for ctx, exact in [(voc.receptive_field(), True), (2, False)]:
        stream, pieces = VocoderStream(voc, ctx), []
        for a, b in [(0, 37), (37, 40), (40, 101), (101, 150)]:
            pieces.append(stream.push(mel[:, a:b]))
        pieces.append(stream.flush())
        got = torch.cat([p for p in pieces if p is not None])
        assert got.shape == whole.shape
        assert ((got - whole).abs().max() < 1e-6) == exact


@pytest.mark.parametrize("on_native", [False, True])
@pytest.mark.parametrize("first,end", [(0, 110), (0, 25), (45, 65), (80, 110), (109, 110)])
def test_vocoder_runs_part_of_a_window(models, native_vocoder, on_native, first, end):
    """forward(mel, emit=(first, end)) gives the whole window's samples of those frames (within
    float rounding: convolutions of other lengths), at the window's edges too, with the torch
    or the native activations, and its 24 kHz layers compute only what those samples read: the
    last activation sees ~one frame more than the emitted ones, not the window's 110 frames."""
    voc = native_vocoder.vocoder if on_native else models[1].vocoder
    mel = torch.randn(2, MEL, 110, generator=torch.Generator().manual_seed(first))
    whole = voc(mel)
    seen = []
    hook = voc.activation_post.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    try:
        got = voc(mel, emit=(first, end))
    finally:
        hook.remove()
    hop = voc.hop
    torch.testing.assert_close(got, whole[:, first * hop:end * hop], atol=1e-6, rtol=0)
    reach = 3 + 5                # conv_post's (kernel 7) and the activation's own, in samples
    assert seen == [min(end * hop + reach, 110 * hop) - max(first * hop - reach, 0)]
    with pytest.raises(ValueError, match="emit"):
        voc(mel, emit=(end, end))


# Tests that compare two paths with each other (not with a recorded measurement) use 4 ODE
# steps (9 evaluations instead of 36) to stay fast.
FAST = 4


def _stream_all(ours, codes, cond, ref, noise, cfg, one_by_one=False, steps=10, catch_up=False):
    """Returns the PCM chunks and the streamed mel (recorded from each chunk's kept frames)."""
    stream, mels = Token2WavStream(ours, cond, ref, noise, cfg, steps=steps), []
    stream.catch_up = catch_up
    take_mel = stream.take_mel

    def record(plan, mel):
        mels.append(mel[plan.keep[0]:plan.keep[1]])
        return take_mel(plan, mel)

    stream.take_mel = record
    if one_by_one:
        chunks = [c for code in codes for c in stream.push(code.view(1))]
    else:
        chunks = stream.push(codes)
    chunks += stream.finish()
    stream.close()
    return chunks, torch.cat(mels)


@pytest.mark.parametrize("chunk,look_ahead,max_mel,max_wav", [
    (16, 4, 2e-3, 1e-5),     # measured: mel max 1.8e-4 rms 2.1e-5; wav max 5.1e-7 rms 8.8e-8
    (24, 8, 2e-3, 1e-5),     # measured: mel max 1.4e-5 rms 1.4e-6; wav max 3.3e-7 rms 7.6e-8
    (32, 0, 1e-1, 5e-4),     # measured: mel max 2.3e-2 rms 2.2e-3; wav max 5.0e-5 rms 4.3e-6
])
def test_stream_close_to_whole(models, chunk, look_ahead, max_mel, max_wav):
    """120 codes (240 frames; signal rms: mel 1.16, waveform 0.18, peak 0.51), look_back 8 codes
    (two blocks: one per look-back layer), the same noise tensor as the whole decode.

    Differences come only from each window's missing context: within one pass a frame sees one
    block ahead and two back, but over 36 passes the reach compounds, so truncated windows
    differ slightly, most without look-ahead (no look-back: mel max 4.3e-2). The vocoder adds
    nothing (exact windows, see above): the waveform error is BigVGAN's response to the mel
    error. Bounds are ~10x the measured values (RMS bounds a tenth of the max bounds); a
    misplaced window, noise slice or crop gives O(1) mel errors (checked below by shifting the
    noise by one frame)."""
    _, ours = models
    codes, cond, ref = utterance(120, seed=7)
    noise = torch.randn(1, 241, MEL, generator=torch.Generator().manual_seed(8))
    whole_mel = ours.mel_batch([Token2WavRequest(codes, cond, ref, noise[:, :240])])[0]
    whole = ours.vocoder(whole_mel.T.unsqueeze(0))[0]          # what decode() returns
    chunks, mel = _stream_all(ours, codes, cond, ref, noise[:, :240], StreamConfig(chunk, look_ahead, 8))
    wav = torch.cat(chunks)
    assert wav.shape == whole.shape and mel.shape == whole_mel.shape
    dm, dw = (mel - whole_mel), (wav - whole)
    assert dm.abs().max() < max_mel and dm.pow(2).mean().sqrt() < max_mel / 10
    assert dw.abs().max() < max_wav and dw.pow(2).mean().sqrt() < max_wav / 10
    if chunk == 16:     # negative control: the metric sees a one-frame noise misalignment
        _, shifted = _stream_all(ours, codes, cond, ref, noise[:, 1:], StreamConfig(chunk, look_ahead, 8))
        assert (shifted - whole_mel).abs().max() > 0.5


def test_stream_first_chunk_after_chunk_plus_look_ahead(models):
    _, ours = models
    codes, cond, ref = utterance(60, seed=9)
    stream = Token2WavStream(ours, cond, ref, torch.Generator().manual_seed(1), StreamConfig(16, 4, 8),
                             steps=FAST)
    assert stream.push(codes[:19]) == []
    first = stream.push(codes[19:20])
    vctx = ours.vocoder.receptive_field()
    assert len(first) == 1 and first[0].numel() == (16 * 2 - vctx) * 240   # lags by the vocoder context
    stream.close()


def test_stream_finish_flushes_the_vocoder_tail(models):
    """Without look-ahead every code can be decoded before finish(); finish() then only emits
    the last vocoder_context frames, and the total length matches the whole decode."""
    _, ours = models
    codes, cond, ref = utterance(48, seed=15)
    stream = Token2WavStream(ours, cond, ref, torch.randn(1, 96, MEL), StreamConfig(16, 0, 8), steps=FAST)
    early = stream.push(codes)
    vctx = ours.vocoder.receptive_field()
    assert sum(c.numel() for c in early) == (96 - vctx) * 240
    tail = stream.finish()
    assert len(tail) == 1 and tail[0].numel() == vctx * 240
    assert stream.finish() == [] and not stream.has_work()
    with pytest.raises(InvalidRequestError):
        stream.push(codes[:1])


def test_stream_one_code_at_a_time_equals_all_at_once(models):
    _, ours = models
    codes, cond, ref = utterance(70, seed=11)
    noise = torch.randn(1, 140, MEL)
    cfg = StreamConfig(16, 4, 8)
    together, _ = _stream_all(ours, codes, cond, ref, noise, cfg, steps=FAST)
    single, _ = _stream_all(ours, codes, cond, ref, noise, cfg, one_by_one=True, steps=FAST)
    assert [c.numel() for c in single] == [c.numel() for c in together]
    for a, b in zip(single, together):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_stream_generator_noise_matches_decode(models):
    """A generator is drawn one DiT block at a time by both paths: same noise per frame."""
    _, ours = models
    codes, cond, ref = utterance(50, seed=12)
    whole = ours.decode(codes, cond, ref, torch.Generator().manual_seed(3), steps=FAST)
    chunks, _ = _stream_all(ours, codes, cond, ref, torch.Generator().manual_seed(3), StreamConfig(24, 8, 8),
                            steps=FAST)
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=0)


def test_step_streams_batches_many_streams(models):
    """Two streams advanced together (one solve per step for both) give what each gives alone."""
    _, ours = models
    cfg = StreamConfig(16, 4, 8)
    inputs = [utterance(n, seed=20 + n) + (torch.randn(1, 2 * n, MEL),) for n in (45, 30)]
    alone = [torch.cat(_stream_all(ours, *inp, cfg, steps=FAST)[0]) for inp in inputs]
    streams = [Token2WavStream(ours, cond, ref, noise, cfg, steps=FAST) for _, cond, ref, noise in inputs]
    outs: list[list[torch.Tensor]] = [[], []]
    for s, (codes, *_) in zip(streams, inputs):
        s.feed(codes)
        s.end()
    rounds = 0
    while any(s.has_work() for s in streams):
        rounds += 1
        for out, pcm in zip(outs, step_streams(streams)):
            if pcm is not None:
                out.append(pcm)
    assert rounds == 3     # chunks of 16, 16, 13 codes and of 16, 14: the first two rounds are shared
    for out, want in zip(outs, alone):
        torch.testing.assert_close(torch.cat(out), want, atol=1e-5, rtol=0)


def test_stream_state_is_bounded_and_close_releases_it(models):
    _, ours = models
    cfg = StreamConfig(16, 4, 8)
    codes, cond, ref = utterance(200, seed=13)
    stream = Token2WavStream(ours, cond, ref, torch.Generator().manual_seed(2), cfg, steps=FAST)
    vctx = ours.vocoder.receptive_field()
    for i in range(0, 200, 10):
        stream.push(codes[i:i + 10])
        assert stream.codes.numel() <= cfg.look_back + 4 + cfg.chunk_size + cfg.look_ahead + 10
        held_mel = 0 if stream.vocoder.mel is None else stream.vocoder.mel.shape[1]
        assert held_mel <= vctx + 2 * cfg.chunk_size
        assert len(stream.noise.blocks) * 8 <= 2 * (cfg.look_back + 4 + cfg.chunk_size + cfg.look_ahead + 10)
    stream.close()
    assert stream.codes is None and stream.vocoder is None and stream.noise is None
    with pytest.raises(InvalidRequestError):
        stream.push(codes[:1])


# ---------------------------------------------------------------- bad input

def test_bad_input_names_the_parameter(models):
    _, ours = models
    codes, cond, ref = utterance(10, seed=14)
    noise = torch.randn(1, 20, MEL)
    cases = [
        (dict(codes=torch.tensor([0, 101])), "codes"),
        (dict(codes=torch.zeros(2, 3, dtype=torch.long)), "codes"),
        (dict(codes=torch.tensor([], dtype=torch.long)), "codes"),
        (dict(cond=torch.zeros(1, 5)), "cond"),
        (dict(ref_mel=torch.zeros(1, 2, MEL)), "ref_mel"),
        (dict(noise=torch.zeros(1, 19, MEL)), "noise"),
        (dict(steps=1), "steps"),
        (dict(guidance_scale=-1.0), "guidance_scale"),
    ]
    for override, param in cases:
        args = dict(codes=codes, cond=cond, ref_mel=ref, noise=noise) | override
        with pytest.raises(InvalidRequestError) as e:
            ours.decode(**args)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        Token2WavStream(ours, cond, ref, noise, StreamConfig(chunk_size=4))
    assert e.value.param == "chunk_size"
    with pytest.raises(InvalidRequestError) as e:
        StreamConfig(look_ahead=-1)
    assert e.value.param == "look_ahead"


@pytest.mark.parametrize("max_chunk", [
    16,     # measured: mel max 2.2e-5 rms 2.7e-6; wav max 3.6e-7 rms 7.7e-8
    32,     # measured: mel max 2.0e-5 rms 2.0e-6; wav max 3.8e-7 rms 8.0e-8
    48,     # measured: mel max 2.2e-5 rms 1.9e-6; wav max 3.9e-7 rms 7.9e-8
    None,   # for_dit as the stage builds it (chunks 24, 24, 48, 48 codes); measured:
            # mel max 1.8e-5 rms 1.8e-6; wav max 4.0e-7 rms 8.2e-8
    "catch-up",   # for_dit's, every later chunk the largest (the stage's catch_up: chunks
                  # 24, 48, 48, 30 codes); measured: mel max 3.1e-5 rms 2.2e-6; wav max 3.6e-7 rms 7.9e-8
])
def test_growing_stream_close_to_transformers_whole_decode(models, max_chunk):
    """Streaming as the vocoder stage runs it (StreamConfig.for_dit: windows with the DiT's
    exact one-pass reach; chunks growing chunk_size * 2**(k-1) up to max_chunk_size: 16 = never
    grows, 48 = for_dit's 12 blocks) against transformers' whole decode with the same noise.
    The first chunk is 16 codes: the tiny vocoder's context is 28 frames (14 codes), so a
    2-block first chunk (8 codes) would carry no audio here; None: for_dit's own schedule,
    whose first chunk adds those 14 codes rounded up to blocks (16). 150 codes (300 frames).
    Within one ODE evaluation every kept frame sees all it would see in the whole utterance
    (look_back/look_ahead = the layers' reach); over the 36 evaluations (10 RK4 steps, CFG)
    that reach compounds past the window, so kept frames differ slightly. Measured values are
    in the parameters' comments below; bounds are ~10x the largest; a misplaced window or
    noise slice gives O(1) mel errors."""
    hf, ours = models
    vctx = ours.vocoder.receptive_field()
    base = StreamConfig.for_dit(ours.config.dit_config, vctx)
    assert vctx == 28 and base.max_chunk_size == 48     # for_dit's 12 blocks of 4 codes
    catch_up = max_chunk == "catch-up"
    if max_chunk is None or catch_up:
        cfg = base
        assert [cfg.chunk(k) for k in range(6)] == [24, 24, 48, 48, 48, 48]
    else:
        cfg = StreamConfig(16, base.look_ahead, base.look_back, max_chunk_size=max_chunk)
        sizes = [cfg.chunk(k) for k in range(6)]
        assert sizes[0] == 16 and sizes == sorted(sizes) and max(sizes) == max_chunk
    codes, cond, ref = utterance(150, seed=11)
    noise, wav_hf = seeded_noise_and_hf_wav(hf, codes, cond, ref, seed=6)
    with torch.no_grad():
        torch.manual_seed(6)
        mel_hf = hf.code2wav_dit_model.sample(cond, ref, codes[None], num_steps=10,
                                              guidance_scale=0.5, sway_coefficient=-1.0)[0].T
    chunks, mel = _stream_all(ours, codes, cond, ref, noise, cfg, catch_up=catch_up)
    wav = torch.cat(chunks)
    assert wav.shape == wav_hf.shape and mel.shape == mel_hf.shape
    if catch_up:            # 4 windows (24, 48, 48 and a tail of 30 codes) instead of 5 (24, 24,
                            # 48, 48, 6)
        assert len(chunks) == 4 and len(_stream_all(ours, codes, cond, ref, noise, cfg)[0]) == 5
    if max_chunk is None:   # the first PCM outlasts 2 blocks: chunk 0 carried the vocoder's context
        assert chunks[0].numel() == (2 * 24 - vctx) * (wav.numel() // mel.shape[0]) > 0
        assert (2 * 24 - vctx) // 2 >= 2 * 4 and cfg.chunk(1) == cfg.chunk(0)
    dm, dw = mel - mel_hf, wav - wav_hf
    print(f"max_chunk {max_chunk}: mel max {dm.abs().max():.2g} rms {dm.pow(2).mean().sqrt():.2g}; "
          f"wav max {dw.abs().max():.2g} rms {dw.pow(2).mean().sqrt():.2g}")
    assert dm.abs().max() < 3e-4 and dm.pow(2).mean().sqrt() < 3e-5
    assert dw.abs().max() < 4e-6 and dw.pow(2).mean().sqrt() < 1e-6
    if max_chunk == 16:   # negative control: a one-frame noise misalignment is seen
        _, shifted = _stream_all(ours, codes, cond, ref, torch.roll(noise, 1, dims=1), cfg)
        assert (shifted - mel_hf).abs().max() > 0.5
