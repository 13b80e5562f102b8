"""The per-process settings engine options ask for, applied wherever a process builds stages
(the engine's own process and each stage worker), before any weights load: torch's CPU
threads, and how the C library keeps the memory tensors free. `serial_torch_thread`, for
every thread of a serving process but the engine's. And `freeze_loaded_heap`, once the stages
are built.

Why one OpenMP team per process: libgomp gives each thread that opens a parallel region a team
of its own, kept for the thread's life, and once its teams together hold more threads than the
machine has CPUs it throttles every team's spin waits (100 spins instead of 300,000 before a
futex sleep). Every parallel region of the engine thread then pays a futex wake-up: measured on
2 cores, a 73k-element multiply 4 -> 40-60 us, and a Qwen2.5-Omni first audio chunk (36 DiT
passes and BigVGAN) 0.33 -> 0.65 s, after one worker thread had decoded one request's audio.
The engine thread owns the team; the threads that prepare requests, decode media or cut a
Realtime session's audio run their torch ops serially (they are small, or not on the engine's
critical path).

Why `host_memory=retain`: glibc's malloc hands freed memory back to the kernel eagerly (a
block above 128 KiB is mapped and unmapped on every allocation until its adaptive threshold
has grown, and the heap's top is returned whenever more than twice that threshold lies free),
so a stage whose steps allocate tens of MiB of activations (a vocoder at 24 kHz, a DiT, a
VAE) fault in fresh zeroed pages at every step. Measured on Qwen3-Omni's code2wav (small
checkpoint, 2 cores, a VM): 8 streams' chunks 2-4x slower in steady state than with the
memory kept. Retained, a block up to 32 MiB (glibc's largest mmap threshold) comes from the
heap and the heap keeps up to 1 GiB free at its top for the next step; a process's resident
memory stays at its high-water mark instead of following each step."""

from __future__ import annotations

import ctypes
import gc
import logging
import platform
from concurrent.futures import ThreadPoolExecutor

import torch

from omnistage.config import EngineConfig

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h) and the values `retain` sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20        # glibc's maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30


def apply_process_options(config: EngineConfig) -> None:
    """Set this process's torch threads and allocator policy from `config` (idempotent)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.host_memory == "retain":
        retain_freed_memory()


def serial_torch_thread() -> None:
    """Run the calling thread's torch ops on it alone, never opening an OpenMP team (see the
    module docstring). Call it first thing in a thread: a team, once made, lasts as long as
    its thread. A no-op where torch's OpenMP runtime cannot be reached (its team size is then
    the process's)."""
    torch.get_num_threads()      # torch's per-thread init first: it would set the size back
    try:
        runtime = ctypes.CDLL(None)          # torch's OpenMP runtime is loaded globally
        runtime.omp_set_num_threads(ctypes.c_int(1))   # this thread's team size (an ICV)
    except (OSError, AttributeError, TypeError):
        log.debug("no OpenMP runtime reachable: this thread keeps the process's team size")


def serial_executor(name: str, max_workers: int | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads run torch serially (`serial_torch_thread`)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=serial_torch_thread)


def retain_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (module docstring); False where the
    C library is not glibc (its allocator keeps its own policy)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either fixes both thresholds (glibc stops adapting them), so both are set.
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    if not ok:
        log.warning("glibc refused mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD): freed memory "
                    "goes back to the kernel as by default")
    return bool(ok)


def freeze_loaded_heap() -> None:
    """Once a process has built its stages: collect, then move every object alive (modules,
    tokenizers, configs, kernels' handles: hundreds of thousands after loading) into the
    collector's permanent generation, which later collections do not traverse. Why: Python's
    full collection walks every tracked object, and as loading and warm-up grew the heap each
    took longer: on the small Qwen2.5-Omni (2 cores, Intel Xeon) eight in the first seconds,
    16 -> 189 ms, the last one while serving (a stall of every stage in the process), and
    later ones as rare but as long. Objects alive now are never freed by the collector after
    this (only cycles would need it; the weights live as long as the engine)."""
    gc.collect()
    gc.freeze()
