"""What the transformers side of benchmarks.omni_e2e runs and returns (shared by the peers of
both omni families, below them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HFJob:
    """What the subprocess runs; every field is JSON."""

    model_dir: str
    messages: list[list[dict]]     # one chat (without system message) per request
    text_tokens: int               # thinker tokens per request (forced)
    codec_tokens: int              # talker codes (Qwen3-Omni: 16-codebook frames) per request (forced)
    threads: int | None = None     # torch.set_num_threads; None: torch's default
    family: str = "qwen2_5_omni"   # or "qwen3_omni"


@dataclass
class HFResult:
    load_s: float                  # from_pretrained + tokenizer + warm-up
    latency_s: list[float]         # per request: generate() wall time (its first audio = its end)
    audio_s: list[float]           # per request: seconds of audio returned
    text_token_ids: list[list[int]]  # per request: the thinker's new tokens (cross-check)
    codes: list = field(default_factory=list)  # per request: the talker's codes, Qwen3: (16, F) frames
    threads: int = 0
    talker_settings: dict = field(default_factory=dict)
    parts_s: dict = field(default_factory=dict)  # forward seconds per part, all timed requests

    @property
    def throughput(self) -> float:
        """Audio seconds out per wall second, requests back to back."""
        return sum(self.audio_s) / sum(self.latency_s)
