"""Qwen3-Omni code2wav against transformers' `Qwen3OmniMoeCode2Wav` (the oracle): whole
forward, streamed windows (`chunked_decode` and a growing chunk schedule), loading.

The tiny model: hidden 64, 2 layers, 4 query / 2 key-value heads (GQA), RoPE theta 500,
sliding window 8 (so 40-frame windows are cut), codebook 64 x 16 quantizers, decoder_dim 64,
the released upsampling (2, 2) x (8, 5, 4, 3) = 1920 samples per frame. transformers' init
leaves LayerScale at 0.01, ConvNeXt gamma at 1e-6 and SnakeBeta at alpha = beta = 0 (and
linears/convs at std 0.02): most parts would barely touch the output, so `randomise` redraws
every tensor with a seeded generator: fan-in scaled weights (decoder convs at gain 0.7, which
keeps its activations at std 0.3-0.9, where SnakeBeta is far from linear), residual scales in
[0.2, 0.8], SnakeBeta log-parameters around 0 / 0.5, the last conv at gain 0.12. The
waveform then has std ~0.15 and peaks ~0.7 (nothing clamped), so an absolute tolerance means
something.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.layers.snake import use_native_snake
from omnistage.models.qwen3_omni.code2wav import (CausalConv, Code2Wav, Code2WavConfig, Code2WavWindow,
                                                  TrimmedTransposedConv, run_causal, sliding_causal_mask,
                                                  use_native_convolutions, use_native_units)

CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, codebook_size=64, num_quantizers=16, decoder_dim=64,
              sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
              upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2))
SPF = 1920        # samples per frame
TRIMMED = 555     # samples a window falls short of frames * SPF: 8*5*4*3 + 5*4*3 + 4*3 + 3
# fp32, different operation order (fused RMSNorm, our RoPE tables, bool-masked SDPA, grouped
# query heads repeated before SDPA): measured max |ours - transformers| 1.6e-6 over all the
# comparisons below (waveform std ~0.15). 1e-5 leaves room for other BLAS builds and is still
# far below what a real mistake gives (>= 0.4, see the negative controls).
ATOL = 1e-5


def _fan_in(m: nn.Module) -> int:
    if isinstance(m, nn.ConvTranspose1d):     # each output sample sums in * kernel / stride taps
        return m.in_channels * m.kernel_size[0] // m.stride[0]
    if isinstance(m, nn.Conv1d):
        return m.in_channels // m.groups * m.kernel_size[0]
    return m.in_features


@torch.no_grad()
def randomise(model: nn.Module, seed: int) -> None:
    """Redraw every parameter so that each part shapes the waveform (see the module doc)."""
    g = torch.Generator().manual_seed(seed)

    def draw(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * std + mean)

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
            gain = 0.12 if name.startswith("decoder.6") else 0.7 if name.startswith("decoder") else 1.0
            draw(m.weight, gain / _fan_in(m) ** 0.5)
            if m.bias is not None:
                draw(m.bias, 0.02)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name == "code_embedding.weight":
            draw(p, 1.0)
        elif leaf in ("alpha", "beta"):
            draw(p, 0.3, 0.5 if leaf == "beta" else 0.0)
        elif leaf in ("scale", "gamma"):
            p.copy_(torch.rand(p.shape, generator=g) * 0.6 + 0.2)
        elif "norm" in name:                      # RMSNorm / LayerNorm weight, LayerNorm bias
            draw(p, 0.1, 1.0 if leaf == "weight" else 0.0)


def checkpoint(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as the released checkpoint names them."""
    return {f"code2wav.{k}": v.clone() for k, v in hf.state_dict().items()}


def load(config, state: dict[str, torch.Tensor]) -> Code2Wav:
    model = Code2Wav(config)
    model.load_weights(state.items())
    return model


@pytest.fixture(scope="module")
def models():
    cfg = Qwen3OmniMoeCode2WavConfig(**CONFIG)
    hf = Qwen3OmniMoeCode2Wav(cfg).eval()
    randomise(hf, seed=0)
    return hf, load(cfg, checkpoint(hf))


def codes_for(batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["codebook_size"], (batch, CONFIG["num_quantizers"], frames), generator=g)


