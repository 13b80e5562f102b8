"""The cascade's edges: a request flows asr -> llm -> tts; text deltas come from the LLM as it
writes, audio from the TTS sentence by sentence. The router renders the chat for the LLM once
the transcripts are in (the audio parts become text parts holding what was heard)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.graph import CLIENT, Edge
from omnistage.models.cascade.messages import CascadeRequest, HearJob, SpeakText, Transcripts
from omnistage.models.qwen2_5_omni.router import audio_deltas, reply_done
from omnistage.outputs import Delta
from omnistage.stage_messages import StageOutput
from omnistage.stages.ar import ARRequest, ARStepOutput


@dataclass
class _Flow:
    req: CascadeRequest
    text_done: bool = False
    audio_done: bool = False
    finish_reason: str | None = None


def chat_with_transcripts(messages: list[dict], texts: list[str]) -> list[dict]:
    """The chat a text model's template reads: each message's content one string, an audio
    part replaced by its transcript."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            pieces = [texts[p["index"]] if p.get("type") == "audio_ref" else p.get("text", "")
                      for p in content]
            content = "\n".join(p for p in pieces if p)
        out.append({**m, "content": content})
    return out


class CascadeRouter:
    def __init__(self, tokenizer, speaks: bool):
        self.tokenizer = tokenizer
        self.flows: dict[str, _Flow] = {}
        self.edges = [Edge("asr", "llm"), Edge("asr", CLIENT), Edge("llm", CLIENT)]
        if speaks:
            self.edges += [Edge("llm", "tts"), Edge("tts", CLIENT)]

    def unfinished(self) -> set[str]:
        return set(self.flows)

    def forget(self, request_id: str) -> None:
        self.flows.pop(request_id, None)

    def start(self, req: CascadeRequest) -> list[tuple[str, object]]:
        self.flows[req.request_id] = _Flow(req, audio_done=not req.speak)
        if req.audio:
            return [("asr", HearJob(req.request_id, req.audio, partial=req.prefill_only))]
        return [("llm", self._llm_request(req, []))]

    def _llm_request(self, req: CascadeRequest, texts: list[str]) -> ARRequest:
        chat = chat_with_transcripts(req.messages, texts)
        ids = self.tokenizer.apply_chat_template(chat, tools=req.tools, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return ARRequest(req.request_id, list(ids), req.params)

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        flow = self.flows.get(out.request_id)
        if flow is None:   # aborted while the output was in flight
            return []
        if out.stage == "asr":
            return self._heard(flow, out.payload)
        if out.stage == "llm":
            return self._from_llm(flow, out.payload)
        return audio_deltas(flow, flow.req.request_id, out.payload)

    def _heard(self, flow: _Flow, t: Transcripts) -> list[tuple[str, object]]:
        if flow.req.prefill_only:      # a turn still spoken: heard so far, nothing to answer yet
            flow.text_done, flow.audio_done, flow.finish_reason = True, True, "stop"
            return reply_done(flow, flow.req.request_id)
        if not flow.req.transcribe_only:
            return [("llm", self._llm_request(flow.req, t.texts))]
        # a transcription: the answer is what was heard
        flow.text_done, flow.audio_done, flow.finish_reason = True, True, "stop"
        text = " ".join(x for x in t.texts if x)
        return [(CLIENT, Delta(t.request_id, 0, text, [])), *reply_done(flow, flow.req.request_id)]

    def _from_llm(self, flow: _Flow, o: ARStepOutput) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if o.token_ids or o.text:
            out.append((CLIENT, Delta(o.request_id, 0, o.text, o.token_ids, logprobs=o.logprobs,
                                      num_prompt_tokens=o.num_prompt_tokens)))
        if flow.req.speak and (o.text or o.finished):
            out.append(("tts", SpeakText(o.request_id, o.text, flow.req.voice, finished=o.finished)))
        if o.finished:
            flow.text_done, flow.finish_reason = True, o.finish_reason
            out += reply_done(flow, flow.req.request_id)
        return out
