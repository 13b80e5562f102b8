"""Duplex channels: in one process (fast protocol checks) and with real 'spawn' children
(echo, throughput, peer death, shared-memory cleanup after crashes)."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.runtime.channel import (Channel, ChannelConfig, ChannelSpec, PeerDeadError,
                                       spawn_child)
from omnistage.runtime.shm import ShmArena, default_shm_dir


class Payload(msgspec.Struct):
    seq: int
    tensors: list[torch.Tensor]
    arrays: dict[str, np.ndarray] = {}
    note: str = ""


TYPES = [Payload]
MiB = 1 << 20


def our_segments() -> list[str]:
    """Segments created by this test process or its children (names carry the parent pid)."""
    return glob.glob(os.path.join(default_shm_dir(), f"omnistage-{os.getpid()}-*"))


# -- child targets (module-level, so 'spawn' can import them) --------------------------------

def echo_child(spec: bytes) -> None:
    torch.set_num_threads(1)  # see tests/conftest.py: OpenMP spin waits on a busy machine
    channel = Channel.connect(spec, TYPES)
    try:
        while True:
            channel.send(channel.recv())
    except PeerDeadError:  # the parent closed (BYE) or died
        pass
    finally:
        channel.close()


def crash_before_hello_child(spec: bytes) -> None:
    """Dies like a child killed between creating its arena and connecting."""
    decoded = msgspec.msgpack.decode(spec, type=ChannelSpec)
    ShmArena(decoded.child_segment, decoded.config.shm_capacity, decoded.shm_dir)
    os.kill(os.getpid(), signal.SIGKILL)


# -- one process -------------------------------------------------------------------------------

@pytest.fixture(params=["ipc", "tcp"])
def pair(request):
    config = ChannelConfig(transport=request.param, shm_capacity=2 * MiB, linger_ms=0)
    parent, spec = Channel.listen(TYPES, config)
    child = Channel.connect(spec, TYPES)  # the main process has no multiprocessing parent
    parent.wait_ready(5.0)
    assert our_segments() == []  # both names were unlinked at the handshake
    yield parent, child
    child.close()
    parent.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_stranger_who_connects_first_gets_nothing(transport):
    """Processes that find the address and connect before the child (plain ZMQ, or CURVE
    with a key of their own) complete no handshake: they read nothing the parent sent, the
    parent reads nothing from them, and the child still connects and gets everything."""
    import zmq

    parent, spec = Channel.listen(TYPES, ChannelConfig(transport=transport, shm_capacity=0, linger_ms=0,
                                                       send_timeout_s=0.5))
    address = msgspec.msgpack.decode(spec, type=ChannelSpec).address
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PAIR)
    forged = ctx.socket(zmq.PAIR)
    forged.curve_publickey, forged.curve_secretkey = zmq.curve_keypair()
    forged.curve_serverkey = zmq.curve_keypair()[0]          # a guess at the parent's key
    try:
        for sock in (plain, forged):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(b"\x93\x01\x90\xa0", zmq.NOBLOCK)    # a HELLO-like header, queued
        # Neither took the PAIR socket: a send finds no peer to go to (before CURVE, the first
        # stranger got it).
        with pytest.raises(TimeoutError):
            parent.send(Payload(0, [], note="to nobody"))
        for sock in (plain, forged):
            assert sock.poll(100) == 0                         # nothing reached them
        assert not parent.poll_ready() and parent.recv(timeout=0.2) is None
        child = Channel.connect(spec, TYPES)
        try:
            parent.wait_ready(5.0)
            parent.send(Payload(1, [torch.arange(4)], note="for the child only"))
            got = child.recv(timeout=5.0)
            assert got.note == "for the child only" and torch.equal(got.tensors[0], torch.arange(4))
            child.send(Payload(2, []))
            assert parent.recv(timeout=5.0).seq == 2
            for sock in (plain, forged):
                assert sock.poll(100) == 0
        finally:
            child.close()
    finally:
        plain.close()
        forged.close()
        ctx.term()
        parent.close()


def test_tcp_on_a_routable_address():
    """`host`: the parent binds an address other machines reach (a Ray stage on another node);
    the child connects there, authenticated like on loopback."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))        # no packet is sent: picks the interface
            host = probe.getsockname()[0]
        except OSError:
            pytest.skip("no IPv4 interface besides loopback")
    if host.startswith("127."):
        pytest.skip("no IPv4 interface besides loopback")
    parent, spec = Channel.listen(TYPES, ChannelConfig(transport="tcp", host=host, shm_capacity=0,
                                                       linger_ms=0))
    assert msgspec.msgpack.decode(spec, type=ChannelSpec).address.startswith(f"tcp://{host}:")
    child = Channel.connect(spec, TYPES)
    try:
        parent.wait_ready(5.0)
        parent.send(Payload(7, [torch.ones(3)]))
        assert child.recv(timeout=5.0).seq == 7
    finally:
        child.close()
        parent.close()
    with pytest.raises(InvalidRequestError, match="host"):
        ChannelConfig(transport="tcp", host="tcp://x:1")


