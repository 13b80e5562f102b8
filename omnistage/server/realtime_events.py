"""The Realtime API's data: the session's configuration, conversation items, and the JSON of
both, parsed from client events and written into server events (OpenAI's GA shapes, as the
openai SDK's `types/realtime` models read them).

Audio formats: input and output are `audio/pcm` (pcm16, little-endian, mono) at 24 kHz; the
model hears 16 kHz float32, so committed audio is resampled once, when it becomes an item.

Turn detection: as OpenAI's, new sessions of a model that hears audio start with server_vad
(OpenAI's defaults: threshold 0.5, prefix_padding_ms 300, silence_duration_ms 500,
create_response and interrupt_response on): the Silero speech detector cuts the appended audio
into turns and each turn gets a response. `semantic_vad` is served too, and `null` turns it off
(the client commits turns itself); see server/turn_detection.py.

session.update is strict: a key the GA session object lacks, at any level read here (a typo,
or the beta layout's `session.turn_detection`), is an error naming it (code unknown_parameter,
param e.g. "session.foo"), and so is a value of a GA field not served here (tools, tracing...);
a refused update changes nothing. Client events are bounded at MAX_EVENT_BYTES (see there).
"""

from __future__ import annotations

import difflib
import json
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

from omnistage.chat_tools import template_takes_tools
from omnistage.errors import InvalidRequestError
from omnistage.media.audio import decode_base64, decode_pcm16
from omnistage.server.realtime_tools import call_message, output_message, parse_tool_choice, parse_tools
from omnistage.server.turn_detection import (SEMANTIC_VAD_KEYS, SERVER_VAD_KEYS, TurnDetection,
                                             parse_turn_detection)
from omnistage.server.voices import resolve_voice

PCM_RATE = 24000              # Hz of every audio/pcm the API carries, in and out
MODEL_RATE = 16000            # Hz the model's audio encoder reads
PCM_FORMAT = {"type": "audio/pcm", "rate": PCM_RATE}
DEFAULT_TEMPERATURE = 0.8     # the beta API's default; GA sessions have no temperature field
DEFAULT_MAX_AUDIO_SECONDS = 300.0   # models without their own media limits
MAX_ITEMS = 1024              # conversation items kept per session
# One client event's bound, as OpenAI's for an input_audio_buffer.append ("up to 15 MiB"):
# larger events are answered with an error event. The WebSocket itself takes messages up to
# WS_MAX_MESSAGE_BYTES (uvicorn's ws_max_size, set by `omnistage serve`), so that an oversized
# append gets that error, not a close; only past it the WebSocket layer closes with 1009.
MAX_EVENT_BYTES = 15 * 2**20
WS_MAX_MESSAGE_BYTES = 32 * 2**20

# The GA session object's keys (openai/types/realtime/realtime_session_create_request_param.py),
# and `temperature` (an extension: the beta field)
SESSION_KEYS = ("type", "model", "instructions", "output_modalities", "max_output_tokens",
                "audio", "tools", "tool_choice", "parallel_tool_calls", "tracing", "truncation",
                "include", "prompt", "reasoning", "temperature")
# The GA response.create `response` object's keys (realtime_response_create_params_param.py)
RESPONSE_KEYS = ("audio", "conversation", "input", "instructions", "max_output_tokens", "metadata",
                 "output_modalities", "parallel_tool_calls", "prompt", "reasoning", "tool_choice",
                 "tools")
# beta-layout session keys, and where the GA API puts them
BETA_SESSION_KEYS = {"modalities": "session.output_modalities",
                     "voice": "session.audio.output.voice",
                     "speed": "session.audio.output.speed",
                     "input_audio_format": "session.audio.input.format",
                     "output_audio_format": "session.audio.output.format",
                     "input_audio_transcription": "session.audio.input.transcription",
                     "input_audio_noise_reduction": "session.audio.input.noise_reduction",
                     "turn_detection": "session.audio.input.turn_detection",
                     "max_response_output_tokens": "session.max_output_tokens"}
