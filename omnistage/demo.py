"""`omnistage demo`: a Gradio page in front of an omnistage server, through its public API
only (the openai SDK and /v1/models), so what it shows is what any client gets.

The tabs follow what the model serves (GET /v1/models, its `omnistage` card): text chat
(streamed); voice chat (microphone or file in, the answer's text and speech streamed back over
chat completions, a voice picker); speech (/v1/audio/speech); transcription; image generation
(/v1/images/generations, or /v1/images/edits with an input image; previews while denoising);
video jobs (POST /v1/videos, progress as it is polled, then the
MP4). A refusal from the server shows as its message, not a trace. Without --api-base the model
is served in this process (`LocalServer`) and the page talks to it over loopback like any client.

Needs the `demo` extra (`pip install -e '.[demo]'`: gradio and the openai SDK).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import wave
from dataclasses import dataclass

import numpy as np

CHAT_MAX_TOKENS = 256
VIDEO_POLL_S = 0.5          # the videos API is polled (OpenAI's shape): how often the tab asks
VIDEO_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Served:
    """What GET /v1/models says of the served model."""

    model: str
    generates: str = "text"
    audio_output: bool = False
    audio_input: bool = False
    voices: tuple[str, ...] = ()
    sample_rate: int = 24000


def served_model(client) -> Served:
    card = client.models.list().data[0]
    extra = (card.model_extra or {}).get("omnistage") or {}
    return Served(card.id, extra.get("generates", "text"), bool(extra.get("audio_output")),
                  bool(extra.get("audio_input")), tuple(extra.get("voices") or ()),
                  extra.get("sample_rate") or 24000)


def _refusal(e: Exception) -> str:
    """The server's own message for an API error (a 4xx names the field), else the error."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and body.get("message"):
        return f"The server refused: {body['message']}"
    return f"{type(e).__name__}: {e}"


def _wav_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pcm(data: bytes) -> np.ndarray:
    """16-bit PCM as the server sent it. Gradio plays int16 as given; float audio it rescales
    to full scale (each clip by its own peak: a quiet answer played loud, and the streamed
    answer's volume moving as it grows)."""
    return np.frombuffer(data, dtype="<i2")


class DemoActions:
    """The tabs' actions: plain functions of the client, testable without a browser."""

    def __init__(self, client, served: Served):
        self.client, self.served = client, served

    def chat(self, message: str, history: list[dict]):
        """Stream the answer into the chat history (OpenAI-style message dicts)."""
        history = [*history, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        try:
            # `with`: leaving early (a cancelled event) closes the stream: the server aborts
            with self.client.chat.completions.create(
                    model=self.served.model, messages=history[:-1], max_tokens=CHAT_MAX_TOKENS,
                    stream=True, modalities=["text"]) as stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        history[-1]["content"] += choice.delta.content or ""
                        yield history, ""
        except Exception as e:      # the page shows the refusal, whatever the SDK raised
            history[-1]["content"] = _refusal(e)
        yield history, ""

    def voice_chat(self, audio_path: str | None, voice: str | None):
        """Spoken question in; the answer's transcript and speech streamed back (24 kHz)."""
        if not audio_path:
            yield "Record or upload a question first.", None
            return
        content = [{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(_wav_bytes(audio_path)).decode(), "format": "wav"}}]
        text, pcm = "", b""
        try:
            with self.client.chat.completions.create(      # closed when stopped: the server aborts
                    model=self.served.model, messages=[{"role": "user", "content": content}],
                    max_tokens=CHAT_MAX_TOKENS, stream=True, modalities=["text", "audio"],
                    audio={"voice": voice or self.served.voices[0], "format": "pcm16"}) as stream:
                for chunk in stream:
                    for choice in chunk.choices:
                        audio = choice.delta.audio      # the SDK's ChoiceDeltaAudio: transcript and/or data
                        # the text comes as content, as the audio's transcript, or both: once
                        text += choice.delta.content or (audio.transcript if audio is not None else None) or ""
                        if audio is not None and audio.data:
                            pcm += base64.b64decode(audio.data)
                    yield text, (self.served.sample_rate, _pcm(pcm)) if pcm else None
        except Exception as e:
            yield _refusal(e), None

    def speech(self, text: str, voice: str | None):
        try:
            data = self.client.audio.speech.create(model=self.served.model, input=text,
                                                   voice=voice or self.served.voices[0],
                                                   response_format="wav").read()
        except Exception as e:
            return None, _refusal(e)
        with wave.open(io.BytesIO(data)) as w:
            return (w.getframerate(), _pcm(w.readframes(w.getnframes()))), ""

    def transcribe(self, audio_path: str | None) -> str:
        if not audio_path:
            return "Record or upload audio first."
        try:
            return self.client.audio.transcriptions.create(
                model=self.served.model, file=("audio.wav", _wav_bytes(audio_path))).text
        except Exception as e:
            return _refusal(e)

    def image(self, prompt: str, size: str, steps: float, source: str | None = None):
        """Generate (or, with a `source` image file, edit): the denoising's previews as they
        come (`partial_images`, the predicted final image part-way through), then the image."""
        from PIL import Image

        args = dict(model=self.served.model, prompt=prompt, size=size, stream=True, partial_images=2,
                    extra_body={"num_inference_steps": int(steps)})
        try:
            if source:
                with open(source, "rb") as f:
                    events = self.client.images.edit(image=f, **args)
                    yield from self._images(events, Image)
            else:
                yield from self._images(self.client.images.generate(**args), Image)
        except Exception as e:
            yield None, _refusal(e)

    @staticmethod
    def _images(events, image_module):
        for event in events:
            picture = image_module.open(io.BytesIO(base64.b64decode(event.b64_json)))
            if event.type.endswith("partial_image"):
                yield picture, f"denoising: preview {event.partial_image_index + 1}"
            else:
                yield picture, "done"


