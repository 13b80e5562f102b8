"""Qwen2.5-Omni's edges: how a request flows encoder -> thinker -> talker -> token2wav, and
what goes back to the client. No model code runs here: the few embedding rows the talker's
inputs need are read once at load time (see BridgeConstants).

The talker's input (transformers' Qwen2_5OmniForConditionalGeneration.generate):
- prompt rows (P + 2): for each thinker prompt position, its input embedding (zeroed at
  audio/image/video positions) + its last hidden state; then the speaker's text-bos
  embedding + codec_pad's embedding; then reply(0) + codec_bos's embedding;
- generated position k (>= 0) reads codec_embed(previous code) + reply(k + 1), where
  reply(j) = input embedding + hidden state of the thinker at its j-th generated token;
  after the last reply vector: the text-eos embedding once, then text-pad forever.
Reply vectors exist only for tokens the thinker fed back (its last token is never fed), so
the talker starts after the thinker's second step and trails it by a token at most.

token2wav hears of a speaking request as soon as the thinker has started it (an empty
CodecChunk naming the speaker opens its stream): from then on the vocoder knows a request is
waiting for its first audio and keeps its own steps short (see VocoderStage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from omnistage.graph import CLIENT, Edge
from omnistage.models.qwen2_5_omni.messages import (AudioChunk, CodecChunk, EncodedMedia, EncodeJob,
                                                    OmniRequest)
from omnistage.models.qwen2_5_omni.talker import TalkerTokens
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams
from omnistage.stage_messages import StageOutput
from omnistage.stages.ar import ARFeed, ARRequest, ARStepOutput


@dataclass
class BridgeConstants:
    tokens: TalkerTokens
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    text_eos_embed: torch.Tensor          # (H,) thinker embedding rows
    text_pad_embed: torch.Tensor
    speaker_bos: dict[str, int]           # speaker -> thinker token id of its text bos
    speaker_bos_embed: dict[str, torch.Tensor]
    codec_bos_embed: torch.Tensor | None  # (H,) talker codec embedding rows (None: no talker)
    codec_pad_embed: torch.Tensor | None


@dataclass
class _Flow:
    """One request's progress through the graph."""

    req: OmniRequest
    mm_mask: torch.Tensor | None          # (P,) bool: prompt positions fed by encoders
    want_audio: bool
    warm_talker: bool = False             # prefill only: the talker prefills the prompt rows, no reply
    prompt_rows: list[torch.Tensor] = field(default_factory=list)   # (n, H) chunks
    rows_seen: int = 0                    # thinker positions whose vectors arrived
    talker_started: bool = False
    stream_opened: bool = False           # token2wav has this request's stream
    text_done: bool = False
    audio_done: bool = False
    finish_reason: str | None = None
    num_codes: int = 0


