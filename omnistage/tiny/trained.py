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


def train_chats_(model: nn.Module, chats: list[list[int]], seed: int, steps: int = 150,
                 batch: int = 8, lr: float = 3e-3) -> float:
    """Next-token training on whole chats (each a sequence from its first token: the model
    learns the answer with its whole context, as it will be asked), batches padded on the
    right with the loss masked there; in place; returns the last step's loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        picked = [chats[i] for i in torch.randint(len(chats), (batch,), generator=g).tolist()]
        width = max(map(len, picked))
        x = torch.tensor([c + [0] * (width - len(c)) for c in picked])
        labels = torch.tensor([c + [-100] * (width - len(c)) for c in picked])
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return loss.item()