class VideoActions:
    """The video tab: create a job, show its progress as it is polled, then the MP4."""

    def __init__(self, client, served: Served, folder: str):
        self.client, self.served, self.folder = client, served, folder

    def make(self, prompt: str, size: str, seconds: str, steps: float):
        try:
            job = self.client.videos.create(model=self.served.model, prompt=prompt, size=size,
                                            seconds=seconds, extra_body={"num_inference_steps": int(steps)})
            deadline = time.monotonic() + VIDEO_TIMEOUT_S
            while job.status not in ("completed", "failed") and time.monotonic() < deadline:
                yield f"{job.status}: {job.progress or 0}%", None
                time.sleep(VIDEO_POLL_S)
                job = self.client.videos.retrieve(job.id)
            if job.status != "completed":
                yield f"The job ended {job.status}: {getattr(job, 'error', None) or 'no video'}", None
                return
            path = os.path.join(self.folder, f"{job.id}.mp4")
            with open(path, "wb") as f:
                f.write(self.client.videos.download_content(job.id).content)
            yield "completed: 100%", path
        except Exception as e:
            yield _refusal(e), None


def build_demo(client):
    """The Gradio Blocks for the server behind `client` (an openai.OpenAI)."""
    import gradio as gr

    served = served_model(client)
    act = DemoActions(client, served)
    voices = list(served.voices)
    with gr.Blocks(title=f"omnistage: {served.model}") as demo:
        gr.Markdown(f"# omnistage · `{served.model}`")
        if served.generates == "text":
            with gr.Tab("Text chat"):
                chatbot = gr.Chatbot(elem_id="chat-log", height=360)
                box = gr.Textbox(label="Message", elem_id="chat-input")
                send = gr.Button("Send", elem_id="chat-send", variant="primary")
                send.click(act.chat, [box, chatbot], [chatbot, box])
                box.submit(act.chat, [box, chatbot], [chatbot, box])
        if served.audio_input and served.audio_output:
            with gr.Tab("Voice chat"):
                mic = gr.Audio(sources=["microphone", "upload"], type="filepath", label="Your question",
                               elem_id="voice-in")
                voice = gr.Dropdown(voices, value=voices[0] if voices else None, label="Voice", elem_id="voice-pick")
                ask = gr.Button("Ask", elem_id="voice-send", variant="primary")
                said = gr.Textbox(label="Answer", elem_id="voice-text")
                heard = gr.Audio(label="Spoken answer", elem_id="voice-out", autoplay=False)
                answering = ask.click(act.voice_chat, [mic, voice], [said, heard])
                # barge-in: stopping closes the answer's stream, and the server aborts it
                gr.Button("Stop answering", elem_id="voice-stop").click(None, cancels=[answering])
        if served.audio_output:
            with gr.Tab("Speech"):
                text = gr.Textbox(label="Text", elem_id="speech-input")
                voice2 = gr.Dropdown(voices, value=voices[0] if voices else None, label="Voice")
                go = gr.Button("Speak", elem_id="speech-send", variant="primary")
                out, note = gr.Audio(label="Speech", elem_id="speech-out"), gr.Markdown(elem_id="speech-note")
                go.click(act.speech, [text, voice2], [out, note])
        if served.audio_input:
            with gr.Tab("Transcription"):
                rec = gr.Audio(sources=["microphone", "upload"], type="filepath", label="Audio", elem_id="asr-in")
                go2 = gr.Button("Transcribe", elem_id="asr-send", variant="primary")
                words = gr.Textbox(label="Transcript", elem_id="asr-out")
                go2.click(act.transcribe, [rec], [words])
        if served.generates == "image":
            _image_tab(gr, act)
        if served.generates == "video":
            _video_tab(gr, VideoActions(client, served, tempfile.mkdtemp(prefix="omnistage-demo-")))
    return demo


