"""process_metrics over a /proc directory: the fields it reads from stat, and only CPU
seconds where there is no /proc."""

from __future__ import annotations

import os
from pathlib import Path

from omnistage.server.process_metrics import process_metrics


def _values(proc) -> dict[str, float]:
    return {name: value for name, _, _, value in process_metrics(proc)}


def test_fields_come_from_stat(tmp_path):
    (tmp_path / "fd").mkdir()
    for i in range(5):
        (tmp_path / "fd" / str(i)).touch()
    # pid (comm with a space and a paren) state ppid ... : field n is the (n - 2)th after ')'
    rest = ["S"] + [str(n) for n in range(4, 20)] + ["7", "0", "500", "123456789", "2000"] + ["0"] * 20
    (tmp_path / "stat").write_text("42 (python (x)) " + " ".join(rest) + "\n")
    v = _values(tmp_path)
    assert v["process_threads"] == 7
    assert v["process_virtual_memory_bytes"] == 123456789
    assert v["process_resident_memory_bytes"] == 2000 * os.sysconf("SC_PAGE_SIZE")
    assert v["process_open_fds"] == 5
    assert v["process_cpu_seconds_total"] > 0


def test_without_proc_only_cpu_seconds(tmp_path):
    assert set(_values(tmp_path / "missing")) == {"process_cpu_seconds_total"}


def test_this_process_matches_its_status():
    v = _values(Path("/proc/self"))
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss = int(status["VmRSS"].split()[0]) * 1024
    assert abs(v["process_resident_memory_bytes"] - rss) < 0.1 * rss
