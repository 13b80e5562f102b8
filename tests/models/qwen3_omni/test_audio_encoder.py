"""Qwen3-Omni's audio tower (omnistage.models.qwen3_omni.audio_encoder) against transformers'
Qwen3OmniMoeAudioEncoder with the same random weights: outputs, token counts, batch
invariance, loading, and raw audio -> features -> embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import (Qwen3OmniMoeAudioEncoderConfig, Qwen3OmniMoeProcessor,
                          WhisperFeatureExtractor)
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_modeling
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as hf_processing

from omnistage.errors import CheckpointError
from omnistage.models.qwen2_5_omni.audio_features import LogMelConfig, LogMelExtractor
from omnistage.models.qwen3_omni.audio_encoder import (CHECKPOINT_PREFIX, Qwen3OmniAudioEncoder,
                                                       num_audio_tokens)

MEL = 128
N_WINDOW = 50                   # chunks of 100 frames -> 13 tokens each
ATOL = 1e-5
# Measured (2 CPU cores, fp32, outputs up to ~7 in magnitude): max |ours - HF| 3.0e-6 (window
# 200) and 3.4e-6 (window 800) over the parity tests below. End to end: features equal bit for
# bit ("max_length") or within 6.0e-5 ("longest"); outputs within 2.4e-6 / 1.2e-5.


def make_config(n_window_infer: int, **overrides) -> Qwen3OmniMoeAudioEncoderConfig:
    fields = dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                  num_mel_bins=MEL, downsample_hidden_size=16, output_dim=48,
                  n_window=N_WINDOW, n_window_infer=n_window_infer, max_source_positions=1500)
    return Qwen3OmniMoeAudioEncoderConfig(**{**fields, **overrides})


def reinit_(module: torch.nn.Module, seed: int) -> None:
    """Every tensor random and O(1)-preserving: weights ~ N(0, 1.5^2 / fan_in), biases
    ~ N(0, 0.1^2), LayerNorm weights 1 + N(0, 0.2^2), so each one changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or name.startswith("ln_post"):
                p.copy_((1.0 + 0.2 * noise) if name.endswith("weight") else 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * 1.5 / (p[0].numel() ** 0.5))


