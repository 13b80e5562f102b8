"""The serving process's own gauges on /metrics, under the names Prometheus' client libraries
export by default (`process_resident_memory_bytes`, ...), so the usual dashboards and alerts
(memory creeping up over a day, descriptors left open by dropped connections) work unchanged.

Read at scrape time from /proc/self (Linux); where /proc is missing only what the standard
library can tell (CPU seconds) is exported, never a stand-in value. The figures are this
process's: stages placed in processes of their own (deploy config) or on Ray nodes are not
counted in them.

Why: memory that keeps growing is what an operator of a long-running server watches for;
a mixed load's figures and where the growth comes from are in benchmarks/README.md ("Memory
over time")."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

_PROC = Path("/proc/self")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_metrics(proc: Path = _PROC) -> list[tuple[str, str, str, float]]:
    """(name, kind, help, value) for the process at `proc`'s /proc directory (this one)."""
    cpu = os.times()
    out = [("process_cpu_seconds_total", "counter", "user and system CPU time of the serving process",
            round(cpu.user + cpu.system, 3))]
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        fds = sum(1 for _ in (proc / "fd").iterdir())
    except OSError:             # no /proc (not Linux): nothing more to tell
        return out
    # /proc/<pid>/stat after the command name: field 3 (state) is fields[0], so field n is
    # fields[n - 3]: 20 num_threads, 22 starttime (clock ticks after boot), 23 vsize (bytes),
    # 24 rss (pages).
    ticks = os.sysconf("SC_CLK_TCK")
    started = _boot_time() + int(fields[19]) / ticks
    return out + [
        ("process_resident_memory_bytes", "gauge", "resident memory of the serving process",
         int(fields[21]) * _PAGE),
        ("process_virtual_memory_bytes", "gauge", "virtual memory of the serving process", int(fields[20])),
        ("process_open_fds", "gauge", "open file descriptors of the serving process", fds),
        ("process_threads", "gauge", "threads of the serving process", int(fields[17])),
        ("process_start_time_seconds", "gauge", "start of the serving process, seconds since the epoch",
         round(started, 2)),
    ]


@functools.cache
def _boot_time() -> float:
    """Seconds since the epoch at boot (/proc/stat's btime; derived from the clocks without it).
    Read once: it does not change, and every scrape needs it."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
