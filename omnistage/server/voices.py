"""OpenAI's voice names on the models' own speakers, so clients that send OpenAI's defaults
(LiveKit Agents: "marin"; the openai SDK's examples: "alloy") get speech instead of a 400.

A name that is one of the model's speakers (any case) is that speaker. An OpenAI voice maps by
its kind to the model's first speaker of that kind; a neutral one, or a kind the model has no
speaker of, to the model's default (first) speaker:

| OpenAI voice | kind | Qwen2.5-Omni (Chelsie, Ethan) | Qwen3-Omni (ethan, aiden, chelsie) |
|---|---|---|---|
| coral, marin, nova, sage, shimmer | female | Chelsie | chelsie |
| ash, ballad, cedar, echo, onyx, verse | male | Ethan | ethan |
| alloy, fable | neutral | Chelsie (default) | ethan (default) |

Any other name passes through unchanged, and the engine refuses it naming the voices it has.
"""

from __future__ import annotations

OPENAI_VOICES = {
    "alloy": None, "fable": None,
    "coral": "female", "marin": "female", "nova": "female", "sage": "female", "shimmer": "female",
    "ash": "male", "ballad": "male", "cedar": "male", "echo": "male", "onyx": "male", "verse": "male",
}
# What kind of voice each known speaker of the served families has.
SPEAKER_KINDS = {"chelsie": "female", "ethan": "male", "aiden": "male"}


def resolve_voice(voice: str | None, speakers: tuple[str, ...] | list[str]) -> str | None:
    """The speaker `voice` names for a model with `speakers` (see the module docstring)."""
    if not isinstance(voice, str) or not speakers:
        return voice
    by_name = {s.lower(): s for s in speakers}
    if voice.lower() in by_name:
        return by_name[voice.lower()]
    if voice.lower() not in OPENAI_VOICES:
        return voice
    kind = OPENAI_VOICES[voice.lower()]
    same = [s for s in speakers if kind is not None and SPEAKER_KINDS.get(s.lower()) == kind]
    return same[0] if same else speakers[0]
