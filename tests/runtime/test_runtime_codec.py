"""The pickle-free codec and the shared-memory arena, in one process (no sockets)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from omnistage.runtime.codec import TORCH_DTYPES, Codec
from omnistage.runtime.shm import ShmArena, ShmReader, ShmRef, new_segment_name


class Leaf(msgspec.Struct, tag=True):
    t: torch.Tensor


class Other(msgspec.Struct, tag=True):
    a: np.ndarray
    label: str = ""


class Nested(msgspec.Struct):
    seq: int
    x: torch.Tensor
    maybe: torch.Tensor | None = None
    by_name: dict[str, torch.Tensor] = {}
    items: list[Leaf | Other] = []  # a tagged union inside a list
    anything: list[Any] = []  # tensors and arrays in untyped positions
    arr: np.ndarray | None = None


class Small(msgspec.Struct):
    t: torch.Tensor


@dataclasses.dataclass
class AsDataclass:
    name: str
    t: torch.Tensor


CODEC = Codec([Nested, Small, AsDataclass])


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as `dtype` (bools kept 0/1), so every bit pattern is exercised."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * dtype.itemsize
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-exact equality (NaN payloads included), same dtype and shape."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def roundtrip(msg: Any) -> Any:
    return CODEC.decode([bytes(f) for f in CODEC.encode(msg).frames])


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("frame_kind", [bytes, bytearray])  # read-only / writable frames
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3, 5)])
def test_every_dtype_and_shape_roundtrips(shape, frame_kind, zero_copy):
    assert {"bfloat16", "float16", "float32", "bool", "int64", "complex64"} <= set(TORCH_DTYPES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch.frombuffer's non-writable-buffer warning
        for i, dtype in enumerate(TORCH_DTYPES.values()):
            x = random_tensor(dtype, shape, seed=i)
            frames = [frame_kind(f) for f in CODEC.encode(Small(x)).frames]
            out = CODEC.decode(frames, zero_copy=zero_copy)
            assert_same(out.t, x)


def test_non_contiguous_and_special_views():
    base = torch.randn(8, 6)
    cases = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.randn(1, 5).expand(4, 5),
        "narrowed": base[2:4],
        "conj": torch.randn(3, 2, dtype=torch.complex64).conj(),
        "requires_grad": torch.randn(4, requires_grad=True),
        "bf16_t": torch.randn(4, 6).to(torch.bfloat16).t(),
    }
    for name, x in cases.items():
        encoded = CODEC.encode(Small(x))
        # Only the view's own bytes travel (a narrowed view does not drag its base along).
        assert encoded.frames[1].nbytes == x.numel() * x.element_size(), name
        out = CODEC.decode(encoded.frames).t
        assert out.is_contiguous() and not out.requires_grad and not out.is_conj(), name
        assert torch.equal(out, x.detach().resolve_conj()), name


def test_nested_structs_unions_dicts_and_numpy():
    arrays = [np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::-1],  # negative strides
              np.full((2, 2), 1.5, dtype=">f4"),  # big-endian stays big-endian
              np.array([True, False, True]), np.array(3 + 4j, dtype=np.complex128),  # 0-d
              np.empty((0, 4), dtype=np.float64)]
    msg = Nested(
        seq=7, x=torch.randn(3, 4), maybe=None,
        by_name={"ids": torch.arange(5), "h": torch.randn(2, 3).to(torch.bfloat16)},
        items=[Leaf(torch.ones(2, dtype=torch.float16)), Other(arrays[0], label="rev")],
        anything=[torch.tensor(2.5), arrays[1], 3, "text", {"k": [1.0, None]}],
        arr=arrays[2])
    out = roundtrip(msg)
    assert type(out) is Nested and out.seq == 7 and out.maybe is None
    assert torch.equal(out.x, msg.x) and set(out.by_name) == {"ids", "h"}
    assert_same(out.by_name["h"], msg.by_name["h"])
    assert type(out.items[0]) is Leaf and type(out.items[1]) is Other and out.items[1].label == "rev"
    np.testing.assert_array_equal(out.items[1].a, arrays[0])
    assert out.anything[2:] == [3, "text", {"k": [1.0, None]}]
    assert_same(out.anything[0], msg.anything[0])
    assert out.anything[1].dtype == np.dtype(">f4")
    np.testing.assert_array_equal(out.anything[1], arrays[1])
    for a in arrays[2:]:
        back = roundtrip(Nested(seq=0, x=torch.zeros(1), arr=a)).arr
        assert back.dtype == a.dtype and back.shape == a.shape
        np.testing.assert_array_equal(back, a)
    dc = roundtrip(AsDataclass("dc", torch.arange(4)))
    assert type(dc) is AsDataclass and dc.name == "dc" and torch.equal(dc.t, torch.arange(4))


def test_decode_copies_unless_zero_copy_is_promised():
    x = torch.randn(64)
    frames = [bytearray(f) for f in CODEC.encode(Small(x)).frames]
    start = np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
    copied = CODEC.decode(frames).t
    viewed = CODEC.decode(frames, zero_copy=True).t
    assert copied.data_ptr() != start and viewed.data_ptr() == start
    frames[1][:] = bytes(len(frames[1]))  # the caller reuses its receive buffer
    assert torch.equal(copied, x) and torch.equal(viewed, torch.zeros(64))
    frames[1][:] = x.numpy().tobytes()
    del frames
    assert torch.equal(viewed, x)  # the view holds its buffer, so dropping the list is safe


@pytest.mark.parametrize("bad", [
    object(), {1, object()}, np.float32(1.0), np.array([object()]),
    torch.randn(4, 4).to_sparse(), torch.empty(3, device="meta"),
])
def test_unknown_objects_raise_type_error(bad):
    with pytest.raises(TypeError):
        CODEC.encode(Nested(seq=0, x=torch.zeros(1), anything=[bad]))


def test_unregistered_types_and_bad_frames():
    class Unregistered(msgspec.Struct):
        v: int

    with pytest.raises(TypeError, match="not a registered message type"):
        CODEC.encode(Unregistered(1))
    with pytest.raises(TypeError):
        Codec([dict])
    frames = CODEC.encode(Small(torch.randn(4))).frames
    with pytest.raises(ValueError, match="unregistered type"):
        Codec([Nested]).decode(frames)
    with pytest.raises(ValueError, match="frame"):
        CODEC.decode(frames[:1])  # the tensor's frame is missing
    with pytest.raises(ValueError, match="bytes"):
        CODEC.decode([frames[0], bytes(frames[1])[:-4]])  # truncated
    # Structs do not check types on construction, so a sender can put an array where a
    # Tensor is declared; the receiver must refuse it.
    mistyped = CODEC.encode(Small(np.zeros(2))).frames
    with pytest.raises(msgspec.ValidationError, match="Tensor"):
        CODEC.decode(mistyped)


@pytest.fixture
def arena():
    a = ShmArena(new_segment_name("test"), 1 << 20)
    yield a
    a.close()
    assert not os.path.exists(a.path)


def test_large_tensor_goes_through_shm_and_arena_is_reused_after_ack(arena):
    reader = ShmReader()
    reader.attach(arena.name)
    big = torch.randn(150_000)  # 600 KB: above the threshold, fits the 1 MiB arena once
    first = CODEC.encode(Small(big), arena=arena)
    assert len(first.frames) == 1 and len(first.shm_tokens) == 1  # no inline frame
    assert arena.outstanding == 1 and arena.used_bytes >= big.numel() * 4
    # Not acked yet: no room for a second one, which travels inline instead.
    second = CODEC.encode(Small(big + 1), arena=arena)
    assert len(second.frames) == 2 and not second.shm_tokens and arena.num_full == 1
    out = CODEC.decode(first.frames, shm=reader).t
    assert torch.equal(out, big)
    arena.release(reader.take_acks())  # the ack
    assert arena.outstanding == 0 and arena.used_bytes == 0
    third = CODEC.encode(Small(big * 2), arena=arena)
    assert len(third.frames) == 1
    assert msgspec.msgpack.decode(third.frames[0])[1]["t"].data  # an ext, not raw bytes
    assert torch.equal(CODEC.decode(third.frames, shm=reader).t, big * 2)
    assert torch.equal(out, big)  # the first result was a copy, unaffected by reuse
    small = CODEC.encode(Small(torch.randn(100)), arena=arena)
    assert len(small.frames) == 2 and not small.shm_tokens  # below the threshold: inline
    reader.close()


def test_failed_encode_frees_its_regions(arena):
    with pytest.raises(TypeError):
        CODEC.encode(Nested(seq=0, x=torch.randn(100_000), anything=[object()]), arena=arena)
    assert arena.outstanding == 0 and arena.used_bytes == 0


def test_ring_allocation_out_of_order_acks_and_wraparound(arena):
    chunk = torch.zeros(300_000, dtype=torch.uint8)  # three fit in 1 MiB, a fourth does not
    a, b, c = (arena.try_write(chunk) for _ in range(3))
    assert [a.offset, b.offset < c.offset] == [0, True] and arena.try_write(chunk) is None
    arena.release([b.token])  # out of order: nothing is reclaimed before a
    assert arena.try_write(chunk) is None
    arena.release([a.token])  # a and b go: the next region wraps to offset 0
    d = arena.try_write(chunk)
    assert d.offset == 0 and arena.try_write(torch.zeros(400_000, dtype=torch.uint8)) is None
    e = arena.try_write(torch.zeros(200_000, dtype=torch.uint8))  # fits in the gap before c
    assert d.offset < e.offset < c.offset
    with pytest.raises(ValueError, match="unknown token"):
        arena.release([a.token])
    assert arena.try_write(torch.zeros(2 << 20, dtype=torch.uint8)) is None  # larger than it all
    arena.release([c.token, d.token, e.token])
    assert arena.used_bytes == 0 and arena.try_write(chunk).offset == 0


def test_reader_refuses_foreign_segments_and_bad_refs(arena):
    reader = ShmReader()
    with pytest.raises(ValueError, match="never attached"):
        reader.read(ShmRef(arena.name, 0, 8, 1))
    with pytest.raises(ValueError, match="invalid shared-memory segment name"):
        reader.attach("../etc/passwd")
    reader.attach(arena.name)
    with pytest.raises(ValueError, match="outside its segment"):
        reader.read(ShmRef(arena.name, arena.capacity - 4, 8, 1))
    reader.close()
