"""Engine configuration: one dataclass, validated on construction. Every field is a
documented CLI flag / keyword argument of `Omni(...)`."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from omnistage.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# quantization option -> how the native kernel stores linear weights (kernels/weight_pack.py)
WEIGHT_FORMATS = {"none": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}


@dataclass
class EngineConfig:
    model: str                            # local HF-format folder
    tokenizer: str | None = None          # folder with tokenizer files; default: model
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16
    device: str = "auto"                  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    max_model_len: int | None = None      # context window; default: the model's
    max_num_seqs: int = 64                # sequences decoding at once
    max_num_batched_tokens: int = 2048    # per-step token budget (prefill chunks + decodes)
    # Of that budget, the most a step gives background prefills (Realtime turns prefilled while
    # still spoken): such a step stays short, so a request that arrives waits little for it.
    max_background_tokens: int = 64
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int | None = None      # KV pool size in blocks; default: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0       # upper bound on the KV pool when num_kv_blocks is unset
    kv_cache_dtype: str = "auto"          # auto (the model's dtype) | float32 | bfloat16 | float16
    enable_prefix_caching: bool = True    # reuse KV blocks of identical prompt prefixes
    seed: int = 0                         # seed of unseeded sampling
    num_threads: int | None = None        # torch CPU threads; default: torch's choice
    host_memory: str = "retain"           # retain (glibc keeps freed memory for reuse) | system (the C library's defaults)
    linear_kernel: str = "auto"           # auto (native on CPU fp32 when it builds, else onednn) | native | onednn | matmul
    attention_kernel: str = "auto"        # auto (native on CPU fp32 when it builds) | native | torch
    quantization: str = "none"            # none | bf16 | int8 | int4: linear weights, native kernel (CPU)
    quantization_group_size: int = 64     # inputs per int4 scale
    int4_activations: str = "int8"        # int8 (integer dot products, llama.cpp's numerics) | float32 (exact)
    int8_activations: str = "int8"        # the same for int8 weights (and GGUF q8_0): int8 | float32 (exact)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"engine option {name} {why}", param=name)

        if self.dtype not in ("auto", *_DTYPES):
            raise bad("dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_background_tokens", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, f"must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise bad(name, f"must be a positive integer or unset, got {v!r}")
        if self.linear_kernel not in ("auto", "native", "onednn", "matmul"):
            raise bad("linear_kernel", f"must be auto, native, onednn or matmul; got {self.linear_kernel!r}")
        if self.host_memory not in ("retain", "system"):
            raise bad("host_memory", f"must be retain or system; got {self.host_memory!r}")
        if self.attention_kernel not in ("auto", "native", "torch"):
            raise bad("attention_kernel", f"must be auto, native or torch; got {self.attention_kernel!r}")
        if self.quantization not in WEIGHT_FORMATS:
            raise bad("quantization", f"must be one of {', '.join(WEIGHT_FORMATS)}; got {self.quantization!r}")
        if not isinstance(self.quantization_group_size, int) or self.quantization_group_size < 1:
            raise bad("quantization_group_size",
                      f"must be a positive integer, got {self.quantization_group_size!r}")
        for name in ("int4_activations", "int8_activations"):
            if getattr(self, name) not in ("int8", "float32"):
                raise bad(name, f"must be int8 or float32; got {getattr(self, name)!r}")
        if self.quantization != "none" and self.linear_kernel in ("onednn", "matmul"):
            raise bad("quantization", f"={self.quantization} runs on the native linear kernel; "
                      f"linear_kernel={self.linear_kernel} reads float weights (use auto or native)")
        if self.kv_cache_dtype not in ("auto", *_DTYPES):
            raise bad("kv_cache_dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {self.kv_cache_dtype!r}")
        if not self.kv_cache_memory_gb > 0:
            raise bad("kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb!r}")
        try:
            self.torch_device
        except RuntimeError as e:
            raise bad("device", f"is not a valid torch device ({e})") from e

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """`auto` keeps the checkpoint's dtype, except half precision on CPU, where most
        CPUs have no fast bf16/fp16 matmul: there float32 is both faster and exact."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        dt = _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
        if self.torch_device.type == "cpu":
            return torch.float32
        return dt

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype: `auto` stores K and V as the model computes them."""
        return model_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "model"]
