"""Engine behaviour on a tiny model: seeds, n samples, stops, penalties, logprobs,
embeddings in and hidden states out."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from omnistage import Omni, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return Omni(tiny_qwen2, block_size=4)


def _ids(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(0, 500, (n,), generator=g).tolist()}


def test_seeded_sample_is_batch_independent(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=30, ignore_eos=True)
    alone = llm.generate(_ids(20, 0), params)[0].token_ids
    others = []
    for i in range(16):  # seeded, unseeded, greedy and filtered neighbours
        kind = i % 4
        others.append(SamplingParams(
            temperature=0.0 if kind == 0 else 1.2, seed=None if kind == 1 else 1000 + i,
            top_k=5 if kind == 3 else -1, min_p=0.05 if kind == 2 else 0.0,
            max_tokens=10 + 3 * i, ignore_eos=True))
    prompts = [_ids(5 + 7 * i, 100 + i) for i in range(16)]
    mixed = llm.generate(prompts[:7] + [_ids(20, 0)] + prompts[7:], others[:7] + [params] + others[7:])
    assert mixed[7].token_ids == alone
    other_seed = llm.generate(_ids(20, 0), SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=43,
                                                          max_tokens=30, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine.llm
    prompt = _ids(37, 5)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    stream = llm.stream(prompt, params)
    first = [next(stream) for _ in range(4)]   # the step that prefilled and forked
    assert sorted(d.index for d in first) == [0, 1, 2, 3]
    seqs = [s.seq for s in engine.requests[first[0].request_id].samples]
    shared = set(seqs[0].block_table[:9])      # 36 prompt tokens fill 9 blocks of 4
    for s in seqs[1:]:
        assert set(s.block_table[:9]) == shared
    assert all(engine.block_manager.blocks[b].ref_count == 4 for b in shared)
    rest = list(stream)
    assert engine.num_free_blocks == engine.num_blocks
    outs = llm.generate(prompt, params)[0].outputs
    assert len(outs) == 4 and all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1      # different seeds per sample
    assert len(first) + len(rest) == 4 * 12
    greedy = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1


def test_stop_strings_and_stop_tokens(llm):
    prompt = _ids(11, 9)
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = base.text
    stop = text[10:13]
    assert len(stop) == 3 and stop in text
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert kept.text == text[:text.index(stop) + 3]
    # Streaming never shows text past the stop string.
    streamed = "".join(d.text for d in llm.stream(prompt, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])))
    assert streamed == cut.text

    tok = base.token_ids[5]
    first = base.token_ids.index(tok)
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                stop_token_ids=[tok]))[0]
    assert by_id.token_ids == base.token_ids[:first + 1]
    assert by_id.outputs[0].stop_reason == tok
    # min_tokens bans the stop id until enough tokens exist.
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                               stop_token_ids=[tok], min_tokens=first + 2))[0]
    assert len(late.token_ids) >= first + 2 and tok not in late.token_ids[:first + 2]


def test_length_limits(llm, tiny_qwen2):
    out = llm.generate(_ids(8, 1), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.outputs[0].finish_reason == "length"
    short = Omni(tiny_qwen2, max_model_len=32)
    out = short.generate(_ids(20, 1), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_more_samples_than_seats_is_refused_not_hung(tiny_qwen2):
    """n samples run side by side from the prompt on: n > max_num_seqs could never be
    admitted (it used to wait for ever); it is a client error naming n."""
    from omnistage.errors import InvalidRequestError

    with Omni(tiny_qwen2, block_size=4, max_num_seqs=2) as small:
        with pytest.raises(InvalidRequestError) as e:
            small.generate(_ids(5, 1), SamplingParams(n=3, max_tokens=4))
        assert e.value.param == "n"
        [ok] = small.generate(_ids(5, 1), SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1))
        assert len(ok.outputs) == 2 and all(len(o.token_ids) == 4 for o in ok.outputs)


def test_repetition_penalty_matches_transformers(tiny_qwen2):
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    llm = Omni(tiny_qwen2)
    never = hf.config.vocab_size
    for n, seed in ((9, 3), (40, 4)):
        p = _ids(n, seed)["prompt_token_ids"]
        x = torch.tensor([p])
        cfg = GenerationConfig(max_new_tokens=20, do_sample=False, repetition_penalty=1.7,
                               eos_token_id=never, pad_token_id=never)
        ref = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)[0, n:].tolist()
        ours = llm.generate({"prompt_token_ids": p}, SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.7))[0].token_ids
        assert ours == ref


def test_logprobs_are_raw_model_logprobs(llm):
    p = _ids(15, 2)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                       return_hidden_states=True)[0]
    lps = out.outputs[0].logprobs
    hidden = out.outputs[0].hidden_states
    assert len(lps) == 6 and hidden.shape[0] == 15 + 5
    for i, lp in enumerate(lps):
        logits = llm.engine.llm.model.compute_logits(hidden[14 + i:15 + i])[0]
        ref = torch.log_softmax(logits, -1)
        assert lp.token_id == out.token_ids[i] == lp.top[0][0]      # greedy: the best token
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_prompt_embeds_equal_token_ids(llm):
    p = _ids(23, 8)["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    by_ids = llm.generate({"prompt_token_ids": p}, params)[0].token_ids
    embeds = llm.engine.llm.model.embed(torch.tensor(p)).clone()
    by_embeds = llm.generate({"prompt_embeds": embeds}, params)[0].token_ids
    assert by_embeds == by_ids


def test_streamed_text_equals_final_text(llm):
    for seed in range(3):
        prompt = _ids(10, 50 + seed)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=50, ignore_eos=True)
        streamed = "".join(d.text for d in llm.stream(prompt, params))
        final = llm.generate(prompt, params)[0]
        assert streamed == final.text
        assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_chat_prompt_uses_template(llm):
    msgs = [{"role": "user", "content": "Say something."}]
    out = llm.generate(msgs, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)


def test_progress_bar_does_not_change_outputs(llm, capsys):
    prompts = [_ids(9, 70 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    shown = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=True)]
    assert shown == plain
    assert "3/3" in capsys.readouterr().err


def test_prompt_embeds_shape_is_checked(llm):
    from omnistage.errors import InvalidRequestError

    hidden = llm.engine.llm.model.config.hidden_size
    with pytest.raises(InvalidRequestError, match="prompt_embeds"):
        llm.generate({"prompt_embeds": torch.zeros(4, hidden + 1)})
    with pytest.raises(InvalidRequestError, match="same length"):
        llm.generate({"prompt_embeds": torch.zeros(4, hidden), "prompt_token_ids": [1, 2, 3]})
    assert not llm.engine.requests and llm.engine.llm.num_free_blocks == llm.engine.llm.num_blocks


def test_forced_tokens_are_the_output_and_end_it(llm):
    forced = [5, 9, 100, 7, 250]
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=50, seed=3,
                                                            forced_token_ids=forced, logprobs=2))
    assert out.token_ids == forced and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].logprobs is None       # a forced token was not drawn from the model
    [cut] = llm.generate("Once upon a time", SamplingParams(max_tokens=3, forced_token_ids=forced))
    assert cut.token_ids == forced[:3] and cut.outputs[0].finish_reason == "length"
    with pytest.raises(Exception, match="forced_token_ids"):
        SamplingParams(n=2, forced_token_ids=forced)


def test_prefix_hits_serve_hidden_states_and_embedding_prompts(tiny_qwen2, llm):
    """A request that returns hidden states, or whose prompt is embeddings, reuses an earlier
    request's prefix blocks; its tokens and every hidden-state row equal an engine without
    prefix caching (the rows of cached positions come from the cache)."""
    shared = _ids(13, 21)["prompt_token_ids"]            # 3 full blocks of 4
    prompts = [shared + _ids(6 + i, 30 + i)["prompt_token_ids"] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cold = Omni(tiny_qwen2, block_size=4, enable_prefix_caching=False)

    def run(engine, prompt):
        out = engine.generate({"prompt_token_ids": prompt}, params, return_hidden_states=True)[0]
        return out.token_ids, out.outputs[0].hidden_states, out.num_cached_tokens

    hits_before = llm.engine.llm.block_manager.num_prefix_hit_tokens
    for p in prompts:
        toks, hidden, _ = run(llm, p)
        ref_toks, ref_hidden, _ = run(cold, p)
        assert toks == ref_toks
        assert hidden.shape == ref_hidden.shape == (len(p) + 4, ref_hidden.shape[1])
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    assert llm.engine.llm.block_manager.num_prefix_hit_tokens - hits_before >= 2 * 12

    # Embedding prompts: the same vectors hit, other vectors (same length) do not.
    emb = llm.engine.llm.model.embed(torch.tensor(prompts[0])).clone()
    first = llm.generate({"prompt_embeds": emb}, params)[0]
    again = llm.generate({"prompt_embeds": emb.clone()}, params)[0]
    assert again.token_ids == first.token_ids == cold.generate({"prompt_embeds": emb}, params)[0].token_ids
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4
    other = llm.generate({"prompt_embeds": emb + 0.01}, params)[0]
    assert other.num_cached_tokens == 0


def test_suppressed_ids_are_never_chosen(llm):
    """The greedy continuation's own tokens, suppressed, never come out: for every request that
    shares one params object (its suppress list converted once and reused) and for a request
    with another list, whose own ids are honoured."""
    prompts = [_ids(12, s) for s in range(3)]
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    greedy = [o.token_ids for o in llm.generate(prompts, plain)]
    banned = sorted({t for ids in greedy for t in ids})
    shared = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, suppress_token_ids=banned)
    for _ in range(2):                     # the second time from the converted list
        for out in llm.generate(prompts, shared):
            assert not set(out.token_ids) & set(banned), out.token_ids
    other = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, suppress_token_ids=greedy[0][:1])
    out = llm.generate(prompts[0], other)[0].token_ids
    assert greedy[0][0] not in out and out != greedy[0]
    assert set(out) & set(banned), "the other list's ids only are suppressed, not the shared one's"


def test_stop_ids_are_banned_until_min_tokens(llm):
    """Before min_tokens a request's stop (and EOS) ids join its suppressed ids, all from one
    tensor made per params object; a list assigned anew to that object is honoured."""
    prompts = [_ids(12, s) for s in range(2)]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    greedy = [o.token_ids for o in llm.generate(prompts, plain)]
    stop, suppressed = greedy[0][1], greedy[1][0]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=[stop],
                            suppress_token_ids=[suppressed])
    for _ in range(2):                     # the second time from the cached tensor
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        for ids in outs:
            assert stop not in ids[:6] and suppressed not in ids, ids
    params.suppress_token_ids = [outs[0][0]]
    out = llm.generate(prompts[0], params)[0].token_ids
    assert outs[0][0] not in out and stop not in out[:6], out
