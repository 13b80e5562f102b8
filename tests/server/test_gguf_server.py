"""`omnistage serve FILE.gguf`: a q4_0 GGUF file served as it is stored, driven by the real
openai SDK; its chat template and tokenizer come from the file. The answer equals the offline
API's over the same file."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from benchmarks.gguf_export import export
from omnistage import Omni, SamplingParams

gguf = pytest.importorskip("gguf")
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def q4_0_file(tiny_qwen2, tmp_path_factory) -> str:
    return str(export(Path(tiny_qwen2), tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf", gguf, "q4_0"))


@pytest.mark.usefixtures("c_compiler")
def test_chat_over_a_gguf_file(start_server, q4_0_file, api_key):
    want = Omni(q4_0_file, block_size=4).generate(
        MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    with start_server(q4_0_file) as running:
        client = openai.OpenAI(base_url=f"{running.base}/v1", api_key=api_key, max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
