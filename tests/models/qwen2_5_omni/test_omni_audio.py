"""Qwen2.5-Omni audio input against transformers: log-mel features vs WhisperFeatureExtractor
with Qwen2_5OmniProcessor's arguments, placeholder counts vs the processor's formula, and our
batched audio tower vs Qwen2_5OmniAudioEncoder.

Tolerances (fp32): features atol 1e-5 (values are O(1); our STFT, filters and ops are the same
float32 operations, so any difference is summation order in the mel matmul, far below 1e-5);
tower outputs atol/rtol 1e-5 (O(1) values after a few float32 GEMMs and softmaxes whose
summation order differs: batched SDPA with a mask vs per-chunk eager attention; measured
differences are ~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniAudioEncoderConfig, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
    _get_feat_extract_output_lengths,
)

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.qwen2_5_omni.audio_encoder import CHECKPOINT_PREFIX, AudioEncoder
from omnistage.models.qwen2_5_omni.audio_features import (
    LogMelConfig,
    LogMelExtractor,
    num_audio_tokens,
)
from omnistage.models.qwen2_5_omni.encoders import OmniEncoders
from omnistage.stages.encoder_cache import EncoderCache

# Qwen2.5-Omni-7B's preprocessor_config.json (audio keys).
OMNI_PREPROCESSOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
                     "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
                     "chunk_length": 300, "n_samples": 4800000, "nb_max_frames": 30000,
                     "dither": 0.0, "padding_side": "right", "padding_value": 0.0,
                     "return_attention_mask": True}


def _hf_features(extractor: WhisperFeatureExtractor, audios: list[np.ndarray]):
    """What Qwen2_5OmniProcessor._process_audio produces, then what the thinker's
    get_audio_features keeps: the valid frames of each audio."""
    out = extractor(audios, sampling_rate=16000, return_attention_mask=True,
                    padding="max_length", return_tensors="pt")
    mask = out["attention_mask"].bool()                                      # (B, frames)
    feats = [out["input_features"][i][:, mask[i]] for i in range(len(audios))]
    tokens = _get_feat_extract_output_lengths(mask.sum(-1)).tolist()
    return feats, tokens


def _test_audios() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    noise = [(0.1 * rng.standard_normal(n)).astype(np.float32)
             for n in (32037, 5000, 321, 480000 - 100, 479800, 480000 + 5000)]
    sine = (0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 16000)).astype(np.float32)
    # Loud last samples: the loudest frame lies past the last frame the model sees, and still
    # sets the 80 dB floor of the whole audio.
    click = (0.001 * rng.standard_normal(4000)).astype(np.float32)
    click[-30:] = 1.0
    return noise + [sine, click]


def test_log_mel_matches_whisper_feature_extractor():
    audios = _test_audios()
    ref, ref_tokens = _hf_features(WhisperFeatureExtractor(feature_size=128), audios)
    ours = LogMelExtractor(LogMelConfig(max_samples=30 * 16000))(audios)
    assert ours.num_frames == [r.shape[1] for r in ref]
    assert ours.num_tokens == ref_tokens
    for mine, theirs in zip(ours.features, ref):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_log_mel_with_omni_preprocessor_config_keeps_long_audio():
    config = LogMelConfig.from_preprocessor_config(OMNI_PREPROCESSOR)
    assert config == LogMelConfig()                   # our defaults are Qwen2.5-Omni's
    assert config.max_samples == 300 * 16000
    audio = (0.1 * np.random.default_rng(1).standard_normal(16000 * 40)).astype(np.float32)
    ref, ref_tokens = _hf_features(WhisperFeatureExtractor(**OMNI_PREPROCESSOR), [audio])
    ours = LogMelExtractor(config)([audio])
    assert ours.num_frames == [4000] and ours.num_tokens == ref_tokens == [1000]
    torch.testing.assert_close(ours.features[0], ref[0], atol=1e-5, rtol=0)


def test_num_audio_tokens_matches_hf_formula():
    frames = torch.arange(0, 4000)
    expected = _get_feat_extract_output_lengths(frames).clamp(min=0).tolist()
    assert [num_audio_tokens(int(n)) for n in frames] == expected
    assert num_audio_tokens(3000) == 750 and num_audio_tokens(2) == 0 and num_audio_tokens(3) == 1


def test_too_short_audio_is_a_client_error():
    extractor = LogMelExtractor(LogMelConfig())
    assert extractor([np.zeros(321, np.float32)]).num_tokens == [1]
    with pytest.raises(InvalidRequestError, match="at least 321 samples") as e:
        extractor([np.zeros(320, np.float32)], param="messages[0].content[0]")
    assert e.value.param == "messages[0].content[0]"


# ---------------------------------------------------------------------------------------------

def _tower_config(n_window: int, mel: int = 16) -> Qwen2_5OmniAudioEncoderConfig:
    config = Qwen2_5OmniAudioEncoderConfig(
        num_mel_bins=mel, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        d_model=32, n_window=n_window, output_dim=24, max_source_positions=64)
    config._attn_implementation = "eager"
    return config


def _towers(config) -> tuple[Qwen2_5OmniAudioEncoder, AudioEncoder]:
    torch.manual_seed(0)
    hf = Qwen2_5OmniAudioEncoder(config).eval()
    with torch.no_grad():               # HF's init (std 0.02, zero biases) is too tame to test
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = AudioEncoder(config, dtype=torch.float32, device="cpu")
    # The path a checkpoint takes: every thinker tensor streams by, only ours are taken.
    checkpoint = [("thinker.model.embed_tokens.weight", torch.zeros(3, 3))]
    checkpoint += [(CHECKPOINT_PREFIX + k, v) for k, v in hf.state_dict().items()]
    ours.load_weights(checkpoint)
    return hf, ours


@pytest.mark.parametrize("n_window", [3, 4])     # odd: pooled pairs straddle chunk boundaries
def test_audio_tower_batched_matches_hf(n_window):
    hf, ours = _towers(_tower_config(n_window))
    assert set(ours.state_dict()) == set(hf.state_dict())
    lengths = [37, 8, 13, 16, 3, 1]      # mostly not multiples of the 2 * n_window chunk
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(16, t, generator=gen) for t in lengths]
    out = ours(feats)
    assert [o.shape for o in out] == [(num_audio_tokens(t), 24) for t in lengths]
    with torch.no_grad():
        for f, o in zip(feats, out):             # HF, one audio at a time
            ref = hf(input_features=f, feature_lens=torch.tensor([f.shape[1]])).last_hidden_state
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
        packed = hf(input_features=torch.cat(feats, dim=1),   # HF, batched (packed + lengths)
                    feature_lens=torch.tensor(lengths)).last_hidden_state
    torch.testing.assert_close(torch.cat(out), packed, atol=1e-5, rtol=1e-5)
    assert torch.cat(out).abs().max() > 0.1      # not a vacuous comparison of near-zeros


def test_audio_tower_one_call_equals_separate_calls():
    _, ours = _towers(_tower_config(4))
    feats = [torch.randn(16, t) for t in (30, 5, 17)]
    together = ours(feats)
    for f, o in zip(feats, together):
        torch.testing.assert_close(o, ours([f])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_window", [3, 4])
def test_encoder_chunk_cache_serves_a_grown_audio_with_the_same_bits(n_window):
    """A Realtime turn warmed while spoken: its audio so far, then the whole. The whole's
    chunks seen before come from the cache; the rows are the bits of a cold encode and match
    HF's. With odd n_window pooled pairs straddle chunks: no chunking, nothing cached."""
    hf, ours = _towers(_tower_config(n_window))
    size = ours.chunk_frames
    full = torch.randn(16, 3 * size + 5, generator=torch.Generator().manual_seed(2))
    cold = OmniEncoders(ours, None, torch.device("cpu"), cache_chunks=0).encode_audio(full)
    with torch.no_grad():
        ref = hf(input_features=full, feature_lens=torch.tensor([full.shape[1]])).last_hidden_state
    torch.testing.assert_close(cold, ref, atol=1e-5, rtol=1e-5)
    enc = OmniEncoders(ours, None, torch.device("cpu"), cache_chunks=8)
    enc.encode_audio(full[:, :2 * size + 1])           # two whole chunks and one frame
    warm = enc.encode_audio(full)
    assert torch.equal(warm, cold)
    chunked = n_window % 2 == 0
    assert (enc.cache.hits, enc.cache.misses) == ((2, 5) if chunked else (0, 0))


