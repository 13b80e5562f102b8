"""Two systems measured fairly on a machine whose speed drifts: A B A B ... in one sitting,
every run reported, and the median of the per-pair ratios A/B as the figure (a drift hits
both runs of a pair alike; the median drops the odd pair hit by a burst of other load)."""

from __future__ import annotations

import statistics
from typing import Callable

from benchmarks.workload import Measurement


def interleaved(run_a: Callable[[], Measurement | None], run_b: Callable[[], Measurement | None],
                pairs: int, log=print) -> dict:
    """`pairs` x (A then B). A pair whose either run failed (None) gives no ratio.
    -> {"runs": [{"pair", "a", "b", "ratio"}...], "median_ratio", "pairs_measured",
        "a_best", "b_best"} (tok/s; the bests only for reference)."""
    if pairs < 1:
        raise ValueError("pairs must be >= 1")
    runs, ratios = [], []
    for i in range(pairs):
        a, b = run_a(), run_b()
        ratio = a.tok_s / b.tok_s if a and b and b.tok_s > 0 else None
        runs.append({"pair": i + 1, "a": a.summary() if a else None, "b": b.summary() if b else None,
                     "ratio": None if ratio is None else round(ratio, 4)})
        if ratio is not None:
            ratios.append(ratio)
        log(f"[pairs] {i + 1}/{pairs}: {_tok(a)} vs {_tok(b)} tok/s -> "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'}")
    best = (lambda key: max((r[key]["tok_s"] for r in runs if r[key]), default=None))
    return {"runs": runs, "pairs_measured": len(ratios),
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "a_best": best("a"), "b_best": best("b")}


def _tok(m: Measurement | None) -> str:
    return "failed" if m is None else f"{m.tok_s:.1f}"
