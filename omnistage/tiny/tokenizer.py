"""An offline Qwen2-style tokenizer: byte-level BPE trained here, deterministically.

No hub, no downloaded vocabulary: the merges are learned from `corpus.txt` (original English
prose shipped in this package) and, when a larger vocabulary is asked for than that text can
yield, from pseudo-words drawn from a fixed-seed RNG. Pre-tokenization (Qwen2's split regex,
NFC, ByteLevel) is taken from `transformers.Qwen2Tokenizer` itself, so the trained merges and
the wrapper that applies them can never disagree.

Layout of the ids, like real Qwen: the byte alphabet and merges first, then `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, then any extra added tokens in the order given (special ones as
`str`; an `AddedToken(..., special=False)` is a plain added token, like Qwen's `<tool_call>`).
The tokenizer's length equals the requested vocab size when it can be reached (always, for sizes
up to a few ten thousands); otherwise the largest size training reached (see `train_byte_bpe`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from importlib import resources

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
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
    # Tools as Qwen2.5 offers them: signatures in the system turn, calls as <tool_call> JSON,
    # results in a user turn as <tool_response>. Without tools or tool messages the text is
    # plain ChatML, as before.
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- render_content(messages[0]['content']) -}}"
    "{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- render_content(message['content']) -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render_content(message['content']) -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- if render_content(message['content']) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + f['name'] + '\\\", \\\"arguments\\\": ' -}}"
    "{%- if f['arguments'] is string -%}{{- f['arguments'] -}}{%- else -%}{{- f['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen2.5-Omni's template, rendering the same text as the real checkpoint's: ChatML with a default
# system turn; a list content renders its parts in order: text as is, each audio part as
# `<|audio_bos|><|AUDIO|><|audio_eos|>`, each image as `<|vision_bos|><|IMAGE|><|vision_eos|>`,
# each video as `<|vision_bos|><|VIDEO|><|vision_eos|>` (the processor later repeats the
# AUDIO/IMAGE/VIDEO placeholder once per encoder output). A part is recognised by its OpenAI
# `type` (text, input_audio, audio, audio_url, image, image_url, video, video_url) or, as in the
# real template, by holding such a key. `add_audio_id` / `add_vision_id` prefix "Audio N: ",
# "Picture N: ", "Video N: " as Qwen does.
OMNI_CHAT_TEMPLATE = (
    "{%- set seen = namespace(audio=0, image=0, video=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}"
    "{%- set kind = part['type'] if 'type' in part else '' -%}"
    "{%- if kind in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    "{%- set seen.image = seen.image + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + seen.image|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' -}}"
    "{%- elif kind in ('audio', 'input_audio', 'audio_url') or 'audio' in part or 'input_audio' in part"
    " or 'audio_url' in part -%}"
    "{%- set seen.audio = seen.audio + 1 -%}"
    "{%- if add_audio_id -%}{{- 'Audio ' + seen.audio|string + ': ' -}}{%- endif -%}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
    "{%- elif kind in ('video', 'video_url') or 'video' in part or 'video_url' in part -%}"
    "{%- set seen.video = seen.video + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' + seen.video|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
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
_WHOLE_WORD_REPEATS = 2000    # far more frequent than any corpus word: merged before any of them


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


def train_byte_bpe(vocab_size: int, whole_words: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn `vocab_size` byte-level BPE tokens (no special tokens); return (vocab, merges).

    First the corpus alone; while short of the target, retrain with more pseudo-word lines
    (doubling, at most `_MAX_SYNTH_ROUNDS` times). If still short, the largest vocabulary
    reached is returned: callers read its size from `len(vocab)`. `whole_words` (e.g. ChatML's
    role names) are added to the corpus often enough that BPE merges each into one token first.
    """
    # The wrapper's own normalizer and pre-tokenizer (Qwen2 regex split + NFC + ByteLevel).
    pre = Qwen2Tokenizer().backend_tokenizer
    corpus = load_corpus() + "".join("\n".join(whole_words) + "\n" for _ in range(_WHOLE_WORD_REPEATS if whole_words else 0))
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
    extra_special_tokens: Sequence[str | AddedToken] = (),
    model_max_length: int = 32768,
    *,
    named_tokens: Mapping[str, str] | None = None,
    chat_template: str = CHATML_TEMPLATE,
    whole_words: Sequence[str] = (),
) -> Qwen2Tokenizer:
    """A `Qwen2Tokenizer` of `vocab_size` ids in total, added tokens included.

    `<|im_end|>` is the eos token (as in Qwen2-Instruct) and `<|endoftext|>` the pad token;
    there is no bos token. `extra_special_tokens` take the ids after `<|im_end|>`, in order; an
    `AddedToken` with `special=False` among them is added as a plain (non-special) token.
    `named_tokens` maps attribute names to tokens (e.g. {"audio_token": "<|AUDIO|>"} gives
    `tokenizer.audio_token` / `tokenizer.audio_token_id`, as multimodal processors expect).
    `whole_words` become single tokens (see `train_byte_bpe`).
    """
    plain = [t.content for t in extra_special_tokens if isinstance(t, AddedToken) and not t.special]
    names = [t.content if isinstance(t, AddedToken) else t for t in extra_special_tokens]
    added = list(dict.fromkeys([*QWEN_SPECIAL_TOKENS, *names]))  # ordered, no duplicates
    smallest = BYTE_ALPHABET_SIZE + len(added)
    if vocab_size < smallest:
        raise InvalidRequestError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: use at least {smallest} "
            f"(256 byte tokens + {len(added)} special tokens)",
            param="vocab_size",
        )
    vocab, merges = train_byte_bpe(vocab_size - len(added), whole_words)
    base = len(vocab)
    # Placing the added tokens in the vocab ourselves fixes their ids (Qwen's order); the wrapper
    # would otherwise append them in the order it happens to register them.
    vocab.update({token: base + i for i, token in enumerate(added)})
    specials = [t for t in added if t not in plain]
    # Named tokens only when given: the plain qwen2 build must keep writing identical files.
    named = {"model_specific_special_tokens": dict(named_tokens)} if named_tokens else {}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        extra_special_tokens=specials[1:],
        clean_up_tokenization_spaces=False,  # decode must be a pure function of the bytes
        model_max_length=model_max_length,
        chat_template=chat_template,
        **named,
    )
    if plain:
        # Already in the vocab, so they keep their ids; registering them makes "<tool_call>" one token.
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tokenizer
