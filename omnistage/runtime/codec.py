"""A pickle-free message codec: msgspec metadata plus raw tensor bytes.

A message is an instance of one of the registered types (msgspec.Structs or dataclasses whose
fields msgspec understands, nested freely) and becomes a list of frames:

    frames[0]   msgpack of (type tag, message). Each torch.Tensor / numpy.ndarray inside is a
                msgpack extension holding a `_TensorHeader`: dtype, shape, and where its bytes are
    frames[i]   the raw bytes of a small tensor (frame index i in its header), or nothing at
                all when the tensor lies in the producer's shared-memory arena (an `ShmRef`)

Tensors of `shm_threshold` bytes or more go through the arena when one is given and has room;
otherwise they travel inline. Anything msgspec cannot encode and that is not a tensor or array
raises TypeError: there is no fallback to pickle.

Decoding returns CPU tensors. Inline tensors are copied out of their frames unless the caller
passes `zero_copy=True`, promising that no frame's memory is ever reused (true of zmq.Frames,
which own their message: the channel does this). A zero-copy tensor is a view that keeps its
frame alive; read-only or misaligned frames are copied anyway. Tensors in shared memory are
always copied out (`ShmReader.read`), so their region is free as soon as it is acked.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

from omnistage.runtime.shm import ShmArena, ShmReader, ShmRef

TORCH_EXT = 1
NUMPY_EXT = 2

# Byte-addressable torch dtypes, by wire name (sub-byte and quantized dtypes are refused).
_TORCH_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _TORCH_DTYPE_NAMES
    if isinstance(getattr(torch, n, None), torch.dtype)  # older torch lacks some float8 kinds
}
_TORCH_DTYPE_TO_NAME = {d: n for n, d in TORCH_DTYPES.items()}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain bytes, no objects


class _TensorHeader(msgspec.Struct, array_like=True):
    dtype: str  # a TORCH_DTYPES key, or a numpy dtype string such as '<f4'
    shape: tuple[int, ...]
    frame: int = -1  # index into the frames list; -1 when the bytes are in shared memory
    shm: ShmRef | None = None


@dataclass
class Encoded:
    frames: list[bytes | memoryview]  # frames[0]: metadata; inline frames alias the tensors
    shm_tokens: list[int] = field(default_factory=list)  # arena regions held until the ack


class Codec:
    """Encodes/decodes the registered message types; both ends must register the same set."""

    def __init__(self, types: Sequence[type], *, shm_threshold: int = 64 * 1024):
        if shm_threshold < 1:
            raise ValueError(f"shm_threshold must be at least 1 byte, got {shm_threshold}")
        self.shm_threshold = shm_threshold
        self._tag_of: dict[type, str] = {}
        self._type_of: dict[str, type] = {}
        for tp in types:
            if not isinstance(tp, type) or not (issubclass(tp, msgspec.Struct)
                                                or dataclasses.is_dataclass(tp)):
                raise TypeError(f"Codec message types must be msgspec.Struct or dataclass "
                                f"classes, got {tp!r}")
            tag = tp.__qualname__
            if tag in self._type_of and self._type_of[tag] is not tp:
                raise ValueError(f"two message types are both named {tag!r}; rename one")
            self._tag_of[tp], self._type_of[tag] = tag, tp

    def encode(self, msg: Any, arena: ShmArena | None = None) -> Encoded:
        tag = self._tag_of.get(type(msg))
        if tag is None:
            raise TypeError(f"{type(msg).__qualname__} is not a registered message type; "
                            f"add it to Codec(types=[...]) on both ends")
        writer = _Writer(arena, self.shm_threshold)
        try:
            meta = msgspec.msgpack.Encoder(enc_hook=writer.enc_hook).encode((tag, msg))
        except BaseException:
            if arena is not None and writer.encoded.shm_tokens:
                arena.release(writer.encoded.shm_tokens)  # the message never left
            raise
        writer.encoded.frames[0] = meta
        return writer.encoded

    def decode(self, frames: Sequence[Any], shm: ShmReader | None = None, *,
               zero_copy: bool = False) -> Any:
        """`frames`: bytes / bytearray / memoryview / zmq.Frame, as `encode` produced them."""
        buffers = [_as_buffer(f) for f in frames]
        if not buffers:
            raise ValueError("cannot decode an empty frame list")
        tag, body = msgspec.msgpack.decode(buffers[0], type=tuple[str, msgspec.Raw])
        tp = self._type_of.get(tag)
        if tp is None:
            raise ValueError(f"received a message of unregistered type {tag!r}; register it in "
                             f"Codec(types=[...]) on both ends")
        reader = _Reader(buffers, shm, zero_copy)
        return msgspec.msgpack.Decoder(tp, ext_hook=reader.ext_hook, dec_hook=_dec_hook).decode(body)


class _Writer:
    """Per-call encode state: the frames and arena regions of one message."""

    def __init__(self, arena: ShmArena | None, threshold: int):
        self.arena, self.threshold = arena, threshold
        self.encoded = Encoded(frames=[b""])  # frames[0] is filled in last

    def enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        if isinstance(obj, torch.Tensor):
            name = _TORCH_DTYPE_TO_NAME.get(obj.dtype)
            if name is None or obj.layout != torch.strided or obj.device.type == "meta":
                raise TypeError(f"cannot send a tensor with dtype {obj.dtype}, layout {obj.layout} "
                                f"on {obj.device}: use a dense tensor of a byte-addressable dtype")
            flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            header = self._place(flat.view(torch.uint8), name, tuple(obj.shape))
            return msgspec.msgpack.Ext(TORCH_EXT, msgspec.msgpack.encode(header))
        if type(obj) is np.ndarray:
            if obj.dtype.kind not in _NUMPY_KINDS:
                raise TypeError(f"cannot send a numpy array of dtype {obj.dtype}: only bool, "
                                "integer, float and complex arrays travel as raw bytes")
            flat = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
            header = self._place(flat, obj.dtype.str, obj.shape)
            return msgspec.msgpack.Ext(NUMPY_EXT, msgspec.msgpack.encode(header))
        raise TypeError(f"cannot encode an object of type {type(obj).__qualname__}: use "
                        "msgspec-native types, msgspec.Structs, torch.Tensor or numpy.ndarray")

    def _place(self, data: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> _TensorHeader:
        """data: (nbytes,) uint8, contiguous, any device."""
        if self.arena is not None and data.numel() >= self.threshold:
            ref = self.arena.try_write(data)
            if ref is not None:
                self.encoded.shm_tokens.append(ref.token)
                return _TensorHeader(dtype, shape, shm=ref)
        # Inline: the frame aliases the (host copy of the) tensor until the caller sends it.
        self.encoded.frames.append(memoryview(data.cpu().numpy()))
        return _TensorHeader(dtype, shape, frame=len(self.encoded.frames) - 1)


class _Reader:
    """Per-call decode state: the frames of one message and the shared-memory reader."""

    def __init__(self, buffers: list[memoryview], shm: ShmReader | None, zero_copy: bool):
        self.buffers, self.shm, self.zero_copy = buffers, shm, zero_copy

    def ext_hook(self, code: int, data: memoryview) -> Any:
        header = msgspec.msgpack.decode(data, type=_TensorHeader)
        if code == TORCH_EXT:
            dtype = TORCH_DTYPES.get(header.dtype)
            if dtype is None:
                raise ValueError(f"received a tensor of unknown dtype {header.dtype!r}")
            raw = self._bytes(header, dtype.itemsize, dtype.itemsize * math.prod(header.shape))
            return raw.view(dtype).reshape(header.shape)
        if code == NUMPY_EXT:
            dtype = np.dtype(header.dtype)
            if dtype.kind not in _NUMPY_KINDS:
                raise ValueError(f"received a numpy array of refused dtype {header.dtype!r}")
            raw = self._bytes(header, dtype.itemsize, dtype.itemsize * math.prod(header.shape))
            return raw.numpy().view(dtype).reshape(header.shape)
        raise ValueError(f"received an unknown msgpack extension type {code}")

    def _bytes(self, header: _TensorHeader, itemsize: int, nbytes: int) -> torch.Tensor:
        """The tensor's bytes as (nbytes,) uint8: a frame view, or a copy out of shm."""
        if header.shm is not None:
            if self.shm is None:
                raise ValueError("message holds shared-memory tensors but no ShmReader was given")
            if header.shm.nbytes != nbytes:
                raise ValueError(f"shared-memory ref holds {header.shm.nbytes} bytes, "
                                 f"the header says {nbytes}")
            return self.shm.read(header.shm)
        if not 0 < header.frame < len(self.buffers):
            raise ValueError(f"tensor refers to frame {header.frame}; the message has "
                             f"{len(self.buffers)} frames")
        buf = self.buffers[header.frame]
        if buf.nbytes != nbytes:
            raise ValueError(f"frame {header.frame} holds {buf.nbytes} bytes, "
                             f"the header says {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if buf.readonly or not self.zero_copy:
            return torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        view = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the frame alive
        return view if view.data_ptr() % min(itemsize, 8) == 0 else view.clone()


def _dec_hook(tp: type, obj: Any) -> Any:
    # The ext hook already built the object; this only checks it fits the annotated type.
    if isinstance(tp, type) and isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {tp.__qualname__}, got {type(obj).__qualname__}")


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes its bytes as .buffer
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