def test_acks_free_the_arena_and_a_full_arena_goes_inline(pair):
    parent, child = pair
    big = [torch.randn(200_000) for _ in range(3)]  # 800 KB each: two fit in 2 MiB
    for i, t in enumerate(big):
        parent.send(Payload(i, [t]))
    assert parent.arena.num_writes == 2 and parent.arena.num_full == 1  # the third went inline
    for i, t in enumerate(big):
        got = child.recv(timeout=5)
        assert got.seq == i and torch.equal(got.tensors[0], t)
    # The child acked each region before its recv returned, but the acks are messages of
    # their own, still in flight: wait for them (bounded) instead of peeking once.
    assert parent.wait_acks(timeout=10), f"{parent.arena.outstanding} regions never acked"
    assert parent.arena.outstanding == 0 and parent.arena.used_bytes == 0
    assert parent.recv(timeout=0) is None  # bare acks are not messages
    child.send(Payload(9, [big[0]], {"a": np.arange(3)}))  # and the other direction
    back = parent.recv(timeout=5)
    assert torch.equal(back.tensors[0], big[0]) and back.arrays["a"].tolist() == [0, 1, 2]
    assert child.arena.num_writes == 1


def test_wait_acks_times_out_or_reports_the_peer_while_regions_are_unread(pair):
    parent, child = pair
    parent.send(Payload(0, [torch.randn(200_000)]))  # through the arena; the child never reads
    t0 = time.monotonic()
    assert parent.wait_acks(timeout=0.1) is False and parent.arena.outstanding == 1
    assert time.monotonic() - t0 >= 0.09
    child.close()
    with pytest.raises(PeerDeadError, match="closed"):
        parent.wait_acks(timeout=10)


def test_close_is_reported_after_queued_messages(pair):
    parent, child = pair
    child.send(Payload(1, []))
    child.send(Payload(2, []))
    child.close()
    assert [parent.recv(timeout=5).seq, parent.recv(timeout=5).seq] == [1, 2]
    with pytest.raises(PeerDeadError, match="closed"):
        parent.recv(timeout=5)
    with pytest.raises(PeerDeadError):
        parent.send(Payload(3, []))
    with pytest.raises(RuntimeError, match="closed"):
        child.recv(timeout=0)


def test_recv_timeout_and_arecv(pair):
    parent, child = pair
    t0 = time.monotonic()
    assert parent.recv(timeout=0.1) is None
    assert 0.09 <= time.monotonic() - t0 < 1.0

    async def main() -> None:
        assert await parent.arecv(timeout=0.05) is None
        waiter = asyncio.create_task(parent.arecv(timeout=5))
        await asyncio.sleep(0.05)  # the waiter is parked on the socket's fd
        child.send(Payload(5, [torch.randn(300_000)]))  # through shared memory
        got = await waiter
        assert got.seq == 5 and got.tensors[0].shape == (300_000,)

    asyncio.run(main())


