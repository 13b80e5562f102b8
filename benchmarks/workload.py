"""The benchmark workload (seeded random prompts and output lengths) and one measurement.

Throughput = generated tokens / wall time from submitting the requests to the last one
finishing (prefill included). Every request is greedy and ignores EOS, so it produces exactly
its output length on every system.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # prompt token ids, one list per request
    output_lens: list[int]  # tokens each request must generate
    seed: int = 0

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, k: int) -> Workload:
        """The first k requests (same order, same seed)."""
        return Workload(self.prompts[:k], self.output_lens[:k], self.seed)

    def to_json(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({**extra, **asdict(self)}))


def usable_token_ids(model_dir: str | Path) -> list[int]:
    """Ordinary (non-special) token ids of the checkpoint's tokenizer that the model can embed."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return [i for i in range(min(tok.vocab_size, vocab)) if i not in special]


def make_workload(token_ids: list[int], num_requests: int = 64, seed: int = 0,
                  prompt_lens: tuple[int, int] = (32, 512),
                  output_lens: tuple[int, int] = (16, 256)) -> Workload:
    """Seeded requests: prompt and output lengths uniform in the inclusive ranges given."""
    lens = random.Random(seed)  # lengths do not depend on the vocabulary size
    ids = random.Random(seed + 1)
    prompts, outs = [], []
    for _ in range(num_requests):
        n_prompt = lens.randint(*prompt_lens)
        outs.append(lens.randint(*output_lens))
        prompts.append([ids.choice(token_ids) for _ in range(n_prompt)])
    return Workload(prompts, outs, seed)


@dataclass
class Measurement:
    """One system's run over (part of) the workload."""

    system: str
    tokens: int  # useful generated tokens (each request's own output length)
    wall_s: float  # submit → last request finished
    start_s: float | None = None  # engine/model start (construction, load), not in wall_s
    notes: dict = field(default_factory=dict)  # extra figures for the JSON summary
    first_outputs: list[list[int]] = field(default_factory=list, repr=False)  # cross-checks

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self) -> dict:
        out = {"tok_s": round(self.tok_s, 2), "tokens": self.tokens,
               "wall_s": round(self.wall_s, 3)}
        if self.start_s is not None:
            out["engine_start_s"] = round(self.start_s, 3)
        return {**out, **self.notes}

    def line(self) -> str:
        start = f", start {self.start_s:.1f} s" if self.start_s is not None else ""
        return (f"[{self.system}] {self.tok_s:.1f} tok/s ({self.tokens} tokens in "
                f"{self.wall_s:.1f} s{start})")
