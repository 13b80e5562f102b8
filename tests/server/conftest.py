"""Real `omnistage serve` processes on free loopback ports, for the server tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest

from benchmarks.serve_process import free_port, stop, wait_healthy

API_KEY = "test-key"


def scrape_metrics(base: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {sample: value}, a sample's name with its labels as the text
    writes them (`omnistage_kv_blocks_free{stage="thinker"}`); `api_key` None: no header."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base}/metrics", headers=headers, timeout=10)
    r.raise_for_status()
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            samples[sample] = float(value)
    return samples


def metric(base: str, name: str, api_key: str | None = None) -> float:
    """One sample of the server's /metrics; AssertionError naming it when it is missing."""
    samples = scrape_metrics(base, api_key)
    assert name in samples, f"{name} is missing from /metrics"
    return samples[name]


@dataclass
class ServerProcess:
    base: str
    proc: subprocess.Popen
    model: str = ""          # the model folder, where a fixture records it


@contextlib.contextmanager
def running_server(model_dir: str, *extra_args: str, key_args: tuple[str, ...] = ("--api-key", API_KEY),
                   env: dict[str, str] | None = None, log_level: str = "warning"):
    """Start the server, wait (bounded) until /health is 200, yield a ServerProcess, stop it.
    `key_args` give the key (default `--api-key API_KEY`), `env` adds environment variables;
    with `log_level` info the process's output (proc.stdout, read once it stopped) has the
    access log."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.cli", "serve", model_dir, "--port", str(port),
         "--served-model-name", "tiny", *key_args, "--block-size", "4",
         "--num-threads", "1", "--log-level", log_level, *extra_args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 60, proc.stdout.read)
        yield ServerProcess(base, proc)
    finally:
        stop(proc, 15)


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def server(tiny_qwen2):
    with running_server(tiny_qwen2) as running:
        yield running.base


@pytest.fixture(scope="module")
def omni_server(tiny_omni):
    """A tiny Qwen2.5-Omni server (matmul linears) for the module that asks for it."""
    with running_server(tiny_omni, "--linear-kernel", "matmul") as running:
        yield running.base


OMNI_STAGES = ("encoder", "thinker", "talker", "token2wav")


@contextlib.contextmanager
def omni_server_placed(tiny_omni: str, placement: str, folder):
    """A tiny Qwen2.5-Omni server (matmul linears) with every stage `local` (this process) or
    each in its own `process` (a deploy config written under `folder`)."""
    flags = ["--linear-kernel", "matmul"]
    if placement == "process":
        deploy = folder / "deploy.yaml"
        deploy.write_text("stages:\n" + "".join(f"  {s}: {{where: process, num_threads: 1}}\n"
                                                 for s in OMNI_STAGES))
        flags += ["--deploy-config", str(deploy)]
    with running_server(tiny_omni, *flags) as running:
        yield running.base


@pytest.fixture(scope="session")
def tools_server():
    """A server of tiny:qwen2 size `tools` (trained on weather-tool chats: its greedy answer to
    a weather question is a call; omnistage/tiny/trained.py). From the checkpoint cache: the
    training (~50 s) runs once for the test workers (build_lock), not once in each."""
    from omnistage.entrypoints.model_source import tiny_checkpoint

    model = str(tiny_checkpoint("qwen2", "tools"))
    with running_server(model) as running:
        running.model = model
        yield running


@pytest.fixture(scope="session")
def place_omni_server():
    """`with place_omni_server(tiny_omni, "local" | "process", folder) as base:`"""
    return omni_server_placed


@pytest.fixture(scope="session")
def long_answer_server(tiny_omni, tmp_path_factory):
    """A tiny Qwen2.5-Omni server whose every spoken answer lasts 8 s (the talker's 400 codes,
    min = max): a barge-in always meets an answer still streaming, however short the random
    model's text (frameworks' defaults sample it: its length varies run to run)."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("long-answer") / "omni"
    shutil.copytree(tiny_omni, folder)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(talker_min_new_tokens=400, talker_max_new_tokens=400)
    gen_path.write_text(json.dumps(gen))
    with running_server(str(folder), "--linear-kernel", "matmul") as running:
        yield running.base


@pytest.fixture(scope="session")
def start_server():
    """`with start_server(model_dir, *flags) as running:` (running.base, running.proc) for tests
    that need a server of their own."""
    return running_server

