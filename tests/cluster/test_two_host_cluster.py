"""Two hosts for real on one machine: two network namespaces joined by a veth pair with
private addresses, a Ray head in the first, a Ray worker node (custom resource `node_b`) in the
second, and the front in the first serving the tiny Qwen2.5-Omni with its talker and token2wav
pinned to the second host (tests/cluster/two_host_front.py): the same tokens and audio as
all-local, a killed remote actor failing its request at once and restarting; then token2wav
as two replicas spread over both hosts serving two requests at once. The hosts talk over the
veth pair only. Needs root and iproute2 (CI runs as root); clean-up always runs: the Ray processes this
test started are stopped and the namespaces deleted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray")
if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("two network namespaces need root and iproute2", allow_module_level=True)

FRONT = Path(__file__).with_name("two_host_front.py")
RAY = str(Path(sys.executable).with_name("ray"))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """Namespaces `a` and `b` with addresses on a /24 of their own, joined by a veth pair."""

    def __init__(self, tag: str, subnet: int):
        self.a, self.b = f"omA{tag}", f"omB{tag}"
        self.addr_a, self.addr_b = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self._made: list[str] = []
        for ns in (self.a, self.b):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((self.a, f"va{tag}", self.addr_a), (self.b, f"vb{tag}", self.addr_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, ns: str, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], start_new_session=True, **kw)

    def delete(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _stop(proc: subprocess.Popen) -> None:
    """A `ray start --block` and everything it started (its session): SIGTERM, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_started(proc: subprocess.Popen, timeout: float) -> None:
    """Until `ray start` reports its node up (its output, read by a thread that then keeps
    draining it), or TimeoutError."""
    seen, lines, up = threading.Event(), [], []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                up.append(True)
                seen.set()
        seen.set()                          # it exited: no need to wait for the timeout

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout) or not up:
        raise TimeoutError(f"ray start did not come up in {timeout} s: {''.join(lines)[-2000:]}")


def test_talker_and_token2wav_on_the_other_host(tiny_omni, tmp_path):
    tag = str(os.getpid() % 100000)
    hosts = Hosts(tag, os.getpid() % 250 + 1)
    # RAY_worker_niceness: the actors at the priority of the other processes (docs/cluster.md)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_worker_niceness": "0"}
    head = f"{hosts.addr_a}:6379"
    common = ["--block", "--num-cpus", "1", "--object-store-memory", str(200 << 20),
              "--disable-usage-stats"]
    procs = []
    # Ray's socket paths must stay under 107 bytes: a short folder of its own, not tmp_path.
    ray_dir = Path(tempfile.mkdtemp(prefix="omray", dir="/tmp"))
    try:
        output = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(hosts.run(hosts.a, RAY, "start", "--head", "--node-ip-address", hosts.addr_a,
                               "--port", "6379", "--include-dashboard", "false",
                               "--temp-dir", str(ray_dir / "a"), *common, env=env, **output))
        _wait_started(procs[-1], 120)
        # The worker node joins over the veth pair; the front's actors that ask for node_b wait
        # (Ray schedules them) until it has.
        procs.append(hosts.run(hosts.b, RAY, "start", "--address", head, "--node-ip-address",
                               hosts.addr_b, "--resources", '{"node_b": 100}',
                               "--temp-dir", str(ray_dir / "b"), *common, env=env, **output))
        _wait_started(procs[-1], 120)
        out = tmp_path / "front.json"
        front = hosts.run(hosts.a, sys.executable, str(FRONT), tiny_omni, head, hosts.addr_a,
                          str(out), f"va{tag}", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
        try:
            log, _ = front.communicate(timeout=900)
        finally:
            _stop(front)
        assert front.returncode == 0, log[-4000:]
        report = json.loads(out.read_text())
        print(report)                       # the link's bytes per request: docs/cluster.md
        assert report["node_b_free"] == 98            # both actors hold node_b: on the other host
        assert report["tokens_equal"] and report["audio_shape_equal"]
        assert report["audio_max_diff"] <= 1e-5
        assert report["failure"] and "talker" in report["failure"]
        assert report["kill_to_failure_s"] < 5.0
        assert report["restarts"] == 1 and report["again_equal"]
        # token2wav's two replicas, one on each host, both serving at once, both exact
        assert report["replica_nodes"] == sorted([hosts.addr_a, hosts.addr_b])
        assert report["replicas_both_busy"] and report["replicas_equal"]
    finally:
        for proc in reversed(procs):
            _stop(proc)
        hosts.delete()
        shutil.rmtree(ray_dir, ignore_errors=True)
