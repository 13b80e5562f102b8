"""The AR stage: an LLMEngine (paged KV, continuous batching) behind the Stage protocol.

Several AR stages (thinker, talker) may live in one process, each with its own engine and KV
pool. A fed request (the talker) receives vectors for its generated positions while it runs;
its steps wait for them (see Sequence.embed_feed).
"""

from __future__ import annotations

import msgspec
import torch

from omnistage.llm.engine import LLMEngine
from omnistage.llm.sequence import EmbedFeed
from omnistage.outputs import TokenLogprob
from omnistage.sampling_params import SamplingParams
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage


class ARRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # (P, input width): replaces the token embeddings of the prompt. Or, with mm_positions,
    # the rows (N, width) that replace the token embeddings at those prompt positions.
    prompt_embeds: torch.Tensor | None = None
    mm_positions: list[int] | None = None
    mrope_positions: torch.Tensor | None = None   # (3, P) int64
    position_delta: int = 0
    return_hidden_states: bool = False     # emit hidden states + input embeddings per step
    fed: bool = False                      # generated positions wait for ARFeed vectors
    # Emit the input embeddings of the tokens each step samples (ARStepOutput.sampled_embeds):
    # the rows the next step will feed, a step before the engine feeds them (not with `fed`).
    embed_sampled: bool = False
    # DeepStack: (K, V, width) vectors added after the first K layers at these V prompt positions
    deepstack: torch.Tensor | None = None
    deepstack_positions: list[int] | None = None
    # Background work (a Realtime turn prefilled while still spoken): computed in pieces of at
    # most the engine's max_background_tokens a step (LLMEngine.add_request)
    background: bool = False


class ARFeed(msgspec.Struct):
    """More vectors for a fed request; `fill` (once set) stands in for every later position."""

    request_id: str
    vectors: torch.Tensor | None = None    # (n, input width)
    fill: torch.Tensor | None = None       # (input width,)


class ARStepOutput(msgspec.Struct):
    """What one engine step produced for one request (sample 0)."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    # Rows for the positions computed this step (prompt chunk, or the previous token).
    hidden_states: torch.Tensor | None = None   # (n, hidden) final-normed
    input_embeds: torch.Tensor | None = None    # (n, input width) what went into layer 0
    # ARRequest.embed_sampled: (k, input width) the token embeddings of token_ids, the rows the
    # next step feeds; None once finished (the token that ends a request is never fed).
    sampled_embeds: torch.Tensor | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them


class ARStage(Stage):
    def __init__(self, name: str, engine: LLMEngine):
        self.name = name
        self.engine = engine
        self.dead: str | None = None   # local stages fail with the process
        self._feeds: dict[str, EmbedFeed] = {}
        self._embed_sampled: set[str] = set()       # requests with ARRequest.embed_sampled

    def add(self, message: ARRequest | ARFeed) -> None:
        if isinstance(message, ARFeed):
            feed = self._feeds.get(message.request_id)
            if feed is None:          # aborted or finished meanwhile
                return
            if message.vectors is not None:
                feed.push(message.vectors)
            if message.fill is not None:
                feed.fill = message.fill
            return
        embeds = message.prompt_embeds
        if message.mm_positions is not None:
            embeds = self._merge(message)
        if message.fed and message.embed_sampled:
            # A fed position's input is its token embedding plus the fed vector, which the
            # engine knows only when it feeds it.
            raise ValueError(f"request {message.request_id}: embed_sampled does not go with fed")
        feed = EmbedFeed() if message.fed else None
        self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                prompt_embeds=embeds,
                                return_hidden_states=message.return_hidden_states,
                                mrope_positions=message.mrope_positions,
                                position_delta=message.position_delta, embed_feed=feed,
                                deepstack=None if message.deepstack is None else
                                (torch.tensor(message.deepstack_positions), message.deepstack),
                                background=message.background)
        if feed is not None:
            self._feeds[message.request_id] = feed
        if message.embed_sampled:
            self._embed_sampled.add(message.request_id)

    def _merge(self, m: ARRequest) -> torch.Tensor:
        """Token embeddings of the prompt with the multimodal rows put at their positions."""
        model = self.engine.model
        ids = torch.tensor(m.prompt_token_ids, device=self.engine.device)
        pos = torch.tensor(m.mm_positions, dtype=torch.int64, device=ids.device)
        with torch.inference_mode():
            embeds = model.embed(ids).clone()
            embeds[pos] = m.prompt_embeds.to(embeds.device, embeds.dtype)
        return embeds

    def step(self) -> list[StageOutput]:
        out = []
        for d in self.engine.step():
            if d.index != 0:
                continue
            sampled = None
            if d.finished:
                self._feeds.pop(d.request_id, None)
                self._embed_sampled.discard(d.request_id)
            elif d.token_ids and d.request_id in self._embed_sampled:
                sampled = self._embed(d.token_ids)
            out.append(StageOutput(self.name, d.request_id, ARStepOutput(
                d.request_id, d.token_ids, d.text, d.hidden_states, d.input_embeds, sampled,
                d.finished, d.finish_reason, d.num_prompt_tokens, d.logprobs), final=d.finished))
        return out

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        """(k, input width): what the engine's next step puts into layer 0 for these tokens (a
        generated position of an unfed request is its token embedding, see ModelRunner.run)."""
        with torch.inference_mode():
            return self.engine.model.embed(torch.tensor(token_ids, device=self.engine.device))

    def abort(self, request_id: str) -> None:
        self._feeds.pop(request_id, None)
        self._embed_sampled.discard(request_id)
        self.engine.abort_request(request_id)

    def has_work(self) -> bool:
        return self.engine.has_ready_work()

    def starving(self) -> bool:
        """A running request waits for its embed feed (a talker's next reply vector): the
        stage feeding it would advance it. StageGraph gives that stage extra passes only while
        this one's own consumer is starving (the vocoder short of codes)."""
        return self.engine.has_lagging_feed()

    def num_requests(self) -> int:
        return len(self.engine.requests)

    def close(self) -> None:
        """Nothing outside this process to release."""

    def metrics(self) -> list[tuple[str, str, str, float]]:
        return self.engine.metrics(f'stage="{self.name}"')     # its KV pool and queues
