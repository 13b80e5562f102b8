"""A tiny language model that has learned something: the accuracy reference for quantization.

Random tiny checkpoints (init.py) are built to make greedy decoding a sharp test of exactness,
and are chaotic for it: their blocks amplify the residual stream ~2.5x each, so a relative
weight change of 1e-3 (bf16 rounding) already flips a third of greedy tokens, which says
nothing of how a trained model takes quantization. With transformers' default init instead,
greedy decoding repeats one token. This module trains a small Qwen2 for a few hundred steps
on a synthetic corpus (sentences of a small grammar, made from a seed), so its weights, and
its logit margins, come from learning, as a real model's do.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "our teacher", "the bird",
            "a small child", "the farmer", "her brother", "the pilot", "this robot", "the queen"]
VERBS = ["sees", "finds", "likes", "paints", "follows", "carries", "builds", "reads",
         "watches", "remembers", "sells", "cleans"]
OBJECTS = ["a red ball", "the river", "an apple", "the green house", "a long letter",
           "the moon", "a wooden box", "the garden", "a blue car", "the map", "some bread",
           "the tall tree"]
ENDINGS = ["today", "at night", "in the morning", "every day", "with care", "again",
           "near the sea", "after lunch"]


def corpus(seed: int, sentences: int) -> str:
    """`sentences` sentences "<subject> <verb> <object> <ending>." drawn from `seed`, each
    word list's i-th entry with probability ~ 1 / (i + 1) (as in text, some choices are
    likelier than others, so a greedy continuation is a question of margins, not of ties)."""
    g = torch.Generator().manual_seed(seed)

    def pick(words: list[str]) -> str:
        weights = 1.0 / torch.arange(1, len(words) + 1, dtype=torch.float64)
        return words[int(torch.multinomial(weights, 1, generator=g))]

    return " ".join(f"{pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)} {pick(ENDINGS)}."
                    for _ in range(sentences))


def train_(model: nn.Module, token_ids: list[int], seed: int, steps: int = 200,
           batch: int = 8, length: int = 128, lr: float = 3e-3) -> float:
    """Next-token training of `model` (a causal LM returning .loss) on random windows of
    `token_ids`, in place; returns the last step's loss."""
    data = torch.tensor(token_ids)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(len(data) - length, (batch,), generator=g)
        x = torch.stack([data[s:s + length] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return loss.item()


# Function calling, learned: the `tools` size of tiny:qwen2 is trained on chats that offer
# WEATHER_TOOL and ask for a city's weather; the answer is the call, then (given the tool's
# result) a sentence that repeats it. Enough for a greedy tool call to come out end to end.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dakar"]
WEATHERS = ["sunny", "rainy", "cloudy", "windy", "snowy"]


def tool_chats(tokenizer, seed: int, count: int) -> list[str]:
    """`count` rendered chats (the tokenizer's template with WEATHER_TOOL)."""
    g = torch.Generator().manual_seed(seed)
    chats = []
    for _ in range(count):
        city = CITIES[int(torch.randint(len(CITIES), (1,), generator=g))]
        weather = WEATHERS[int(torch.randint(len(WEATHERS), (1,), generator=g))]
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
        messages = [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": weather},
                    {"role": "assistant", "content": f"It is {weather} in {city}."}]
        chats.append(tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False))
    return chats


def shared_prefix(chats: list[list[int]]) -> int:
    """How many first tokens every chat has in common (the template's system turn with the
    tools, the question up to the city)."""
    first, n = chats[0], min(map(len, chats))
    return next((i for i in range(n) if any(c[i] != first[i] for c in chats)), n)


def _chats_loss(model: nn.Module, prefix: torch.Tensor, tails: list[list[int]]) -> torch.Tensor:
    """Mean next-token loss over whole chats `prefix + tail`, the shared prefix (1, P) run once
    and its cache repeated for the batch: the same loss as running each chat whole, at a
    fraction of the cost (the prefix is ~85% of every chat). Tails are padded on the right,
    the padding masked out of the loss."""
    batch, width, p = len(tails), max(map(len, tails)), prefix.shape[1]
    x = torch.tensor([t + [0] * (width - len(t)) for t in tails])                  # (B, W)
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in tails])
    head = model(input_ids=prefix, use_cache=True)
    head.cache.batch_repeat_interleave(batch)
    out = model(input_ids=x, cache=head.cache, position_ids=torch.arange(p, p + width).expand(batch, -1))
    vocab = out.logits.shape[-1]
    # every chat predicts the prefix's tokens 1..P-1 (counted once per chat), its tail's first
    # token from the prefix's last position, the rest of its tail from the tail
    own = F.cross_entropy(head.logits[0, :-1], prefix[0, 1:], reduction="sum") * batch
    first = F.cross_entropy(head.logits[0, -1:].expand(batch, -1), x[:, 0], reduction="sum")
    rest = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), reduction="sum")
    return (own + first + rest) / (batch * p + int((labels[:, 1:] != -100).sum()))


def train_chats_(model: nn.Module, chats: list[list[int]], seed: int, steps: int = 150,
                 batch: int = 8, lr: float = 3e-3) -> float:
    """Next-token training on whole chats (each a sequence from its first token: the model
    learns the answer with its whole context, as it will be asked), `batch` chats a step; in
    place; returns the last step's loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    p = shared_prefix(chats) - 1                # >= 1 token of every chat in its tail
    prefix = torch.tensor([chats[0][:p]])
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        picked = [chats[i] for i in torch.randint(len(chats), (batch,), generator=g).tolist()]
        loss = _chats_loss(model, prefix, [c[p:] for c in picked])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return loss.item()