def test_encoder_cache_is_a_bounded_lru():
    cache = EncoderCache(2)
    calls = []

    def double(x):
        calls.append(x.sum().item())
        return x * 2
    a, b, c = (torch.full((2,), float(v)) for v in (1, 2, 3))
    assert torch.equal(cache.get(a, double), a * 2) and torch.equal(cache.get(a.clone(), double), a * 2)
    cache.get(b, double)
    cache.get(a, double)                       # a is now the most recent: c evicts b
    cache.get(c, double)
    cache.get(a, double)
    cache.get(b, double)
    assert calls == [2.0, 4.0, 6.0, 4.0] and (cache.hits, cache.misses) == (3, 4)
    assert cache.get(a.view(2, 1), double).shape == (2, 1)     # the shape is in the key
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_audio_tower_bf16_runs_close_to_fp32():
    config = _tower_config(4)
    hf, ours = _towers(config)
    half = AudioEncoder(config, dtype=torch.bfloat16, device="cpu")
    half.load_weights((CHECKPOINT_PREFIX + k, v) for k, v in hf.state_dict().items())
    feats = [torch.randn(16, t) for t in (21, 9)]
    for lo, hi in zip(half(feats), ours(feats)):
        assert lo.dtype == torch.bfloat16
        torch.testing.assert_close(lo.float(), hi, atol=0.15, rtol=0.05)


def test_audio_tower_rejects_incomplete_or_foreign_weights():
    config = _tower_config(4)
    hf, _ = _towers(config)
    state = [(CHECKPOINT_PREFIX + k, v) for k, v in hf.state_dict().items()]
    with pytest.raises(CheckpointError, match="lacks weights"):
        AudioEncoder(config).load_weights(state[:-1])
    with pytest.raises(CheckpointError, match="has no place"):
        AudioEncoder(config).load_weights(state + [(CHECKPOINT_PREFIX + "extra", torch.zeros(1))])


def test_audio_to_tower_end_to_end_matches_hf():
    """Waveforms -> features -> tower, ours vs processor + thinker.get_audio_features' packing."""
    hf, ours = _towers(_tower_config(4, mel=128))
    rng = np.random.default_rng(2)
    audios = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (4321, 800, 2000)]
    ref_feats, ref_tokens = _hf_features(WhisperFeatureExtractor(feature_size=128), audios)
    with torch.no_grad():
        ref = hf(input_features=torch.cat(ref_feats, dim=1),
                 feature_lens=torch.tensor([f.shape[1] for f in ref_feats])).last_hidden_state
    features = LogMelExtractor(LogMelConfig(max_samples=30 * 16000))(audios)
    out = ours(features.features)
    assert [o.shape[0] for o in out] == features.num_tokens == ref_tokens
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-5, rtol=1e-5)
