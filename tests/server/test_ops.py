"""Operating the server (real processes on loopback): probes and scrapers without the key
(/health always, /metrics with --metrics-auth open), the key from OMNISTAGE_API_KEY or
--api-key-file (and clear errors for bad key sources), CORS preflights with a key, one
access-log line per request, and a Qwen2.5-Omni start free of transformers' config
warnings."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from omnistage.errors import InvalidRequestError
from omnistage.server.serve import resolve_api_key
from tests.server.conftest import scrape_metrics

ORIGIN = "https://app.example"
ENV_KEY = "env-key-123"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 6, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def open_metrics(tiny_qwen2, start_server):
    """Key from the environment, /metrics open, one allowed CORS origin."""
    with start_server(tiny_qwen2, "--metrics-auth", "open", "--allowed-origins", ORIGIN,
                      key_args=(), env={"OMNISTAGE_API_KEY": ENV_KEY}) as running:
        yield running.base


# ---- probes, scrapers and key sources -----------------------------------------------------------

def test_health_needs_no_key_and_metrics_keep_it_by_default(server, api_key):
    assert httpx.get(f"{server}/health").status_code == 200
    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {api_key}"}).status_code == 200
    assert httpx.get(f"{server}/version").status_code == 401


def test_open_metrics_and_the_key_from_the_environment(open_metrics):
    assert httpx.get(f"{open_metrics}/health").status_code == 200
    r = httpx.get(f"{open_metrics}/metrics")
    assert r.status_code == 200 and "omnistage_server_requests_in_flight" in r.text
    assert httpx.get(f"{open_metrics}/v1/models").status_code == 401
    assert httpx.post(f"{open_metrics}/v1/chat/completions", json=CHAT).status_code == 401
    ok = httpx.post(f"{open_metrics}/v1/chat/completions", json=CHAT, timeout=60,
                    headers={"Authorization": f"Bearer {ENV_KEY}"})
    assert ok.status_code == 200


def test_metrics_give_the_serving_process_its_standard_gauges(tiny_qwen2, start_server):
    """process_resident_memory_bytes and the other gauges Prometheus' clients export, as the
    kernel reports them for the server's process; CPU seconds grow with work."""
    with start_server(tiny_qwen2, "--metrics-auth", "open", key_args=(),
                      env={"OMNISTAGE_API_KEY": ENV_KEY}) as running:
        before = scrape_metrics(running.base)
        status = dict(line.split(":", 1) for line in open(f"/proc/{running.proc.pid}/status"))
        rss = int(status["VmRSS"].split()[0]) * 1024
        assert abs(before["process_resident_memory_bytes"] - rss) < 0.2 * rss
        assert before["process_threads"] == int(status["Threads"])
        assert before["process_virtual_memory_bytes"] >= before["process_resident_memory_bytes"]
        assert 3 <= before["process_open_fds"] < 1000
        started = before["process_start_time_seconds"]
        assert time.time() - 600 < started < time.time()
        for _ in range(3):
            ok = httpx.post(f"{running.base}/v1/chat/completions", json=CHAT, timeout=60,
                            headers={"Authorization": f"Bearer {ENV_KEY}"})
            assert ok.status_code == 200
        after = scrape_metrics(running.base)
        assert after["process_cpu_seconds_total"] > before["process_cpu_seconds_total"]
        assert after["process_start_time_seconds"] == started


def test_key_from_a_file(tiny_qwen2, start_server, tmp_path):
    path = tmp_path / "key"
    path.write_text("file-key-9\n")
    with start_server(tiny_qwen2, key_args=("--api-key-file", str(path))) as running:
        assert httpx.get(f"{running.base}/v1/models").status_code == 401
        good = httpx.get(f"{running.base}/v1/models", headers={"Authorization": "Bearer file-key-9"})
        assert good.status_code == 200


def test_key_sources_are_checked(tmp_path):
    empty, key = tmp_path / "empty", tmp_path / "key"
    empty.write_text("  \n")
    key.write_text("k\n")
    assert resolve_api_key(None, None, None) is None
    assert resolve_api_key("a", None, None) == "a"
    assert resolve_api_key(None, str(key), None) == "k"
    assert resolve_api_key(None, None, "e") == "e"
    assert resolve_api_key("a", None, "e") == "a"          # a flag overrides the environment
    cases = [(("a", str(key), None), "not both"), ((None, str(empty), None), "empty"),
             ((None, str(tmp_path / "missing"), None), "cannot read"), ((None, None, ""), "empty"),
             (("", None, None), "empty"), (("two words", None, None), "one word")]
    for args, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            resolve_api_key(*args)


