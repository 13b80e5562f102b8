"""Memory-read bandwidth of this machine and the decode speed it allows.

Single-stream decode must read every weight once per token, so
    bound tok/s = read bandwidth (bytes/s) / weight bytes per token.
Weight bytes are counted from the checkpoint's safetensors headers: every stored tensor once
(a tied lm_head shares the embedding matrix, so that matrix counts once); an untied
embedding matrix counts one row (a decode step reads only its token's). KV-cache reads and
activations are ignored (a few MB for a short prompt, against hundreds of MB of weights).
"""

from __future__ import annotations

import json
import struct
import time
from contextlib import contextmanager
from pathlib import Path

import torch

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def seconds(fn, repeats: int) -> list[float]:
    """`repeats` timings of fn() after one untimed call, fastest first."""
    fn()  # touch pages / warm caches of code paths
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def measure_read_bandwidth(gib: float = 1.0, threads: int = 2, repeats: int = 20) -> dict:
    """Read bandwidth in bytes/s over a `gib`-GiB fp32 tensor with `threads` threads.

    Two readers: `torch.sum` over the whole tensor and a vector-matrix product `x @ W`
    (the decode-shaped access). Each reader's figure is its second-fastest of `repeats`
    timings: best-of-N, less one (on a VM a lone timing can come out impossibly fast; once
    60 GB/s against a steady 35). The faster reader is the machine's usable read bandwidth.
    """
    n_bytes = int(gib * (1 << 30))
    cols = 4096
    rows = n_bytes // (4 * cols)
    with torch_threads(threads), torch.inference_mode():
        w = torch.rand(rows, cols, dtype=torch.float32)
        x = torch.rand(1, rows, dtype=torch.float32)
        size = w.numel() * 4
        sum_t = seconds(w.sum, repeats)
        mv_t = seconds(lambda: torch.mm(x, w), repeats)
    sum_bw, mv_bw = size / sum_t[1], size / mv_t[1]
    median = (lambda t: round(size / t[len(t) // 2] / 1e9, 2))
    return {"threads": threads, "gib": round(size / (1 << 30), 3), "repeats": repeats,
            "sum_GBps": round(sum_bw / 1e9, 2), "matvec_GBps": round(mv_bw / 1e9, 2),
            "sum_median_GBps": median(sum_t), "matvec_median_GBps": median(mv_t),
            "read_GBps": round(max(sum_bw, mv_bw) / 1e9, 2),
            "bytes_per_s": max(sum_bw, mv_bw)}


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_bytes(model_dir: str | Path) -> dict:
    """Bytes of weights read per decode token: all stored tensors once, a tied matrix once,
    an untied embedding matrix one row."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(_safetensors_header(file))
    if tied:  # some writers store both names; the matrix is read once either way
        tensors.pop("lm_head.weight", None)
    total, params = 0, 0
    for name, info in tensors.items():
        numel = 1
        for d in info["shape"]:
            numel *= d
        params += numel
        read = numel
        if not tied and name.endswith("embed_tokens.weight"):
            read = info["shape"][-1]     # untied: a decode step reads one row (its token's)
        total += read * _DTYPE_BYTES[info["dtype"]]
    return {"bytes": total, "params": params, "tied_embeddings": tied}


def decode_bound(model_dir: str | Path, bandwidth: dict) -> dict:
    """The bandwidth-bound single-stream decode speed of the checkpoint."""
    w = weight_bytes(model_dir)
    return {**w, "bound_tok_s": round(bandwidth["bytes_per_s"] / w["bytes"], 2),
            # for reference: the bound at the speed of torch's own vector-matrix product
            "matvec_bound_tok_s": round(bandwidth["matvec_GBps"] * 1e9 / w["bytes"], 2)}
