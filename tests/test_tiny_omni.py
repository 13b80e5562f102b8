"""The offline tiny Qwen2.5-Omni builder: the folder loads and runs in transformers (text + audio),
its ids agree across tokenizer and config, its files are deterministic, and the small size
matches the benchmark anchor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.cli import main
from omnistage.tiny import SUPPORTED_TINY_ARCHS, TINY_ARCHS, build_tiny
from omnistage.tiny.omni_files import build_omni_tokenizer
from omnistage.tiny.qwen2_5_omni import count_parameters, make_config

ARCH = "qwen2_5_omni"
SAMPLES_PER_CODE = 2 * 240  # DiT repeats each code twice; BigVGAN makes 240 samples per mel frame
FILES = (
    "config.json", "generation_config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json",
    "tokenizer_config.json", "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json",
)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(ARCH, tmp_path_factory.mktemp("omni") / "tiny")


@pytest.fixture(scope="module")
def omni_model(omni_dir: Path) -> Qwen2_5OmniForConditionalGeneration:
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir).eval()


@pytest.fixture(scope="module")
def omni_tokenizer(omni_dir: Path):
    return AutoTokenizer.from_pretrained(omni_dir)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_registered_with_both_sizes() -> None:
    assert ARCH in SUPPORTED_TINY_ARCHS
    assert TINY_ARCHS[ARCH].sizes == ("tiny", "small")


def test_folder_layout(omni_dir: Path) -> None:
    assert set(FILES) <= {p.name for p in omni_dir.iterdir()}
    config = read_json(omni_dir / "config.json")
    assert config["model_type"] == "qwen2_5_omni" and config["enable_audio_output"] is True
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "token2wav_config"} <= config.keys()
    assert {"text_config", "audio_config", "vision_config"} <= config["thinker_config"].keys()
    assert {"dit_config", "bigvgan_config"} <= config["token2wav_config"].keys()


def test_loads_without_missing_or_unexpected_keys(omni_dir: Path, omni_model) -> None:
    # Qwen2_5OmniForConditionalGeneration.from_pretrained drops output_loading_info (it then
    # loads the speakers); its parent's from_pretrained reports the keys.
    parent = super(Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniForConditionalGeneration)
    _, info = parent.from_pretrained(omni_dir, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with safe_open(omni_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        # Real checkpoint names, and the values the loaded model holds.
        thinker = omni_model.thinker.model
        expected = {
            "thinker.model.embed_tokens.weight": thinker.language_model.embed_tokens.weight,
            "thinker.audio_tower.conv1.weight": thinker.audio_tower.conv1.weight,
            "thinker.visual.patch_embed.proj.weight": thinker.visual.patch_embed.proj.weight,
            "talker.codec_head.weight": omni_model.talker.codec_head.weight,
            "token2wav.code2wav_dit_model.proj_out.bias": omni_model.token2wav.code2wav_dit_model.proj_out.bias,
            "token2wav.code2wav_bigvgan_model.activation_post.act.alpha":
                omni_model.token2wav.code2wav_bigvgan_model.activation_post.act.alpha,
        }
        for name, param in expected.items():
            assert torch.equal(f.get_tensor(name), param), name
    assert "thinker.lm_head.weight" not in names  # tied to the embedding, as the config says
    assert omni_model.thinker.lm_head.weight.data_ptr() == thinker.language_model.embed_tokens.weight.data_ptr()
    snake = omni_model.token2wav.code2wav_bigvgan_model.activation_post.act.alpha
    assert snake.abs().max() > 0  # not HF's zeros: a loader that drops it would be caught


def test_speakers(omni_dir: Path, omni_model, omni_tokenizer) -> None:
    speakers = torch.load(omni_dir / "spk_dict.pt", weights_only=True)
    dit = omni_model.config.token2wav_config.dit_config
    assert set(speakers) == set(omni_model.speaker_map) == {"Chelsie", "Ethan"}
    bos = {name: s["bos_token"] for name, s in speakers.items()}
    assert bos == {"Chelsie": omni_tokenizer.convert_tokens_to_ids("<|tts_bos_chelsie|>"),
                   "Ethan": omni_tokenizer.convert_tokens_to_ids("<|tts_bos_ethan|>")}
    for s in speakers.values():
        assert isinstance(s["bos_token"], int) and s["bos_token"] < len(omni_tokenizer)
        assert s["cond"].shape == (1, dit.enc_emb_dim) and s["cond"].dtype == torch.float32
        assert s["ref_mel"].shape[0] == 1 and s["ref_mel"].shape[2] == dit.mel_dim
    assert not torch.equal(speakers["Chelsie"]["cond"], speakers["Ethan"]["cond"])


def test_tokenizer_ids_match_config(omni_model, omni_tokenizer) -> None:
    thinker, talker = omni_model.config.thinker_config, omni_model.config.talker_config
    assert len(omni_tokenizer) == thinker.text_config.vocab_size == 512
    get = omni_tokenizer.convert_tokens_to_ids
    for cfg in (thinker, talker):  # the talker's rope index reads thinker ids too
        assert cfg.audio_token_index == get("<|AUDIO|>")
        assert cfg.image_token_index == get("<|IMAGE|>")
        assert cfg.video_token_index == get("<|VIDEO|>")
        assert cfg.audio_start_token_id == get("<|audio_bos|>")
        assert cfg.audio_end_token_id == get("<|audio_eos|>")
        assert cfg.vision_start_token_id == get("<|vision_bos|>")
        assert cfg.vision_end_token_id == get("<|vision_eos|>")
    assert thinker.vision_token_id == get("<|vision_pad|>")
    assert thinker.eos_token_id == get("<|im_end|>") == omni_tokenizer.eos_token_id
    tts = [talker.tts_text_pad_token_id, talker.tts_text_start_token_id, talker.tts_text_end_token_id]
    assert tts == get(["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"])
    # Qwen's layout: <|endoftext|> then the Omni tokens at the real offsets (151643 + k).
    base = get("<|endoftext|>")
    assert [t - base for t in get(["<|AUDIO|>", "<|vision_bos|>", "<|IMAGE|>", "<|VIDEO|>"])] == [3, 9, 12, 13]
    # Attributes Qwen2_5OmniProcessor reads; <tool_call> is a plain (non-special) token as in Qwen.
    assert omni_tokenizer.audio_token == "<|AUDIO|>" and omni_tokenizer.image_token_id == get("<|IMAGE|>")
    assert omni_tokenizer.vision_bos_token == "<|vision_bos|>" and omni_tokenizer.video_token == "<|VIDEO|>"
    assert omni_tokenizer.encode("<tool_call>") == [get("<tool_call>")]
    assert omni_tokenizer.decode(omni_tokenizer.encode("a <tool_call> b <|AUDIO|>"), skip_special_tokens=True) \
        == "a <tool_call> b "
    # Talker codec ids: below the talker vocab and the DiT's codec table.
    codec = [talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id, talker.tts_codec_end_token_id,
             talker.tts_codec_mask_token_id]
    assert codec == [132, 133, 134, 136] and max(codec) < talker.vocab_size
    assert omni_model.config.token2wav_config.dit_config.num_embeds == talker.vocab_size


def test_chat_template_renders_omni_parts(omni_dir: Path, omni_tokenizer) -> None:
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}},
        {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "video", "video": "clip.mp4"},
        {"type": "text", "text": "What is this?"},
    ]}]
    text = omni_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>"
        "<|vision_bos|><|VIDEO|><|vision_eos|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    )
    numbered = omni_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *messages], tokenize=False, add_vision_id=True, add_audio_id=True)
    assert numbered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "Audio 1: <|audio_bos|>" in numbered and "Picture 1: <|vision_bos|>" in numbered
    assert "Video 1: <|vision_bos|>" in numbered
    processor_template = read_json(omni_dir / "chat_template.json")["chat_template"]
    assert processor_template == read_json(omni_dir / "tokenizer_config.json")["chat_template"]


def test_processor_files_load(omni_dir: Path) -> None:
    features = WhisperFeatureExtractor.from_pretrained(omni_dir)
    assert (features.feature_size, features.sampling_rate, features.hop_length) == (128, 16000, 160)
    audio = (0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    out = features(audio, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    assert out.input_features.shape[1] == 128 and int(out.attention_mask.sum()) == 100  # 100 frames/s

    images = Qwen2VLImageProcessorPil.from_pretrained(omni_dir)
    assert (images.patch_size, images.temporal_patch_size, images.merge_size) == (14, 2, 2)
    image = Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8))
    pixels = images(image, return_tensors="pt")
    assert pixels.image_grid_thw.tolist() == [[1, 4, 6]]  # 56 x 84 after rounding to 28
    assert pixels.pixel_values.shape == (24, 3 * 2 * 14 * 14)

    video = read_json(omni_dir / "video_preprocessor_config.json")
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert (video["patch_size"], video["temporal_patch_size"], video["merge_size"]) == (14, 2, 2)


def test_generates_text_and_audio(omni_dir: Path, omni_model, omni_tokenizer) -> None:
    generation = read_json(omni_dir / "generation_config.json")
    talker_kwargs = {k: v for k, v in generation.items() if k.startswith("talker_")}
    assert talker_kwargs["talker_eos_token_id"] == [132, 134]  # [codec pad, codec end]
    prompt = omni_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Tell me about the sea."}]}],
        tokenize=False, add_generation_prompt=True)
    ids = omni_tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(0)
    sequences, wav = omni_model.generate(ids, thinker_max_new_tokens=8, thinker_do_sample=False, **talker_kwargs)
    assert sequences.shape[1] > ids.shape[1]
    assert wav.ndim == 1 and torch.isfinite(wav).all()
    assert wav.numel() % SAMPLES_PER_CODE == 0
    assert wav.numel() >= talker_kwargs["talker_min_new_tokens"] * SAMPLES_PER_CODE  # >= 0.48 s at 24 kHz
    rms = wav.pow(2).mean().sqrt().item()
    assert 0.01 < rms < 0.5, rms  # audible, not saturated
    assert (wav.abs() > 0.999).float().mean() < 0.01  # hardly any clipping
    assert abs(wav.mean().item()) < 0.5 * rms  # no large DC offset


def test_generates_from_audio_and_image(omni_dir: Path, omni_model, omni_tokenizer) -> None:
    """Placeholders expanded as Qwen2_5OmniProcessor does (it cannot be built here without
    torchvision): the config's ids drive HF's embedding merge and the thinker's and talker's
    3D rope index."""
    features = WhisperFeatureExtractor.from_pretrained(omni_dir)
    images = Qwen2VLImageProcessorPil.from_pretrained(omni_dir)
    audio = features((0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440)).astype(np.float32),
                     sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    pixels = images(Image.fromarray(np.full((64, 96, 3), 128, dtype=np.uint8)), return_tensors="pt")
    num_audio = ((int(audio.attention_mask.sum()) - 1) // 2 + 1 - 2) // 2 + 1  # two stride-2 stages
    num_image = int(pixels.image_grid_thw.prod()) // 2**2  # merge_size 2
    prompt = omni_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                      {"type": "image_url", "image_url": {"url": ""}},
                                      {"type": "text", "text": "What is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<|AUDIO|>", "<|AUDIO|>" * num_audio).replace("<|IMAGE|>", "<|IMAGE|>" * num_image)
    ids = omni_tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(0)
    # thinker_pixel_values: HF's generate would hand plain `pixel_values` to the talker too.
    sequences, wav = omni_model.generate(
        ids, input_features=audio.input_features, feature_attention_mask=audio.attention_mask,
        thinker_pixel_values=pixels.pixel_values, image_grid_thw=pixels.image_grid_thw,
        thinker_max_new_tokens=4, thinker_do_sample=False, talker_eos_token_id=[132, 134],
        talker_min_new_tokens=24, talker_max_new_tokens=24)
    assert sequences.shape[1] == ids.shape[1] + 4
    assert wav.numel() == 24 * SAMPLES_PER_CODE and torch.isfinite(wav).all() and wav.abs().max() > 0


def test_greedy_text_is_informative(omni_model, omni_tokenizer) -> None:
    """Engine-vs-HF greedy comparisons need varied tokens and top-2 logits far apart."""
    gaps = []
    for text in ["The market opens at eight.", "def mean(values):", "你好，世界"]:
        prompt = omni_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
        ids = omni_tokenizer(prompt, return_tensors="pt").input_ids
        out = omni_model.thinker.generate(ids, max_new_tokens=16, do_sample=False, output_scores=True,
                                          return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:].tolist()
        assert len(set(new)) >= 8, new
        gaps += [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    assert torch.tensor(gaps).median() > 0.1 and min(gaps) > 1e-4


def test_build_is_deterministic(omni_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    assert main(["tiny", ARCH, str(tmp_path / "again"), "--size", "tiny"]) == 0  # the CLI path
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG is left alone
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (omni_dir / name).read_bytes(), name
    other = build_tiny(ARCH, tmp_path / "seed1", seed=1)
    with safe_open(other / "model.safetensors", "pt") as a, safe_open(omni_dir / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        name = "talker.model.layers.0.mlp.up_proj.weight"
        assert not torch.equal(a.get_tensor(name), b.get_tensor(name))


def test_sharded_build_loads(tmp_path: Path) -> None:
    folder = build_tiny(ARCH, tmp_path / "sharded", max_shard_size="1MB")
    index = read_json(folder / "model.safetensors.index.json")
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert not (folder / "model.safetensors").exists()
    Qwen2_5OmniForConditionalGeneration.from_pretrained(folder)


def test_overrides_are_nested_like_config_json(tmp_path: Path) -> None:
    _, ids = build_omni_tokenizer(512, model_max_length=4096)
    config = make_config("tiny", {"thinker_config": {"text_config": {"num_hidden_layers": 3}},
                                  "talker_config": {"num_hidden_layers": 1}}, ids)
    assert config.thinker_config.text_config.num_hidden_layers == 3
    assert config.thinker_config.text_config.hidden_size == 64  # the rest of the size is kept
    assert config.talker_config.num_hidden_layers == 1


def test_small_parameter_counts_match_the_anchor() -> None:
    _, ids = build_omni_tokenizer(512, model_max_length=4096)  # ids do not change the shapes
    counts = count_parameters(make_config("small", {}, ids))
    anchor = {"thinker_text": 57e6, "talker": 17e6, "dit": 7e6, "bigvgan": 2e6, "total": 93e6}
    for part, target in anchor.items():
        assert abs(counts[part] - target) <= 0.15 * target, (part, counts[part])
    towers = counts["audio_tower"] + counts["vision_tower"]
    assert abs(towers - 10e6) <= 0.15 * 10e6, towers
    assert counts["audio_tower"] > 0 and counts["vision_tower"] > 0
