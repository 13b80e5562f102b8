"""A duplex message channel between a parent process and a child process.

Transport: a ZMQ PAIR socket per end over ipc (Linux abstract namespace: no file to leak) or
tcp://127.0.0.1; the parent binds, the child connects. A ZMQ message is [header, *codec
frames]; the header (kind, acks, segment) is a few msgpack bytes.

Shared memory: each end owns one `ShmArena` for what it sends and maps the peer's read-only.
A receiver copies tensors out while decoding and acks at once: on the header of a message it
sends anyway, else as a bare ACK before `recv` returns. A producer applies acks whenever it
reads its socket, and reads before encoding while regions are outstanding. A full arena sends
inline (shm.py). `wait_acks` blocks until every region has been acked (drain, tests).

Authentication and encryption: every channel runs ZMQ's CURVE mechanism (CurveZMQ: X25519
key exchange, XSalsa20-Poly1305 per message). The parent, the CURVE server, makes a fresh key
pair per channel and hands its public key to the child only inside `spec` (the spawn
arguments, a Ray actor's constructor): never published, it is the channel's shared secret. A
client's handshake must be sealed to that key, and the parent must prove it holds the matching
secret key, so a process that finds the address (an abstract socket is listed in
/proc/net/unix; a TCP port is open to the host) and connects before the child completes no
handshake: libzmq drops it before a message is read or sent, the PAIR socket stays free for
the child, and nothing the parent queued reaches anyone else. Everything on the socket is
encrypted and authenticated (tensors in shared memory are not: /dev/shm segments are the
user's own, mode 0600, shm.py).

Start-up: the parent creates its arena, binds (`listen`) and hands the child `spec` bytes. The
child (`connect`) maps the parent's arena, creates its own, connects and sends HELLO. On HELLO
the parent maps the child's arena and unlinks both names, so from then on nothing of the
channel is left in /dev/shm however either process dies; before that, `close()` and peer
death unlink both names at either end.

Peer death: each end polls, beside its socket, an fd that turns readable when the peer process
is gone (parent: `Process.sentinel`; child: `multiprocessing.parent_process().sentinel`), so a
waiting `recv` raises PeerDeadError as soon as the kernel reports the exit (no heartbeats). A
clean `close()` sends BYE, reported the same way after everything sent before it.

A Channel belongs to one thread (ZMQ sockets are not thread-safe). `send` blocks only while
the peer's ZMQ queue is full, and keeps reading (acks, messages) meanwhile.

A channel dropped without `close()` (say, held by a failed test's traceback) closes its socket
without lingering and ends its ZMQ context when collected. Left to pyzmq, a context collected
in the same reference cycle as its socket can be finalised first: it no longer sees the
socket (its weak reference is cleared), and ctx.term() waits for ever for that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Sequence

import msgspec
import zmq

from omnistage.errors import InvalidRequestError, OmniStageError
from omnistage.runtime.codec import Codec
from omnistage.runtime.shm import (ShmArena, ShmReader, default_shm_dir, new_segment_name,
                                   try_create_arena, unlink_segment)

_HELLO, _MSG, _ACK, _BYE = 0, 1, 2, 3
_DRAIN_BATCH = 64  # messages decoded per drain while send waits (bounds the time spent there)


class PeerDeadError(OmniStageError):
    """The process at the other end exited or closed its end; this channel is finished."""


@dataclass
class ChannelConfig:
    transport: str = "ipc"               # ipc (abstract socket on Linux, else tcp) | tcp
    host: str = "127.0.0.1"              # tcp: the address the parent binds (the child connects to it)
    shm_capacity: int = 64 << 20         # bytes of each end's arena; 0 sends every tensor inline
    shm_threshold: int = 64 << 10        # tensors of at least this many bytes go through the arena
    send_timeout_s: float = 30.0         # longest wait of send while the peer's queue is full
    handshake_timeout_s: float = 60.0    # spawn to the child's HELLO (its imports included)
    linger_ms: int = 1000                # close(): time to flush unsent messages to a live peer

    def __post_init__(self) -> None:
        checks = {  # option: (is valid, what it must be)
            "transport": (self.transport in ("ipc", "tcp"), "ipc or tcp"),
            "host": (isinstance(self.host, str) and bool(self.host) and ":" not in self.host,
                     "an IPv4 address or a host name"),
            "shm_capacity": (isinstance(self.shm_capacity, int) and self.shm_capacity >= 0,
                             "a byte count >= 0"),
            "shm_threshold": (isinstance(self.shm_threshold, int) and self.shm_threshold >= 1,
                              "a byte count >= 1"),
            "send_timeout_s": (self.send_timeout_s > 0, "> 0 seconds"),
            "handshake_timeout_s": (self.handshake_timeout_s > 0, "> 0 seconds"),
            "linger_ms": (isinstance(self.linger_ms, int) and self.linger_ms >= 0, "ms >= 0"),
        }
        for name, (ok, what) in checks.items():
            if not ok:
                raise InvalidRequestError(f"channel option {name} must be {what}, got "
                                          f"{getattr(self, name)!r}", param=name)


class ChannelSpec(msgspec.Struct, frozen=True):
    """What the child needs to connect; travels to it as msgpack bytes (never pickled)."""

    address: str
    server_key: bytes  # the parent's CURVE public key (z85): the secret proven in the handshake
    shm_dir: str
    parent_segment: str  # the parent's arena ("" when it has none)
    child_segment: str  # the name the child creates its arena under ("" for none)
    config: ChannelConfig


class _Header(msgspec.Struct, array_like=True):
    kind: int
    acks: list[int] = []  # tokens of the receiver's arena that the sender is done with
    segment: str = ""  # HELLO: the sender's arena ("" when it has none)


class Channel:
    """One end of a duplex channel. Build with `listen` (parent) or `connect` (child)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, codec: Codec, config: ChannelConfig,
                 arena: ShmArena | None, reader: ShmReader, spec: ChannelSpec, ready: bool):
        self.config = config
        self._ctx, self._sock, self._codec = ctx, sock, codec
        self.arena = arena  # what this end sends through (stats: num_writes, num_full, ...)
        self._reader, self._spec = reader, spec
        self._names = [n for n in (spec.parent_segment, spec.child_segment) if n]  # to unlink
        self._ready = ready  # parent: HELLO received
        self._inbox: deque[Any] = deque()  # decoded messages not yet returned by recv
        self._unacked: list[int] = []  # tokens of the peer's arena we read and did not ack yet
        self._peer_gone: str | None = None  # why the peer is gone
        self._sentinel: int | None = None
        self._closed = False
        self._recv_poller, self._send_poller = zmq.Poller(), zmq.Poller()
        self._recv_poller.register(sock, zmq.POLLIN)
        self._send_poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
        self._header_enc = msgspec.msgpack.Encoder()
        self._header_dec = msgspec.msgpack.Decoder(_Header)
        self._dropped = weakref.finalize(self, _end_dropped, ctx, sock)   # see the module doc

    @classmethod
    def listen(cls, types: Sequence[type],
               config: ChannelConfig | None = None) -> tuple[Channel, bytes]:
        """The parent end: bind and create its arena. Returns the channel and the child's spec."""
        config = config or ChannelConfig()
        ctx, arena = zmq.Context(io_threads=1), None
        sock = _pair_socket(ctx, config)
        server_key, secret_key = _curve_keypair()
        try:
            sock.curve_secretkey, sock.curve_publickey = secret_key, server_key
            sock.curve_server = True                # set before bind: the listener inherits it
            if config.transport == "ipc" and sys.platform == "linux":
                address = f"ipc://@{new_segment_name('sock')}"
                sock.bind(address)
            else:
                address = f"tcp://{config.host}:{sock.bind_to_random_port(f'tcp://{config.host}')}"
            shm_dir = default_shm_dir()
            arena = try_create_arena(new_segment_name("p"), config.shm_capacity, shm_dir)
            spec = ChannelSpec(address, server_key, shm_dir, arena.name if arena else "",
                               new_segment_name("c") if config.shm_capacity else "", config)
            channel = cls(ctx, sock, Codec(types, shm_threshold=config.shm_threshold), config,
                          arena, ShmReader(), spec, ready=False)
        except BaseException:
            _abandon(ctx, sock, arena)
            raise
        return channel, msgspec.msgpack.encode(spec)

    @classmethod
    def connect(cls, spec: bytes, types: Sequence[type], peer_sentinel: int | None = None) -> Channel:
        """The child end. `peer_sentinel` defaults to the multiprocessing parent's sentinel."""
        decoded = msgspec.msgpack.decode(spec, type=ChannelSpec)
        config, reader = decoded.config, ShmReader()
        if peer_sentinel is None and multiprocessing.parent_process() is not None:
            peer_sentinel = multiprocessing.parent_process().sentinel
        ctx, arena, channel = zmq.Context(io_threads=1), None, None
        sock = _pair_socket(ctx, config)
        try:
            if decoded.parent_segment:
                reader.attach(decoded.parent_segment, decoded.shm_dir)
            if decoded.child_segment:
                arena = try_create_arena(decoded.child_segment, config.shm_capacity, decoded.shm_dir)
            sock.curve_publickey, sock.curve_secretkey = _curve_keypair()
            sock.curve_serverkey = decoded.server_key
            sock.connect(decoded.address)
            channel = cls(ctx, sock, Codec(types, shm_threshold=config.shm_threshold), config,
                          arena, reader, decoded, ready=True)
            if peer_sentinel is not None:
                channel.watch(peer_sentinel)
            channel._send(_Header(_HELLO, segment=arena.name if arena else ""))
        except BaseException:
            if channel is not None:
                channel.close()
            else:
                reader.close()
                _abandon(ctx, sock, arena)
            raise
        return channel

    def watch(self, sentinel: int) -> None:
        """Poll `sentinel` (an fd readable once the peer process is gone) beside the socket."""
        self._sentinel = sentinel
        self._recv_poller.register(sentinel, zmq.POLLIN)
        self._send_poller.register(sentinel, zmq.POLLIN)

    def readable(self) -> bool:
        """Whether recv(0) may return something now: a queued message, data on the socket, or
        a peer known to be gone (its death is reported by recv)."""
        return bool(self._inbox) or self._peer_gone is not None or bool(self._sock.poll(0))

    def poll_ready(self) -> bool:
        """Parent: whether the child's HELLO has arrived, without blocking (PeerDeadError if
        it died first)."""
        self._pump(_DRAIN_BATCH)
        if not self._ready:
            self._wait(self._recv_poller, 0.0)   # reads what came, notices a dead peer
        if not self._ready and self._peer_gone:
            raise PeerDeadError(f"{self._peer_gone} before it finished connecting")
        return self._ready

    def wait_ready(self, timeout: float) -> None:
        """Parent: wait for the child's HELLO. TimeoutError, or PeerDeadError if it died."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump(_DRAIN_BATCH)
            if self._ready:
                return
            if self._peer_gone:
                raise PeerDeadError(f"{self._peer_gone} before it finished connecting")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the child did not connect within {timeout:.1f} s; raise "
                                   "ChannelConfig.handshake_timeout_s if its start-up is slow")
            self._wait(self._recv_poller, max(0.0, deadline - time.monotonic()))

    def send(self, msg: Any) -> None:
        """Encode and queue `msg`. Tensors are copied (to shm or ZMQ) before this returns."""
        self._check_open(for_send=True)
        if self.arena is not None and self.arena.outstanding:
            self._pump(_DRAIN_BATCH)  # collect acks so the arena has room
        encoded = self._codec.encode(msg, self.arena)
        acks, self._unacked = self._unacked, []  # piggyback
        try:
            self._send(_Header(_MSG, acks=acks), encoded.frames)
        except BaseException:  # not sent: free its regions, keep the acks for the next message
            self._unacked = acks + self._unacked
            if self.arena is not None and encoded.shm_tokens:
                self.arena.release(encoded.shm_tokens)
            raise
        self._flush_acks()  # acks for messages read while waiting to send

    def wait_acks(self, timeout: float) -> bool:
        """Block until the peer has acked every region this end wrote to its arena (at once
        without an arena), reading the socket meanwhile: messages that arrive are queued for
        `recv` and acked. True once none is outstanding, False after `timeout` s; PeerDeadError
        if the peer is gone first (its acks will never come). Acks travel on their own
        messages, so `recv(timeout=0)` right after the peer read is not enough to see them."""
        self._check_open()
        deadline = time.monotonic() + timeout
        while True:
            self._pump(_DRAIN_BATCH)
            self._flush_acks()  # a peer waiting for our acks the same way must progress too
            if self.arena is None or not self.arena.outstanding:
                return True
            if self._peer_gone:
                raise PeerDeadError(self._peer_gone)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._wait(self._recv_poller, remaining)

    def recv(self, timeout: float | None = None) -> Any | None:
        """The next message, or None after `timeout` s (None: no limit). PeerDeadError once the
        peer is gone and everything it sent before was returned."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._inbox:
                self._pump(1)
            if self._inbox:
                self._flush_acks()  # first: if it fails, the message stays queued
                return self._inbox.popleft()
            if self._peer_gone:
                raise PeerDeadError(self._peer_gone)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._wait(self._recv_poller, remaining) and remaining == 0.0:
                return None

    async def arecv(self, timeout: float | None = None) -> Any | None:
        """`recv` for asyncio: waits on the socket's and the sentinel's fds in the event loop."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            msg = self.recv(timeout=0)
            if msg is not None:
                return msg
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            # ZMQ's fd is edge-triggered: check its pending events before sleeping on it.
            if self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                continue
            woken = loop.create_future()
            fds = [self._sock.get(zmq.FD)] + ([self._sentinel] if self._sentinel is not None else [])
            for fd in fds:
                loop.add_reader(fd, lambda: woken.done() or woken.set_result(None))
            try:
                await asyncio.wait([woken], timeout=remaining)
            finally:
                for fd in fds:
                    loop.remove_reader(fd)

    def close(self) -> None:
        """Send BYE to a live peer, close the socket, unmap and unlink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._dropped.detach()
        alive = self._peer_gone is None
        if alive:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(self._header_enc.encode(_Header(_BYE)), zmq.NOBLOCK)
        self._sock.close(linger=self.config.linger_ms if alive else 0)
        self._ctx.term()
        if self.arena is not None:
            self.arena.close()
        self._reader.close()
        self._unlink_names()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, header: _Header, frames: Sequence[Any] = ()) -> None:
        parts = [self._header_enc.encode(header), *frames]
        deadline = time.monotonic() + self.config.send_timeout_s
        while True:
            try:
                self._sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=True)
                return
            except zmq.Again:
                pass
            # The peer's queue is full (or it has not connected yet). Keep reading, so a peer
            # that is itself blocked sending to us can progress.
            if self._peer_gone:
                raise PeerDeadError(self._peer_gone)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the peer took no message for {self.config.send_timeout_s} s")
            self._wait(self._send_poller, max(0.0, deadline - time.monotonic()))

    def _wait(self, poller: zmq.Poller, timeout: float | None) -> bool:
        """Poll the socket and the sentinel; read what arrived. True if anything happened."""
        events = dict(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))
        if self._sentinel is not None and self._sentinel in events:
            self._pump(_DRAIN_BATCH)  # what the peer sent before dying is still delivered
            if self._peer_gone is None:
                self._peer_gone = "the peer process exited"
                self._unlink_names()
        elif events.get(self._sock, 0) & zmq.POLLIN:
            self._pump(_DRAIN_BATCH)
        return bool(events)

    def _pump(self, max_messages: int) -> None:
        """Read without blocking: apply control messages, decode up to `max_messages` messages."""
        decoded = 0
        while decoded < max_messages:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            header = self._header_dec.decode(parts[0].buffer)
            if header.acks:  # the peer is done with these regions of our arena
                if self.arena is None:
                    raise ValueError("the peer acked shared memory this end never wrote")
                self.arena.release(header.acks)
            if header.kind == _MSG:
                self._inbox.append(self._codec.decode(parts[1:], self._reader, zero_copy=True))
                self._unacked += self._reader.take_acks()
                decoded += 1
            elif header.kind == _HELLO:
                self._on_hello(header.segment)
            elif header.kind == _BYE:
                self._peer_gone = "the peer closed the channel"
                self._unlink_names()
                return

    def _on_hello(self, segment: str) -> None:
        if segment and segment != self._spec.child_segment:
            raise ValueError(f"child announced shared-memory segment {segment!r}, expected "
                             f"{self._spec.child_segment!r}")
        if segment:
            self._reader.attach(segment, self._spec.shm_dir)
        self._unlink_names()  # both ends now hold both mappings; names are no longer needed
        self._ready = True

    def _flush_acks(self) -> None:
        while self._unacked and self._peer_gone is None:
            acks, self._unacked = self._unacked, []
            self._send(_Header(_ACK, acks=acks))

    def _unlink_names(self) -> None:
        for name in self._names:
            unlink_segment(name, self._spec.shm_dir)
        self._names = []

    def _check_open(self, for_send: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this channel is closed")
        if for_send and self._peer_gone:
            raise PeerDeadError(self._peer_gone)


@dataclass
class ChildProcess:
    """A child process and the parent's end of its channel."""

    channel: Channel
    process: BaseProcess

    def shutdown(self, timeout: float = 5.0) -> int | None:
        """Close the channel (the child's recv sees BYE), wait for the exit, kill if it hangs."""
        self.channel.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode


def spawn_child(target: Callable[[bytes], None], types: Sequence[type],
                config: ChannelConfig | None = None, *, name: str | None = None,
                start_method: str = "spawn", wait: bool = True) -> ChildProcess:
    """Start `target(spec)` (a module-level function that calls `Channel.connect(spec, types)`)
    in a new process and (unless `wait` is False: then the first recv does) wait for its
    HELLO. Only the spec bytes cross the process start."""
    channel, spec = Channel.listen(types, config)
    process = multiprocessing.get_context(start_method).Process(
        target=target, args=(spec,), name=name, daemon=True)
    try:
        process.start()
        channel.watch(process.sentinel)
        if wait:
            channel.wait_ready(channel.config.handshake_timeout_s)
    except BaseException:
        channel.close()
        if process.pid is not None:
            process.kill()
            process.join()
        raise
    return ChildProcess(channel, process)


def _pair_socket(ctx: zmq.Context, config: ChannelConfig) -> zmq.Socket:
    """A PAIR socket whose LINGER is set before it binds or connects. libzmq copies the options
    into a listener at bind time, and a connection it accepted that ends first (the peer closed)
    is terminated with the listener's copy: left at the default (-1, for ever), ctx.term() can
    hang on a message queued to that peer however low `close(linger=...)` sets it."""
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, config.linger_ms)
    return sock


