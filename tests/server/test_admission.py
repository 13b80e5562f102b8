"""The server's request bound is counted at arrival (server/admission.py): a burst of
simultaneous requests against the real server on loopback gets exactly `seats + queued`
admissions and 429s (OpenAI's error JSON, Retry-After) for the rest; the places come back when
responses end, also for streams the client closed; and the bound's unit pieces."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from omnistage.server.admission import Admission

SEATS, QUEUED, BURST = 2, 4, 20
WAIT_S = 120                 # every wait below is bounded by this
# Long enough (~1.5 s for two on the tiny model) that no admitted request can finish while a
# burst is still arriving.
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def bounded(tiny_qwen2, start_server, api_key):
    with start_server(tiny_qwen2, "--max-num-seqs", str(SEATS),
                      "--max-queued-requests", str(QUEUED)) as running:
        yield running.base, {"Authorization": f"Bearer {api_key}"}


def _is_rate_limited(r: httpx.Response) -> bool:
    error = r.json()["error"]
    return (r.status_code == 429 and r.headers["retry-after"] == "1"
            and error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            and set(error) == {"message", "type", "param", "code"})


async def _first_event(r: httpx.Response):
    """Read the stream's first event; returns the line iterator, to be kept while the stream
    should stay open (a dropped iterator is closed, and the connection with it)."""
    lines = r.aiter_lines()
    async for line in lines:
        if line:
            break
    return lines


async def _burst(base: str, auth: dict, body: dict) -> list[httpx.Response]:
    """BURST requests released together by one event."""
    gate = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=WAIT_S) as client:
        async def one() -> httpx.Response:
            await gate.wait()
            return await client.post("/v1/chat/completions", json=body)

        tasks = [asyncio.create_task(one()) for _ in range(BURST)]
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)


async def _stream_burst(base: str, auth: dict) -> tuple[int, list[httpx.Response]]:
    """BURST streams released together. Admitted streams read their first event and hold the
    connection until every refusal is in and the SEATS running streams have started (the
    queued ones cannot start before), so that no place is given back during the burst; then
    each closes its stream mid-way. Returns (streams admitted, refusals)."""
    refused: list[httpx.Response] = []
    started = 0
    gate, settled = asyncio.Event(), asyncio.Event()

    def check() -> None:
        if len(refused) == BURST - SEATS - QUEUED and started == SEATS:
            settled.set()

    async def one(client: httpx.AsyncClient) -> bool:
        nonlocal started
        await gate.wait()
        async with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                refused.append(r)
                check()
                return False
            lines = await _first_event(r)
            started += 1
            check()
            await settled.wait()
            await lines.aclose()
            return True       # leaving the block closes the stream mid-way

    async with httpx.AsyncClient(base_url=base, headers=auth, timeout=WAIT_S) as client:
        tasks = [asyncio.create_task(one(client)) for _ in range(BURST)]
        gate.set()
        try:
            await asyncio.wait_for(settled.wait(), WAIT_S)
        except TimeoutError:
            for t in tasks:
                t.cancel()
            raise AssertionError(f"burst never settled: {len(refused)} refused, {started} "
                                 f"streaming (want {BURST - SEATS - QUEUED} and {SEATS})") from None
        admitted = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    return sum(admitted), refused


def _one_more(base: str, auth: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=WAIT_S,
                      json={**LONG, "max_tokens": 2})


def test_simultaneous_streams_are_bounded_and_client_closes_give_places_back(bounded):
    base, auth = bounded
    admitted, refused = asyncio.run(_stream_burst(base, auth))
    assert admitted == SEATS + QUEUED
    assert len(refused) == BURST - SEATS - QUEUED and all(_is_rate_limited(r) for r in refused)
    # the closed streams gave their places back: a lone request is served
    assert _one_more(base, auth).status_code == 200


def test_simultaneous_requests_get_seats_plus_queue_then_429(bounded):
    base, auth = bounded
    responses = asyncio.run(_burst(base, auth, LONG))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    # Every place is free when the burst starts (the test before gave them all back), so
    # this also shows that nothing leaked there.
    assert len(ok) == SEATS + QUEUED, [r.status_code for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == LONG["max_tokens"] for r in ok)
    assert len(refused) == BURST - SEATS - QUEUED and all(_is_rate_limited(r) for r in refused)
    assert _one_more(base, auth).status_code == 200         # nothing leaked
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200


def test_full_server_still_answers_gets_and_metrics_show_the_bound(bounded):
    """While the bound is reached, GETs are served, and /metrics shows the count."""
    base, auth = bounded

    async def main() -> tuple[str, int]:
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=WAIT_S) as client:
            streams = [client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True})
                       for _ in range(SEATS)]
            opened = [await s.__aenter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in opened)
                held = [await _first_event(r) for r in opened]     # both running
                metrics = (await client.get("/metrics")).text
                health = (await client.get("/health")).status_code
                for lines in held:
                    await lines.aclose()
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
        return metrics, health

    metrics, health = asyncio.run(main())
    assert health == 200
    values = dict(line.split() for line in metrics.splitlines()
                  if line.startswith("omnistage_server_requests_"))
    assert float(values["omnistage_server_requests_in_flight"]) == SEATS
    assert float(values["omnistage_server_requests_queued"]) == 0
    assert float(values["omnistage_server_requests_rejected_total"]) >= 0


# ---- units ------------------------------------------------------------------------------------

def test_admission_counts_served_plus_queued_and_releases_once():
    a = Admission(max_queued=1, seats=lambda: 2)
    tickets = [a.try_acquire() for _ in range(3)]
    assert all(t is not None for t in tickets) and a.in_flight == 3 and a.queued == 1
    assert a.try_acquire() is None and a.rejected == 1
    tickets[0].release()
    tickets[0].release()                  # idempotent
    assert a.in_flight == 2
    moved = tickets[1].hand_over()        # a video job takes the place over
    tickets[1].release()                  # the response's release no longer counts
    assert a.in_flight == 2
    moved.release()
    assert a.in_flight == 1
    assert Admission(max_queued=0, seats=lambda: 1).try_acquire() is not None   # 0: no line
    with pytest.raises(ValueError):
        Admission(max_queued=-1, seats=lambda: 1)
