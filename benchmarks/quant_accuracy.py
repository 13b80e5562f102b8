"""What each weight format (`quantization`) and the bfloat16 KV cache (`kv_cache_dtype`) cost
in accuracy, against float32 weights and cache.

    python -m benchmarks.quant_accuracy                    # the trained tiny Qwen2, group 64
    python -m benchmarks.quant_accuracy --group-size 32 --model PATH

The set: a Qwen2 checkpoint (default: `tiny:qwen2` size `trained`, a small model trained for a
few seconds on a synthetic corpus, see omnistage/tiny/trained.py), 32 prompts cut from that
corpus under another seed (5-100 tokens), 64 greedy tokens each. Per format: the share of
generated tokens equal to float32's at the same position (free-running: after a divergence
the rest usually differs too), the continuations equal in full, and over the prompt positions
of the first 8 prompts the logits' largest absolute difference and the KL divergence
KL(float32 || format) per position (mean and max). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omnistage import Omni, SamplingParams  # noqa: E402

# name -> engine options (the group size is added to each)
# (int8 and int4 multiply int8-rounded activations by default; "-exact": float32 activations)
FORMATS = {"bf16": {"quantization": "bf16"}, "int8": {"quantization": "int8"},
           "int4": {"quantization": "int4"}, "kv-bf16": {"kv_cache_dtype": "bfloat16"},
           "int8-exact": {"quantization": "int8", "int8_activations": "float32"},
           "int4-exact": {"quantization": "int4", "int4_activations": "float32"}}
NEW_TOKENS = 64


@dataclass
class FormatAccuracy:
    name: str                     # a key of FORMATS
    tokens_equal: float           # share of generated tokens equal to float32's
    continuations_equal: int      # continuations equal in full
    continuations: int
    logits_max_abs: float         # over the prompt positions of the first 8 prompts
    kl_mean: float                # KL(float32 || this) per position
    kl_max: float


def accuracy_prompts(model_dir: str, count: int = 32) -> list[list[int]]:
    """`count` prompts of 5-100 tokens cut from the trained model's corpus (another seed)."""
    from transformers import AutoTokenizer

    from omnistage.tiny.trained import corpus

    ids = AutoTokenizer.from_pretrained(model_dir).encode(corpus(99, 400), verbose=False)
    lengths = (5, 17, 33, 64, 100, 9, 48, 80)
    return [ids[i * 97:i * 97 + lengths[i % len(lengths)]] for i in range(count)]


def _run(model_dir: str, prompts: list[list[int]], **options) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of every prompt, and the prompt positions' logits of the first 8."""
    llm = Omni(model_dir, enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    probe = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]],
                         SamplingParams(temperature=0.0, max_tokens=1), return_hidden_states=True)
    model = llm.engine.llm.model
    logits = [model.compute_logits(o.outputs[0].hidden_states[:len(p)]) for p, o in zip(prompts, probe)]
    return [o.token_ids for o in outs], logits


def measure(model_dir: str, prompts: list[list[int]], group_size: int = 64,
            formats: tuple[str, ...] = tuple(FORMATS)) -> list[FormatAccuracy]:
    ref_tokens, ref_logits = _run(model_dir, prompts)
    results = []
    for q in formats:
        tokens, logits = _run(model_dir, prompts, quantization_group_size=group_size, **FORMATS[q])
        pairs = [(a, b) for r, o in zip(ref_tokens, tokens) for a, b in zip(r, o)]
        kl = torch.cat([torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                   reduction="none").sum(-1)
                        for a, b in zip(ref_logits, logits)])
        results.append(FormatAccuracy(
            q, sum(a == b for a, b in pairs) / len(pairs),
            sum(r == o for r, o in zip(ref_tokens, tokens)), len(prompts),
            max((a - b).abs().max().item() for a, b in zip(ref_logits, logits)),
            kl.mean().item(), kl.max().item()))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Qwen2 folder (default: the trained tiny Qwen2, built here)")
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size (default: 64)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from omnistage.tiny import build_tiny

            model_dir = str(build_tiny("qwen2", Path(tmp) / "trained", size="trained"))
        results = measure(model_dir, accuracy_prompts(model_dir), args.group_size)
    for r in results:
        print(f"{r.name:7s} tokens equal {r.tokens_equal:.3f}  continuations equal "
              f"{r.continuations_equal}/{r.continuations}  logits max |diff| {r.logits_max_abs:.4f}  "
              f"KL mean {r.kl_mean:.2e} max {r.kl_max:.2e}")
    print(json.dumps({"group_size": args.group_size, "results": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
