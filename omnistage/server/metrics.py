"""Prometheus text exposition for the server: engine gauges read at scrape time, plus
request histograms (TTFT, latency) and token counters recorded by the routes."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = _BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {self.total}",
                f"{self.name}_count {self.n}"]
        return out


@dataclass
class ServerMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "omnistage_time_to_first_token_seconds", "request arrival to its first generated text"))
    latency: Histogram = field(default_factory=lambda: Histogram(
        "omnistage_request_latency_seconds", "request arrival to its last token"))
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def render(self, engine) -> str:
        e = engine.engine
        values = [
            ("omnistage_kv_blocks_total", "gauge", "KV cache blocks in the pool", e.num_blocks),
            ("omnistage_kv_blocks_free", "gauge", "KV cache blocks free", e.num_free_blocks),
            ("omnistage_requests_running", "gauge", "sequences holding KV blocks", len(e.scheduler.running)),
            ("omnistage_requests_waiting", "gauge", "sequences queued or preempted", len(e.scheduler.waiting)),
            ("omnistage_requests_in_engine", "gauge", "requests the engine holds (any state)", len(e.requests)),
            ("omnistage_preemptions_total", "counter", "sequences preempted so far", e.scheduler.num_preemptions),
            ("omnistage_requests_aborted_total", "counter", "requests aborted (client gone, or abort())",
             e.num_aborted_requests),
            ("omnistage_prefix_cache_hit_tokens_total", "counter", "prompt tokens served by the prefix cache",
             e.block_manager.num_prefix_hit_tokens),
            ("omnistage_prompt_tokens_total", "counter", "prompt tokens of served requests", self.prompt_tokens),
            ("omnistage_generation_tokens_total", "counter", "tokens generated for served requests",
             self.generation_tokens),
        ]
        lines = []
        for name, kind, help_text, value in values:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += self.ttft.lines() + self.latency.lines()
        return "\n".join(lines) + "\n"
