"""A text model behind the engine protocol: prompts parsed by `prompts.parse_prompt`, served
by an LLMEngine (`self.llm`)."""

from __future__ import annotations

from omnistage.config import EngineConfig
from omnistage.engine_api import EngineAbilities, OutputOptions
from omnistage.entrypoints.prompts import ParsedPrompt, parse_prompt
from omnistage.errors import InvalidRequestError
from omnistage.llm.engine import LLMEngine
from omnistage.models.loader import load_text_model
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams


class TextEngine:
    def __init__(self, llm: LLMEngine):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.abilities = EngineAbilities(max_model_len=llm.max_model_len)

    @classmethod
    def from_config(cls, config: EngineConfig) -> TextEngine:
        return cls(LLMEngine(config, *load_text_model(config)))

    @property
    def requests(self):
        return self.llm.requests

    def prepare(self, prompt, opts: OutputOptions) -> ParsedPrompt:
        if opts.wants_audio(self.abilities):   # raises: a text model asked for audio
            raise InvalidRequestError("this model does not produce audio", param="modalities")
        return parse_prompt(prompt, self.tokenizer)

    def default_params(self) -> SamplingParams:
        return SamplingParams()

    def resolve(self, prepared: ParsedPrompt, params: SamplingParams) -> SamplingParams:
        return params

    def num_samples(self, params: SamplingParams) -> int:
        return params.n

    def add_request(self, request_id: str, prepared: ParsedPrompt, params: SamplingParams,
                    opts: OutputOptions, return_hidden_states: bool = False) -> None:
        self.llm.add_request(request_id, prepared.token_ids, opts.text_params(params),
                             prompt_embeds=prepared.embeds,
                             return_hidden_states=return_hidden_states, background=opts.prefill_only)

    def step(self) -> list[Delta]:
        return self.llm.step()

    def abort_request(self, request_id: str) -> list[Delta]:
        return self.llm.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        return self.llm.num_waiting_requests()

    def health(self) -> str | None:
        return None      # one in-process engine: it serves while the process runs

    def metrics(self) -> list[tuple[str, str, str, float]]:
        return self.llm.metrics()

    def close(self) -> None:
        """Nothing to release beyond memory."""