def test_a_dropped_channel_in_a_reference_cycle_is_collected_without_hanging():
    """A channel nobody closed, in a cycle (as a failed test's traceback holds one), is freed
    by the collector; pyzmq alone would finalise its context first and hang in ctx.term()."""
    import gc

    for transport in ("ipc", "tcp"):
        parent, spec = Channel.listen(TYPES, ChannelConfig(transport=transport, shm_capacity=0))
        child = Channel.connect(spec, TYPES)
        parent.wait_ready(5.0)
        child.send(Payload(1, []))          # unread: a message queued on the way
        cycle = {"parent": parent, "child": child}
        cycle["self"] = cycle
        del parent, child, cycle
        done = threading.Event()
        collector = threading.Thread(target=lambda: (gc.collect(), done.set()), daemon=True)
        collector.start()
        assert done.wait(20), f"gc.collect() hung on a dropped {transport} channel"


def test_config_is_validated():
    with pytest.raises(InvalidRequestError) as e:
        ChannelConfig(shm_capacity=-1)
    assert e.value.param == "shm_capacity"
    with pytest.raises(InvalidRequestError, match="ipc or tcp"):
        ChannelConfig(transport="udp")


# -- real child processes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo():
    child = spawn_child(echo_child, TYPES, ChannelConfig(shm_capacity=48 * MiB))
    yield child
    child.shutdown()


def test_echo_1000_mixed_messages(echo):
    channel = echo.channel
    big = torch.randn(2 * MiB // 4)  # 2 MiB of fp32
    writes_before = channel.arena.num_writes

    def message(i: int) -> Payload:
        tensors = [torch.arange(i, i + 16), torch.full((4, 8), float(i)).to(torch.bfloat16)]
        if i % 10 == 0:
            tensors.append(big + i)
        return Payload(i, tensors, {"meta": np.array([i, -i], dtype=np.int32)}, note=f"m{i}")

    window, sent, received = 8, 0, 0  # keep 8 in flight, so queues and acks interleave
    while received < 1000:
        while sent < 1000 and sent - received < window:
            channel.send(message(sent))
            sent += 1
        got = channel.recv(timeout=10)
        want = message(received)
        assert got.seq == received and got.note == want.note
        assert len(got.tensors) == len(want.tensors)
        for a, b in zip(got.tensors, want.tensors):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert np.array_equal(got.arrays["meta"], want.arrays["meta"])
        received += 1
    assert channel.arena.num_writes - writes_before >= 90  # the 2 MiB tensors went through shm


def test_throughput_report(echo, capsys):
    channel = echo.channel
    lines = []
    for size, n in ((1 * MiB, 100), (16 * MiB, 12)):
        x = torch.randn(size // 4)
        channel.send(Payload(-1, [x]))  # warm-up
        channel.recv(timeout=10)
        t0 = time.perf_counter()
        for i in range(n):
            channel.send(Payload(i, [x]))
            got = channel.recv(timeout=10)
        dt = time.perf_counter() - t0
        assert torch.equal(got.tensors[0], x)
        lines.append(f"{size // MiB:>2} MiB parent->child->parent: {n / dt:7.1f} round trips/s, "
                     f"{n * size / dt / 1e6:7.0f} MB/s of payload each way")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_close_leaves_nothing_behind(echo):
    assert echo.shutdown() == 0  # BYE ends the child's loop; it closes cleanly
    assert our_segments() == []


def test_killed_child_raises_peer_dead_quickly():
    child = spawn_child(echo_child, TYPES, ChannelConfig(shm_capacity=8 * MiB))
    try:
        x = torch.randn(MiB)  # 4 MiB: both arenas are in use
        child.channel.send(Payload(0, [x]))
        assert torch.equal(child.channel.recv(timeout=10).tensors[0], x)
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(child.process.pid, signal.SIGKILL)

        threading.Timer(0.3, kill).start()
        with pytest.raises(PeerDeadError, match="exited"):
            child.channel.recv(timeout=10)  # waiting when the child dies
        assert time.monotonic() - killed_at[0] < 2.0
        with pytest.raises(PeerDeadError):
            child.channel.send(Payload(1, [x]))
    finally:
        assert child.shutdown() == -signal.SIGKILL
    assert our_segments() == []


def test_crash_before_handshake_unlinks_both_segments():
    with pytest.raises(PeerDeadError, match="before it finished connecting"):
        spawn_child(crash_before_hello_child, TYPES, ChannelConfig(shm_capacity=1 * MiB))
    assert our_segments() == []  # the parent removed its own and the dead child's segment
