"""Pipecat's OpenAI Realtime service (pipecat-ai's OpenAIRealtimeLLMService) against the real
server (tiny Qwen2.5-Omni), with its defaults: only base_url, api_key and model point at us.

A bot as pipecat builds one, less the transport: a Microphone processor pushes espeak-ng speech
as 20 ms InputAudioRawFrames, a Speaker processor takes the output frames (and tells the service
when "playback" starts and stops, as an output transport does), and the context aggregator pair
turns the service's VAD proposals into user turns and interruptions. pipecat sends no turn
detection and relies on OpenAI's default server_vad: our server cuts the turns.

- a text turn (LLMMessagesAppendFrame, run_llm: the way a pipecat bot opens a conversation)
  answered in audio; a voice turn answered in audio;
- a barge-in: speech over a streaming answer interrupts it (the server cancels and truncates it,
  pipecat interrupts its pipeline) and the new turn is answered, no error on the way;
- a voice turn, then a text turn too long for the model's context window: the response fails,
  pipecat hears of it, and the server stays up.

The model is random: its words are gibberish and its speech noise, so this checks the protocol
(frames, audio, item states), not what is said. Its answers are long (pipecat sets no
max_output_tokens; often 1000-2000 tokens, at times the whole window): the tiny model's
4096-token window holds one for sure, so each test lets one answer run its course."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

# pipecat logs a version banner at import (loguru, to stderr): pytest captures it
pytest.importorskip("pipecat.services.openai.realtime.llm")

from pipecat.frames.frames import (BotStartedSpeakingFrame, BotStoppedSpeakingFrame, EndFrame,  # noqa: E402
                                   ErrorFrame, Frame, InputAudioRawFrame, InterruptionFrame,
                                   LLMFullResponseEndFrame, LLMMessagesAppendFrame, LLMTextFrame,
                                   StartFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame,
                                   UserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from benchmarks.espeak import RATE, SENTENCES, espeak, pcm16  # noqa: E402

FRAME_MS = 20              # a transport's input audio frame
WAIT_S = 120               # bound of every wait (two shared CPU cores run the model)
END_S = 30                 # bound of the pipeline's shutdown


def _spoken(k: int, lead_s: float = 0.8, tail_s: float = 1.2) -> bytes:
    """Sentence k between silences (the tail ends the turn: server_vad's 500 ms), as pcm16."""
    s = espeak(SENTENCES[k])
    return pcm16(np.concatenate([np.zeros(int(lead_s * RATE), np.float32), s.audio[s.onset:s.end],
                                 np.zeros(int(tail_s * RATE), np.float32)]))


class Microphone(FrameProcessor):
    """The pipeline's input, as a transport's: speech in 20 ms InputAudioRawFrames."""

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)

    async def say(self, pcm: bytes) -> None:
        # as fast as the pipeline takes them: the server's turn detection runs on the audio's own
        # clock (its samples), not on when they arrive
        step = 2 * RATE * FRAME_MS // 1000
        for i in range(0, len(pcm), step):
            await self.push_frame(InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=RATE,
                                                     num_channels=1))


class Speaker(FrameProcessor):
    """The pipeline's output: queues what reaches it (but the microphone's audio, which the
    service passes on) for the test to await and, as an output transport does, tells the service
    when the bot starts and stops speaking (playback is instant here). Without
    BotStoppedSpeakingFrame the service would take the last answer as still playing, and
    truncate it when the user next speaks."""

    def __init__(self):
        super().__init__()
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM and not isinstance(frame, InputAudioRawFrame):
            self.frames.put_nowait(frame)
            if isinstance(frame, TTSStartedFrame):
                await self.push_frame(BotStartedSpeakingFrame(), FrameDirection.UPSTREAM)
            elif isinstance(frame, TTSStoppedFrame):
                await self.push_frame(BotStoppedSpeakingFrame(), FrameDirection.UPSTREAM)
        await self.push_frame(frame, direction)


def _names(frames: list[Frame]) -> list[str]:
    return [type(f).__name__ for f in frames if not isinstance(f, TTSAudioRawFrame)]


def _audio_bytes(frames: list[Frame]) -> int:
    return sum(len(f.audio) for f in frames if isinstance(f, TTSAudioRawFrame))


def _index(frames: list[Frame], kind: type[Frame]) -> int:
    return next((i for i, f in enumerate(frames) if isinstance(f, kind)), len(frames))


