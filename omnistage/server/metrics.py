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
    ttfa: Histogram = field(default_factory=lambda: Histogram(
        "omnistage_time_to_first_audio_seconds", "request arrival to its first audio chunk"))
    latency: Histogram = field(default_factory=lambda: Histogram(
        "omnistage_request_latency_seconds", "request arrival to its last token"))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    audio_seconds: float = 0.0

    def render(self, engine, server: list[tuple[str, str, str, float]] = ()) -> str:
        """The exposition: the engine's metrics, the server's own (`server`: admission), the
        routes' counters and histograms."""
        values = engine.metrics() + list(server) + [
            ("omnistage_prompt_tokens_total", "counter", "prompt tokens of served requests", self.prompt_tokens),
            ("omnistage_generation_tokens_total", "counter", "tokens generated for served requests",
             self.generation_tokens),
            ("omnistage_audio_seconds_total", "counter", "seconds of speech generated", self.audio_seconds),
        ]
        lines, described = [], set()
        for name, kind, help_text, value in values:
            base = name.split("{", 1)[0]
            if base not in described:     # one HELP/TYPE per metric family, however many labels
                lines += [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
                described.add(base)
            lines.append(f"{name} {value}")
        lines += self.ttft.lines() + self.ttfa.lines() + self.latency.lines()
        return "\n".join(lines) + "\n"
