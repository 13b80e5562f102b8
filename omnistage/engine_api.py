"""The one protocol every engine kind implements, so that Omni, AsyncOmni and the server drive
a text model (LLMEngine), a model served as a stage graph (Qwen2.5-Omni) and an image/video
model (diffusion) the same way, and never ask which kind they hold.

A request goes `prepare` (CPU work: templates, tokens, media decoding; safe on any thread) ->
`add_request` (on the engine's thread) -> deltas out of `step()` until one per sample is
finished, or `abort_request`. What an engine can do beyond text is declared in its
`abilities`, read by callers instead of probing attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Collection, Protocol, runtime_checkable

from omnistage.errors import InvalidRequestError
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams

MODALITIES = ("text", "audio")


@dataclass(frozen=True)
class EngineAbilities:
    """What an engine offers; every field has the meaning of "no" as its default."""

    generates: str = "text"                  # text | image | video: what a request makes
    audio_output: bool = False               # answers in speech too (Delta.audio)
    audio_input: bool = False                # hears audio parts in chat messages
    max_model_len: int | None = None         # text context (prompt + answer); None: no text
    sample_rate: int | None = None           # of Delta.audio
    end_of_turn_id: int | None = None        # the token that ends an answer (forced speech)
    talker_defaults: SamplingParams | None = None  # speech-token sampling unless a request sets it
    speakers: tuple[str, ...] = ()           # voices of audio output, the default first
    max_audio_seconds: float | None = None   # longest audio input
    max_input_pixels: int | None = None      # largest input image (image/video models)
    max_frames: int | None = None            # longest video (video models)

    @property
    def makes_pixels(self) -> bool:
        """An image or video model: its requests take DiffusionParams."""
        return self.generates in ("image", "video")


@dataclass
class OutputOptions:
    """What a request wants back, beyond text sampling."""

    modalities: list[str] | None = None   # None: the model's default (text + audio if it speaks)
    voice: str | None = None              # speaker name; None: the model's first
    talker_params: SamplingParams | None = None  # speech token sampling; None: model defaults
    use_audio_in_video: bool = False      # a video's audio track is heard too
    # Prepare and prefill the prompt exactly as this request would be, then stop: one token is
    # sampled, nothing is spoken. Its KV blocks (and, for a speaking request, the hidden rows
    # the talker reads) stay in the prefix cache, so a later request whose prompt begins the
    # same computes only the rest (the Realtime API's streamed input warms a turn this way).
    prefill_only: bool = False
    # A transcription (/v1/audio/transcriptions, Realtime input transcription): the prompt asks
    # for the transcript of its audio. A model that hears through its own ASR (the cascade)
    # answers with what it heard; the omni models answer the ask as written.
    transcribe: bool = False

    def text_params(self, params: SamplingParams) -> SamplingParams:
        """The text sampling this request runs with: one token when it only prefills."""
        return replace(params, max_tokens=1, min_tokens=0) if self.prefill_only else params

    def wants_audio(self, abilities: EngineAbilities) -> bool:
        mods = self.modalities
        if mods is None:
            return abilities.audio_output
        bad = [m for m in mods if m not in MODALITIES]
        if bad or "text" not in mods:
            raise InvalidRequestError(f"modalities must be ['text'] or ['text', 'audio'], got {mods}",
                                      param="modalities")
        if "audio" in mods and not abilities.audio_output:
            raise InvalidRequestError("this model does not produce audio; ask for ['text']",
                                      param="modalities")
        return "audio" in mods


class PreparedPrompt(Protocol):
    """What `prepare` returns (each engine adds what its add_request needs)."""

    text: str | None
    token_ids: list[int]


@runtime_checkable
class Engine(Protocol):
    abilities: EngineAbilities
    tokenizer: Any                    # None for models without text output

    @property
    def requests(self) -> Collection[str]:
        """Ids of the requests in flight."""

    def prepare(self, prompt: Any, opts: OutputOptions) -> PreparedPrompt:
        """Check and preprocess a prompt (thread-safe; raises InvalidRequestError)."""

    def default_params(self) -> Any:
        """The sampling parameters of a request that gives none."""

    def resolve(self, prepared: PreparedPrompt, params: Any) -> Any:
        """The parameters the request will run with (defaults filled, limits checked)."""

    def num_samples(self, params: Any) -> int:
        """Finished deltas that end a request with these parameters."""

    def add_request(self, request_id: str, prepared: PreparedPrompt, params: Any,
                    opts: OutputOptions, return_hidden_states: bool = False) -> None:
        """Queue a prepared request (on the engine's thread)."""

    def step(self) -> list[Delta]:
        """Advance every request one step; their new deltas."""

    def abort_request(self, request_id: str) -> list[Delta]:
        """Stop a request and free what it holds (unknown ids: no-op)."""

    def has_unfinished_requests(self) -> bool: ...

    def num_waiting_requests(self) -> int:
        """Requests admitted but waiting for a seat (the server's queue bound reads it)."""

    def health(self) -> str | None:
        """None when every part can serve, else why not."""

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """(name{labels}, kind, help, value) gauges and counters for /metrics."""

    def close(self) -> None:
        """Release processes and actors the engine started."""
