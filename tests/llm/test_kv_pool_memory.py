"""The KV pool takes host memory only where blocks are written (layers/lazy_zeros.py), and
reads as zeros where they are not, as torch.zeros would."""

import os

import pytest
import torch

from omnistage.layers.attention import KVCache
from omnistage.layers.lazy_zeros import lazy_zeros

MiB = 2**20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_costs_memory_only_where_written(dtype):
    # 2 x 2 heads x 8192 blocks x 16 x 64: 128 MiB in float32, 64 in bfloat16
    before = _resident_bytes()
    cache = KVCache(2, 8192, 16, 64, dtype, torch.device("cpu"))
    pool = cache.kv.numel() * cache.kv.element_size()
    assert pool >= 64 * MiB and cache.kv.is_contiguous() and cache.kv.dtype == dtype
    assert _resident_bytes() - before < 8 * MiB         # torch.zeros: the whole pool resident

    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([5, 16 * 4000 + 1, 16 * 8191 + 15])
    cache.write(k, v, slots)
    keys, values = cache.gather(torch.tensor([0, 4000, 8191]), 3, None)   # (Hkv, 3, 16, D)
    assert torch.equal(keys[:, 0, 5], k[0].to(dtype))
    assert torch.equal(values[:, 2, 15], v[2].to(dtype))
    assert torch.equal(keys[:, 1, 1], k[1].to(dtype))
    written = torch.zeros(3, 16, dtype=torch.bool)
    written[0, 5] = written[1, 1] = written[2, 15] = True
    assert not keys[:, ~written].any() and not values[:, ~written].any()   # never written: zeros
    assert not cache.kv[:, :, 1:4000].any()
    assert _resident_bytes() - before < 16 * MiB + pool // 4   # read pages share the zero page


def test_lazy_zeros_is_writable_and_outlives_its_name():
    x = lazy_zeros((3, 5), torch.float32, "cpu")
    assert torch.equal(x, torch.zeros(3, 5))
    x[1, 2] = 7.0
    view = x[1]
    del x
    assert view.tolist() == [0.0, 0.0, 7.0, 0.0, 0.0]
    assert lazy_zeros((0, 4), torch.float32, "cpu").shape == (0, 4)
