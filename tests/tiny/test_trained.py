"""The tools model's training (omnistage/tiny/trained.py) runs the chats' shared prefix once a
step: its loss and gradients must be those of the chats run whole."""

from __future__ import annotations

import torch
from transformers import Qwen2ForCausalLM

from omnistage.tiny.qwen2 import ENDOFTEXT, IM_END, build_qwen_tokenizer, make_config
from omnistage.tiny.trained import _chats_loss, shared_prefix, tool_chats


def test_shared_prefix_loss_equals_the_whole_chats_loss():
    tokenizer = build_qwen_tokenizer(512, model_max_length=2048)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (ENDOFTEXT, IM_END)}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(make_config("tools", {}, ids)).train()
    chats = [tokenizer.encode(c, verbose=False) for c in tool_chats(tokenizer, seed=3, count=4)]
    p = shared_prefix(chats) - 1
    assert 0 < p < min(map(len, chats)) and len({len(c) for c in chats}) > 1   # padding is exercised

    loss = _chats_loss(model, torch.tensor([chats[0][:p]]), [c[p:] for c in chats])
    fast = torch.autograd.grad(loss, list(model.parameters()))
    width = max(map(len, chats))
    x = torch.tensor([c + [0] * (width - len(c)) for c in chats])
    labels = torch.tensor([c + [-100] * (width - len(c)) for c in chats])
    whole = model(input_ids=x, labels=labels).loss
    slow = torch.autograd.grad(whole, list(model.parameters()))
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