# GA session fields not served here: the values that mean "none of it" (what session.created
# reports), and why others are refused
UNSERVED_SESSION_FIELDS = {
    "parallel_tool_calls": ((None, True, False), "session.parallel_tool_calls must be a boolean"),
    "tracing": ((None,), "tracing is not supported"),
    "truncation": ((None, "disabled"), "truncation is not supported (a conversation that "
                                       "outgrows the context window fails its response)"),
    "include": ((None, []), "transcription logprobs (include) are not supported"),
    "prompt": ((None,), "stored prompts are not supported"),
    "reasoning": ((None,), "reasoning settings are not supported"),
}


# response.create's fields not served here, as UNSERVED_SESSION_FIELDS
UNSERVED_RESPONSE_FIELDS = {key: UNSERVED_SESSION_FIELDS[key]
                            for key in ("parallel_tool_calls", "prompt", "reasoning")}


class RealtimeError(InvalidRequestError):
    """A client mistake with OpenAI's error code for it (clients branch on these codes, e.g.
    a barge-in's response.cancel answered `response_cancel_not_active` is not fatal)."""

    def __init__(self, message: str, param: str | None, code: str):
        super().__init__(message, param=param)
        self.code = code


class UnknownParameterError(RealtimeError):
    """A key the GA session object does not have (OpenAI's error code: unknown_parameter)."""

    def __init__(self, param: str, hint: str = ""):
        super().__init__(f"Unknown parameter: '{param}'.{hint}", param, "unknown_parameter")


# Keys whose null means "off" (kept); any other null in session.update / response.create means
# "not given" (clients such as LiveKit Agents send every optional field, null when unset).
NULL_MEANS_OFF = frozenset({"turn_detection", "transcription", "noise_reduction"})


def given(obj: dict) -> dict:
    """`obj` without the keys whose value is null, but those where null means "off"."""
    return {k: v for k, v in obj.items() if v is not None or k in NULL_MEANS_OFF}


def check_metadata(metadata, param: str) -> dict | None:
    """OpenAI's metadata: at most 16 string keys (64 chars) to string values (512 chars)."""
    if metadata is None:
        return None
    ok = (isinstance(metadata, dict) and len(metadata) <= 16
          and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                  for k, v in metadata.items()))
    if not ok:
        raise InvalidRequestError(f"{param} must map at most 16 keys (up to 64 characters) to "
                                  "strings (up to 512 characters)", param=param)
    return dict(metadata)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class InputTranscription:
    """session.audio.input.transcription: each committed user audio item is transcribed by the
    served model itself (server/transcribe.py), whatever `model` names (reported back as
    given), into conversation.item.input_audio_transcription.delta / .completed events."""

    model: str
    language: str | None = None           # ISO-639-1, a hint in the ask
    prompt: str | None = None             # earlier words, names, spellings

    def to_json(self) -> dict:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}


