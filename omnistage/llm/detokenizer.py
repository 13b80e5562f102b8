"""Incremental detokenization: token ids in, text deltas out, never broken UTF-8.

Decoding the whole output again at every step costs O(length) per step. Instead we decode a
short sliding window of ids (the same idea as vLLM's `detokenize_incrementally` and HF's
`TextStreamer`): `window[:read]` is context whose text is already final ("prefix text"), and
`window[read:]` holds tokens whose text is new or still incomplete. Each push decodes only
the window, so its cost depends on the window, not on how long the output already is.

Why a window and not one token at a time: byte-level BPE tokens can hold part of a UTF-8
character (an emoji is often 2-4 tokens), and SentencePiece drops a token's leading space when
it is decoded alone. Decoding with context and holding back a trailing '\\ufffd' (an incomplete
character) fixes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output tokens (SentencePiece spacing).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a HF tokenizer we use."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


class IncrementalDetokenizer:
    """Turns a request's output ids into text deltas, one `push` per engine step.

    Ids outside [0, len(tokenizer)) decode to nothing (a model's vocab may be larger than its
    tokenizer, as with real Qwen checkpoints). Text is held back while it ends in an incomplete
    character; `flush()` releases what is held when the request finishes.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._num_ids = len(tokenizer)
        window = self._valid(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        prefix_text = self._decode(window)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its context would not be a clean start.
            window, prefix_text = [], ""
        self._window: list[int] = window  # context ids + pending ids
        self._read = len(window)  # window[:read] is context, window[read:] pending
        self._prefix_text = prefix_text  # decode(window[:read])
        self._emitted = 0  # chars of decode(window) after prefix_text already returned
        self._chunks: list[str] = []  # every delta returned so far; joined lazily by `text`

    @property
    def text(self) -> str:
        """All output text returned so far (deltas of `push` and `flush`), prompt excluded."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add output ids; return the text they complete (may be "" while a char is partial)."""
        ids = self._valid(new_token_ids)
        if not ids:
            return ""
        self._window.extend(ids)
        full = self._decode(self._window)
        stable = full.rstrip(REPLACEMENT_CHAR)
        start = len(self._prefix_text) + self._emitted
        delta = stable[start:]
        if len(stable) == len(full):
            # Complete text: the pending ids become the next context; older ids are dropped.
            self._window = self._window[self._read :]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)
            self._emitted = 0
        else:
            # Ends inside a character: keep the ids pending, remember what was returned.
            self._emitted = max(self._emitted, len(stable) - len(self._prefix_text))
        return self._record(delta)

    def flush(self) -> str:
        """Return the held-back text, replacement chars included; call once, at the end."""
        full = self._decode(self._window)
        delta = full[len(self._prefix_text) + self._emitted :]
        self._emitted += len(delta)
        return self._record(delta)

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _valid(self, ids: Sequence[int]) -> list[int]:
        # tokenizer.decode skips ids >= len(tokenizer) but raises on negative ones.
        return [int(i) for i in ids if 0 <= i < self._num_ids]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def find_stop(text: str, num_new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """Find the earliest stop string that ends within the last `num_new_chars` chars of `text`.

    Returns (stop string, index in `text` where it starts), or None. Only the tail that could
    hold such a match is scanned (num_new_chars + len(s) - 1 chars per stop string s). Ties on
    the start index go to the shorter string (it completed first). Empty strings never match.
    """
    num_new_chars = min(num_new_chars, len(text))
    if num_new_chars <= 0:
        return None
    new_start = len(text) - num_new_chars
    best: tuple[str, int] | None = None
    for s in stop:
        if not s:
            continue
        index = text.find(s, max(0, new_start - len(s) + 1))
        if index != -1 and (best is None or (index, len(s)) < (best[1], len(best[0]))):
            best = (s, index)
    return best
