"""AsyncOmni: concurrent streams match the blocking Omni; leaving a stream early or calling
abort() frees the request; a bad request fails only itself; shutdown is prompt.
Each test runs its own event loop (asyncio.run) and its own engine, shut down afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.errors import EngineDeadError, InvalidRequestError, PromptTooLongError

# Small blocks and budget: prefills are chunked and share steps with decodes.
OPTIONS = {"max_model_len": 512, "block_size": 4, "max_num_batched_tokens": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Long enough (hundreds of steps) that an abort always lands before the natural end.
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
WAIT_S = 5.0


def _prompts() -> list:
    g = torch.Generator().manual_seed(7)
    prompts: list = [{"prompt_token_ids": torch.randint(0, 500, (n,), generator=g).tolist()}
                     for n in (1, 5, 9, 16, 23, 40)]
    prompts += ["hello world", [{"role": "user", "content": "what is a stage?"}]]
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def blocking(tiny_qwen2):
    return Omni(tiny_qwen2, **OPTIONS)


@pytest.fixture(scope="module")
def reference(blocking):
    """What the blocking API gives: (token_ids, text) per prompt."""
    outs = blocking.generate(PROMPTS, GREEDY)
    return [(o.token_ids, o.text) for o in outs]


@pytest.fixture
def llm(tiny_qwen2):
    engine = AsyncOmni(tiny_qwen2, **OPTIONS)
    yield engine
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < WAIT_S
    assert not engine._thread.is_alive()


async def collect(llm: AsyncOmni, prompt, params=GREEDY, request_id=None, on_delta=None):
    deltas = []
    async for d in llm.generate(prompt, params, request_id=request_id):
        deltas.append(d)
        if on_delta is not None:
            await on_delta(d, deltas)
    return deltas


def run(coro, timeout: float = 20.0):
    """asyncio.run with an overall limit: a hang fails the test instead of the suite."""
    async def limited():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(limited())


def tokens_of(deltas, index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


def text_of(deltas, index: int = 0) -> str:
    return "".join(d.text for d in deltas if d.index == index)


async def wait_idle(llm: AsyncOmni) -> None:
    """Bounded wait until the engine holds no request and every block is free again."""
    engine = llm.engine.llm
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if not engine.requests and engine.num_free_blocks == engine.num_blocks and not llm._streams:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle after {WAIT_S}s: requests={list(engine.requests)}, "
                         f"free blocks {engine.num_free_blocks}/{engine.num_blocks}")


def check_complete(deltas, expected) -> None:
    tokens, text = expected
    assert tokens_of(deltas) == tokens and len(tokens) == GREEDY.max_tokens
    assert text_of(deltas) == text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length"


# ---- streams ----------------------------------------------------------------------------

def test_concurrent_streams_match_the_blocking_api(llm, reference):
    async def main():
        return await asyncio.gather(*(collect(llm, p) for p in PROMPTS))

    results = run(main())
    assert len(results) == 8
    for i, (deltas, expected) in enumerate(zip(results, reference)):
        assert tokens_of(deltas) == expected[0], f"prompt {i}"
        check_complete(deltas, expected)
        assert all(d.index == 0 for d in deltas)
    assert llm.engine.requests == {} and llm.engine.llm.num_free_blocks == llm.engine.llm.num_blocks


def test_streams_deliver_token_by_token(llm, reference):
    async def main():
        return await collect(llm, PROMPTS[3])

    deltas = run(main())
    assert [len(d.token_ids) for d in deltas] == [1] * GREEDY.max_tokens
    check_complete(deltas, reference[3])


def test_n_samples_stream_every_sample(llm, reference):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        return await collect(llm, PROMPTS[4], params)

    deltas = run(main(), timeout=3.0)
    for i in range(3):   # greedy: every sample is the single-sample answer
        assert tokens_of(deltas, i) == reference[4][0]
        assert text_of(deltas, i) == reference[4][1]
    assert sum(d.finished for d in deltas) == 3
    assert llm.engine.requests == {} and llm.engine.llm.num_free_blocks == llm.engine.llm.num_blocks


# ---- leaving early / abort --------------------------------------------------------------

def test_breaking_out_of_a_stream_aborts_the_request(llm, reference):
    async def main():
        got, seq = [], None
        async for d in llm.generate(PROMPTS[5], LONG, request_id="early"):
            if seq is None:
                seq = llm.engine.requests["early"].samples[0].seq
            got.append(d)
            if len(got) == 3:
                break
        await wait_idle(llm)
        return got, seq

    got, seq = run(main())
    assert tokens_of(got) == reference[5][0][:3]
    assert seq.finish_reason == "abort" and seq.num_output_tokens < LONG.max_tokens


def test_abort_ends_that_stream_only(llm, reference):
    async def main():
        async def abort_after_two(d, deltas):
            if len(deltas) == 2:
                await llm.abort("victim")

        victim = asyncio.create_task(collect(llm, PROMPTS[2], LONG, "victim", abort_after_two))
        others = [asyncio.create_task(collect(llm, p)) for p in PROMPTS[3:6]]
        got = await asyncio.wait_for(victim, WAIT_S)
        rest = await asyncio.wait_for(asyncio.gather(*others), WAIT_S)
        await wait_idle(llm)
        return got, rest

    got, rest = run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert sum(d.finished for d in got) == 1
    assert 2 <= len(tokens_of(got)) < LONG.max_tokens
    assert tokens_of(got) == reference[2][0][:len(tokens_of(got))]
    for deltas, expected in zip(rest, reference[3:6]):
        check_complete(deltas, expected)


def test_abort_of_an_unknown_request_is_ignored(llm, reference):
    async def main():
        await llm.abort("no-such-request")
        return await collect(llm, PROMPTS[1])

    check_complete(run(main()), reference[1])
    assert llm.dead is None


def test_engine_abort_before_the_samples_fork_reports_every_sample(blocking):
    engine = blocking.engine.llm
    engine.add_request("n3", list(range(100)), SamplingParams(n=3, max_tokens=5))
    engine.step()                          # part of the prefill: nothing forked yet
    deltas = engine.abort_request("n3")
    assert engine.requests == {} and engine.num_free_blocks == engine.num_blocks
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    assert all(d.finished and d.finish_reason == "abort" for d in deltas)


def test_abort_before_the_samples_fork_ends_the_stream(llm):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=5)
    prompt = {"prompt_token_ids": list(range(100))}   # a prefill over 4 steps

    async def main():
        task = asyncio.ensure_future(collect(llm, prompt, params, "n2"))
        with llm._cv:   # hold the engine thread until the add and the abort are both queued
            # generate() queues its add once a worker thread has prepared the prompt: wait for
            # that (bounded), sleeping for real so the worker gets the GIL.
            deadline = time.monotonic() + WAIT_S
            while not llm._commands and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            assert llm._commands, "generate() did not queue its request"
            await llm.abort("n2")
        return await task

    deltas = run(main(), timeout=2 * WAIT_S)
    assert sorted(d.index for d in deltas if d.finished) == [0, 1]
    assert all(d.finish_reason == "abort" for d in deltas if d.finished)


# ---- bad requests -------------------------------------------------------------------------

def test_bad_requests_fail_only_themselves(llm, reference):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)

    async def expect_error(prompt):
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm, prompt)
        return info.value

    async def main():
        good = [asyncio.create_task(collect(llm, p)) for p in PROMPTS[:4]]
        errors = await asyncio.wait_for(asyncio.gather(
            expect_error(""),
            expect_error({"prompt_token_ids": [1] * 600}),
            expect_error({"prompt_token_ids": [1, 9999]}),
            expect_error([{"role": "wizard", "content": "x"}]),
        ), WAIT_S)
        done = await asyncio.wait_for(asyncio.gather(*good), WAIT_S)
        await wait_idle(llm)
        after = await collect(llm, PROMPTS[4])
        return errors, done, after

    errors, done, after = run(main())
    assert "empty" in str(errors[0])
    assert isinstance(errors[1], PromptTooLongError) and "max_model_len" in str(errors[1])
    assert "[0, 512)" in str(errors[2])
    assert "wizard" in str(errors[3])
    for deltas, expected in zip(done, reference[:4]):
        check_complete(deltas, expected)
    check_complete(after, reference[4])
    assert llm.dead is None


def test_duplicate_request_id_fails_only_the_duplicate(llm, reference):
    """The first "dup" runs to the context limit (~470 steps): it is surely in flight when the
    duplicate arrives (with 12 tokens it could finish first on a busy machine, and the id was
    free again). It goes on unaffected: its tokens are the greedy reference's; closing its
    stream aborts it (the abort queued before the next add), and the id serves a new request."""
    want = reference[5][0]

    async def main():
        first_delta, refused = asyncio.Event(), asyncio.Event()

        async def first_stream() -> list[int]:
            long = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            stream, tokens = llm.generate(PROMPTS[5], long, request_id="dup"), []
            try:
                async for d in stream:
                    tokens += d.token_ids
                    first_delta.set()
                    if len(tokens) >= len(want):
                        await asyncio.wait_for(refused.wait(), WAIT_S)
                        break
            finally:
                await stream.aclose()
            return tokens

        first = asyncio.create_task(first_stream())
        await asyncio.wait_for(first_delta.wait(), WAIT_S)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await collect(llm, PROMPTS[1], request_id="dup")
        refused.set()
        tokens = await asyncio.wait_for(first, WAIT_S)
        return tokens, await asyncio.wait_for(collect(llm, PROMPTS[5], request_id="dup"), WAIT_S)

    tokens, again = run(main())
    assert tokens[:len(want)] == want
    check_complete(again, reference[5])


# ---- bursts -------------------------------------------------------------------------------

def test_a_burst_of_requests_goes_into_one_first_step(tiny_qwen2):
    """Requests submitted together reach the engine thread unevenly (here one chat of 151
    turns takes milliseconds to render and tokenize, the others a fraction of one); an idle
    engine waits while any is still being prepared, so its first step takes them all:
    sixteen one-token chats finish in one step."""
    engine = AsyncOmni(tiny_qwen2, burst_max_s=WAIT_S, max_model_len=2048, max_num_batched_tokens=4096)
    try:
        before = engine.engine.llm.num_steps
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        long = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(151)]
        chats = [[{"role": "user", "content": f"request {i} of a burst"}] for i in range(15)] + [long]

        async def main():
            return await asyncio.gather(*(collect(engine, chat, params) for chat in chats))

        outs = run(main())
        assert [len(tokens_of(d)) for d in outs] == [1] * 16 and all(d[-1].finished for d in outs)
        assert engine.engine.llm.num_steps - before == 1
    finally:
        engine.shutdown()


# ---- shutdown -----------------------------------------------------------------------------

def test_shutdown_is_prompt_and_fails_streams_in_flight(llm):
    async def main():
        started = asyncio.Event()

        async def mark(d, deltas):
            started.set()

        task = asyncio.create_task(collect(llm, PROMPTS[5], SamplingParams(
            temperature=0.0, max_tokens=None, ignore_eos=True), on_delta=mark))
        await asyncio.wait_for(started.wait(), WAIT_S)
        t0 = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - t0
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, WAIT_S)
        return took

    assert run(main()) < 2.0
    assert not llm._thread.is_alive()


def test_generate_after_shutdown_raises(llm):
    llm.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(llm, PROMPTS[0]), 1.0)

    run(main(), timeout=2.0)
