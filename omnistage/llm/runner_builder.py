"""Setting up the model side of an LLMEngine, beside the ModelRunner it builds: which linear
and attention kernels serve the model here, how long a context may be, and how many KV
blocks the pool gets. The engine itself only serves requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.kernels.argmax import ArgmaxKernel
from omnistage.kernels.build import NativeBuildError, pick_native
from omnistage.kernels.moe import MoeKernel
from omnistage.kernels.norms import NormKernel
from omnistage.kernels.paged_attention import PagedAttentionKernel, unsupported_reason
from omnistage.layers.linear import native_kernel_for, pack_linears, weight_format
from omnistage.layers.moe import MoeMLP
from omnistage.layers.native_kernel import attach_kernel
from omnistage.layers.norm import RMSNorm
from omnistage.layers.onednn import onednn_linear_available
from omnistage.llm.model_runner import ModelRunner
from omnistage.llm.sampler import RowArgmax, torch_argmax

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV pool an engine was sized to."""

    num_blocks: int          # blocks in the pool (every layer's K and V share the numbering)
    block_size: int          # tokens per block
    block_bytes: int         # bytes of one block over all layers, K and V
    max_model_len: int       # longest sequence (prompt + output) a request may reach


@dataclass(frozen=True)
class RunnerSetup:
    runner: ModelRunner
    kv_cache: KVCacheConfig
    linear_kernel: str       # native [bf16|int8|int4] | onednn | matmul: what the linear layers run on
    attention_kernel: str    # native | torch


def build_runner(config: EngineConfig, model: torch.nn.Module, eos_ids: set[int]) -> RunnerSetup:
    """Pack `model`'s linear layers for the chosen kernel, size the KV pool and build the
    runner over it. `model` is loaded already, in its serving dtype, on config's device."""
    device, dtype = config.torch_device, next(model.parameters()).dtype
    kv_dtype = config.kv_torch_dtype(dtype)
    linear = choose_linear_kernel(config, model, device, dtype)
    kv = kv_cache_config(config, model, kv_dtype)
    attention = attention_kernel(config, model, device, dtype, kv_dtype)
    argmax = row_argmax(linear)
    native = argmax if isinstance(argmax, ArgmaxKernel) else None    # greedy and race choosers too
    runner = ModelRunner(model, kv.num_blocks, kv.block_size, dtype, device, eos_ids, config.seed,
                         attention, kv_dtype, argmax, native, native)
    if linear.startswith("native") and attention is not None:
        # Native linears and attention: the layer loop can run in C as well (one call a step).
        if model.use_native_stack(attention, runner.caches):
            log.info("decoder layers as one native call per step")
        # Layers still run op by op (MoE models) take the norms natively (kernels/norms.py).
        attach_kernel(model, RMSNorm, NormKernel, "RMSNorm layers")
    # MoE layers: the experts' grouping and weighted sums around their products (kernels/moe.py)
    if linear.startswith("native") and attach_kernel(model, MoeMLP, MoeKernel, "MoE layers' grouping and sums"):
        moe = [m for m in model.modules() if isinstance(m, MoeMLP)]
        log.info("MoE experts as two native calls in %d of %d layers", sum(m.use_native() for m in moe), len(moe))
    runner.keep_prompt_rows = config.enable_prefix_caching
    return RunnerSetup(runner, kv, linear, "torch" if attention is None else "native")


def row_argmax(linear: str) -> RowArgmax:
    """The sampler's argmax: the native one where the linear layers run natively (the logits are
    on the CPU; the same answers as torch's, ~5x faster: kernels/argmax.c), else torch's."""
    if not linear.startswith("native"):
        return torch_argmax
    try:
        return ArgmaxKernel()
    except NativeBuildError as e:
        log.info("sampler argmax without the native kernel: %s", e)
        return torch_argmax


def choose_linear_kernel(config: EngineConfig, model: torch.nn.Module, device: torch.device,
                         dtype: torch.dtype) -> str:
    """Ours where it serves and builds, else oneDNN's packed GEMM where it serves, else
    matmul. An explicit choice that cannot serve is an error."""
    want, fmt = config.linear_kernel, weight_format(config)
    if want == "matmul":
        return "matmul"
    if want in ("auto", "native"):
        kernel, why = native_kernel_for(config, device, dtype)
        if kernel is not None:
            pack_linears(model, kernel, fmt)
            return "native" if config.quantization == "none" else f"native {config.quantization}"
        log.info("linear layers without the native kernel: %s", why)
    if onednn_linear_available(device, dtype):
        pack_linears(model, None)
        return "onednn"
    if want == "onednn":
        raise InvalidRequestError(
            "linear_kernel=onednn needs float32 on a CPU with a oneDNN-enabled torch build; "
            "use auto or matmul", param="linear_kernel")
    return "matmul"


def attention_kernel(config: EngineConfig, model: torch.nn.Module, device: torch.device,
                     dtype: torch.dtype, kv_dtype: torch.dtype) -> PagedAttentionKernel | None:
    """The native attention kernels where they serve (built on first use), else None: the
    PyTorch path. `auto` falls back (and logs why) when they do not serve or build."""
    want = config.attention_kernel
    if want == "torch":
        return None
    _, kv_heads, head_dim = model.kv_shape
    heads = model.config.num_attention_heads
    kernel, why = pick_native(
        "attention_kernel", want,
        unsupported_reason(device, dtype, kv_dtype, heads, kv_heads, head_dim, config.block_size),
        lambda: PagedAttentionKernel(heads, kv_heads, head_dim, config.block_size, kv_dtype),
        "auto or torch")
    if kernel is None:
        log.info("attention in PyTorch: the native kernels do not serve here (%s)", why)
    return kernel


def kv_cache_config(config: EngineConfig, model: torch.nn.Module, kv_dtype: torch.dtype) -> KVCacheConfig:
    """Every seat filled to the full context, within `kv_cache_memory_gb` (or exactly
    `num_kv_blocks`); at least one full-length sequence must fit."""
    limit = model.config.max_position_embeddings
    max_len = config.max_model_len or limit
    if max_len > limit:
        raise InvalidRequestError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings {limit}",
            param="max_model_len")
    bs = config.block_size
    layers, kv_heads, head_dim = model.kv_shape
    block_bytes = 2 * layers * kv_heads * head_dim * bs * kv_dtype.itemsize
    one_seq = -(-max_len // bs) + 1   # +1: a copy-on-write spare
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    else:
        full = config.max_num_seqs * -(-max_len // bs) + 1
        n = min(full, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
    if n < one_seq:
        raise InvalidRequestError(
            f"the KV pool ({n} blocks of {bs} tokens) cannot hold one sequence of "
            f"max_model_len={max_len} tokens; raise kv_cache_memory_gb / "
            f"num_kv_blocks to at least {one_seq} blocks or lower max_model_len",
            param="num_kv_blocks")
    return KVCacheConfig(n, bs, block_bytes, max_len)
