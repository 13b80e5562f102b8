"""Shared-memory arenas: one bounded ring buffer per producer, read by one consumer.

The protocol and its invariants:

- A producer owns one segment (a file under /dev/shm, mapped read-write) and is its only
  writer. `ShmArena.try_write` copies bytes into a free region and returns a `ShmRef`
  (segment, offset, nbytes, token) that travels inside a message.
- The consumer maps the segment read-only once (`ShmReader.attach`, by name), copies a region
  out (`ShmReader.read`) and records the ref's token. Tokens travel back to the producer (an
  ack); `ShmArena.release(tokens)` makes those regions reusable. Until its ack arrives the
  producer never writes a region again, so a consumer always reads exactly what was written.
- Regions are handed out in ring order; free space is reclaimed from the oldest region
  forward, so an out-of-order ack only delays reuse, it never corrupts.
- When no region fits, `try_write` returns None and the caller sends the bytes inline. It never
  blocks: two processes each waiting for the other's acks cannot deadlock.
- Names: a segment's name can be unlinked as soon as both ends have mapped it (a mapping
  outlives its name). The owner unlinks it at close and through a finalizer at interpreter
  exit; `unlink_segment` lets anyone who knows the name (the parent of a crashed child) remove
  it. Space is reserved up front (posix_fallocate) so a full /dev/shm fails at creation with
  OSError instead of killing a writer with SIGBUS later.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import secrets
import tempfile
import weakref
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

logger = logging.getLogger(__name__)

ALIGN = 64  # region offsets are cache-line aligned, which also aligns every dtype


class ShmRef(msgspec.Struct, array_like=True, frozen=True):
    """Where a producer wrote `nbytes` bytes; `token` is what the consumer acks."""

    segment: str
    offset: int
    nbytes: int
    token: int


def default_shm_dir() -> str:
    """/dev/shm (RAM-backed) where it exists, else the temp dir (file-backed mmap)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_segment_name(role: str) -> str:
    """A fresh, unguessable name; the creating pid makes leftovers attributable."""
    return f"omnistage-{os.getpid()}-{secrets.token_hex(8)}-{role}"


def unlink_segment(name: str, directory: str | None = None) -> bool:
    """Remove a segment's name; False if it was already gone. Mappings stay valid."""
    try:
        os.unlink(_segment_path(name, directory))
        return True
    except FileNotFoundError:
        return False


def _segment_path(name: str, directory: str | None) -> str:
    # A peer sends segment names; never let one point outside the shm directory.
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory segment name {name!r}: use a plain file name")
    return os.path.join(directory or default_shm_dir(), name)


def try_create_arena(name: str, capacity: int, directory: str | None = None) -> ShmArena | None:
    """An arena, or None (everything then travels inline) if capacity is 0 or it cannot be made."""
    if capacity == 0:
        return None
    try:
        return ShmArena(name, capacity, directory)
    except OSError as e:  # e.g. /dev/shm too small (docker's default is 64 MB)
        logger.warning("no shared-memory arena (%s); tensors will travel inline", e)
        return None


