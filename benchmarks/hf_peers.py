"""transformers peers: what a user runs today without a serving engine.

- one request at a time: `generate` per request (optionally only the first K, extrapolated);
- padded batches: prompts sorted by length, left-padded, batch generates max(n) tokens but only
  each member's own n count as useful output;
- single-stream decode speed (batch 1), prefill excluded, timed with a streamer.
All greedy; `min_new_tokens = max_new_tokens` stands in for ignore-EOS.
"""

from __future__ import annotations

import time

import torch

from benchmarks.workload import Measurement, Workload


def load_model(model_dir):
    """(model, pad_token_id, load seconds): fp32, eval mode, warmed up by one tiny generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = pad if pad is not None else 0
    load_s = time.perf_counter() - t0
    x = torch.full((2, 8), 1 if pad != 1 else 2)
    _generate(model, x, torch.ones_like(x), 2, pad)  # warm-up, not timed
    return model, pad, load_s


@torch.inference_mode()
def _generate(model, input_ids, attention_mask, n: int, pad_id: int, streamer=None):
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                          streamer=streamer)


def one_at_a_time(model, pad_id: int, workload: Workload, sample: int | None = None,
                  start_s: float | None = None) -> Measurement:
    """`generate` per request; with `sample`=K only the first K run, tok/s extrapolates."""
    part = workload.head(sample) if sample else workload
    outs = []
    t0 = time.perf_counter()
    for ids, n in zip(part.prompts, part.output_lens):
        x = torch.tensor([ids])
        y = _generate(model, x, torch.ones_like(x), n, pad_id)
        outs.append(y[0, len(ids):].tolist())
    wall = time.perf_counter() - t0
    assert [len(o) for o in outs] == part.output_lens, "HF produced wrong lengths"
    measured = Measurement("hf_one_at_a_time", part.total_output_tokens, wall, start_s)
    if len(part.prompts) == len(workload.prompts):
        measured.notes = {"requests_timed": len(outs), "extrapolated": False}
        measured.first_outputs = outs[:2]
        return measured
    # Extrapolate the whole workload's wall time at the measured tok/s.
    full_wall = workload.total_output_tokens / measured.tok_s
    notes = {"requests_timed": len(outs), "extrapolated": True,
             "timed_tokens": measured.tokens, "timed_wall_s": round(wall, 3)}
    return Measurement("hf_one_at_a_time", workload.total_output_tokens, full_wall, start_s,
                       notes, outs[:2])


def padded_batches(model, pad_id: int, workload: Workload, batch_size: int,
                   start_s: float | None = None) -> Measurement:
    """Left-padded batches of prompts sorted by length; useful tokens = each member's own n."""
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    outs: dict[int, list[int]] = {}
    generated = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(workload.prompts[i]) for i in idx)
        n_max = max(workload.output_lens[i] for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = workload.prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        y = _generate(model, ids, mask, n_max, pad_id)
        generated += y.shape[0] * (y.shape[1] - width)
        for row, i in enumerate(idx):
            outs[i] = y[row, width:width + workload.output_lens[i]].tolist()
    wall = time.perf_counter() - t0
    notes = {"batch_size": batch_size, "generated_incl_wasted": generated}
    return Measurement(f"hf_padded[bs={batch_size}]", workload.total_output_tokens, wall,
                       start_s, notes, [outs[i] for i in range(min(2, len(outs)))])


class _TokenClock:
    """A generate() streamer that records when each new token arrives (first put = prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value):
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self):
        pass


def single_stream_decode(model, pad_id: int, prompt: list[int], n: int) -> dict:
    """Batch-1 decode tok/s from the first to the last generated token (prefill excluded)."""
    x = torch.tensor([prompt])
    _generate(model, x, torch.ones_like(x), 8, pad_id)  # warm-up
    clock = _TokenClock()
    _generate(model, x, torch.ones_like(x), n, pad_id, streamer=clock)
    span = clock.times[-1] - clock.times[0]
    return {"decode_tok_s": round((len(clock.times) - 1) / span, 2), "tokens": len(clock.times),
            "prompt_len": len(prompt), "method": "streamer timestamps"}
