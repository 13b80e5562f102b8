"""An offline Qwen2-style tokenizer: byte-level BPE trained here, deterministically.

No hub, no downloaded vocabulary: the merges are learned from `corpus.txt` (original English
prose shipped in this package) and, when a larger vocabulary is asked for than that text can
yield, from pseudo-words drawn from a fixed-seed RNG. Pre-tokenization (Qwen2's split regex,
NFC, ByteLevel) is taken from `transformers.Qwen2Tokenizer` itself, so the trained merges and
the wrapper that applies them can never disagree.

Layout of the ids, like real Qwen: the byte alphabet and merges first, then `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, then any extra special tokens. The tokenizer's length equals the
requested vocab size when it can be reached (always, for sizes up to a few ten thousands);
otherwise the largest size training reached (see `train_byte_bpe`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from importlib import resources

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer

from omnistage.errors import InvalidRequestError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
QWEN_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
BYTE_ALPHABET_SIZE = 256

# ChatML as Qwen2-Instruct uses it: a default system turn when none is given, one
# `<|im_start|>role\n...<|im_end|>\n` block per message, and `<|im_start|>assistant\n` as the
# generation prompt. `content` may be a string or a list of OpenAI-style parts (text parts are
# concatenated; other parts are left to multimodal templates).
CHATML_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render_content(message['content']) -}}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Pseudo-word material for vocabularies larger than the corpus supports. Fixed seed: the
# tokenizer is the same for every model seed.
_SYNTH_SEED = 0
_ONSETS = tuple("bcdfghjklmnprstvwz") + ("ch", "sh", "th", "tr", "st", "pl", "gr", "br")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "io", "y")
_CODAS = ("", "", "", "n", "r", "s", "l", "t", "m", "ng", "x")
_WORDS_PER_LINE = 12
_MAX_SYNTH_ROUNDS = 4


def load_corpus() -> str:
    """The shipped training text (package data `omnistage/tiny/corpus.txt`)."""
    return resources.files("omnistage.tiny").joinpath("corpus.txt").read_text(encoding="utf-8")


def synthetic_lines(num_lines: int, seed: int = _SYNTH_SEED) -> list[str]:
    """`num_lines` lines of pronounceable pseudo-words, identical for a given seed."""
    rng = random.Random(seed)

    def word() -> str:
        syllables = rng.randint(1, 4)
        return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))

    lines = []
    for _ in range(num_lines):
        words = [word() for _ in range(_WORDS_PER_LINE)]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice((".", ",", "", "!", "?")))
    return lines


def _train_once(texts: Sequence[str], vocab_size: int, pre: Tokenizer) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = pre.normalizer
    tok.pre_tokenizer = pre.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,  # keep merging pairs seen once: reach the target on a small corpus
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_byte_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn `vocab_size` byte-level BPE tokens (no special tokens); return (vocab, merges).

    First the corpus alone; while short of the target, retrain with more pseudo-word lines
    (doubling, at most `_MAX_SYNTH_ROUNDS` times). If still short, the largest vocabulary
    reached is returned: callers read its size from `len(vocab)`.
    """
    # The wrapper's own normalizer and pre-tokenizer (Qwen2 regex split + NFC + ByteLevel).
    pre = Qwen2Tokenizer().backend_tokenizer
    corpus = load_corpus()
    tok = _train_once([corpus], vocab_size, pre)
    # Measured: a line of pseudo-words yields ~16+ new tokens, so this usually takes one round.
    num_lines = max(32, (vocab_size - tok.get_vocab_size()) // 16)
    for _ in range(_MAX_SYNTH_ROUNDS):
        if tok.get_vocab_size() >= vocab_size:
            break
        tok = _train_once([corpus, *synthetic_lines(num_lines)], vocab_size, pre)
        num_lines *= 2
    merges = [tuple(pair) for pair in json.loads(tok.to_str())["model"]["merges"]]
    return tok.get_vocab(), merges


def build_qwen_tokenizer(
    vocab_size: int,
    extra_special_tokens: Sequence[str] = (),
    model_max_length: int = 32768,
) -> Qwen2Tokenizer:
    """A `Qwen2Tokenizer` of `vocab_size` ids in total, special tokens included.

    `<|im_end|>` is the eos token (as in Qwen2-Instruct) and `<|endoftext|>` the pad token;
    there is no bos token. The ChatML template is set as `chat_template`.
    """
    specials = list(dict.fromkeys([*QWEN_SPECIAL_TOKENS, *extra_special_tokens]))  # ordered, no duplicates
    smallest = BYTE_ALPHABET_SIZE + len(specials)
    if vocab_size < smallest:
        raise InvalidRequestError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: use at least {smallest} "
            f"(256 byte tokens + {len(specials)} special tokens)",
            param="vocab_size",
        )
    vocab, merges = train_byte_bpe(vocab_size - len(specials))
    base = len(vocab)
    # Placing the specials in the vocab ourselves fixes their ids (Qwen's order); the wrapper
    # would otherwise append them in the order it happens to register them.
    vocab.update({token: base + i for i, token in enumerate(specials)})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        extra_special_tokens=specials[1:],
        clean_up_tokenization_spaces=False,  # decode must be a pure function of the bytes
        model_max_length=model_max_length,
        chat_template=CHATML_TEMPLATE,
    )
