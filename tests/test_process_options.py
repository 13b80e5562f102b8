"""Per-process engine options (runtime/process.py): host_memory=retain keeps freed memory in
glibc's heap for the next step; system leaves the C library's defaults."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh interpreter: apply the option, allocate and free a 16 MiB tensor (a vocoder's
# activation at 24 kHz), then read how much free memory glibc's heap holds (mallinfo2).
PROBE = """
import ctypes, json, sys, torch
from omnistage.config import EngineConfig
from omnistage.runtime.process import apply_process_options
apply_process_options(EngineConfig(model="unused", host_memory=sys.argv[1]))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
t = torch.ones(4 << 20)          # 16 MiB
mapped = libc.mallinfo2().hblkhd
del t
print(json.dumps({"mapped_while_live": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
"""


def probe(host_memory: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, host_memory], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the retain policy sets glibc's malloc")
def test_retain_keeps_a_freed_large_block_in_the_heap():
    mib16 = 16 << 20
    kept, system = probe("retain"), probe("system")
    # retain: the block came from the heap (not a private mapping) and stays there, free.
    assert kept["mapped_while_live"] < mib16 <= kept["free_in_heap"]
    # system: glibc mapped the block on its own and unmapped it on free.
    assert system["mapped_while_live"] >= mib16 > system["free_in_heap"]


def test_host_memory_is_checked():
    assert EngineConfig(model="m").host_memory == "retain"
    with pytest.raises(InvalidRequestError, match="host_memory must be retain or system"):
        EngineConfig(model="m", host_memory="keep")


def test_the_flag_reaches_the_engine_options():
    from omnistage.cli import build_parser, engine_options

    for argv, want in ((["serve", "tiny:qwen2"], "retain"),
                       (["serve", "tiny:qwen2", "--host-memory", "system"], "system")):
        assert engine_options(build_parser().parse_args(argv))["host_memory"] == want


# In a fresh interpreter: a thread that opens an OpenMP team adds the team's worker threads to
# the process; one that ran serial_torch_thread (or a serial_executor's thread) first adds
# none, whatever torch ops it runs (elementwise, copies, GEMMs, convolutions, FFTs).
TEAM_PROBE = """
import json, os, threading, torch
from omnistage.runtime.process import serial_executor, serial_torch_thread

def work():
    x = torch.randn(512, 1024)
    (x * x).sum(); x.clone(); x @ x.T
    torch.nn.functional.conv1d(x[None, :64], torch.randn(64, 64, 7), padding=3)
    torch.fft.rfft(x, dim=1)

def threads_after(*steps):
    seen = []
    def body():
        for step in steps:
            step()
        seen.append(len(os.listdir("/proc/self/task")))   # while this thread still lives
    t = threading.Thread(target=body)
    t.start(); t.join()
    return seen[0]

idle = threads_after()
with serial_executor("probe", 1) as pool:
    pooled = pool.submit(lambda: (work(), len(os.listdir("/proc/self/task")))[1]).result()
out = {"torch_threads": torch.get_num_threads(), "idle": idle,
       "serial": threads_after(serial_torch_thread, work), "pooled": pooled,
       "plain": threads_after(work)}
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="counts the process's threads in /proc")
def test_serial_threads_open_no_openmp_team():
    out = json.loads(subprocess.run([sys.executable, "-c", TEAM_PROBE], capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    if out["torch_threads"] < 2:
        pytest.skip("one torch thread: no thread opens a team")
    assert out["plain"] > out["idle"], out           # the control: a plain thread makes a team
    assert out["serial"] == out["idle"], out
    assert out["pooled"] == out["idle"], out         # (its one thread stands for the idle one)


def test_freeze_loaded_heap_collects_cycles_first_and_freezes_the_rest():
    """What a built server or stage worker does: garbage in reference cycles is collected
    before the freeze (never kept for the process's life), and what is alive leaves the
    collector's walks (gc.get_freeze_count). Restored after (gc.unfreeze)."""
    import gc
    import weakref

    from omnistage.runtime.process import freeze_loaded_heap

    class Node:
        pass

    dead = Node()
    dead.me = dead                      # a cycle: only the collector frees it
    gone = weakref.ref(dead)
    del dead
    try:
        freeze_loaded_heap()
        assert gone() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