class Bot:
    """pipecat's realtime bot on our server: the service (its defaults, but where it connects),
    the pipeline and its runner, the assistant items as the server reports them done (through
    the service's own event handlers), and the errors that reach the pipeline's source."""

    def __init__(self, base: str, api_key: str):
        ws = base.replace("http://", "ws://", 1) + "/v1/realtime"     # pipecat appends ?model=
        self.llm = OpenAIRealtimeLLMService(
            api_key=api_key, base_url=ws, settings=OpenAIRealtimeLLMService.Settings(model="tiny"))
        self.mic, self.speaker = Microphone(), Speaker()
        pair = LLMContextAggregatorPair(LLMContext())
        self.worker = PipelineWorker(Pipeline([self.mic, pair.user(), self.llm, self.speaker,
                                               pair.assistant()]))
        self.runner = WorkerRunner(handle_sigint=False)
        self.answers: asyncio.Queue = asyncio.Queue()     # assistant items, once each, when done
        self._done: set[str] = set()
        self.errors: list[ErrorFrame] = []
        self._hook_events()

    def _hook_events(self) -> None:
        # conversation.item.done and response.done's output both report an item: keep the first
        @self.llm.event_handler("on_conversation_item_updated")
        async def updated(_llm, item_id, item):
            if item is not None and item.role == "assistant" and item_id not in self._done:
                self._done.add(item_id)
                self.answers.put_nowait(item)

        # errors travel upstream, to the worker: put them among the speaker's frames too, so
        # that a wait for a frame ends at once when pipecat gives up instead
        @self.worker.event_handler("on_pipeline_error")
        async def error(_worker, frame):
            self.errors.append(frame)
            self.speaker.frames.put_nowait(frame)

    async def until(self, kind: type[Frame], what: str) -> list[Frame]:
        """The frames that reach the speaker up to and including the next `kind` (bounded; an
        ErrorFrame on the way fails, unless it is what is awaited)."""
        seen: list[Frame] = []
        try:
            async with asyncio.timeout(WAIT_S):
                while not isinstance(frame := await self.speaker.frames.get(), kind):
                    if isinstance(frame, ErrorFrame):
                        pytest.fail(f"{what}: pipecat reported an error: {frame.error}")
                    seen.append(frame)
        except TimeoutError:
            pytest.fail(f"{what}: no {kind.__name__} within {WAIT_S} s; the speaker got "
                        f"{_names(seen)}")
        return seen + [frame]

    async def answer(self, what: str):
        """The next assistant item the server reports done (bounded)."""
        try:
            return await asyncio.wait_for(self.answers.get(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"{what}: no answer done within {WAIT_S} s; errors {self.error_texts()}")

    async def run(self, steps) -> None:
        """Runs the pipeline, `steps(self)` in it, and ends it (EndFrame, or cancelled when a
        step failed), each bounded."""
        await self.runner.add_workers(self.worker)
        running = asyncio.create_task(self.runner.run())
        try:
            await self.until(StartFrame, "pipeline start")
            await steps(self)
            await self.worker.queue_frame(EndFrame())
            await asyncio.wait_for(asyncio.shield(running), END_S)
        finally:
            if not running.done():
                await self.worker.cancel(reason="the test ended early")
                await asyncio.wait_for(running, END_S)
        assert self.worker.has_finished()

    def error_texts(self) -> list[str]:
        return [e.error for e in self.errors]

    def check_no_errors(self, step: str) -> None:
        # pipecat stops reading the session at an error event (but two codes): none may come
        assert not self.errors, f"{step}: {self.error_texts()}"


async def _say_and_hear(bot: Bot, k: int, what: str) -> list[Frame]:
    """Sentence k, cut into a turn by the server's VAD (pipecat proposes the turn from
    speech_started / speech_stopped) and answered in audio, unasked (create_response): the
    frames of the turn and its answer."""
    await bot.mic.say(_spoken(k))
    frames = await bot.until(LLMFullResponseEndFrame, what)
    names = _names(frames)
    assert "UserStartedSpeakingFrame" in names and "UserStoppedSpeakingFrame" in names, names
    assert _index(frames, UserStoppedSpeakingFrame) < _index(frames, TTSAudioRawFrame), names
    assert _audio_bytes(frames) > 0, names
    assert all(f.sample_rate == RATE for f in frames if isinstance(f, TTSAudioRawFrame))
    return frames


async def _append_text(bot: Bot, text: str) -> None:
    """A user message appended with run_llm: the context reaches the service, which sends it
    as a conversation item and asks for a response (in audio, pipecat's default)."""
    await bot.worker.queue_frame(LLMMessagesAppendFrame(
        messages=[{"role": "user", "content": text}], run_llm=True))


async def _text_turn(bot: Bot) -> None:
    await _append_text(bot, "Tell me about the sea.")
    frames = await bot.until(LLMFullResponseEndFrame, "text turn")
    assert _audio_bytes(frames) > 0, _names(frames)
    assert any(isinstance(f, LLMTextFrame) for f in frames), _names(frames)   # its transcript
    # "incomplete" where the answer filled the context window (the model rambles: it is random)
    assert (await bot.answer("text turn")).status in ("completed", "incomplete")
    bot.check_no_errors("text turn")


async def _voice_turn(bot: Bot) -> None:
    await _say_and_hear(bot, 0, "voice turn")
    assert (await bot.answer("voice turn")).status in ("completed", "incomplete")
    bot.check_no_errors("voice turn")


async def _barge_in(bot: Bot) -> None:
    """Speech over a streaming answer: the server cancels the answer (turn_detected) and cuts
    its audio and transcript, pipecat interrupts the pipeline (InterruptionFrame) and truncates
    the item to what it played, and the new turn is answered."""
    await bot.mic.say(_spoken(2))
    await bot.until(TTSAudioRawFrame, "barge-in: the first answer")
    await bot.mic.say(_spoken(3, lead_s=0.3))
    await bot.until(InterruptionFrame, "barge-in: the interruption")
    cut = await bot.answer("barge-in: the first answer")
    assert cut.status == "incomplete", f"the answer was not interrupted: {cut}"
    answer = await bot.answer("barge-in: the new turn")
    assert answer.id != cut.id and answer.status in ("completed", "incomplete"), answer
    await bot.until(LLMFullResponseEndFrame, "barge-in: the new answer's end")
    bot.check_no_errors("barge-in")
    # what the server kept: the cut answer without its transcript, the new one with its audio
    kept = await asyncio.wait_for(bot.llm.retrieve_conversation_item(cut.id), WAIT_S)
    assert kept.content[0].type == "output_audio" and kept.content[0].transcript == "", kept
    new = await asyncio.wait_for(bot.llm.retrieve_conversation_item(answer.id), WAIT_S)
    assert len(base64.b64decode(new.content[0].audio)) > 0


async def _voice_then_long_text(bot: Bot, base: str, api_key: str) -> None:
    """A voice turn, then the app appends a message longer than the model's window (4096
    tokens). pipecat's first response.create sends its local context first, packed into one
    user item ("This is a previously saved conversation ..."); the response must fail, pipecat
    hear of it (an ErrorFrame), and the server stay up for everyone else."""
    await _say_and_hear(bot, 0, "voice turn")
    await bot.answer("voice turn")
    await _append_text(bot, "Read this back: " + "1234567890" * 450)   # a token a digit: 4500+
    error = (await bot.until(ErrorFrame, "the long text turn's failure"))[-1]
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(f"{base}/health", headers={"Authorization": f"Bearer {api_key}"})
    # with audio in the conversation the prompt enters at the audio encoder: the thinker
    # refuses it only then, inside a graph step, and that request alone fails
    assert health.status_code == 200, (health.text, error.error)
    assert "max_model_len" in error.error, error.error


async def _talk(base: str, api_key: str, steps) -> None:
    bot = Bot(base, api_key)        # in the event loop: pipecat's runner takes the running one
    await bot.run(steps)


# one long answer a session (see the module's docstring): the text turn and the voice turn each
# have their own, and the barge-in's first answer is cut before it grows

def test_text_turn_is_answered_in_audio(omni_server, api_key):
    asyncio.run(_talk(omni_server, api_key, _text_turn))


def test_voice_turn_is_cut_by_the_server_and_answered_in_audio(omni_server, api_key):
    asyncio.run(_talk(omni_server, api_key, _voice_turn))


def test_barge_in_interrupts_the_answer_and_the_new_turn_is_answered(long_answer_server,
                                                                      api_key):
    # every answer lasts 8 s there: the speech always meets it streaming
    asyncio.run(_talk(long_answer_server, api_key, _barge_in))


def test_a_turn_over_the_context_window_fails_and_the_server_stays_up(start_server, tiny_omni,
                                                                      api_key):
    # a server of its own: were the engine to die, the other tests would not fail for it
    with start_server(tiny_omni, "--linear-kernel", "matmul") as running:
        asyncio.run(_talk(running.base, api_key,
                          lambda bot: _voice_then_long_text(bot, running.base, api_key)))