def _release_segment(mm: mmap.mmap, path: str) -> None:
    """Finalizer body: must not reference the arena object."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        mm.close()
    except BufferError:  # a view is still alive; the mapping goes when it does
        pass


@dataclass
class _Region:
    token: int
    offset: int
    end: int  # offset + the aligned size
    released: bool = False


class ShmArena:
    """A producer's bounded ring buffer in one shared-memory segment (single-threaded use)."""

    def __init__(self, name: str, capacity: int, directory: str | None = None):
        if capacity <= 0:
            raise ValueError(f"shared-memory capacity must be positive, got {capacity}")
        self.name = name
        self.directory = directory or default_shm_dir()
        self.capacity = _round_up(capacity)
        self.path = _segment_path(name, self.directory)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, self.capacity)
            self._mm = mmap.mmap(fd, self.capacity)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _release_segment, self._mm, self.path)
        self._buf: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)  # (capacity,)
        self._regions: collections.deque[_Region] = collections.deque()  # oldest first
        self._by_token: dict[int, _Region] = {}  # regions not yet acked
        self._tokens = itertools.count(1)
        self.num_writes = 0  # regions handed out
        self.num_full = 0  # try_write calls that found no room (the caller went inline)

    @property
    def outstanding(self) -> int:
        """Regions written and not yet acked."""
        return len(self._by_token)

    @property
    def used_bytes(self) -> int:
        """Bytes between the oldest unreclaimed region and the newest (0 when empty)."""
        if not self._regions:
            return 0
        head, tail = self._regions[0].offset, self._regions[-1].end
        return tail - head if tail > head else self.capacity - head + tail

    def try_write(self, data: torch.Tensor) -> ShmRef | None:
        """Copy `data` ((N,) uint8, contiguous, any device) into a free region, or None if full."""
        if self._buf is None:
            raise RuntimeError(f"shared-memory arena {self.name} is closed")
        n = data.numel()
        if n == 0:
            return None
        offset = self._find_space(_round_up(n))
        if offset is None:
            self.num_full += 1
            return None
        dst = self._buf[offset:offset + n]
        if data.device.type == "cpu":
            dst.numpy()[:] = data.numpy()  # a plain memcpy: wakes no OpenMP threads
        else:
            dst.copy_(data)  # one device-to-host copy straight into shared memory
        token = next(self._tokens)
        region = _Region(token, offset, offset + _round_up(n))
        self._regions.append(region)
        self._by_token[token] = region
        self.num_writes += 1
        return ShmRef(self.name, offset, n, token)

    def release(self, tokens: list[int] | tuple[int, ...]) -> None:
        """Acks: the consumer is done with these regions. Unknown tokens are a protocol bug."""
        for token in tokens:
            region = self._by_token.pop(token, None)
            if region is None:
                raise ValueError(f"shared-memory arena {self.name}: ack for unknown token {token}")
            region.released = True
        while self._regions and self._regions[0].released:
            self._regions.popleft()

    def unlink(self) -> None:
        """Remove the name (call once the consumer has mapped it); the mapping stays valid."""
        unlink_segment(self.name, self.directory)

    def close(self) -> None:
        """Unlink and unmap. Idempotent."""
        self._buf = None  # drop our exported view so the mapping can close
        self._finalizer()

    def _find_space(self, size: int) -> int | None:
        if size > self.capacity:
            return None
        if not self._regions:
            return 0
        head, tail = self._regions[0].offset, self._regions[-1].end
        if self._regions[-1].offset >= head:
            # Not wrapped: live bytes are [head, tail); free are [tail, cap) and [0, head).
            if tail + size <= self.capacity:
                return tail
            return 0 if size <= head else None
        # Wrapped: live bytes are [head, cap) and [0, tail); free is [tail, head).
        return tail if tail + size <= head else None


class ShmReader:
    """The consumer side: maps peers' segments read-only and copies regions out.

    Only segments attached explicitly can be read, so a message cannot make us open files.
    Every `read` records its token; `take_acks` hands them to whoever sends the ack.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._acks: list[int] = []

    def attach(self, name: str, directory: str | None = None) -> None:
        if name in self._maps:
            return
        fd = os.open(_segment_path(name, directory), os.O_RDONLY)
        try:
            self._maps[name] = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def read(self, ref: ShmRef) -> torch.Tensor:
        """A private copy ((nbytes,) uint8) of the region; its token is queued for the ack."""
        mm = self._maps.get(ref.segment)
        if mm is None:
            raise ValueError(f"message refers to shared-memory segment {ref.segment!r}, which "
                             "was never attached to this reader")
        if ref.offset < 0 or ref.nbytes < 0 or ref.offset + ref.nbytes > len(mm):
            raise ValueError(f"shared-memory ref {ref} lies outside its segment ({len(mm)} bytes)")
        out = torch.empty(ref.nbytes, dtype=torch.uint8)
        out.numpy()[:] = np.frombuffer(mm, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
        self._acks.append(ref.token)
        return out

    def take_acks(self) -> list[int]:
        acks, self._acks = self._acks, []
        return acks

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