def hf_window(hf, codes: torch.Tensor, start: int, end: int, left_context: int) -> torch.Tensor:
    """The oracle for one chunk of codes (Q, T): transformers' chunked_decode rule by hand."""
    ctx = left_context if start - left_context > 0 else start
    with torch.no_grad():
        return hf(codes[None, :, start - ctx:end])[0, 0, ctx * SPF:]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- whole forward

@pytest.mark.parametrize("frames", [1, 7, 40])
@pytest.mark.parametrize("batch", [1, 2])
def test_forward_matches_transformers(models, frames, batch):
    """Measured max error: 0 (T=1), 1.1e-6 (T=7), 1.3e-6 (T=40)."""
    hf, ours = models
    codes = codes_for(batch, frames, seed=frames)
    with torch.no_grad():
        want = hf(codes)
    got = ours(codes)
    assert got.shape == want.shape == (batch, 1, frames * SPF - TRIMMED)
    assert 0.05 < want.abs().max() < 1.0          # a real, unclamped signal
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("frames", [7, 40])
def test_native_snake_matches_transformers(models, frames):
    """The decoder's SnakeBeta through the native kernel (as the recipe runs it on CPU): the
    whole forward and streamed windows within the same tolerance."""
    hf, ours = models
    native = load(ours.config, checkpoint(hf))
    assert use_native_snake(native) == 1 + 3 * 2 * len(CONFIG["upsample_rates"]) + len(CONFIG["upsample_rates"])
    codes = codes_for(2, frames, seed=frames + 1)
    with torch.no_grad():
        want = hf(codes)
    torch.testing.assert_close(native(codes), want, atol=ATOL, rtol=0)
    window = Code2WavWindow(codes[0], 3, frames, 25)
    torch.testing.assert_close(native.decode_windows([window])[0], hf_window(hf, codes[0], 3, frames, 25),
                               atol=ATOL, rtol=0)


def every_native_kernel(model: Code2Wav) -> Code2Wav:
    """As the recipe runs it on the CPU: SnakeBeta, the residual units and the other
    convolutions through the native kernels."""
    use_native_snake(model)
    assert use_native_units(model) == 3 * len(CONFIG["upsample_rates"])
    # decoder.0 and the last conv, the upsampler's two transposed and two depthwise ones, the
    # decoder blocks' transposed ones and the two convolutions of each residual unit
    units = 3 * len(CONFIG["upsample_rates"])
    assert use_native_convolutions(model) == 2 + 2 * 2 + len(CONFIG["upsample_rates"]) + 2 * units
    return model