def test_bad_key_source_stops_the_cli_with_a_clear_error(tiny_qwen2, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("")
    for extra in (["--api-key", "a", "--api-key-file", str(empty)], ["--api-key-file", str(empty)],
                  ["--api-key-file", str(tmp_path / "missing")]):
        r = subprocess.run([sys.executable, "-m", "omnistage.cli", "serve", tiny_qwen2, *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "omnistage serve: error: " in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_serve_help_documents_the_flags():
    r = subprocess.run([sys.executable, "-m", "omnistage.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    flat = " ".join(r.stdout.split())
    for flag in ("--api-key-file", "--metrics-auth", "--no-access-log", "OMNISTAGE_API_KEY",
                 "--max-queued-requests"):
        assert flag in flat
    assert "beyond those being served" in flat


# ---- CORS with a key ----------------------------------------------------------------------------

def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_passes_without_the_key_for_allowed_origins_only(open_metrics):
    r = _preflight(open_metrics, ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "POST" in r.headers["access-control-allow-methods"]
    other = _preflight(open_metrics, "https://elsewhere.example")
    assert other.status_code >= 400 and "access-control-allow-origin" not in other.headers
    # the real request: a missing key is a 401 the page can read; with the key, served
    refused = httpx.post(f"{open_metrics}/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    served = httpx.post(f"{open_metrics}/v1/chat/completions", json=CHAT, timeout=60,
                        headers={"Origin": ORIGIN, "Authorization": f"Bearer {ENV_KEY}"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in served.headers["access-control-expose-headers"].lower()
    elsewhere = httpx.post(f"{open_metrics}/v1/chat/completions", json=CHAT, timeout=60,
                           headers={"Origin": "https://elsewhere.example",
                                    "Authorization": f"Bearer {ENV_KEY}"})
    assert "access-control-allow-origin" not in elsewhere.headers


# ---- the access log -----------------------------------------------------------------------------

def _access_lines(output: str) -> dict[str, dict[str, str]]:
    """request_id -> the fields of its omnistage.access line."""
    lines = {}
    for line in output.splitlines():
        if " omnistage.access: " not in line:
            continue
        fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.split(" omnistage.access: ", 1)[1]))
        lines[fields["request_id"]] = fields
    return lines


def test_one_access_line_per_request_when_it_ends(tiny_qwen2, start_server, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    with start_server(tiny_qwen2, log_level="info") as running:
        base = running.base
        assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60,
                          headers={**auth, "X-Request-Id": "whole-1"}).status_code == 200
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60,
                          json={**CHAT, "stream": True, "max_tokens": 40},
                          headers={**auth, "X-Request-Id": "stream-1"}) as r:
            assert r.status_code == 200 and [x for x in r.iter_lines() if x][-1] == "data: [DONE]"
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60,
                          json={**CHAT, "stream": True, "max_tokens": 1500},
                          headers={**auth, "X-Request-Id": "left-1"}) as r:
            next(r.iter_lines())           # the client leaves mid-stream
        httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "nokey-1"})
        httpx.get(f"{base}/v1/nothing", headers={**auth, "X-Request-Id": "lost 1"})
        # a last request, so the one left mid-stream surely ended before the server stops
        httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60, headers=auth)
    lines = _access_lines(running.proc.stdout.read())
    whole = lines["whole-1"]
    assert (whole["method"], whole["route"], whole["status"]) == ("POST", "/v1/chat/completions", "200")
    assert whole["completion_tokens"] == "6" and int(whole["prompt_tokens"]) > 0
    assert float(whole["latency_ms"]) > 0
    stream = lines["stream-1"]
    assert stream["status"] == "200" and stream["completion_tokens"] == "40"   # known at its end
    assert "incomplete" not in stream
    assert lines["left-1"]["incomplete"] == "1"
    assert int(lines["left-1"]["completion_tokens"]) < 1500
    assert lines["nokey-1"]["status"] == "401"
    lost = lines['"lost 1"']
    assert (lost["route"], lost["status"]) == ("/v1/nothing", "404")


# ---- Qwen2.5-Omni ---------------------------------------------------------------------------------

def test_omni_start_logs_no_config_warnings_and_speech_is_logged(tiny_omni, start_server, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    with start_server(tiny_omni, "--linear-kernel", "matmul", log_level="info") as running:
        r = httpx.post(f"{running.base}/v1/audio/speech", timeout=120,
                       headers={**auth, "X-Request-Id": "say-1"},
                       json={"model": "tiny", "input": "Hello there.", "response_format": "wav"})
        assert r.status_code == 200
    output = running.proc.stdout.read()
    assert "must be `None` or an integer" not in output, output
    assert "tts_text_start_token_id" not in output
    speech = _access_lines(output)["say-1"]
    assert speech["route"] == "/v1/audio/speech" and float(speech["audio_s"]) > 0