def parse_transcription(value, served_model: str) -> InputTranscription | None:
    param = "session.audio.input.transcription"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be null or an object", param=param)
    check_keys(value, ("model", "language", "prompt"), param)
    for key in ("model", "language", "prompt"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise InvalidRequestError(f"{param}.{key} must be a string", param=f"{param}.{key}")
    language = value.get("language") or None
    if language is not None and not (2 <= len(language) <= 8 and language.replace("-", "").isalpha()):
        raise InvalidRequestError(f"{param}.language must be a language code such as 'en'; "
                                  f"got {language!r}", param=f"{param}.language")
    return InputTranscription(value.get("model") or served_model, language,
                              value.get("prompt") or None)


@dataclass
class SessionConfig:
    """What session.update may change; checked as a whole before it replaces the old one."""

    output_modalities: list[str]          # ["text"] or ["audio"] (audio carries its transcript)
    voice: str | None                     # a speaker of the model; None for text models
    instructions: str = ""                # "" -> no system message (the model's own default)
    max_output_tokens: int | None = None  # None: "inf" (up to the context window)
    temperature: float = DEFAULT_TEMPERATURE   # extension (beta field): 0 is greedy
    turn_detection: TurnDetection | None = None   # None: the client commits turns itself
    transcription: InputTranscription | None = None   # None: user audio is not transcribed
    tools: list[dict] = field(default_factory=list)   # realtime function tools (realtime_tools.py)
    tool_choice: str = "auto"             # auto | none

    @property
    def speaks(self) -> bool:
        """Responses are speech (with its transcript), not text."""
        return self.output_modalities == ["audio"]

    @property
    def offered_tools(self) -> list[dict]:
        """The tools a response offers the model (none with tool_choice none)."""
        return self.tools if self.tool_choice == "auto" else []

    def to_json(self, session_id: str, model: str) -> dict:
        return {"type": "realtime", "object": "realtime.session", "id": session_id,
                "model": model, "output_modalities": list(self.output_modalities),
                "instructions": self.instructions,
                "audio": {"input": {"format": PCM_FORMAT,
                                    "transcription": None if self.transcription is None
                                    else self.transcription.to_json(),
                                    "noise_reduction": None,
                                    "turn_detection": None if self.turn_detection is None
                                    else self.turn_detection.to_json()},
                          "output": {"format": PCM_FORMAT, "voice": self.voice, "speed": 1.0}},
                "tools": list(self.tools), "tool_choice": self.tool_choice, "tracing": None,
                "truncation": "disabled",
                "max_output_tokens": _tokens_json(self.max_output_tokens),
                "temperature": self.temperature}


@dataclass
class ModelAbilities:
    """What the served model can hear and say (checked against every request)."""

    speakers: list[str]                   # voices; empty: the model does not speak
    hears_audio: bool                     # audio input parts are accepted
    max_audio_seconds: float              # per committed clip, and the input buffer's bound
    takes_tools: bool = False             # its chat template renders function tools


def model_abilities(engine) -> ModelAbilities:
    can = engine.abilities
    return ModelAbilities(speakers=list(can.speakers) if can.audio_output else [],
                          hears_audio=can.audio_input,
                          max_audio_seconds=can.max_audio_seconds or DEFAULT_MAX_AUDIO_SECONDS,
                          # (text and omni engines: image/video models get no Realtime session)
                          takes_tools=template_takes_tools(engine.tokenizer.chat_template))


def default_config(model: ModelAbilities) -> SessionConfig:
    speaks = bool(model.speakers)
    return SessionConfig(output_modalities=["audio"] if speaks else ["text"],
                         voice=model.speakers[0] if speaks else None,
                         turn_detection=TurnDetection() if model.hears_audio else None)


def update_config(cfg: SessionConfig, session, model: ModelAbilities,
                  served_model: str) -> SessionConfig:
    """session.update's `session` applied over `cfg` (a new object; `cfg` is untouched). Keys
    the GA session object lacks, at every level read here, are refused (UnknownParameterError),
    as are values of GA fields this server does not serve (tools, tracing, ...)."""
    if not isinstance(session, dict):
        raise InvalidRequestError("session must be an object", param="session")
    check_keys(session, SESSION_KEYS, "session", BETA_SESSION_KEYS)
    session = given(session)
    if session.get("type", "realtime") != "realtime":
        raise InvalidRequestError("only 'realtime' sessions are served; set session.type to "
                                  "'realtime' (transcription sessions are not supported)",
                                  param="session.type")
    _check_unserved(session, served_model)
    out = replace(cfg, output_modalities=list(cfg.output_modalities))
    _apply_tools(out, session, "session", model)
    if "instructions" in session:
        out.instructions = _string(session["instructions"], "session.instructions")
    if "output_modalities" in session:
        out.output_modalities = check_modalities(session["output_modalities"], model,
                                                 "session.output_modalities")
    if "max_output_tokens" in session:
        out.max_output_tokens = parse_max_tokens(session["max_output_tokens"],
                                                 "session.max_output_tokens")
    if "temperature" in session:
        t = session["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 2.0:
            raise InvalidRequestError("session.temperature must be a number in [0, 2]",
                                      param="session.temperature")
        out.temperature = float(t)
    _apply_audio(out, _object(session.get("audio"), "session.audio"), model, served_model)
    return out


def _apply_audio(out: SessionConfig, audio: dict, model: ModelAbilities, served_model: str) -> None:
    """session.audio (input and output) applied over `out`."""
    check_keys(audio, ("input", "output"), "session.audio")
    inp = given(_object(audio.get("input"), "session.audio.input"))
    output = given(_object(audio.get("output"), "session.audio.output"))
    check_keys(inp, ("format", "noise_reduction", "transcription", "turn_detection"),
               "session.audio.input")
    check_keys(output, ("format", "speed", "voice"), "session.audio.output")
    for side, part in (("input", inp), ("output", output)):
        if "format" in part:
            check_format(part["format"], f"session.audio.{side}.format")
    if "turn_detection" in inp:
        td = inp["turn_detection"]
        if isinstance(td, dict) and td.get("type") in ("server_vad", "semantic_vad"):
            keys = SERVER_VAD_KEYS if td["type"] == "server_vad" else SEMANTIC_VAD_KEYS
            check_keys(td, keys, "session.audio.input.turn_detection")
        out.turn_detection = parse_turn_detection(td)
    if "transcription" in inp:
        if inp["transcription"] is not None and not model.hears_audio:
            raise InvalidRequestError("this model does not hear audio: it cannot transcribe; set "
                                      "session.audio.input.transcription to null",
                                      param="session.audio.input.transcription")
        out.transcription = parse_transcription(inp["transcription"], served_model)
    if inp.get("noise_reduction") is not None:
        raise InvalidRequestError("input audio noise reduction is not supported; set "
                                  "session.audio.input.noise_reduction to null",
                                  param="session.audio.input.noise_reduction")
    if output.get("speed", 1.0) != 1.0:
        raise InvalidRequestError("session.audio.output.speed must be 1.0",
                                  param="session.audio.output.speed")
    if "voice" in output:
        out.voice = check_voice(output["voice"], model, "session.audio.output.voice")


def _check_unserved(session: dict, served_model: str) -> None:
    """GA session fields this server does not serve: only their neutral values pass."""
    if "model" in session and session["model"] != served_model:
        raise InvalidRequestError(f"this server serves {served_model!r}; set session.model to "
                                  "that or drop it", param="session.model")
    refuse_unserved(session, UNSERVED_SESSION_FIELDS, "session")


def refuse_unserved(obj: dict, table: dict, prefix: str) -> None:
    """Fields of `obj` (at `prefix`) in `table` (field -> (neutral values, why not served)) that
    hold anything but a neutral value are refused, naming the field."""
    for key, (accepted, why) in table.items():
        if key in obj and not any(obj[key] == a and type(obj[key]) is type(a) for a in accepted):
            shown = " or ".join(json.dumps(a) for a in accepted if a is not None)
            raise InvalidRequestError(f"{why}; drop {prefix}.{key}" + (f" or set it to {shown}" if shown else ""),
                                      param=f"{prefix}.{key}")


def check_keys(obj: dict, allowed, param: str, moved: dict[str, str] | None = None) -> None:
    """Refuses the first key of `obj` (the object at `param`) that is not in `allowed`; `moved`
    maps beta-layout keys to where the GA API puts them, for the hint."""
    moved = moved or {}
    for key in obj:
        if key in allowed:
            continue
        if key in moved:
            hint = f" That is the beta layout; the GA API puts it at {moved[key]}."
        else:
            close = difflib.get_close_matches(str(key), [*allowed, *moved], n=1, cutoff=0.75)
            hint = f" Did you mean {moved.get(close[0], f'{param}.{close[0]}')}?" if close else ""
        raise UnknownParameterError(f"{param}.{key}", hint)


def response_config(session: SessionConfig, body, model: ModelAbilities) -> SessionConfig:
    """response.create's `response` overrides over the session's config."""
    if body is None:
        return session
    if not isinstance(body, dict):
        raise InvalidRequestError("response must be an object", param="response")
    check_keys(body, RESPONSE_KEYS, "response")
    body = given(body)
    refuse_unserved(body, UNSERVED_RESPONSE_FIELDS, "response")
    if body.get("input") is not None or body.get("conversation", "auto") != "auto":
        raise InvalidRequestError("out-of-band responses (response.input, "
                                  "response.conversation) are not supported; drop them",
                                  param="response.conversation")
    cfg = replace(session)
    _apply_tools(cfg, body, "response", model)
    if "output_modalities" in body:
        cfg.output_modalities = check_modalities(body["output_modalities"], model,
                                                 "response.output_modalities")
    if "instructions" in body:
        if not isinstance(body["instructions"], str):
            raise InvalidRequestError("response.instructions must be a string",
                                      param="response.instructions")
        cfg.instructions = body["instructions"]
    if "max_output_tokens" in body:
        cfg.max_output_tokens = parse_max_tokens(body["max_output_tokens"],
                                                 "response.max_output_tokens")
    audio = body.get("audio")
    output = audio.get("output") if isinstance(audio, dict) else None
    voice = output.get("voice") if isinstance(output, dict) else None
    if voice is not None:
        cfg.voice = check_voice(voice, model, "response.audio.output.voice")
    return cfg


def _apply_tools(cfg: SessionConfig, obj: dict, prefix: str, model: ModelAbilities) -> None:
    if "tools" in obj:
        cfg.tools = parse_tools(obj["tools"], f"{prefix}.tools")
        if cfg.tools and not model.takes_tools:
            raise InvalidRequestError("this model's chat template has no function calling: it "
                                      f"cannot be given tools; set {prefix}.tools to []",
                                      param=f"{prefix}.tools")
    if "tool_choice" in obj:
        cfg.tool_choice = parse_tool_choice(obj["tool_choice"], f"{prefix}.tool_choice")


def check_modalities(mods, model: ModelAbilities, param: str) -> list[str]:
    if mods not in (["text"], ["audio"]):
        raise InvalidRequestError(f"{param} must be ['text'] or ['audio'] (audio output carries "
                                  f"its transcript); got {mods!r}", param=param)
    if mods == ["audio"] and not model.speakers:
        raise InvalidRequestError(f"this model produces text only; set {param} to ['text']",
                                  param=param)
    return list(mods)


def check_voice(voice, model: ModelAbilities, param: str) -> str:
    if isinstance(voice, dict):
        check_keys(voice, ("id",), param)
        voice = voice.get("id")
    if not model.speakers:
        raise InvalidRequestError("this model does not speak; drop the voice", param=param)
    voice = resolve_voice(voice, model.speakers)
    if voice not in model.speakers:
        raise InvalidRequestError(f"unknown voice {voice!r}; choose one of {model.speakers}",
                                  param=param)
    return voice


def check_format(fmt, param: str) -> None:
    """Only 24 kHz pcm16 ("audio/pcm"; the beta's "pcm16" is accepted too)."""
    if isinstance(fmt, dict):
        check_keys(fmt, ("type", "rate"), param)
    ok = fmt == "pcm16" or (isinstance(fmt, dict) and fmt.get("type") == "audio/pcm"
                            and fmt.get("rate", PCM_RATE) == PCM_RATE)
    if not ok:
        raise InvalidRequestError(f"{param} must be {{'type': 'audio/pcm', 'rate': 24000}}; "
                                  f"got {fmt!r} (G.711 pcmu/pcma are not supported)", param=param)


def parse_max_tokens(value, param: str) -> int | None:
    if value == "inf" or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise InvalidRequestError(f"{param} must be an integer in [1, 4096] or 'inf'", param=param)
    return value


# ---- conversation items -----------------------------------------------------------------------

@dataclass
class Part:
    type: str                             # input_text | input_audio | output_text | output_audio
    text: str = ""                        # the text, or an audio part's transcript
    audio: np.ndarray | None = None       # input_audio: (N,) float32 at MODEL_RATE
    # output_audio: the pcm16 at PCM_RATE the client was sent (realtime_items bounds it);
    # None once dropped to make room, or for other parts
    pcm: bytearray | None = None

    def to_json(self) -> dict:
        if self.type == "input_audio":
            return {"type": "input_audio", "audio": None, "transcript": self.text or None}
        if self.type == "output_audio":
            return {"type": "output_audio", "audio": None, "transcript": self.text}
        return {"type": self.type, "text": self.text}


@dataclass
class Item:
    id: str
    role: str                             # user | assistant | system ("" for function items)
    parts: list[Part] = field(default_factory=list)
    status: str = "completed"             # in_progress while a response writes it
    type: str = "message"                 # message | function_call | function_call_output
    call_id: str = ""                     # function items: the call they are or answer
    name: str = ""                        # function_call: the function
    arguments: str = ""                   # function_call: its arguments, JSON text
    output: str = ""                      # function_call_output: what the client's run gave

    def to_json(self) -> dict:
        base = {"id": self.id, "type": self.type, "object": "realtime.item"}
        if self.type == "function_call":
            return {**base, "status": self.status, "call_id": self.call_id, "name": self.name,
                    "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        return {**base, "role": self.role, "status": self.status,
                "content": [p.to_json() for p in self.parts]}

    def message(self) -> dict:
        """The item as one chat message for the engine (see models/qwen2_5_omni/processor)."""
        if self.type == "function_call":
            return call_message(self.call_id, self.name, self.arguments)
        if self.type == "function_call_output":
            return output_message(self.call_id, self.output)
        if self.role != "user":
            return {"role": self.role, "content": "".join(p.text for p in self.parts)}
        return {"role": "user", "content": [
            {"type": "audio", "audio": p.audio} if p.type == "input_audio"
            else {"type": "text", "text": p.text} for p in self.parts]}

    def audio_seconds(self) -> float:
        return sum(p.audio.size for p in self.parts if p.audio is not None) / MODEL_RATE


def audio_part(pcm: bytes, max_seconds: float, param: str) -> Part:
    """24 kHz pcm16 bytes -> an input_audio part at the model's rate."""
    clip = decode_pcm16(pcm, input_rate=PCM_RATE, sample_rate=MODEL_RATE,
                        max_seconds=max_seconds, param=param)
    return Part("input_audio", audio=clip.samples)


def parse_item(item, model: ModelAbilities, taken: set[str]) -> Item:
    """conversation.item.create's `item`: a message from the user (input_text, input_audio),
    the system (input_text) or the assistant (output_text); or a function_call_output (the
    result of a call the model made) or a function_call (a call, to rebuild a history)."""
    if isinstance(item, dict) and item.get("type") in ("function_call", "function_call_output"):
        return _function_item(item, taken)
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise InvalidRequestError("item.type must be message, function_call or "
                                  "function_call_output", param="item.type")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise InvalidRequestError("item.role must be 'user', 'assistant' or 'system'",
                                  param="item.role")
    item_id = item.get("id") or new_id("item")
    if not isinstance(item_id, str) or item_id in taken:
        raise InvalidRequestError(f"item.id {item_id!r} is already in the conversation; "
                                  "omit it to get a fresh one", param="item.id")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise InvalidRequestError("item.content must be a non-empty list of content parts",
                                  param="item.content")
    allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
               "assistant": ("output_text",)}[role]
    parts = []
    for i, p in enumerate(content):
        param = f"item.content[{i}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in allowed:
            raise InvalidRequestError(f"{param}: a {role} message takes parts of type "
                                      f"{', '.join(allowed)}; got {kind!r}", param=param)
        if kind == "input_audio":
            if not model.hears_audio:
                raise InvalidRequestError(f"{param}: this model takes text only", param=param)
            raw = decode_base64(_string(p.get("audio"), f"{param}.audio"), param=f"{param}.audio")
            parts.append(audio_part(raw, model.max_audio_seconds, f"{param}.audio"))
        else:
            parts.append(Part(kind, text=_string(p.get("text"), f"{param}.text")))
    return Item(item_id, role, parts)


def _function_item(item: dict, taken: set[str]) -> Item:
    kind = item["type"]
    keys = ("call_id", "output") if kind == "function_call_output" else ("call_id", "name", "arguments")
    unknown = set(item) - {"type", "id", "object", "status", *keys}
    if unknown:
        raise InvalidRequestError(f"a {kind} item has unknown keys {sorted(unknown)}", param="item")
    values = {k: _string(item.get(k), f"item.{k}") for k in keys}
    if not values["call_id"]:
        raise InvalidRequestError(f"a {kind} item needs its call_id", param="item.call_id")
    item_id = item.get("id") or new_id("item")
    if not isinstance(item_id, str) or item_id in taken:
        raise InvalidRequestError(f"item.id {item_id!r} is already in the conversation; "
                                  "omit it to get a fresh one", param="item.id")
    return Item(item_id, "", type=kind, **values)


def insert_position(prev, items: list[Item]) -> int:
    """Where conversation.item.create's item goes: after `previous_item_id` (None: at the
    end, "root": first)."""
    if prev is None:
        return len(items)
    if prev == "root":
        return 0
    for i, item in enumerate(items):
        if item.id == prev:
            return i + 1
    raise InvalidRequestError(f"previous_item_id {prev!r} is not in the conversation",
                              param="previous_item_id")


def check_room(items: list[Item], item: Item, model: ModelAbilities) -> None:
    """Refuses an item the conversation has no room for (count, or audio in all)."""
    if len(items) >= MAX_ITEMS:
        raise InvalidRequestError(f"the conversation holds {MAX_ITEMS} items, the most a "
                                  "session keeps; start a new session", param="item")
    audio = sum(i.audio_seconds() for i in items) + item.audio_seconds()
    if audio > model.max_audio_seconds:
        raise InvalidRequestError(
            f"the conversation's audio would exceed {model.max_audio_seconds:g} s; "
            "start a new session", param="item")


def check_event_size(size: int, kind) -> None:
    """Refuses a client event of `size` characters (JSON text) over MAX_EVENT_BYTES."""
    if size <= MAX_EVENT_BYTES:
        return
    seconds = MAX_EVENT_BYTES * 3 // 4 // 2 // PCM_RATE     # base64 of pcm16 at 24 kHz
    raise InvalidRequestError(
        f"this event is {size / 2**20:.1f} MiB; a client event may carry at most "
        f"{MAX_EVENT_BYTES // 2**20} MiB (one input_audio_buffer.append: about {seconds} s of "
        "24 kHz pcm16): send the audio in smaller appends, e.g. 100 ms each (this event was "
        "dropped)", param="audio" if kind == "input_audio_buffer.append" else None)


def appended_pcm(event: dict, model: ModelAbilities) -> bytes:
    """input_audio_buffer.append's audio: base64 pcm16 -> bytes (whole samples)."""
    if not model.hears_audio:
        raise InvalidRequestError("this model takes text only; send input_text items",
                                  param="audio")
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise InvalidRequestError("audio must be a base64 string of pcm16 samples", param="audio")
    raw = decode_base64(audio, param="audio")
    if len(raw) % 2:
        raise InvalidRequestError("audio must hold whole 16-bit samples (an even number of "
                                  "bytes)", param="audio")
    return raw


# ---- server events ----------------------------------------------------------------------------

def response_json(response_id: str, status: str, cfg: SessionConfig, output: list[Item],
                  details: dict | None = None, usage: dict | None = None,
                  metadata: dict | None = None) -> dict:
    return {"id": response_id, "object": "realtime.response", "status": status,
            "status_details": details, "output": [i.to_json() for i in output],
            "conversation_id": None, "output_modalities": list(cfg.output_modalities),
            "max_output_tokens": _tokens_json(cfg.max_output_tokens), "metadata": metadata,
            "audio": {"output": {"format": PCM_FORMAT, "voice": cfg.voice}}, "usage": usage}


def usage_json(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens}


def error_json(message: str, param: str | None = None, code: str | None = None,
               event_id: str | None = None, kind: str = "invalid_request_error") -> dict:
    """An `error` event's body; `event_id` names the client event that caused it."""
    return {"type": "error", "error": {"type": kind, "code": code, "message": message,
                                       "param": param, "event_id": event_id}}


# ---- helpers ----------------------------------------------------------------------------------

def _tokens_json(n: int | None):
    return "inf" if n is None else n


def _string(value, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param=param)
    return value


def _object(value, param: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    return value