@pytest.mark.parametrize("frames", [1, 9, 40])
def test_native_convolutions_match_transformers(models, frames):
    """Every convolution through the native time-major kernel where it serves it (the
    transposed ones as 1- or 2-tap convolutions over the stride's phases, the depthwise ones
    by its depthwise form), with the native units and SnakeBeta: the whole forward and windows
    of mixed lengths in one call within the same tolerance."""
    hf, ours = models
    native = every_native_kernel(load(ours.config, checkpoint(hf)))
    served = [m for m in native.modules() if isinstance(m, (CausalConv, TrimmedTransposedConv))]
    assert all(m.run.packed() is not None for m in served)      # the tiny widths: all of them
    codes = codes_for(2, frames, seed=frames + 2)
    with torch.no_grad():
        want = hf(codes)
    torch.testing.assert_close(native(codes), want, atol=ATOL, rtol=0)
    spans = [(0, frames), (frames // 2, frames), (frames - 1, frames)]
    windows = [Code2WavWindow(codes[r], s, e, 6) for r in (0, 1) for s, e in spans]
    for w, got in zip(windows, native.decode_windows(windows)):
        torch.testing.assert_close(got, hf_window(hf, w.codes, w.start, w.end, 6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("native", [False, True])
def test_no_convolution_reaches_onednn(models, native):
    """Neither the native kernels nor the matrix products (the path without them: CUDA, the
    `matmul` kernels) call PyTorch's convolution: oneDNN kept a primitive for every input shape,
    and a stream's windows brought ever new ones (a server's memory grew ~15 MB a minute)."""
    hf, ours = models
    model = every_native_kernel(load(ours.config, checkpoint(hf))) if native else ours
    windows = [Code2WavWindow(codes_for(1, 30, seed=5)[0], s, e, 25) for s, e in ((0, 4), (4, 10), (10, 30))]
    with torch.autograd.profiler.profile() as prof:
        model.decode_windows(windows)
    ops = {e.name for e in prof.function_events}
    assert "aten::mm" in ops or "aten::addmm" in ops or native     # the profile saw the decode
    assert not {name for name in ops if "conv" in name}


def test_other_codes_give_another_waveform(models):
    """Negative control: one frame's codes changed -> the output moves by far more than ATOL
    (measured 0.52), and not at all before TRIMMED samples ahead of that frame's span (the
    decoder's transposed convs look one step ahead: 480 + 60 + 12 + 3 samples)."""
    hf, ours = models
    codes = codes_for(1, 40, seed=3)
    other = codes.clone()
    other[0, :, 20] = (other[0, :, 20] + 1) % CONFIG["codebook_size"]
    a, b = ours(codes), ours(other)
    assert max_err(a[..., 20 * SPF:], b[..., 20 * SPF:]) > 0.01
    first = 20 * SPF - TRIMMED
    assert max_err(a[..., :first], b[..., :first]) == 0 and (a[..., first] != b[..., first]).all()


@pytest.mark.parametrize("window", [7, 9])
def test_sliding_window_off_by_one_is_caught(models, window):
    """Negative control: the same weights with a window one frame shorter or longer differ from
    transformers by far more than ATOL (measured 0.53 and 0.42)."""
    hf, ours = models
    wrong = Code2Wav(dataclasses.replace(ours.config, sliding_window=window))
    wrong.load_state_dict(ours.state_dict())
    codes = codes_for(1, 40, seed=40)
    with torch.no_grad():
        want = hf(codes)
    assert max_err(wrong(codes), want) > 0.01


def test_sliding_window_mask_matches_transformers():
    """A query sees itself and the window - 1 frames before it (kv > q - window, kv <= q)."""
    t, window = 20, 8
    rule = sliding_window_causal_mask_function(window)
    zero, pos = torch.tensor(0), torch.arange(t)
    want = rule(zero, zero, pos[:, None], pos[None, :])                  # (T, T) by broadcasting
    got = sliding_causal_mask(t, window, torch.device("cpu"))
    assert torch.equal(got, want)
    assert got[10].nonzero().flatten().tolist() == list(range(3, 11))


def test_bfloat16_is_as_close_as_transformers_own(models):
    """The released weights are bfloat16. Ours in bf16 vs transformers in fp32: measured 0.032,
    transformers' own bf16 run 0.039 (the snake decoder amplifies rounding); both far from the
    0.5 that other codes give."""
    hf, ours = models
    half = Code2Wav(ours.config, dtype=torch.bfloat16)
    half.load_weights(checkpoint(hf).items())
    codes = codes_for(1, 40, seed=1)
    with torch.no_grad():
        want = hf(codes)
    got = half(codes)
    assert got.dtype == torch.bfloat16
    assert max_err(got.float(), want) < 0.08


# ---------------------------------------------------------------- streamed windows

@pytest.mark.parametrize("chunk,left", [(4, 25), (5, 3), (7, 0), (64, 25)])
def test_windows_match_chunked_decode(models, chunk, left):
    """Our windows, one request at a time, concatenated = transformers' chunked_decode; and our
    own chunked_decode over a batch of two = theirs. Measured max error 1.6e-6."""
    hf, ours = models
    codes = codes_for(2, 40, seed=chunk)
    with torch.no_grad():
        want = hf.chunked_decode(codes, chunk_size=chunk, left_context_size=left)
    chunks = [(s, min(s + chunk, 40)) for s in range(0, 40, chunk)]
    assert want.shape[-1] == 40 * SPF - len(chunks) * TRIMMED     # TRIMMED lost per chunk
    for row in range(2):
        got = torch.cat([ours.decode_window(codes[row], s, e, left) for s, e in chunks])
        torch.testing.assert_close(got, want[row, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.chunked_decode(codes, chunk, left), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("left", [6, 25])
def test_growing_schedule_matches_transformers(models, left):
    """Chunks of 2, 4, 8, 16, then the rest (10) frames, for two requests at once: each step's
    two windows have one length and share a forward. Oracle: transformers' forward over the same
    windows (chunked_decode's rule by hand). Measured max error 1.5e-6."""
    hf, ours = models
    codes = codes_for(2, 40, seed=7)
    bounds = [0, 2, 6, 14, 30, 40]
    for s, e in zip(bounds, bounds[1:]):
        got = ours.decode_windows([Code2WavWindow(codes[r, :, :e], s, e, left) for r in range(2)])
        for r in range(2):
            assert got[r].shape == ((e - s) * SPF - TRIMMED,)
            torch.testing.assert_close(got[r], hf_window(hf, codes[r], s, e, left), atol=ATOL, rtol=0)


def test_windows_of_mixed_lengths_in_one_call(models):
    """One call with windows of several lengths (grouped by length) gives each its own chunk
    (measured max error 1.3e-6)."""
    hf, ours = models
    codes = codes_for(1, 40, seed=8)[0]
    spans = [(0, 2), (2, 6), (6, 14), (30, 40), (14, 22)]
    got = ours.decode_windows([Code2WavWindow(codes, s, e, 6) for s, e in spans])
    for (s, e), wav in zip(spans, got):
        torch.testing.assert_close(wav, hf_window(hf, codes, s, e, 6), atol=ATOL, rtol=0)


def test_full_context_window_is_a_slice_of_forward(models):
    """The invariant behind streaming: a window starting at frame 0 is causal, so its chunk
    [s, e) equals the whole utterance's samples [s * SPF, e * SPF - TRIMMED); the TRIMMED samples
    after it need frame e. Measured max error 1e-6."""
    hf, ours = models
    codes = codes_for(1, 40, seed=9)
    whole = ours(codes)[0, 0]
    for s, e in [(0, 5), (5, 12), (12, 40)]:
        got = ours.decode_window(codes[0], s, e, left_context=s)
        torch.testing.assert_close(got, whole[s * SPF:e * SPF - TRIMMED], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seamless", [False, True])
def test_decoder_runs_over_its_reach_not_the_whole_context(models, seamless):
    """The decoder runs from decoder_reach steps before a chunk's first sample (19 steps,
    4.75 frames, here as at the released config), not over the transformer's 25 frames of
    context, and each later layer only over what it reaches back (the 24 kHz conv: 6 samples):
    the same samples as the whole window's forward, the decoder fed fewer steps. One
    or two steps short of the reach changes the samples: the reach is needed, and computed
    from the layers, not guessed."""
    hf, ours = models
    assert ours.decoder_reach == 19
    codes = codes_for(1, 60, seed=12)[0]
    steps = SPF // 480                             # decoder input steps per frame
    fed, last = [], []
    for s, e in [(30, 42), (40, 60), (3, 9)]:
        w = Code2WavWindow(codes, s, e, 25, seamless)
        hooks = [ours.decoder[0].register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1])),
                 ours.decoder[-1].register_forward_hook(lambda m, args, out: last.append(args[0].shape[1]))]
        try:
            got = ours.decode_windows([w])[0]
        finally:
            for hook in hooks:
                hook.remove()
        whole = ours(codes[None, :, s - w.context:e])[0, 0, w.emit_from(SPF, TRIMMED):]
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=0)
        # the last conv (24 kHz) reads the emitted samples and its own reach (6), not the
        # decoder's 19 steps of 480 before them
        assert last[-1] == got.numel() + 6 or w.context == s < 5
    # the chunk's steps + the reach (+ one step for the 555 samples seamless emits before
    # the chunk: 1.16 steps of 480, which with the reach's own 18.4 steps still round up to
    # 20), instead of (25 + chunk) frames; a context under the reach: the whole window
    assert fed == [12 * steps + 19 + seamless, 20 * steps + 19 + seamless, 9 * steps]
    with torch.no_grad():
        h = run_causal(ours.upsampler_steps(), ours.frames(codes[None, :, 5:42]), 0)
        full = run_causal(ours.decoder_steps(), h, 0)[0, 25 * SPF:, 0]
        for short, over in ((1, 2e-6), (2, 1e-4)):     # float noise here: 5e-7
            first = 25 * steps - ours.decoder_reach + short
            cut = run_causal(ours.decoder_steps(), h[:, first:], 0)[0, (25 * steps - first) * 480:, 0]
            assert (cut - full).abs().max() > over


def test_context_beyond_the_reach_matches_forward(models):
    """With 25 frames of left context (beyond this model's reach: 2 layers x 7 frames of
    attention plus the convolutions; measured, 24 frames suffice and 22 give 2.6e-5), chunked
    decoding equals the whole forward with TRIMMED samples cut before each later chunk start
    (measured max error 1.3e-6); with 3 frames it does not (measured 0.76)."""
    hf, ours = models
    codes = codes_for(1, 40, seed=10)
    whole = ours(codes)[0, 0]
    keep = torch.cat([torch.arange(s * SPF, min(s + 4, 40) * SPF - TRIMMED) for s in range(0, 40, 4)])
    torch.testing.assert_close(ours.chunked_decode(codes, 4, 25)[0, 0], whole[keep], atol=ATOL, rtol=0)
    assert max_err(ours.chunked_decode(codes, 4, 3)[0, 0], whole[keep]) > 0.01


def test_window_checks(models):
    _, ours = models
    codes = codes_for(1, 10, seed=0)[0]
    for s, e in [(3, 3), (-1, 2), (4, 11)]:
        with pytest.raises(ValueError, match="start < end"):
            ours.decode_window(codes, s, e)
    with pytest.raises(InvalidRequestError, match="integer codes"):
        ours(codes_for(1, 5, seed=0)[:, :15])
    with pytest.raises(InvalidRequestError, match="integer codes"):
        ours(codes_for(1, 5, seed=0).float())
    bad = codes_for(1, 5, seed=0)
    bad[0, 3, 2] = CONFIG["codebook_size"]
    with pytest.raises(InvalidRequestError, match="codec ids"):
        ours(bad)


# ---------------------------------------------------------------- config and loading

def test_config_of_the_released_model():
    """config.json's code2wav_config (old-style rope_theta key) -> 1920 samples per frame, 555
    trimmed; both config spellings give the same shape."""
    released = dict(codebook_size=2048, hidden_size=1024, max_position_embeddings=8000,
                    rope_theta=10000, num_attention_heads=16, num_key_value_heads=16,
                    attention_bias=False, sliding_window=72, intermediate_size=3072,
                    hidden_act="silu", layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
                    num_hidden_layers=8, num_quantizers=16, upsample_rates=[8, 5, 4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=1536, attention_dropout=0.0)
    c = Code2WavConfig.from_hf(released)
    assert (c.samples_per_frame, c.trimmed_samples, c.rope_theta, c.head_dim) == (1920, 555, 10000.0, 64)
    assert c.num_samples(4) == 4 * 1920 - 555
    tiny = Qwen3OmniMoeCode2WavConfig(**CONFIG)
    assert Code2WavConfig.from_hf(tiny.to_dict()) == Code2WavConfig.from_hf(tiny)
    assert Code2WavConfig.from_hf(tiny).rope_theta == 500.0


def test_load_needs_every_tensor(models):
    hf, ours = models
    state = checkpoint(hf)
    extra = [("code2wav.pre_transformer.rotary_emb.inv_freq", torch.ones(8)),   # derived: skipped
             ("talker.model.norm.weight", torch.ones(3))]                       # other prefix
    fresh = Code2Wav(ours.config)
    assert fresh.load_weights(list(state.items()) + extra) == set(fresh.state_dict())
    missing = dict(state)
    del missing["code2wav.decoder.3.block.2.act1.beta"]
    with pytest.raises(CheckpointError, match="lacks weights.*decoder.3.block.2.act1.beta"):
        Code2Wav(ours.config).load_weights(missing.items())


def test_load_refuses_misfits(models):
    hf, ours = models
    wrong_shape = checkpoint(hf)
    wrong_shape["code2wav.upsample.1.1.pwconv1.weight"] = torch.zeros(128, 64)
    with pytest.raises(CheckpointError, match="shape"):
        Code2Wav(ours.config).load_weights(wrong_shape.items())
    unknown = checkpoint(hf)
    unknown["code2wav.pre_transformer.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)
    with pytest.raises(CheckpointError, match="no place"):
        Code2Wav(ours.config).load_weights(unknown.items())
