"""The front of the two-host test (tests/cluster/test_two_host_cluster.py), run inside the first
host's network namespace: the tiny Qwen2.5-Omni all-local, then with its talker and token2wav
pinned to the other host (Ray custom resource `node_b`), the same request through both; then
the remote talker's actor killed mid-answer, and a request after it. Writes what it saw as
JSON (argv: model folder, Ray head address, this host's address, output path, this host's
veth device)."""

from __future__ import annotations

import io
import json
import sys
import time

import numpy as np


def _wav() -> bytes:
    import soundfile as sf

    t = np.arange(12000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def _equal(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.audio.shape == b.audio.shape
            and float(np.abs(a.audio - b.audio).max()) <= 1e-5)


def _replicas(omni, prompt, params, opts, want) -> dict:
    """Two requests at once through token2wav's two replicas (Ray spreads them over the nodes):
    where each runs, whether both served at once, and whether each answer equals all-local."""
    pipe, stage = omni.engine, omni.engine.graph.stages["token2wav"]
    prepared = pipe.prepare(prompt, opts)
    for rid in ("a", "b"):
        pipe.add_request(rid, prepared, params, opts)
    audio, tokens, both = {"a": [], "b": []}, {"a": [], "b": []}, False
    while pipe.has_unfinished_requests():
        for d in pipe.step():
            tokens[d.request_id] += d.token_ids
            if d.audio is not None:
                audio[d.request_id].append(d.audio)
        both |= [r.num_requests() for r in stage.replicas] == [1, 1]
    return {"replica_nodes": sorted(r._child.node_ip() for r in stage.replicas), "replicas_both_busy": both,
            "replicas_equal": all(tokens[r] == want.token_ids and np.concatenate(audio[r]).shape == want.audio.shape
                                  and float(np.abs(np.concatenate(audio[r]) - want.audio).max()) <= 1e-5
                                  for r in ("a", "b"))}


def _link_bytes(device: str) -> int:
    """Bytes sent plus received on this host's end of the veth pair (this namespace's sysfs)."""
    stats = f"/sys/class/net/{device}/statistics"
    return sum(int(open(f"{stats}/{k}").read()) for k in ("tx_bytes", "rx_bytes"))


def main(model: str, head: str, host: str, out_path: str, device: str) -> None:
    import ray

    from omnistage import Omni, SamplingParams
    from omnistage.deploy import DeployConfig, RayCluster, StagePlacement
    from omnistage.engine_api import OutputOptions
    from omnistage.errors import StageFailedError

    prompt = [{"role": "user", "content": [{"type": "audio", "audio": _wav()}, {"type": "text", "text": "Hm?"}]}]
    params = SamplingParams(temperature=0, max_tokens=8)
    opts = OutputOptions(talker_params=SamplingParams(temperature=0, max_tokens=50, min_tokens=30, seed=5))
    with Omni(model, linear_kernel="matmul", num_threads=1) as local:
        [want] = local.generate(prompt, params, output=opts)
    pinned = StagePlacement("ray", resources={"node_b": 1}, start_timeout_s=300)
    deploy = DeployConfig({"talker": pinned, "token2wav": pinned}, RayCluster(address=head, bind_host=host))
    report = {}
    with Omni(model, deploy_config=deploy, linear_kernel="matmul", num_threads=1) as omni:
        omni.generate(prompt, params, output=opts)                   # warm: connections made
        before = _link_bytes(device)
        [got] = omni.generate(prompt, params, output=opts)
        report["link_bytes_per_request"] = _link_bytes(device) - before
        report["audio_seconds"] = len(got.audio) / got.sample_rate
        report["node_b_free"] = ray.available_resources().get("node_b", 0.0)
        report["tokens_equal"] = got.token_ids == want.token_ids
        report["audio_shape_equal"] = got.audio.shape == want.audio.shape
        report["audio_max_diff"] = float(np.abs(got.audio - want.audio).max()) if report["audio_shape_equal"] else None
        talker = omni.engine.graph.stages["talker"]
        long = OutputOptions(talker_params=SamplingParams(temperature=0, max_tokens=2000, min_tokens=2000))
        t0, error = None, None
        try:
            for d in omni.stream(prompt, params, long):
                if d.audio is not None and t0 is None:      # mid-speech: kill the remote talker
                    ray.kill(talker._child._actor)
                    t0 = time.monotonic()
        except StageFailedError as e:
            error = str(e)
        report["kill_to_failure_s"] = None if t0 is None else time.monotonic() - t0
        report["failure"] = error
        [again] = omni.generate(prompt, params, output=opts)
        report["restarts"] = talker.restarts
        report["again_equal"] = _equal(again, want)
    spread = DeployConfig({"token2wav": StagePlacement("ray", replicas=2, spread="strict", start_timeout_s=300)},
                          RayCluster(address=head, bind_host=host))
    with Omni(model, deploy_config=spread, linear_kernel="matmul", num_threads=1) as omni:
        report.update(_replicas(omni, prompt, params, opts, want))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
