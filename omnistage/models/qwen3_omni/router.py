"""Qwen3-Omni's edges: a request flows encoder -> thinker -> talker -> code2wav; what goes back
to the client. No model code runs here (the talker stage projects the rows it receives).

The talker's input (transformers' Qwen3OmniMoeForConditionalGeneration.generate):
- the user turns of the prompt (positions whose ChatML turn, the token after the last
  <|im_start|> at or before them, is `user`): a media position's row is the thinker's hidden
  state at layer `accept_hidden_layer` (hidden_projection), any other position's its input
  embedding (text_projection);
- the assistant part, from the last `<|im_start|>assistant` on: its first 3 rows (the header,
  text_projection) with no codec; 4 rows of tts_pad with codec nothink, think_bos, think_eos and
  the speaker's id; tts_bos with codec pad; the 4th row (the reply's first token) with codec bos;
- then one row per talker step: the reply's next token (rows 5, 6, ... of the assistant part),
  then tts_eos once the thinker finished, then tts_pad.
The rows are the thinker's input embeddings of its positions: the prompt's as the thinker
prefills them (media rows and the hidden states come from that step), the reply's from the
thinker stage as each token is sampled (ARRequest.embed_sampled: a reply row is its token's
embedding, which exists a step before the thinker feeds the token back). The reference's rows
are those of the fed positions, so the token that ends the reply has none. So the talker starts
right after the thinker's prefill, and the reply's text keeps a step ahead of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.graph import CLIENT, Edge
from omnistage.models.qwen2_5_omni.messages import EncodeJob
from omnistage.models.qwen2_5_omni.router import audio_deltas, place_media_rows, reply_done
from omnistage.models.qwen3_omni.messages import (HIDDEN, TEXT, CodecFrames, EncodedMedia,
                                                  TalkerStart, TalkerText)
from omnistage.models.qwen3_omni.request import Qwen3OmniRequest
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams
from omnistage.stage_messages import StageOutput
from omnistage.stages.ar import ARRequest, ARStepOutput

HEADER = 3          # <|im_start|> assistant \n


@dataclass
class BridgeIds:
    """Ids the router needs (from config.json) and two thinker embedding rows."""

    im_start: int
    user: int
    assistant: int
    media: tuple[int, int, int]            # audio, image, video placeholder ids
    codec: dict[str, int]                  # nothink, think_bos, think_eos, pad, bos
    tts_pad_row: torch.Tensor              # (Ht,) thinker embedding of tts_pad
    tts_bos_row: torch.Tensor


@dataclass
class _Flow:
    req: Qwen3OmniRequest
    want_audio: bool
    warm_talker: bool = False            # prefill only: the talker prefills the user rows, no reply
    embeds: list[torch.Tensor] = field(default_factory=list)    # thinker rows as they come (n, Ht)
    hidden: list[torch.Tensor] = field(default_factory=list)
    rows_seen: int = 0
    talker_started: bool = False
    text_done: bool = False
    audio_done: bool = False
    finish_reason: str | None = None


class Qwen3OmniRouter:
    def __init__(self, ids: BridgeIds, audio_output: bool):
        self.ids = ids
        self.flows: dict[str, _Flow] = {}
        self.edges = [Edge("encoder", "thinker"), Edge("thinker", CLIENT)]
        if audio_output:
            self.edges += [Edge("thinker", "talker"), Edge("talker", "code2wav"), Edge("code2wav", CLIENT),
                           Edge("talker", CLIENT),          # the end of a warm prefill (_warm_talker)
                           Edge("thinker", "code2wav")]     # the end of a reply with no talker rows

    def unfinished(self) -> set[str]:
        return set(self.flows)

    def forget(self, request_id: str) -> None:
        self.flows.pop(request_id, None)

    def start(self, req: Qwen3OmniRequest) -> list[tuple[str, object]]:
        want_audio = req.talker_params is not None
        warm = req.warm_talker and not want_audio
        self.flows[req.request_id] = _Flow(req, want_audio, warm, audio_done=not (want_audio or warm))
        # Frames-less: opens the request's code2wav stream, so that stage knows a first chunk
        # is on its way (finished answers' last chunks wait for it there).
        out: list[tuple[str, object]] = [("code2wav", self._no_frames(req.request_id))] if want_audio else []
        if req.media:
            return out + [("encoder", EncodeJob(req.request_id, req.media))]
        return out + [("thinker", self._thinker_request(req, None, None))]

    def _no_frames(self, request_id: str, finished: bool = False) -> CodecFrames:
        return CodecFrames(request_id, torch.zeros(0, 0, dtype=torch.long), finished)

    def _thinker_request(self, req: Qwen3OmniRequest, embeds, positions, deepstack=None) -> ARRequest:
        ds, ds_at = deepstack if deepstack is not None else (None, None)
        return ARRequest(req.request_id, req.prompt_token_ids, req.thinker_params,
                         prompt_embeds=embeds, mm_positions=positions,
                         mrope_positions=req.mrope_positions, position_delta=req.position_delta,
                         return_hidden_states=req.keep_hidden,
                         embed_sampled=req.keep_hidden and req.talker_params is not None,
                         deepstack=ds, deepstack_positions=ds_at, background=req.prefill_only)

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        flow = self.flows.get(out.request_id)
        if flow is None:   # aborted while the output was in flight
            return []
        if out.stage == "encoder":
            return [("thinker", self._merged(flow, out.payload))]
        if out.stage == "thinker":
            return self._from_thinker(flow, out.payload)
        if out.stage == "talker":
            if flow.warm_talker:        # its one frame is not an answer
                flow.audio_done = out.final
                return reply_done(flow, flow.req.request_id)
            return [("code2wav", out.payload)]
        return audio_deltas(flow, flow.req.request_id, out.payload)

    def _merged(self, flow: _Flow, enc: EncodedMedia) -> ARRequest:
        """Encoder rows go to the placeholder positions of their modality, in prompt order; the
        images' and videos' DeepStack rows to their positions, in prompt order (the reference's
        joint order)."""
        rows, positions, wheres = place_media_rows(flow.req.prompt_token_ids, list(zip(
            self.ids.media, (enc.audio, enc.image, enc.video))))
        visual = [(where, torch.cat(stacks, dim=1))                     # (V_m,), (K, V_m, H)
                  for where, stacks in zip(wheres[1:], (enc.image_deepstack, enc.video_deepstack)) if stacks]
        deepstack = None
        if visual:
            at = torch.cat([w for w, _ in visual])
            order = torch.argsort(at)
            deepstack = (torch.cat([d for _, d in visual], dim=1)[:, order], at[order].tolist())
        return self._thinker_request(flow.req, rows, positions, deepstack)

    # ---- thinker -> talker ------------------------------------------------------------------
    def _from_thinker(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if flow.want_audio and (o.hidden_states is not None or o.sampled_embeds is not None):
            out += self._talker_inputs(flow, o)
        elif flow.warm_talker:
            self._gather(flow, o)
        if o.token_ids or o.text:
            out.append((CLIENT, Delta(o.request_id, 0, o.text, o.token_ids, logprobs=o.logprobs,
                                      num_prompt_tokens=o.num_prompt_tokens)))
        if o.finished:
            flow.text_done, flow.finish_reason = True, o.finish_reason
            if flow.want_audio:
                if flow.talker_started:
                    out.append(("talker", TalkerText(flow.req.request_id, finished=True)))
                else:
                    # The thinker stopped before its reply's first row existed (it ended at its
                    # first token): transformers fails here; the answer has no audio (its
                    # stream's end comes back from code2wav).
                    out.append(("code2wav", self._no_frames(flow.req.request_id, finished=True)))
            elif flow.warm_talker:
                out += self._warm_talker(flow)
            out += reply_done(flow, flow.req.request_id)
        return out

    def _talker_inputs(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        """The talker's share of a thinker step: its prompt's rows (module docstring) up to the
        reply's first, then each later row."""
        if flow.talker_started:
            rows, _ = self._new_rows(flow, o)
            return [] if rows is None else [("talker", TalkerText(flow.req.request_id, rows))]
        self._gather(flow, o)
        first = flow.req.assistant_at + HEADER            # the reply's first row
        if flow.rows_seen <= first:
            return []
        embeds, hidden = torch.cat(flow.embeds), torch.cat(flow.hidden)
        flow.embeds, flow.hidden, flow.talker_started = [], [], True
        out: list[tuple[str, object]] = [("talker", self._talker_start(flow.req, embeds, hidden))]
        if embeds.shape[0] > first + 1:
            out.append(("talker", TalkerText(flow.req.request_id, embeds[first + 1:])))
        return out

    def _gather(self, flow: _Flow, o: ARStepOutput) -> None:
        """This step's new rows (and its prompt rows' hidden states) kept for the talker's
        prompt: a speaking request's until its talker starts, a warm prefill's all along."""
        rows, hidden = self._new_rows(flow, o)
        if rows is not None:
            flow.embeds.append(rows)
        if hidden is not None:
            flow.hidden.append(hidden)

    def _new_rows(self, flow: _Flow, o: ARStepOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This step's new rows of the request's position stream, and the hidden states of
        those that are prompt positions (the user turns' media rows read them): prompt
        positions from the prefill's input embeddings, generated ones from the sampled tokens'
        embeddings (the fed positions' rows, which come again a step later as input embeddings,
        are skipped)."""
        parts, hidden, prompt = [], None, len(flow.req.prompt_token_ids)
        if o.input_embeds is not None and flow.rows_seen < prompt:
            n = min(o.input_embeds.shape[0], prompt - flow.rows_seen)
            parts.append(o.input_embeds[:n])
            hidden = o.hidden_states[:n]
        if o.sampled_embeds is not None:
            parts.append(o.sampled_embeds)
        if not parts:
            return None, None
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        flow.rows_seen += rows.shape[0]
        return rows, hidden

    def _warm_talker(self, flow: _Flow) -> list[tuple[str, object]]:
        """A prefill-only turn's user rows prefilled by the talker as well (one code sampled and
        dropped): at commit the response's talker prompt starts with the same rows (the
        thinker's, bit for bit from its prefix cache), so its prefix cache skips them."""
        req = flow.req
        if not flow.embeds:
            flow.audio_done = True                     # (the caller sends the reply's end)
            return []
        rows, kinds = self._user_rows(req, torch.cat(flow.embeds), torch.cat(flow.hidden))
        flow.embeds, flow.hidden = [], []
        if not kinds:
            flow.audio_done = True
            return []
        pos = req.talker_mrope_positions
        return [("talker", TalkerStart(req.request_id, rows, kinds, [-1] * len(kinds),
                                       SamplingParams(temperature=0, max_tokens=1),
                                       mrope_positions=None if pos is None else pos[:, :len(kinds)],
                                       position_delta=req.talker_position_delta, background=True))]

    def _user_rows(self, req: Qwen3OmniRequest, embeds: torch.Tensor,
                   hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The talker prompt's first part: the user turns' rows (media positions: the thinker's
        hidden states; text: its input embeddings) and their kinds."""
        ids = self.ids
        tokens = torch.tensor(req.prompt_token_ids)
        user = user_positions(tokens, ids.im_start, ids.user)
        media = torch.isin(tokens, torch.tensor(ids.media)) & user
        rows = torch.where(media.unsqueeze(1), hidden[:len(tokens)], embeds[:len(tokens)])[user]
        return rows, [HIDDEN if m else TEXT for m in media[user].tolist()]

    def _talker_start(self, req: Qwen3OmniRequest, embeds: torch.Tensor, hidden: torch.Tensor) -> TalkerStart:
        """The talker's prompt (see the module docstring) from the thinker's rows so far."""
        ids, c = self.ids, self.ids.codec
        rows, kinds = self._user_rows(req, embeds, hidden)
        a = req.assistant_at
        pad, bos = ids.tts_pad_row.to(embeds), ids.tts_bos_row.to(embeds)
        tail = torch.cat([embeds[a:a + HEADER], pad.expand(4, -1), bos[None], embeds[a + HEADER:a + HEADER + 1]])
        codec = [-1] * HEADER + [c["nothink"], c["think_bos"], c["think_eos"], req.speaker_id, c["pad"], c["bos"]]
        return TalkerStart(req.request_id, torch.cat([rows, tail]), kinds + [TEXT] * len(codec),
                           [-1] * len(kinds) + codec, req.talker_params,
                           mrope_positions=req.talker_mrope_positions, position_delta=req.talker_position_delta)


def user_positions(tokens: torch.Tensor, im_start: int, user: int) -> torch.Tensor:
    """(P,) bool: the positions in user turns (from a user turn's <|im_start|> up to the next
    <|im_start|>), as transformers finds them: by the token after the last <|im_start|> at or
    before each position."""
    p = tokens.shape[0]
    idx = torch.arange(p)
    last_start = torch.cummax(torch.where(tokens == im_start, idx, torch.full_like(idx, -1)), 0).values
    role = tokens[(last_start.clamp_min(0) + 1).clamp_max(p - 1)]   # (as the reference: before
    return role == user                                               # any <|im_start|>, token 1)