def run_demo(api_base: str, api_key: str | None, host: str, port: int) -> int:
    """Serve the page for the server at `api_base` until interrupted (Ctrl-C or SIGTERM)."""
    import openai

    # SIGTERM ends the page like Ctrl-C, so the caller stops its own server too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = openai.OpenAI(base_url=api_base, api_key=api_key or "none", max_retries=0, timeout=600)
    build_demo(client).launch(server_name=host, server_port=port)
    return 0


class LocalServer:
    """The page's own server when no --api-base is given: `omnistage serve`'s engine and app
    (cli.serve_parts) in this process, uvicorn on a thread of its own. The loopback socket
    listens before the page is built, so a request sent before uvicorn's loop accepts waits in
    the socket's backlog: nothing to poll for."""

    def __init__(self, config, engine):
        import uvicorn

        self._engine, self._server = engine, uvicorn.Server(config)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._run, name="omnistage-demo-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        finally:
            # if uvicorn ever stops on its own, waiting requests are refused rather than hang
            self._sock.close()

    def stop(self, timeout_s: float) -> None:
        """Stop accepting, let uvicorn end its connections (up to `timeout_s`), stop the engine."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._engine.shutdown()


def _image_tab(gr, act: DemoActions) -> None:
    with gr.Tab("Image"):
        prompt = gr.Textbox(label="Prompt", elem_id="image-prompt")
        size = gr.Textbox(value="512x512", label="Size (WIDTHxHEIGHT)", elem_id="image-size")
        steps = gr.Slider(1, 50, value=4, step=1, label="Steps")
        source = gr.Image(label="Image to edit (optional: empty generates)", type="filepath",
                          elem_id="image-source")
        make = gr.Button("Generate", elem_id="image-send", variant="primary")
        picture, note2 = gr.Image(label="Image", elem_id="image-out"), gr.Markdown(elem_id="image-note")
        make.click(act.image, [prompt, size, steps, source], [picture, note2])


def _video_tab(gr, videos: VideoActions) -> None:
    with gr.Tab("Video"):
        vprompt = gr.Textbox(label="Prompt", elem_id="video-prompt")
        vsize = gr.Textbox(value="480x272", label="Size (WIDTHxHEIGHT)", elem_id="video-size")
        vseconds = gr.Textbox(value="1", label="Seconds", elem_id="video-seconds")
        vsteps = gr.Slider(1, 50, value=4, step=1, label="Steps")
        vgo = gr.Button("Generate", elem_id="video-send", variant="primary")
        vstatus, vout = gr.Markdown(elem_id="video-status"), gr.Video(label="Video", elem_id="video-out")
        vgo.click(videos.make, [vprompt, vsize, vseconds, vsteps], [vstatus, vout])
