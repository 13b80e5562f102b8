"""Linear layer kinds of our model files.

Linear weights are stored transposed, (in_features, out_features) contiguous, because
`x @ W_t` against such a weight streams memory twice as fast as `F.linear` on the CPUs we
serve from (measured: 16-18 GB/s vs ~8 GB/s for a matrix-vector product) and is no slower on
GPUs. Merged projections (q|k|v, gate|up) are one weight with column shards.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from omnistage.config import WEIGHT_FORMATS, EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.kernels.linear import (NativeLinearKernel, native_linear_kernel,
                                      unsupported_reason as native_linear_unsupported)
from omnistage.kernels.weight_pack import (PackedWeight, QuantizedCodes, WeightFormat, exact_format,
                                           pack_codes)
from omnistage.layers.onednn import pack_weight, packed_linear


class TransposedLinear(nn.Module):
    """y = x @ weight_t (+ bias). `shard_sizes` splits the output columns into merged parts
    (e.g. q, k, v) that are loaded from separate checkpoint tensors.

    After loading, the weight may move into a CPU kernel's own layout (`pack`):
    - `native`: 64-column panels for our kernel (omnistage/kernels/linear.c), in float32,
      bfloat16, int8 or int4 (the engine's `quantization`). It is as fast as oneDNN for many
      rows, streams ~20% faster for one (a single-stream decode), and gives every row the
      same bits whatever batch it is in.
    - `onednn`: oneDNN's blocked layout. Its fp32 GEMM uses AVX-512 where the default BLAS
      path stays on AVX2, 2-3x faster on the CPUs we serve from (measured: ~450 vs ~190
      GFLOP/s on two Zen cores, and 35 vs 21 GB/s for a matrix-vector product).
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device | str = "meta", output_head: bool = False):
        super().__init__()
        self.output_head = output_head          # a model's lm_head (WeightFormat.for_output_head)
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        out = self.out_features = sum(shard_sizes)
        self.weight_t = nn.Parameter(torch.empty(in_features, out, dtype=dtype, device=device),
                                     requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None   # oneDNN-blocked (out, in) weight, if packed
        self.panels: PackedWeight | None = None   # the native kernel's panels, if packed
        self.native: NativeLinearKernel | None = None
        # Set by pack_when_loaded: packed as soon as every shard (and bias) is in.
        self._pack_on_load: tuple[NativeLinearKernel, WeightFormat] | None = None
        self._loaded: set[tuple[str, int]] = set()
        self._codes: dict[int, QuantizedCodes] = {}   # shards loaded pre-quantized

    def load_weight(self, w: torch.Tensor | QuantizedCodes, shard: int = 0) -> None:
        """w: (out_shard, in) as checkpoints store it: float, or codes quantized elsewhere
        (a GGUF q4_0 / q8_0 tensor), which the native kernel then computes with as they are."""
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        self._check_unpacked()
        _check_shape(w, (size, self.in_features))
        if isinstance(w, QuantizedCodes):
            self._codes[shard] = w
        else:
            self._codes.pop(shard, None)
            self.weight_t[:, off:off + size].copy_(w.t())
        self._loaded_part("weight", shard)

    @property
    def in_features(self) -> int:
        return self.weight_t.shape[0] if self.panels is None else self.panels.in_features

    def load_bias(self, b: torch.Tensor, shard: int = 0) -> None:
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        self._check_unpacked()
        _check_shape(b, (size,))
        self.bias[off:off + size].copy_(b)
        self._loaded_part("bias", shard)

    def pack_when_loaded(self, kernel: NativeLinearKernel, fmt: WeightFormat) -> None:
        """Pack for `kernel` in `fmt` as soon as every shard of the weight (and of the bias)
        has been loaded, dropping the float32 copy then: while a checkpoint loads, only the
        layers still loading hold float32 weights (their untouched pages are not resident)."""
        self._pack_on_load = (kernel, fmt)

    def _loaded_part(self, kind: str, shard: int) -> None:
        self._loaded.add((kind, shard))
        parts = len(self.shard_sizes) * (1 if self.bias is None else 2)
        if self._pack_on_load is not None and len(self._loaded) == parts:
            self.pack(*self._pack_on_load)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None or self.panels is not None

    def _check_unpacked(self) -> None:
        if self.is_packed:
            raise ValueError("this layer's weights were loaded (and packed) already")

    def pack(self, kernel: NativeLinearKernel | None, fmt: WeightFormat = WeightFormat()) -> None:
        """Move the weight into `kernel`'s panels in `fmt` (kernel None: oneDNN's float32
        layout); drop the plain copy."""
        if self.is_packed:
            return                                # packed while loading (pack_when_loaded)
        codes = self._merged_codes() if kernel is not None else None
        if codes is not None:                     # every shard pre-quantized alike: as stored
            self.native, self.panels = kernel, pack_codes(codes, fmt)
        else:
            for shard, part in self._codes.items():   # mixed with float shards: as floats
                off = self.shard_offsets[shard]
                self.weight_t[:, off:off + self.shard_sizes[shard]].copy_(part.dequantize().t())
            if kernel is not None:
                assert self.bias is None or self.bias.is_contiguous()
                fmt = exact_format(self.weight_t, fmt.for_output_head() if self.output_head else fmt)
                self.native, self.panels = kernel, kernel.pack(self.weight_t, fmt)
            else:
                self.packed = pack_weight(self.weight_t.t())          # (out, in)
        self.weight_t = nn.Parameter(torch.empty(0, dtype=self.weight_t.dtype), requires_grad=False)
        self._pack_on_load, self._codes = None, {}

    def _merged_codes(self) -> QuantizedCodes | None:
        """The whole weight as one QuantizedCodes when every shard came pre-quantized with
        the same group size (formats may differ: int4 parts then become int8g, exactly)."""
        if len(self._codes) != len(self.shard_sizes):
            return None
        return QuantizedCodes.cat([self._codes[i] for i in range(len(self.shard_sizes))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x, self.panels, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def pack_linears(model: nn.Module, kernel: NativeLinearKernel | None,
                 fmt: WeightFormat = WeightFormat()) -> int:
    """Pack every TransposedLinear of `model` for `kernel` in `fmt` (kernel None: oneDNN);
    returns how many."""
    linears = [m for m in model.modules() if isinstance(m, TransposedLinear)]
    for m in linears:
        m.pack(kernel, fmt)
    return len(linears)


class NativeLinear(nn.Module):
    """An `nn.Linear` whose weight lives in the native kernel's panels (fp32 CPU compute, the
    weight in `fmt`): the GEMM of omnistage/kernels/linear.c, ~2.5x the default BLAS path on
    AVX-512 CPUs, with every row's result independent of the other rows in the call."""

    def __init__(self, linear: nn.Linear, kernel: NativeLinearKernel, fmt: WeightFormat = WeightFormat()):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        w_t = linear.weight.detach().t()
        self.panels = kernel.pack(w_t, exact_format(w_t, fmt))
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # Models read `.weight.dtype` / `.device` of their layers: an empty stand-in answers
        # those; anything that needs the values fails loudly.
        self.register_buffer("weight", linear.weight.new_empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.panels, self.bias)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    serves: Callable[[nn.Linear], bool]) -> int:
    """Replace every plain `nn.Linear` of `model` that `serves` accepts by `make(linear)`,
    through nn.Module's public child replacement (as quantization swaps layers); returns how
    many."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and serves(m)]
    for name, m in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, make(m))
    return len(targets)


def use_native_linears(model: nn.Module, kernel: NativeLinearKernel,
                       fmt: WeightFormat = WeightFormat()) -> int:
    """Replace every fp32 CPU `nn.Linear` of `model` by a NativeLinear with its weight in
    `fmt`; returns how many."""
    return replace_linears(model, lambda m: NativeLinear(m, kernel, fmt),
                           lambda m: native_linear_unsupported(m.weight.device, m.weight.dtype) is None)


def weight_format(config: EngineConfig) -> WeightFormat:
    """How the native kernel stores the linear weights for `config.quantization`."""
    return WeightFormat(WEIGHT_FORMATS[config.quantization], config.quantization_group_size,
                        config.int4_activations, config.int8_activations)


def native_linears_for(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                       *modules: nn.Module) -> bool:
    """Where `linear_kernel` allows it (auto, native) and the kernel serves, swap every
    nn.Linear of `modules` for a NativeLinear in the config's weight format (`quantization`);
    returns whether it did. A quantization the kernel cannot serve here is an error."""
    if config.linear_kernel not in ("auto", "native"):
        return False
    kernel, _ = native_kernel_for(config, device, dtype)
    if kernel is None:
        return False
    for module in modules:
        use_native_linears(module, kernel, weight_format(config))
    return True


def pack_while_loading(model: nn.Module, config: EngineConfig) -> None:
    """Before `model` (its parameters materialised, not yet filled) loads its checkpoint:
    where the native kernel serves, each TransposedLinear packs into the config's format (the
    exact one: exact_format) as soon as its weights are in, so loading never holds the whole
    model in float32 (a Qwen2.5-Omni-7B thinker would need ~30 GB; as its checkpoint's bf16
    ~15, as int8 ~8), nor a pre-quantized one's codes beside its panels. Output heads pack
    later, with the rest (a tied head is loaded from the embedding table, perhaps twice)."""
    if config.linear_kernel not in ("auto", "native"):
        return
    param = next(model.parameters())
    # None only for float32 weights (a quantization it cannot serve raises): packed later
    # for oneDNN, or kept for matmul.
    kernel, _ = native_kernel_for(config, param.device, param.dtype)
    if kernel is None:
        return
    for m in model.modules():
        if isinstance(m, TransposedLinear) and not m.output_head:
            m.pack_when_loaded(kernel, weight_format(config))


def native_kernel_for(config: EngineConfig, device: torch.device, dtype: torch.dtype
                      ) -> tuple[NativeLinearKernel | None, str | None]:
    """For `linear_kernel` auto or native: the native kernel, or (None, why it cannot serve
    here). A quantization other than none that it cannot serve raises (such weights exist only
    in its layout), as does linear_kernel=native."""
    kernel, why = native_linear_kernel(config.linear_kernel, device, dtype)
    if kernel is None and config.quantization != "none":
        raise InvalidRequestError(f"quantization={config.quantization} needs the native linear "
                                  f"kernel, which cannot serve here: {why}", param="quantization")
    return kernel, why


def _check_shape(t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        # Caught by the loader, which names the checkpoint tensor.
        raise ValueError(f"shape {tuple(t.shape)} does not match the config's {tuple(shape)}")
