"""What every example shares: the client (OPENAI_BASE_URL / OPENAI_API_KEY, as the openai SDK
reads them; default http://127.0.0.1:8000/v1) and the served model's name."""

from __future__ import annotations

import argparse
import os

import openai


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                         api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0, timeout=600)


def model(c: openai.OpenAI, given: str | None) -> str:
    """`given`, else the server's (first) model."""
    return given or c.models.list().data[0].id


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="served model name (default: the server's first model)")
    return p