class OmniRouter:
    def __init__(self, consts: BridgeConstants, audio_output: bool = True):
        self.c = consts
        self.flows: dict[str, _Flow] = {}
        self.edges = [Edge("encoder", "thinker"), Edge("thinker", CLIENT)]
        if audio_output:
            self.edges += [Edge("thinker", "talker"), Edge("thinker", "token2wav"),
                           Edge("talker", "token2wav"), Edge("token2wav", CLIENT),
                           Edge("talker", CLIENT)]          # the end of a warm prefill (_warm_talker)

    def unfinished(self) -> set[str]:
        return set(self.flows)

    def forget(self, request_id: str) -> None:
        self.flows.pop(request_id, None)

    # ---- entry ----------------------------------------------------------------------------
    def start(self, req: OmniRequest) -> list[tuple[str, object]]:
        want_audio = req.talker_params is not None
        ids = torch.tensor(req.prompt_token_ids)
        mm = torch.isin(ids, torch.tensor([self.c.audio_token_id, self.c.image_token_id,
                                           self.c.video_token_id]))
        warm = req.warm_talker and not want_audio
        self.flows[req.request_id] = _Flow(req, mm if req.media else None, want_audio, warm,
                                           audio_done=not (want_audio or warm))
        if req.media:
            return [("encoder", EncodeJob(req.request_id, req.media))]
        return [("thinker", self._thinker_request(req, None, None))]

    def _thinker_request(self, req: OmniRequest, embeds, positions) -> ARRequest:
        return ARRequest(req.request_id, req.prompt_token_ids, req.thinker_params,
                         prompt_embeds=embeds, mm_positions=positions,
                         mrope_positions=req.mrope_positions, position_delta=req.position_delta,
                         return_hidden_states=req.keep_hidden, background=req.prefill_only)

    # ---- routing --------------------------------------------------------------------------
    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        flow = self.flows.get(out.request_id)
        if flow is None:   # aborted while the output was in flight
            return []
        if out.stage == "encoder":
            return [("thinker", self._merged(flow, out.payload))]
        if out.stage == "thinker":
            return self._from_thinker(flow, out.payload)
        if out.stage == "talker":
            return self._from_talker(flow, out.payload)
        return audio_deltas(flow, flow.req.request_id, out.payload)

    def _merged(self, flow: _Flow, enc: EncodedMedia) -> ARRequest:
        """Encoder rows go to the placeholder positions of their modality, in prompt order."""
        rows, positions, _ = place_media_rows(flow.req.prompt_token_ids, [
            (self.c.audio_token_id, enc.audio), (self.c.image_token_id, enc.image),
            (self.c.video_token_id, enc.video)])
        return self._thinker_request(flow.req, rows, positions)

    def _from_thinker(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if flow.want_audio and not flow.stream_opened:
            flow.stream_opened = True
            out.append(("token2wav", self._codec_chunk(flow, [], False)))
        if (flow.want_audio or flow.warm_talker) and o.hidden_states is not None:
            out += self._talker_inputs(flow, o)
        if o.token_ids or o.text:
            out.append((CLIENT, Delta(o.request_id, 0, o.text, o.token_ids, logprobs=o.logprobs,
                                      num_prompt_tokens=o.num_prompt_tokens)))
        if o.finished:
            flow.text_done, flow.finish_reason = True, o.finish_reason
            if flow.want_audio:
                out += self._thinker_finished(flow)
            elif flow.warm_talker:
                out += self._warm_talker(flow)
            out += reply_done(flow, flow.req.request_id)
        return out

    def _talker_inputs(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        p = len(flow.req.prompt_token_ids)
        embeds, hidden = o.input_embeds, o.hidden_states
        start = flow.rows_seen
        flow.rows_seen += hidden.shape[0]
        if start < p:   # prompt rows: encoder positions do not pass their embeddings on
            keep = (~flow.mm_mask[start:start + hidden.shape[0]]).unsqueeze(1).to(embeds.dtype) \
                if flow.mm_mask is not None else 1.0
            flow.prompt_rows.append(embeds * keep + hidden)
            return []
        if flow.warm_talker:
            return []
        reply = embeds + hidden                        # (n, H), n == 1 in decode steps
        if not flow.talker_started:
            flow.talker_started = True
            return [("talker", self._talker_request(flow, reply[:1]))] + (
                [("talker", ARFeed(o.request_id, vectors=reply[1:]))] if reply.shape[0] > 1 else [])
        return [("talker", ARFeed(o.request_id, vectors=reply))]

    def _talker_request(self, flow: _Flow, reply0: torch.Tensor) -> ARRequest:
        c, req = self.c, flow.req
        bos = c.speaker_bos_embed[req.speaker].to(reply0)
        rows = torch.cat(flow.prompt_rows + [(bos + c.codec_pad_embed.to(reply0)).unsqueeze(0),
                                             reply0 + c.codec_bos_embed.to(reply0)])
        flow.prompt_rows = []
        p = len(req.prompt_token_ids)
        ids = [c.tokens.codec_mask] * p + [c.tokens.codec_pad, c.tokens.codec_bos]
        return ARRequest(req.request_id, ids, req.talker_params, prompt_embeds=rows,
                         mrope_positions=req.talker_mrope_positions,
                         position_delta=req.talker_position_delta, fed=True)

    def _warm_talker(self, flow: _Flow) -> list[tuple[str, object]]:
        """A prefill-only turn's prompt rows prefilled by the talker as well (one code sampled
        and dropped): at commit the response's talker prompt starts with the same rows (the
        thinker's, bit for bit from its prefix cache), so its prefix cache skips them."""
        rows, req = flow.prompt_rows, flow.req
        flow.prompt_rows = []
        n = sum(r.shape[0] for r in rows)
        if not n or req.talker_mrope_positions is None:
            flow.audio_done = True                     # (the caller sends the reply's end)
            return []
        params = SamplingParams(temperature=0, max_tokens=1)
        return [("talker", ARRequest(req.request_id, [self.c.tokens.codec_mask] * n, params,
                                     prompt_embeds=torch.cat(rows),
                                     mrope_positions=req.talker_mrope_positions[:, :n],
                                     position_delta=req.talker_position_delta, background=True))]

    def _thinker_finished(self, flow: _Flow) -> list[tuple[str, object]]:
        if not flow.talker_started:
            # The thinker stopped at its first token: no reply vector exists to start the
            # talker with (transformers fails here); the answer has no audio. Its token2wav
            # stream ends empty (its final, empty AudioChunk finds the request done).
            flow.audio_done = True
            return [("token2wav", self._codec_chunk(flow, [], True))]
        return [("talker", ARFeed(flow.req.request_id, vectors=self.c.text_eos_embed.unsqueeze(0),
                                  fill=self.c.text_pad_embed))]

    def _from_talker(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        if flow.warm_talker:           # its one code is not an answer
            flow.audio_done = o.finished
            return reply_done(flow, flow.req.request_id)
        codes = o.token_ids
        if o.finished and o.finish_reason == "stop" and codes and codes[-1] in self.c.tokens.stop_ids:
            codes = codes[:-1]
        flow.num_codes += len(codes)
        return [("token2wav", self._codec_chunk(flow, codes, o.finished))]

    def _codec_chunk(self, flow: _Flow, codes: list[int], finished: bool) -> CodecChunk:
        # Every chunk names the speaker and seed: the first one to arrive opens the stream.
        return CodecChunk(flow.req.request_id, codes, finished, speaker=flow.req.speaker,
                          seed=flow.req.talker_params.seed)


def place_media_rows(prompt_ids: list[int], groups: list[tuple[int, list[torch.Tensor]]]
                     ) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Encoder outputs onto their placeholders: for each (placeholder token, its items' rows in
    prompt order), the rows go to that token's positions in order. -> (all rows (N, hidden),
    their prompt positions, each group's positions (as a tensor)). A count that does not match
    is an internal fault (the processor expanded the placeholders from the same media)."""
    ids = torch.tensor(prompt_ids)
    rows, positions, wheres = [], [], []
    for token, embeds in groups:
        where = torch.nonzero(ids == token).squeeze(1)
        got = sum(e.shape[0] for e in embeds)
        if got != where.numel():
            raise RuntimeError(f"encoder gave {got} rows for {where.numel()} placeholders of token {token}")
        rows += embeds
        positions += where.tolist()
        wheres.append(where)
    return torch.cat(rows), positions, wheres


class SpokenReply(Protocol):
    """A request's flow as a speaking family's router keeps it: the reply is done when both
    its text and its audio are."""

    text_done: bool
    audio_done: bool
    finish_reason: str | None


def audio_deltas(flow: SpokenReply, request_id: str, a: AudioChunk) -> list[tuple[str, object]]:
    """A vocoder's chunk to the client; its last one ends the audio (and the reply, if the
    text ended too)."""
    out: list[tuple[str, object]] = []
    if a.samples.numel():
        out.append((CLIENT, Delta(a.request_id, 0, "", [], audio=a.samples.numpy(), sample_rate=a.sample_rate)))
    if a.finished:
        flow.audio_done = True
        out += reply_done(flow, request_id)
    return out


def reply_done(flow: SpokenReply, request_id: str) -> list[tuple[str, object]]:
    """The client's final delta once both text and audio are done; nothing before."""
    if not (flow.text_done and flow.audio_done):
        return []
    return [(CLIENT, Delta(request_id, 0, "", [], finished=True, finish_reason=flow.finish_reason))]
