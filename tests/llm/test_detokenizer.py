"""IncrementalDetokenizer and find_stop against the tiny offline Qwen tokenizer."""

from __future__ import annotations

import random

import pytest

from omnistage.llm.detokenizer import IncrementalDetokenizer, find_stop
from omnistage.tiny.tokenizer import build_qwen_tokenizer, load_corpus

TEXTS = [
    "Plain ASCII, with punctuation: (a), [b], {c}; 1,234.56!",
    "Grüße aus München — crème brûlée, naïve fiancé, jalapeño piñata.",
    "你好，世界。今天天气很好，我们去市场吧。東京 こんにちは 안녕하세요",
    "Emoji: 😀👍🏽❤️🎉 flags 🇫🇷 family 👨‍👩‍👧 and ☕ at €3.50 (21°C).",
    "नमस्ते مرحبا καλημέρα спасибо",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen_tokenizer(512)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas, i = [], 0
    for size in chunk_sizes:
        deltas.append(detok.push(ids[i : i + size]))
        i += size
    assert i >= len(ids)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_breaks_utf8(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = stream(detok, ids, [1] * len(ids))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert detok.flush() == ""


def test_random_corpus_slices_with_prompts(tokenizer) -> None:
    corpus = load_corpus()
    rng = random.Random(0)
    for _ in range(200):
        start = rng.randrange(len(corpus) - 200)
        text = corpus[start : start + rng.randrange(1, 200)] + rng.choice(["", " 😀", "你好", "é"])
        ids = tokenizer.encode(text)
        prompt = tokenizer.encode(corpus[max(0, start - 40) : start])
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
        deltas = stream(detok, ids, [rng.randint(1, 3) for _ in range(len(ids))])
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_random_ids_match_full_decode(tokenizer) -> None:
    """Any id sequence (invalid UTF-8, specials, ids past the vocab) streams to decode(all)."""
    rng = random.Random(1)
    for _ in range(500):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        out = [rng.randrange(-1, 700) for _ in range(rng.randrange(0, 40))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        deltas = stream(detok, out, [rng.randint(1, 4) for _ in range(len(out))])
        streamed = "".join(deltas) + detok.flush()
        assert streamed == detok.text
        assert streamed == tokenizer.decode([i for i in out if i >= 0], skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = tokenizer.encode("Hello<|im_end|>") + [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipped.push([i]) for i in ids) == "Hello"
    assert "".join(kept.push([i]) for i in ids) == "Hello<|im_end|><|endoftext|>"


def test_chat_prompt_context_not_in_output(tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    ids = tokenizer.encode("Sure, 😀!")
    assert "".join(detok.push([i]) for i in ids) == "Sure, 😀!"


def test_prompt_ending_inside_a_character(tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, ids[:1], skip_special_tokens=True)
    assert detok.push(ids[1:]) + detok.flush() == tokenizer.decode(ids[1:])


def test_out_of_range_ids_do_not_crash(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [10**9, -5], skip_special_tokens=True)
    assert detok.push([len(tokenizer), 10**6, -1]) == ""
    assert detok.push(tokenizer.encode("ok")) == "ok"
    assert detok.push([]) == ""


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_push_does_not_grow(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    text = load_corpus()[:6000] + " ".join(TEXTS)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Prompt: "), skip_special_tokens=True)
    for i in ids:
        detok.push([i])
    assert detok.text == text
    assert len(ids) > 2000 and max(counting.calls) <= 12
    assert len(counting.calls) <= 2 * len(ids) + 1


def test_find_stop_basics() -> None:
    assert find_stop("hello world", 5, ["world"]) == ("world", 6)
    assert find_stop("hello world", 5, ["hello"]) is None  # ends before the new tail
    assert find_stop("hello world", 0, ["world"]) is None
    assert find_stop("hello world", 100, ["hello"]) == ("hello", 0)
    assert find_stop("hello world", 5, ["", "xyz"]) is None
    assert find_stop("", 0, ["a"]) is None


def test_find_stop_earliest_of_many() -> None:
    text = "abc STOP def END"
    assert find_stop(text, len(text), ["END", "STOP"]) == ("STOP", 4)
    assert find_stop("xx<end>", 5, ["<end>", "<e", "nd>"]) == ("<e", 2)  # tie on start: shorter wins
    assert find_stop("one two three", 9, ["three", "two"]) == ("two", 4)


def test_find_stop_spanning_two_pushes(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    found = []
    for piece in ["The answer is 4", "2. ###", "# more"]:
        delta = detok.push(tokenizer.encode(piece))
        found.append(find_stop(detok.text, len(delta), ["42.", "####"]))
    assert found[0] is None
    assert found[1] == ("42.", 14)
    assert found[2] == ("####", 18)  # two '#' from each push