def _curve_keypair() -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys; libzmq makes them from the OS's random source."""
    if not zmq.has("curve"):
        raise OmniStageError("this libzmq has no CURVE support (it needs libsodium or its "
                             "tweetnacl build); stage channels are authenticated with it: "
                             "install pyzmq's wheel, which has it")
    return zmq.curve_keypair()


def _end_dropped(ctx: zmq.Context, sock: zmq.Socket) -> None:
    """A collected channel's end (it holds neither: they are closed here, not by pyzmq)."""
    sock.close(linger=0)
    ctx.term()


def _abandon(ctx: zmq.Context, sock: zmq.Socket, arena: ShmArena | None) -> None:
    """Undo a half-built end."""
    sock.close(linger=0)
    ctx.term()
    if arena is not None:
        arena.close()



def wait_any(channels: Sequence[Channel], timeout: float | None) -> None:
    """Block until one of `channels` has a message or a dead peer to report (or `timeout` s).
    One poller over every socket and peer sentinel: no polling loop."""
    if any(ch._inbox or ch._peer_gone for ch in channels):
        return
    poller = zmq.Poller()
    for ch in channels:
        poller.register(ch._sock, zmq.POLLIN)
        if ch._sentinel is not None:
            poller.register(ch._sentinel, zmq.POLLIN)
    poller.poll(None if timeout is None else int(timeout * 1000))
