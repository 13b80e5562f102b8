"""The cascade served as a graph of stages (each in this process unless a placement says
otherwise):

    asr (pocketsphinx) -> llm (our AR engine) -> tts (espeak-ng / flite)

`CascadePipeline` is an engine (omnistage.engine_api) like the omni models: chat with audio in
and out, speech, transcriptions and the Realtime API reach it through the same routes. What
the user said is heard as words only (no tone, no pauses): the point of the comparison with an
end-to-end model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from jinja2 import TemplateError

from omnistage.chat_messages import check_messages, check_text
from omnistage.config import EngineConfig
from omnistage.engine_api import EngineAbilities, OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.graph_pipeline import GraphPipeline
from omnistage.layers.checkpoint import eos_token_ids, load_tokenizer, read_config
from omnistage.models.cascade.messages import CascadeRequest
from omnistage.models.cascade.recipe import RECIPE, CascadeParts, CascadeSettings
from omnistage.models.cascade.speech_tools import TTS_TOOLS
from omnistage.models.qwen2_5_omni.processor import audio_part_samples
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)
AUDIO_PARTS = ("input_audio", "audio", "audio_url")


@dataclass
class CascadePrompt:
    """A prepared request: the chat (audio parts as references) and their samples."""

    messages: list[dict]
    audio: list[np.ndarray]
    tools: list | None
    token_ids: list[int]               # the chat without the transcripts (those come from the ASR)
    text: str | None = None


class CascadePipeline(GraphPipeline):
    recipe = RECIPE

    def __init__(self, config: EngineConfig, settings: CascadeSettings | None = None, placement=None):
        super().__init__(config, settings, placement)
        parts = CascadeParts.of(config.model)
        self.tokenizer = load_tokenizer(parts.llm)
        eos = sorted(eos_token_ids(parts.llm, self.tokenizer))
        positions = read_config(parts.llm).get("max_position_embeddings", 32768)
        self.abilities = EngineAbilities(
            audio_output=True, audio_input=True, max_model_len=config.max_model_len or positions,
            sample_rate=24000, end_of_turn_id=eos[0] if eos else None,
            speakers=TTS_TOOLS[parts.tts].voices, max_audio_seconds=self.settings.limits.max_audio_seconds)
        log.info("cascade ready: %s -> %s -> %s", parts.asr, parts.llm, parts.tts)

    def prepare(self, prompt, opts: OutputOptions) -> CascadePrompt:
        """Audio parts decoded to 16 kHz samples; the chat checked (thread-safe CPU work)."""
        opts.wants_audio(self.abilities)                  # checks the modalities
        messages, tools = _messages_of(prompt)
        check_messages(messages, media_types=AUDIO_PARTS)
        audio, refs = [], []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") in AUDIO_PARTS:
                        audio.append(audio_part_samples(part, f"messages[{i}].content", self.settings.limits))
                        parts.append({"type": "audio_ref", "index": len(audio) - 1})
                    else:
                        parts.append(part)
                m = {**m, "content": parts}
            refs.append(m)
        try:    # rendered here so that a chat the template refuses is the client's 400
            ids = self.tokenizer.apply_chat_template(
                [{**m, "content": m["content"] if isinstance(m.get("content"), str) else ""} for m in refs],
                tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"the chat template refused these messages: {e}", param="messages") from e
        return CascadePrompt(refs, audio, tools, list(ids))

    def default_params(self) -> SamplingParams:
        return SamplingParams()

    def resolve(self, pp: CascadePrompt, params: SamplingParams) -> SamplingParams:
        if params.n != 1:
            raise InvalidRequestError("n must be 1 for this model", param="n")
        return params

    def add_request(self, request_id: str, pp: CascadePrompt, params: SamplingParams,
                    opts: OutputOptions, return_hidden_states: bool = False) -> None:
        if return_hidden_states:
            raise InvalidRequestError("return_hidden_states is not offered for the cascade",
                                      param="return_hidden_states")
        params = opts.text_params(self.resolve(pp, params))
        speak = opts.wants_audio(self.abilities) and not opts.prefill_only
        voice = opts.voice or self.abilities.speakers[0]
        if speak and voice not in self.abilities.speakers:
            raise InvalidRequestError(f"unknown voice {voice!r}; choose one of "
                                      f"{list(self.abilities.speakers)}", param="voice")
        audio = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in pp.audio]
        if opts.transcribe and not audio:
            raise InvalidRequestError("a transcription needs audio", param="file")
        req = CascadeRequest(request_id, pp.messages, audio, params, speak, voice, pp.tools,
                             transcribe_only=opts.transcribe, prefill_only=opts.prefill_only)
        self.graph.add_request(request_id, req)

    def num_waiting_requests(self) -> int:
        """Requests beyond the LLM's seats (the server's queue bound reads it)."""
        return max(0, len(self.graph.requests) - self.config.max_num_seqs)


def _messages_of(prompt) -> tuple[list[dict], list | None]:
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return [{"role": "user", "content": prompt}], None
    if isinstance(prompt, list):
        return prompt, None
    if isinstance(prompt, dict) and "messages" in prompt:
        return prompt["messages"], prompt.get("tools")
    raise InvalidRequestError("the cascade takes a prompt string, chat messages, or a dict with "
                              "messages (and tools)", param="prompt")
