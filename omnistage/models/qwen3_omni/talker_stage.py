"""The Qwen3-Omni talker stage: an AR engine for codebook 0, with the code predictor run inside
the stage's step for every request that produced a code this step, batched across requests.

One step:
  0. the thinker's vectors that arrived since the last step are projected to the talker's
     width together (text_projection / hidden_projection, one call each for all requests:
     the native linear's rows do not depend on the batch, so the same bits as one by one),
     new requests join the engine and the inputs that became complete go to the feeds;
  1. the engine steps the talker (continuous batching, paged KV): each running request whose
     input is ready computes one position and samples codebook 0;
  2. every request that sampled a code and goes on gets its frame completed at once: the code
     predictor runs once for all of them (B rows; code_predictor.py) and gives codebooks
     1..G-1 and the frame's residual embedding;
  3. the talker's next input for that request is its embedding of code 0 (the engine's) + the
     residual embedding + the next reply row (text_projection of the thinker's next token
     embedding; after the reply: the text-end row once, then the pad row), pushed into the
     request's embed feed. A request whose reply row has not arrived waits (the engine skips
     it) and the others go on;
  4. the new frames go to code2wav.
As transformers' generate: the talker's last sampled code (its end-of-speech code, or the last
one allowed by max_tokens) gets no frame.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from omnistage.errors import OmniStageError
from omnistage.llm.engine import LLMEngine
from omnistage.llm.sampler import SamplingBatch
from omnistage.llm.sequence import EmbedFeed
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.models.qwen3_omni.messages import HIDDEN, CodecFrames, TalkerStart, TalkerText
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams
from omnistage.stage_messages import StageFailure, StageOutput
from omnistage.stages.ar import ARStage

# transformers' code predictor sampling: temperature 1, top-k 50, top-p 0.8
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


class ResizeMLP(nn.Module):
    """talker.{text,hidden}_projection: fc2(silu(fc1(x))), thinker width -> talker width."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int, dtype, device):
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(intermediate, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(torch.nn.functional.silu(self.linear_fc1(x)))


@dataclass
class TalkerParts:
    """What the stage computes besides the engine's model (talker width H, thinker width Ht)."""

    text_projection: ResizeMLP
    hidden_projection: ResizeMLP
    predictor: CodePredictor
    text_end: torch.Tensor        # (Ht,) thinker embedding of the text-end token (tts_eos)
    text_pad: torch.Tensor        # (Ht,) of tts_pad
    prompt_id: int                # the talker's prompt placeholder id (codec pad)


@dataclass
class _Speech:
    """One request's state in the stage."""

    feed: EmbedFeed
    generator: torch.Generator | None        # None: greedy code predictor
    raw: list[torch.Tensor] = field(default_factory=list)   # reply rows (n, Ht) not projected yet
    text: deque = field(default_factory=deque)        # projected reply rows not used yet (H,)
    residuals: deque = field(default_factory=deque)   # frame residual embeddings waiting for text
    reply_done: bool = False                 # the thinker finished: text-end, then pad rows
    end_used: bool = False


class TalkerStage(ARStage):
    """An ARStage (has_work, num_requests, metrics: the engine's) with its own input and step."""

    def __init__(self, name: str, engine: LLMEngine, parts: TalkerParts):
        super().__init__(name, engine)
        self.parts = parts
        self._speech: dict[str, _Speech] = {}
        # What arrived since the last step (taken at its start, _take_arrivals): requests to
        # start, and the speeches with new reply rows or a finished reply, in arrival order.
        self._starts: dict[str, TalkerStart] = {}
        self._touched: dict[str, _Speech] = {}
        with torch.inference_mode():
            rows = parts.text_projection(torch.stack([parts.text_end, parts.text_pad]))
        self._text_end, self._text_pad = rows[0], rows[1]

    # ---- input ----------------------------------------------------------------------------
    def add(self, message: TalkerStart | TalkerText) -> None:
        """Recorded here, computed at the next step (see the module docstring, step 0)."""
        if isinstance(message, TalkerText):
            s = self._speech.get(message.request_id)
            if s is None:                     # aborted or finished meanwhile
                return
            if message.rows is not None and message.rows.numel():
                s.raw.append(message.rows)
            s.reply_done = s.reply_done or message.finished
            self._touched[message.request_id] = s
            return
        gen = None
        if message.params.temperature > 0:
            gen = torch.Generator(device=self.engine.device)
            if message.params.seed is not None:
                gen.manual_seed(message.params.seed)
            else:
                gen.seed()
        self._speech[message.request_id] = _Speech(EmbedFeed(), gen)
        self._starts[message.request_id] = message

    def has_work(self) -> bool:
        return bool(self._starts or self._touched) or super().has_work()

    def num_requests(self) -> int:
        return super().num_requests() + len(self._starts)

    @torch.inference_mode()
    def _take_arrivals(self) -> list[StageOutput]:
        """Start the new requests and project the new reply rows, each kind in one call;
        -> the requests the engine refused."""
        refused = []
        if self._starts:
            starts, self._starts = list(self._starts.values()), {}
            refused = self._start(starts)
        if self._touched:
            touched, self._touched = list(self._touched.values()), {}
            fresh = [s for s in touched if s.raw]
            if fresh:
                rows = [torch.cat(s.raw) for s in fresh]
                projected = self._project_text(torch.cat(rows)).split([r.shape[0] for r in rows])
                for s, p in zip(fresh, projected):
                    s.text.extend(p.unbind(0))
                    s.raw.clear()
            for s in touched:
                self._pump(s)
        return refused

    def _project_text(self, rows: torch.Tensor) -> torch.Tensor:
        p = self.parts.text_projection
        return p(rows.to(p.linear_fc1.weight.dtype))

    def _start(self, starts: list[TalkerStart]) -> list[StageOutput]:
        """The prompts of `starts` into the engine; -> a failure for each one it refused (e.g.
        a prompt over the talker's max_model_len)."""
        p, model = self.parts, self.engine.model
        rows = torch.cat([m.rows for m in starts]).to(p.text_projection.linear_fc1.weight.dtype)
        hidden = torch.tensor([k for m in starts for k in m.kinds], device=rows.device) == HIDDEN
        embeds = torch.empty(rows.shape[0], model.input_size, dtype=rows.dtype, device=rows.device)
        embeds[~hidden] = p.text_projection(rows[~hidden])
        if hidden.any():
            embeds[hidden] = p.hidden_projection(rows[hidden])
        codec = torch.tensor([c for m in starts for c in m.codec_ids], device=rows.device)
        has = codec >= 0
        embeds[has] += model.embed(codec[has])
        refused = []
        for m, e in zip(starts, embeds.split([m.rows.shape[0] for m in starts])):
            # placeholder ids the penalties may see: transformers' talker penalises generated
            # codes only, so the prompt holds a suppressed id (codec pad), never a sampled one
            try:
                self.engine.add_request(m.request_id, [p.prompt_id] * e.shape[0], m.params, prompt_embeds=e,
                                        return_hidden_states=True, mrope_positions=m.mrope_positions,
                                        position_delta=m.position_delta,
                                        embed_feed=self._speech[m.request_id].feed,
                                        background=m.background)
            except OmniStageError as err:
                self._speech.pop(m.request_id)
                self._touched.pop(m.request_id, None)
                refused.append(StageOutput(self.name, m.request_id, StageFailure.of(m.request_id, err),
                                           final=True))
        return refused

    def _pump(self, s: _Speech) -> None:
        """Push the talker inputs that are complete: residual + reply row (or end/pad row).
        Reply rows not projected yet come first, so none may be pending (_take_arrivals)."""
        while s.residuals and not s.raw:
            if s.text:
                text = s.text.popleft()
            elif s.reply_done:
                text = self._text_pad if s.end_used else self._text_end
                s.end_used = True
            else:
                return
            s.feed.push((s.residuals.popleft() + text).unsqueeze(0))

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[StageOutput]:
        out = self._take_arrivals()
        deltas = [d for d in self.engine.step() if d.index == 0]
        going = [d for d in deltas if d.token_ids and not d.finished]
        frames = self._complete_frames(going) if going else {}
        for d in deltas:
            codes = frames.get(d.request_id)
            if d.finished:
                self._speech.pop(d.request_id, None)
            if codes is not None or d.finished:
                g = self.parts.predictor.num_code_groups
                codes = codes if codes is not None else torch.zeros(g, 0, dtype=torch.int64)
                out.append(StageOutput(self.name, d.request_id, CodecFrames(d.request_id, codes, d.finished),
                                       final=d.finished))
        return out

    @torch.inference_mode()
    def _complete_frames(self, deltas: list[Delta]) -> dict[str, torch.Tensor]:
        """Codebooks 1..G-1 for the code 0 each delta sampled, in one batch; their residual
        embeddings go to the requests' feeds. -> request id -> (G, 1) codes."""
        model, p = self.engine.model, self.parts
        code0 = torch.tensor([d.token_ids[-1] for d in deltas], device=self.engine.device)
        hidden = torch.stack([d.hidden_states[-1] for d in deltas])          # (B, H)
        speech = [self._speech[d.request_id] for d in deltas]
        codes, residual = p.predictor.predict(hidden, model.embed(code0), self._picker(speech))
        out = {}
        for i, (d, s) in enumerate(zip(deltas, speech)):
            s.residuals.append(residual[i])
            self._pump(s)
            out[d.request_id] = torch.cat([code0[i:i + 1], codes[i]]).unsqueeze(1).cpu()
        return out

    def _picker(self, speech: list[_Speech]):
        """The code predictor's choice per row: argmax (greedy requests) or a draw at
        temperature 1 from the top-k 50 / top-p 0.8 set with the request's own generator,
        the sampled rows of a pass in one call of the engine's sampler (its exponential race,
        one native call where the linear layers run natively: eight sampling rows of 2048
        codes 0.75 -> 0.28 ms a pass against a multinomial per row, 15 passes a frame)."""
        rows = [i for i, s in enumerate(speech) if s.generator is not None]
        batch = SamplingBatch([PREDICTOR_SAMPLING] * len(rows), [speech[i].generator for i in rows],
                              [[] for _ in rows], [[] for _ in rows], [[] for _ in rows])
        sampler = self.engine.runner.sampler

        def pick(logits: torch.Tensor, j: int) -> torch.Tensor:
            out = logits.argmax(dim=-1)
            if rows:
                drawn = sampler(logits[rows] if len(rows) < len(speech) else logits, batch).token_ids
                out[rows] = drawn.to(out.device)
            return out
        return pick

    def abort(self, request_id: str) -> None:
        self._speech.pop(request_id, None)
        self._starts.pop(request_id, None)
        self._touched.pop(request_id, None)
        super().abort(request_id)
