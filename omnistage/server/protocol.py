"""Request bodies of the OpenAI API we serve, with OpenAI's field names, and their mapping to
SamplingParams. Unknown fields are ignored, as OpenAI's SDK may send newer ones; but OpenAI
fields that would change the answer and that this server does not serve (forced tool choice,
legacy functions, structured output, logit bias) are refused naming the field, never silently
dropped."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from omnistage.chat_tools import check_tools
from omnistage.errors import InvalidRequestError
from omnistage.sampling_params import SamplingParams

TOOLS_UNSERVED = ("legacy function calling is not served by this server; use tools (the model "
                  "decides whether to call one: tool_choice auto or none)")


class StreamOptions(BaseModel):
    include_usage: bool = False


class AudioParams(BaseModel):
    """Chat completions' `audio` field: how to speak the answer."""
    voice: str | None = None                   # None: the model's first speaker
    format: Literal["wav", "pcm16", "flac", "mp3", "opus", "aac"] = "wav"


class TalkerParams(BaseModel):
    """Extension: sampling of the speech (codec) tokens; unset fields keep the model's defaults."""
    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    min_tokens: int | None = Field(None, ge=0, le=32768)
    seed: int | None = None

    def merged(self, defaults: SamplingParams) -> SamplingParams:
        from dataclasses import replace

        given = {k: v for k, v in self.model_dump().items() if v is not None}
        return replace(defaults, **given)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)   # OpenAI's range
    top_p: float = Field(1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    user: str | None = None
    # Extensions (OpenAI SDK: extra_body={...}), named as in vLLM.
    top_k: int = -1
    min_p: float = Field(0.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, allow_inf_nan=False)
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioParams | None = None
    # Extensions: speech sampling, and whether a video's sound track is heard.
    talker: TalkerParams | None = None
    use_audio_in_video: StrictBool = False
    # Function calling (chat_tools.py): the model decides (auto), or tools are not offered (none)
    tools: list | None = None
    tool_choice: str | dict | None = None
    # OpenAI fields not served: only their neutral values are taken (refuse_unserved)
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None

    def refuse_unserved(self) -> None:
        """InvalidRequestError naming the first field asking for what is not served."""
        neutral = {"tool_choice": self.tool_choice in (None, "none", "auto"),
                   "functions": self.functions in (None, []),
                   "function_call": self.function_call in (None, "none", "auto"),
                   "response_format": self.response_format in (None, {"type": "text"}),
                   "logit_bias": not self.logit_bias}
        why = {"tool_choice": "tool_choice 'required' or a named function is not served: the model "
                              "decides whether to call (auto) or is given no tools (none)",
               "response_format": "structured output (json_object, json_schema) is not served "
                                  "by this server; send {\"type\": \"text\"} or leave it out",
               "logit_bias": "logit_bias is not served by this server; leave it out"}
        for field, ok in neutral.items():
            if not ok:
                raise InvalidRequestError(why.get(field, f"{TOOLS_UNSERVED}; leave out {field}"),
                                          param=field)
        if self.tools:
            check_tools(self.tools)

    @property
    def offered_tools(self) -> list | None:
        """The tools the model is given (none with tool_choice none)."""
        return self.tools if self.tools and self.tool_choice != "none" else None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    max_tokens: int | None = 16          # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: StrictBool = False

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)