@dataclass
class Pair:
    hf: hf_modeling.Qwen3OmniMoeAudioEncoder
    ours: Qwen3OmniAudioEncoder
    weights: dict[str, torch.Tensor]     # checkpoint names -> tensors

    def hf_run(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        """One HF call over all audios (features concatenated along time), split per audio."""
        lens = torch.tensor([f.shape[1] for f in feats])
        with torch.no_grad():
            out = self.hf(input_features=torch.cat(feats, dim=1), feature_lens=lens)
        counts = hf_modeling._get_feat_extract_output_lengths(lens, N_WINDOW).tolist()
        return list(out.last_hidden_state.split(counts))


def build_pair(n_window_infer: int, seed: int = 0) -> Pair:
    hf = hf_modeling.Qwen3OmniMoeAudioEncoder(make_config(n_window_infer)).eval()
    reinit_(hf, seed)
    weights = {CHECKPOINT_PREFIX + k: v.clone() for k, v in hf.state_dict().items()}
    ours = Qwen3OmniAudioEncoder(make_config(n_window_infer))
    ours.load_weights(weights.items())
    return Pair(hf, ours, weights)


@pytest.fixture(scope="module", params=[200, 800], ids=["window200", "window800"])
def pair(request) -> Pair:
    return build_pair(request.param)


def features(frames: int, seed: int) -> torch.Tensor:
    """(MEL, frames) log-mel-like values."""
    return torch.randn(MEL, frames, generator=torch.Generator().manual_seed(seed)) * 0.6 - 0.3


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# 37: shorter than a chunk (odd lengths after conv1, so padding would matter); 100: one
# chunk exactly; 250: a short last chunk; 1037 / 1600: several attention windows of 2 (or 8)
# chunks, the last window partial (1037) or full (1600).
@pytest.mark.parametrize("frames", [1, 37, 99, 100, 101, 250, 1037, 1600])
def test_parity_alone(pair: Pair, frames: int):
    x = features(frames, seed=frames)
    [ref] = pair.hf_run([x])
    [out] = pair.ours([x])
    assert out.shape == (num_audio_tokens(frames, N_WINDOW), 48)
    assert max_err(out, ref) < ATOL


def test_parity_batched_call(pair: Pair):
    # Audios of at least one chunk: HF pads every last chunk to 100 frames in any call, so its
    # per-audio result does not depend on the batch, and equals ours per audio.
    feats = [features(t, seed=t) for t in (250, 1037, 100, 137, 400, 1600)]
    refs = pair.hf_run(feats)
    outs = pair.ours(feats)
    for ref, out in zip(refs, outs):
        assert max_err(out, ref) < ATOL


def test_reference_short_audio_depends_on_its_batch(pair: Pair):
    # HF pads a short audio's only chunk to the longest chunk of the call; GELU(bias) in the
    # padding reaches the last frames, so HF's rows for 37 frames change next to a longer audio.
    # Ours are HF's on the audio alone, whatever else is in the call.
    short, long = features(37, seed=1), features(250, seed=2)
    [hf_alone] = pair.hf_run([short])
    hf_batched = pair.hf_run([short, long])[0]
    assert max_err(hf_batched, hf_alone) > 1e-2
    ours_batched = pair.ours([short, long])[0]
    assert max_err(ours_batched, hf_alone) < ATOL


def test_batch_invariance(pair: Pair):
    x = features(1037, seed=7)
    [alone] = pair.ours([x])
    others = [features(t, seed=t + 100) for t in (37, 250, 1600)]
    for call, at in (([others[0], x, others[1]], 1), ([*others, x], 3), ([x, x], 0), ([x, x], 1)):
        assert torch.equal(pair.ours(call)[at], alone)


def test_negative_control(pair: Pair):
    x = features(250, seed=3)
    [ref] = pair.hf_run([x])
    [other] = pair.ours([features(250, seed=4)])
    assert max_err(other, ref) > 0.1
    # one frame changed in the last chunk changes the rows of its attention window
    y = x.clone()
    y[:, 240] += 1.0
    [changed] = pair.ours([y])
    assert max_err(changed, ref) > 1e-3


@pytest.mark.parametrize("n_window", [25, 50, 60])
def test_num_audio_tokens_rows(n_window: int):
    # Our count is the encoder's row count for any n_window; HF's formula hard-codes 13 tokens
    # per full chunk, which holds only for n_window 49..52 (the checkpoint's 50).
    ours = Qwen3OmniAudioEncoder(make_config(4 * n_window, n_window=n_window))
    for frames in (1, 2, 7, 2 * n_window - 1, 2 * n_window, 2 * n_window + 1, 777):
        [out] = ours([features(frames, seed=frames)])
        assert out.shape[0] == num_audio_tokens(frames, n_window), frames


def test_num_audio_tokens_formula():
    frames = torch.arange(0, 6001)
    for hf_fn in (hf_modeling._get_feat_extract_output_lengths,
                  hf_processing._get_feat_extract_output_lengths):
        expected = hf_fn(frames, N_WINDOW).tolist()
        assert [num_audio_tokens(t, N_WINDOW) for t in frames.tolist()] == expected
    assert num_audio_tokens(100, 50) == 13 and num_audio_tokens(37, 50) == 5
    with pytest.raises(ValueError):
        num_audio_tokens(-1, 50)


def test_num_audio_tokens_processor():
    """The processor's placeholders per audio (one audio per call): its feature frames are
    floor(samples / 160) (padding=True, no truncation), then the same formula."""
    # A stand-in `self` for the processor's audio methods: the whole Qwen3OmniMoeProcessor
    # cannot be built here (its video processor needs torchvision).
    proc = SimpleNamespace(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                           n_window=N_WINDOW, audio_token="<|audio_pad|>")
    proc.replace_audio_token = partial(Qwen3OmniMoeProcessor.replace_audio_token, proc)
    kwargs = dict(sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True)
    for samples in (481, 800, 5920, 16000, 16080, 16159, 40037, 160 * 1037 + 5, 320000):
        inputs, [text] = Qwen3OmniMoeProcessor._process_audio(
            proc, [np.zeros(samples, np.float32)], **kwargs)
        count = text.count(proc.audio_token)
        assert int(inputs["feature_attention_mask"].sum()) == samples // 160
        assert count == num_audio_tokens(samples // 160, N_WINDOW), samples
        assert Qwen3OmniMoeProcessor._get_num_audio_tokens(proc, samples) == count


def test_loading_refuses_bad_checkpoints(pair: Pair):
    cfg = make_config(200)
    missing = {k: v for k, v in pair.weights.items() if not k.endswith("layers.1.fc2.bias")}
    with pytest.raises(CheckpointError, match="layers.1.fc2.bias"):
        Qwen3OmniAudioEncoder(cfg).load_weights(missing.items())
    wrong = dict(pair.weights)
    name = CHECKPOINT_PREFIX + "conv_out.weight"
    wrong[name] = torch.zeros(64, 16 * 16 + 1)
    with pytest.raises(CheckpointError, match="conv_out.weight"):
        Qwen3OmniAudioEncoder(cfg).load_weights(wrong.items())
    extra = {**pair.weights, CHECKPOINT_PREFIX + "audio_bos_eos_token.weight": torch.zeros(2, 48)}
    with pytest.raises(CheckpointError, match="audio_bos_eos_token"):
        Qwen3OmniAudioEncoder(cfg).load_weights(extra.items())


def test_config_dict_and_checks(pair: Pair):
    as_dict = Qwen3OmniAudioEncoder(make_config(200).to_dict())
    assert {k: v.shape for k, v in as_dict.state_dict().items()} == \
        {k: v.shape for k, v in pair.ours.state_dict().items()}
    with pytest.raises(ValueError, match="n_window_infer"):
        Qwen3OmniAudioEncoder(make_config(99))
    with pytest.raises(ValueError, match="features 1"):
        pair.ours([features(10, 0), torch.zeros(80, 10)])
    assert pair.ours([]) == []


def _sound(samples: int) -> np.ndarray:
    rng = np.random.RandomState(5)
    t = np.arange(samples) / 16000
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.3 * t)
    return (wave + 0.05 * rng.randn(samples)).astype(np.float32)


@pytest.mark.parametrize("padding", ["max_length", "longest"])
def test_end_to_end_raw_audio(pair: Pair, padding: str):
    """16 kHz audio -> our log-mel (qwen2_5_omni.audio_features) -> our encoder, against
    WhisperFeatureExtractor(feature_size=128) -> HF encoder. "longest" is what
    Qwen3OmniMoeProcessor asks for (padding=True): floor(samples / 160) frames, here equal to
    ours over those frames (samples not a multiple of 160)."""
    samples = 40037
    audio = _sound(samples)
    fe = WhisperFeatureExtractor(feature_size=128)
    hf_in = fe(audio, sampling_rate=16000, padding=padding, return_attention_mask=True,
               return_tensors="pt")
    frames = int(hf_in["attention_mask"].sum())
    assert frames == (-(-samples // 160) if padding == "max_length" else samples // 160)
    hf_feats = hf_in["input_features"][0, :, :frames]
    ours_feats = LogMelExtractor(LogMelConfig(max_samples=30 * 16000))([audio]).features[0]
    ours_feats = ours_feats[:, :frames]
    assert max_err(ours_feats, hf_feats) < 1e-4
    [ref] = pair.hf_run([hf_feats])
    [out] = pair.ours([ours_feats])
    assert max_err(out, ref) < 1e-4


@pytest.mark.parametrize("frames", [37, 250, 1037, 1650])
def test_window_cache_serves_a_grown_audio_with_the_same_bits(pair: Pair, frames: int):
    """Encoded window by window through the encoder stage's cache: HF's rows for the audio; a
    prefix seen before (a Realtime turn warmed while spoken) serves its whole windows, bit for
    bit. 1650 frames: its last window is one short chunk, padded as in the whole call."""
    from omnistage.models.qwen3_omni.encoders import Qwen3OmniEncoders

    x = features(frames, seed=frames + 5)
    [ref] = pair.hf_run([x])
    cold = Qwen3OmniEncoders(pair.ours, None, torch.device("cpu"), cache_windows=0).encode_audio(x)
    assert max_err(cold, ref) < ATOL
    enc = Qwen3OmniEncoders(pair.ours, None, torch.device("cpu"), cache_windows=16)
    size = pair.ours.window_frames
    enc.encode_audio(x[:, :max(1, frames - 20)])
    assert torch.equal(enc.encode_audio(x), cold)
    whole_windows_before = (frames - 20) // size if frames > 20 else 0
    assert enc.cache.hits == whole_windows_before
