"""`cascade:ASR+LLM+TTS` -> a cascade folder: config.json naming the architecture
`OmnistageCascade`, the ASR, the TTS and the text model's folder (e.g.
`cascade:pocketsphinx+tiny:qwen2+espeak`, `cascade:pocketsphinx+/models/Qwen2.5-0.5B-Instruct+flite`).

The folder is written once per spec under `<omnistage cache>/cascade/` (a person may also write
one by hand: it is an ordinary model folder to every entry point and deploy config)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from omnistage.errors import InvalidRequestError
from omnistage.models.cascade.speech_tools import ASR_TOOLS, TTS_TOOLS
from omnistage.paths import cache_dir

PREFIX = "cascade:"
ARCHITECTURE = "OmnistageCascade"


def parse_spec(spec: str) -> tuple[str, str, str]:
    """'cascade:ASR+LLM+TTS' -> (asr, llm, tts); the LLM part may hold ':' and '+'."""
    body = spec[len(PREFIX):]
    if not spec.startswith(PREFIX) or body.count("+") < 2:
        raise InvalidRequestError(f"{spec!r} is not cascade:ASR+LLM+TTS (e.g. "
                                  f"cascade:pocketsphinx+tiny:qwen2+espeak)", param="model")
    asr, rest = body.split("+", 1)
    llm, tts = rest.rsplit("+", 1)
    if asr not in ASR_TOOLS:
        raise InvalidRequestError(f"unknown cascade ASR {asr!r}; one of {sorted(ASR_TOOLS)}", param="model")
    if tts not in TTS_TOOLS:
        raise InvalidRequestError(f"unknown cascade TTS {tts!r}; one of {sorted(TTS_TOOLS)}", param="model")
    return asr, llm, tts


def cascade_folder(spec: str, resolve: Callable[[str], str]) -> Path:
    """The folder serving `spec`; `resolve` turns the LLM part into a local folder (tiny:ARCH
    specs are built on first use)."""
    asr, llm, tts = parse_spec(spec)
    llm_dir = Path(resolve(llm)).resolve()
    if not (llm_dir / "config.json").is_file():
        raise InvalidRequestError(f"the cascade's LLM {llm!r} is not a model folder (no config.json)",
                                  param="model")
    cfg = {"architectures": [ARCHITECTURE], "asr": asr, "llm": str(llm_dir), "tts": tts}
    text = json.dumps(cfg, indent=1)
    out = cache_dir() / "cascade" / hashlib.sha256(text.encode()).hexdigest()[:16]
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"config.json.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / "config.json")       # never half-written
    return out
