"""From sampled tokens to what a caller reads: incremental detokenization, stop checks (EOS,
stop ids, stop strings, lengths, forced answers) and one Delta per sampled token.

The engine keeps one RequestState per request; this module owns what is inside it and never
touches the scheduler: a Delta with `finished` set tells the engine to free the sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.llm.detokenizer import IncrementalDetokenizer, find_stop
from omnistage.llm.model_runner import SampledToken
from omnistage.llm.sequence import Sequence
from omnistage.outputs import Delta, TokenLogprob
from omnistage.sampling_params import SamplingParams


@dataclass
class SampleState:
    seq: Sequence
    detok: IncrementalDetokenizer | None     # None when the engine has no tokenizer
    emitted: int = 0           # characters of detok.text already returned


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    samples: list[SampleState]
    hold_chars: int            # text held back while it could still be a stop string's start
    unfinished: int = field(init=False)

    def __post_init__(self) -> None:
        self.unfinished = len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_request(self, request_id: str, params: SamplingParams, seqs: list[Sequence]) -> RequestState:
        """The output state of a request's samples (`seqs`, one per sample, same prompt)."""
        samples = []
        for seq in seqs:
            det = None
            if self.tokenizer is not None:
                det = IncrementalDetokenizer(self.tokenizer, seq.token_ids, params.skip_special_tokens)
            samples.append(SampleState(seq, det))
        hold = max((len(s) for s in params.stop), default=1) - 1
        return RequestState(request_id, params, samples, hold)

    def on_token(self, req: RequestState, st: SampledToken, hidden: torch.Tensor | None) -> Delta:
        """Append the sampled token to its sequence; the delta of new text (held back while it
        may still begin a stop string), finished when a stop condition holds."""
        seq, tok = st.seq, st.token_id
        sample = req.samples[seq.index]
        seq.token_ids.append(tok)
        detok = sample.detok
        before = len(detok.text) if detok else 0
        if detok:
            detok.push([tok])
        text = detok.text if detok else ""
        reason, stop_reason, end = self.check_stop(seq, tok, text, len(text) - before)
        if reason is None:
            end = max(sample.emitted, len(text) - req.hold_chars)
        elif not isinstance(stop_reason, str) and detok:   # ended by a token: release held-back bytes
            detok.flush()
            text = detok.text
            end = len(text)
        delta = Delta(seq.request_id, seq.index, text[sample.emitted:end], [tok],
                      hidden_states=hidden, num_prompt_tokens=seq.num_prompt_tokens,
                      num_cached_tokens=seq.num_cached_tokens)
        sample.emitted = end
        if st.logprob is not None:
            delta.logprobs = [TokenLogprob(tok, st.logprob, st.top_logprobs or [])]
        if reason is not None:
            delta.finished, delta.finish_reason, delta.stop_reason = True, reason, stop_reason
        return delta

    def check_stop(self, seq: Sequence, tok: int, text: str, num_new_chars: int):
        """-> (finish_reason or None, stop_reason, end of the text to keep)."""
        p = seq.params
        if p.stop:
            hit = find_stop(text, num_new_chars, p.stop)
            if hit is not None:
                s, idx = hit
                return "stop", s, idx + (len(s) if p.include_stop_str_in_output else 0)
        if p.forced_token_ids:     # a forced sample ends with its last forced token
            if seq.num_output_tokens >= len(p.forced_token_ids):
                return "stop", None, len(text)
            if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
                    or seq.num_tokens >= self.max_model_len:
                return "length", None, len(text)
            return None, None, 0
        if tok in self.eos_token_ids and not p.ignore_eos:
            return "stop", None, len(text)
        if tok in p.stop_token_ids:
            return "stop", tok, len(text)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None, len(text)
        if seq.num_tokens >= self.max_model_len:
            return "length", None, len(text)
        return None, None, 0
