"""The native linear kernel (omnistage/kernels/linear.c) against a float64 product, its batch
invariance, and its selection by `linear_kernel`."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from omnistage import Omni, SamplingParams
from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.kernels.linear import NativeLinearKernel, unsupported_reason
from omnistage.kernels.weight_pack import QuantizedCodes, WeightFormat, pack, pack_codes, quantize_codes
from omnistage.layers.linear import use_native_linears

needs_cc = pytest.mark.usefixtures("c_compiler")


@pytest.fixture(scope="module")
def kernel(c_compiler) -> NativeLinearKernel:
    return NativeLinearKernel()


@pytest.fixture(scope="module")
def narrow_kernel(c_compiler) -> NativeLinearKernel:
    """The path of CPUs without AVX-512 (8 lanes, 3-row tiles), built here too."""
    return NativeLinearKernel(wide_vectors=False)


@pytest.fixture(scope="module")
def no_vnni_kernel(c_compiler) -> NativeLinearKernel:
    """The AVX-512 path of CPUs without VNNI (int4k / int8k through AVX-512BW)."""
    return NativeLinearKernel(vnni=False)


@pytest.fixture(scope="module")
def narrow_no_vnni_kernel(c_compiler) -> NativeLinearKernel:
    """The 8-lane path without AVX-VNNI (int4k / int8k through maddubs: Zen 1-3, Haswell)."""
    return NativeLinearKernel(wide_vectors=False, vnni=False)


EXACT = dict(int4_activations="float32", int8_activations="float32")
FORMATS = [WeightFormat("float32"), WeightFormat("bfloat16"), WeightFormat("int8"),
           WeightFormat("int8", **EXACT), WeightFormat("int4", 32), WeightFormat("int4", 7),
           WeightFormat("int8g", 32), WeightFormat("int8g", 32, **EXACT), WeightFormat("int8g", 5)]


def fmt_id(f: WeightFormat) -> str:
    return f"{f.name}-{f.group_size}" + ("-exact" if f.int8_activations == "float32" else "")
# (rows, out, in): one row (the decode path), every tile height 1-6 and their mixes, partial
# last panels (out not a multiple of 64), odd inner sizes.
SHAPES = [(1, 64, 16), (1, 5, 3), (2, 130, 33), (3, 64, 7), (4, 192, 512), (5, 100, 64),
          (6, 64, 96), (7, 250, 40), (13, 65, 17), (64, 768, 512), (200, 300, 129)]


def activations(x: torch.Tensor, packed) -> torch.Tensor:
    """x as the kernel multiplies it: int4k and int8k round each block of 32 inputs of a row
    to int8 steps of max |x| / 127 (linear.c); every other format takes x as it is."""
    if packed.format not in ("int4k", "int8k"):
        return x
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks)).clamp(-127, 127)
    return (q * scale).view_as(x)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_matches_float64_product(kernel, narrow_kernel, no_vnni_kernel, narrow_no_vnni_kernel,
                                 m, n, k, bias, fmt):
    """The product of x and the weights as the format stores them (dequantized), within
    float32 summation error; the AVX2-width path gives the same bits (each output is the same
    chain of FMAs in either), as do the paths without VNNI (the same integer sums: AVX-512BW,
    and AVX2's maddubs where the 8-lane build here has AVX-VNNI)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w_t = torch.randn(k, n, generator=g)                 # (in, out), as TransposedLinear keeps it
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    packed = kernel.pack(w_t, fmt)
    assert packed.panels.shape[:2] == (-(-n // 64), {"int4k": k // 8, "int8k": k // 4}.get(packed.format, k))
    integer_dots = fmt.name in ("int4", "int8", "int8g") and fmt.integer_dots(fmt.name) \
        and k % 32 == 0 and fmt.group_size % 32 == 0
    assert packed.format == (fmt.name[:4] + "k" if integer_dots else fmt.name)
    got = kernel(x, packed, b)
    ref = activations(x, packed).double() @ packed.dequantize().double() + (b.double() if bias else 0)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, atol=2e-5 * k ** 0.5, rtol=1e-5)
    assert torch.equal(narrow_kernel(x, packed, b), got)
    if packed.format in ("int4k", "int8k"):
        assert torch.equal(no_vnni_kernel(x, packed, b), got)
        assert torch.equal(narrow_no_vnni_kernel(x, packed, b), got)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_quantization_error_is_bounded(fmt):
    """Each stored weight is within the format's rounding of the original: bf16 half an ulp
    (2^-8 relative), int8 half a column scale, int4 half a group scale (one scale on the
    clamped side: +8 scales is stored as +7)."""
    g = torch.Generator().manual_seed(3)
    w_t = torch.randn(150, 100, generator=g) * torch.rand(1, 100, generator=g) * 3
    w_t[:, 7] = 0                                                  # an all-zero column
    packed = pack(w_t, fmt)
    err = (packed.dequantize() - w_t).abs()
    assert packed.dequantize()[:, 7].abs().max() == 0
    if fmt.name == "float32":
        assert err.max() == 0
    elif fmt.name == "bfloat16":
        assert (err <= w_t.abs() * 2 ** -8).all()
    elif fmt.name == "int8":
        assert (err <= w_t.abs().amax(0) / 127 / 2 * 1.001 + 1e-7).all()
    elif fmt.name == "int8g":
        groups = -(-150 // fmt.group_size)
        padded = torch.nn.functional.pad(w_t, (0, 0, 0, groups * fmt.group_size - 150))
        scale = padded.view(groups, fmt.group_size, 100).abs().amax(1) / 127
        assert (err <= scale.repeat_interleave(fmt.group_size, 0)[:150] / 2 * 1.001 + 1e-7).all()
    else:
        groups = -(-150 // fmt.group_size)
        padded = torch.nn.functional.pad(w_t, (0, 0, 0, groups * fmt.group_size - 150))
        scale = padded.view(groups, fmt.group_size, 100).abs().amax(1) / 8     # (groups, out)
        bound = scale.repeat_interleave(fmt.group_size, 0)[:150] * 1.001 + 1e-7
        assert (err <= bound).all()
    assert packed.nbytes < w_t.numel() * 4 * {"float32": 1.3, "bfloat16": 0.65, "int8": 0.35,
                                                "int4": 0.25 if fmt.group_size > 8 else 0.9,
                                                "int8g": 0.4 if fmt.group_size > 8 else 1.3}[fmt.name]


@pytest.mark.parametrize("name,group,k", [("int4", 32, 70), ("int8g", 32, 70), ("int4", 5, 70),
                                          ("int4", 32, 96), ("int8g", 32, 96)])
def test_codes_quantized_elsewhere_are_kept_exactly(kernel, name, group, k):
    """pack_codes (a GGUF q4_0 / q8_0 tensor's codes and scales): the kernel computes with
    exactly (u - 8) * s or q * s, whatever the shape (partial panels, a partial last group;
    inputs a multiple of 32: int4k / int8k, against int8-rounded activations)."""
    g = torch.Generator().manual_seed(7)
    n = 100
    groups = -(-k // group)
    codes = (torch.randint(0, 16, (n, k), generator=g).to(torch.uint8) if name == "int4"
             else torch.randint(-127, 128, (n, k), generator=g).to(torch.int8))
    scales = torch.randn(n, groups, generator=g).half().float()     # GGUF stores float16 scales
    w = QuantizedCodes(name, codes, scales, group)
    packed = pack_codes(w)
    s = scales.repeat_interleave(group, dim=1)[:, :k]
    want = (codes.float() - (8 if name == "int4" else 0)) * s          # (out, in), exact here
    assert torch.equal(packed.dequantize(), want.t()) and torch.equal(w.dequantize(), want)
    assert torch.equal(w.as_int8g().dequantize(), want)                 # lossless
    again = quantize_codes(want, WeightFormat(name, group))             # codes <-> panels
    assert torch.equal(pack_codes(again).panels, pack(want.t(), WeightFormat(name, group)).panels)
    assert packed.format == (name if k % 32 else name[:4] + "k")
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(kernel(x, packed, None).double(),
                               activations(x, packed).double() @ want.t().double(),
                               atol=2e-5 * k ** 0.5, rtol=1e-5)
    if name == "int4" and group == 32:
        # q4_0 as llama.cpp quantizes it (the largest magnitude of each block at code 0):
        # packing its float values again gives back the same codes and scales.
        codes[:, ::group] = 0
        w = QuantizedCodes(name, codes, scales, group)
        assert torch.equal(pack(w.dequantize().t(), WeightFormat(name, group)).panels, pack_codes(w).panels)


def test_inputs_of_other_layouts(kernel):
    """Leading dimensions are kept; strided inputs are made contiguous first."""
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(40, 70, generator=g)
    packed = kernel.pack(w_t)
    x = torch.randn(3, 5, 80, generator=g)[..., ::2]           # (3, 5, 40), stride 2
    got = kernel(x, packed, None)
    assert got.shape == (3, 5, 70)
    torch.testing.assert_close(got, x @ w_t, atol=1e-4, rtol=1e-5)
    assert kernel(torch.empty(0, 40), packed, None).shape == (0, 70)
    with pytest.raises(ValueError, match="in_features"):
        kernel(torch.randn(2, 41), packed, None)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_rows_are_batch_invariant(kernel, narrow_kernel, fmt):
    """A row's result is the same bits alone, in any batch, and at any position of it; the
    AVX2-width path's too (its int8k / int4k tiles of 2-4 rows against a row alone)."""
    g = torch.Generator().manual_seed(2)
    w_t, b = torch.randn(300, 200, generator=g), torch.randn(200, generator=g)
    packed = kernel.pack(w_t, fmt)
    x = torch.randn(37, 300, generator=g)
    whole = kernel(x, packed, b)
    for i in range(37):
        assert torch.equal(kernel(x[i:i + 1], packed, b)[0], whole[i])
    for lo, hi in [(0, 2), (5, 11), (3, 37), (30, 37)]:
        assert torch.equal(kernel(x[lo:hi], packed, b), whole[lo:hi])
        assert torch.equal(narrow_kernel(x[lo:hi], packed, b), whole[lo:hi])
    # ...and with other rows around it.
    mixed = torch.cat([torch.randn(4, 300, generator=g), x[7:8], torch.randn(20, 300, generator=g)])
    assert torch.equal(kernel(mixed, packed, b)[4], whole[7])


@pytest.mark.parametrize("fmt", [WeightFormat("float32"), WeightFormat("bfloat16")], ids=lambda f: f.name)
def test_rows_of_large_weights_are_batch_invariant(kernel, narrow_kernel, fmt):
    """Weights of 4 MiB or more: up to 16 rows take the 8-lane build's 2-row wide tiles, more
    rows its 3-row tiles; a row's bits are the same in either (and on the 16-lane path)."""
    g = torch.Generator().manual_seed(3)
    packed = kernel.pack(torch.randn(1024, 2048, generator=g), fmt)     # 8 / 4 MiB
    x = torch.randn(19, 1024, generator=g)
    whole = kernel(x, packed, None)                                      # 19 rows: 3-row tiles
    for lo, hi in [(0, 1), (0, 2), (0, 3), (4, 9), (3, 19)]:
        assert torch.equal(kernel(x[lo:hi], packed, None), whole[lo:hi])
        assert torch.equal(narrow_kernel(x[lo:hi], packed, None), whole[lo:hi])


@pytest.mark.parametrize("m,n,k", [(1, 130, 33), (2, 64, 1100), (3, 200, 64), (5, 64, 1030),
                                   (8, 192, 512), (13, 100, 1500), (16, 2048, 1024), (40, 70, 2050)])
def test_bfloat16_panels_of_bfloat16_weights_equal_float32_panels(kernel, narrow_kernel, m, n, k):
    """Weights that are bfloat16 values (a bf16 checkpoint) give the same bits from bfloat16
    panels (columns in pairs, widened in registers) as from float32 ones, in every regime: 1-2
    row wide tiles (also up to 16 rows of a 4+ MiB weight), 3-row tiles (run half a tile at a
    time for bf16) on short and long inputs (K around 1024, where float32 copies of quantized
    formats stop), partial panels; on both builds."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(k, n, generator=g).bfloat16().float()
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    half, full = kernel.pack(w, WeightFormat("bfloat16")), kernel.pack(w, WeightFormat("float32"))
    assert torch.equal(half.dequantize(), w)
    want = kernel(x, full, b)
    assert torch.equal(kernel(x, half, b), want)
    assert torch.equal(narrow_kernel(x, half, b), want)


def test_unsupported_reasons():
    assert unsupported_reason(torch.device("cpu"), torch.float32) is None
    assert "float32" in unsupported_reason(torch.device("cpu"), torch.bfloat16)
    assert "CPUs" in unsupported_reason(torch.device("meta"), torch.float32)



@needs_cc
def test_engine_kernels_agree(tiny_model, random_prompts):
    """Greedy tokens of concurrent requests are the same with every linear kernel."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(9, 11, 3, 29)
    runs = {}
    for name in ("native", "onednn", "matmul"):
        omni = Omni(tiny_model, linear_kernel=name)
        assert omni.engine.llm.linear_kernel == name
        runs[name] = [o.token_ids for o in omni.generate(prompts, params)]
    assert runs["native"] == runs["onednn"] == runs["matmul"]


@needs_cc
def test_request_alone_equals_request_in_batch(tiny_qwen2, random_prompts):
    """With the native kernels (linear and attention), a request's logprobs are the same bits
    alone as among 16 others that prefill and decode in the same steps."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    omni = Omni(tiny_qwen2, linear_kernel="native", attention_kernel="native",
                enable_prefix_caching=False)
    prompts = random_prompts(17, 11, 3, 29)
    [alone] = omni.generate(prompts[5:6], params)
    batch = omni.generate(prompts, params)
    assert batch[5].token_ids == alone.token_ids

    def values(out):
        return [(t.token_id, t.logprob, t.top) for t in out.outputs[0].logprobs]

    assert values(batch[5]) == values(alone)


def test_linear_kernel_option(tiny_qwen2, tmp_path, monkeypatch, caplog):
    with pytest.raises(InvalidRequestError, match="linear_kernel"):
        EngineConfig(model=str(tiny_qwen2), linear_kernel="fast")
    assert Omni(tiny_qwen2, linear_kernel="matmul").engine.llm.linear_kernel == "matmul"
    # A compiler that fails: auto falls back to oneDNN (and logs why); native says why.
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.INFO, logger="omnistage"):
        assert Omni(tiny_qwen2).engine.llm.linear_kernel in ("onednn", "matmul")
    assert "without the native kernel" in caplog.text
    with pytest.raises(InvalidRequestError, match="linear_kernel=native.*(could not compile|does not run)"):
        Omni(tiny_qwen2, linear_kernel="native")


def test_native_linear_module_swap(kernel):
    """use_native_linears swaps every fp32 nn.Linear (bias or not) for the same product."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 70), nn.GELU(), nn.Linear(70, 9, bias=False))
    x = torch.randn(5, 3, 40)
    with torch.inference_mode():
        ref = model(x)
        assert use_native_linears(model, kernel) == 2
        assert all(type(m) is not nn.Linear for m in model.modules())
        assert model[0].weight.dtype == torch.float32
        torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)
