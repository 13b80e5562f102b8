"""Streamed input for the Realtime API: a turn is prefilled while the user is still speaking.

While a turn's audio arrives, `TurnWarmer` keeps it as the model will hear it (16 kHz, resampled
piece by piece from the turn's first sample: `StreamResampler`'s outputs joined are exactly
`resample` of the whole, so the samples warmed are a prefix of the committed item's samples,
bit for bit). About every WARM_EVERY_S of new audio the session runs the conversation plus the
turn so far through the engine as a `prefill_only` request (one in flight per session): its
encoder chunks land in the encoder's cache and its KV blocks (and the hidden rows the talker
reads) in the thinker's prefix cache; a speaking model's talker prefills those rows as well, into
its own prefix cache (Qwen2.5-Omni and Qwen3-Omni; a 15 s turn's ~400 talker rows cost ~25 ms at
commit on the small Qwen2.5-Omni). When the turn is committed, the response's request finds them and
computes only what is new: the last audio, the closing tokens, the answer.

A warm request still in flight when the response starts is cancelled, not waited for: what it
computed is in the caches already (the prefix cache registers blocks as each engine step
computes them; the encoder's outputs are kept by content), and the response computes the rest
in its own passes. Waited for, the response's own preparation and passes queued behind the
warm request's: eight 15 s Realtime sessions committing together reached the encoder ~0.55 s
after their commits, ~0.26 s with the warm-ups cancelled (small Qwen2.5-Omni, 2 cores).

Nothing stale can be used, by construction: both caches are keyed by content (the encoder's by
the bytes of a chunk's log-mel features, the prefix cache by token ids and embedding rows).
Where the features of the audio so far differ from the committed audio's -- Whisper's log-mel
floors every value at the utterance's peak minus 8, so a louder moment later changes all
earlier frames; the last frames of a prefix see its end -- the keys differ and the work is
done again. A turn's answer is therefore the same, token for token and sample for sample, as
with streamed input off (tests/server/test_realtime_streamed.py).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from omnistage.engine_api import OutputOptions
from omnistage.errors import InvalidRequestError
from omnistage.media.audio import StreamResampler, pcm16_mono
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WARM_EVERY_S = 1.0      # new speech between warm requests: each costs a prefill of the new part
MODEL_RATE = 16000      # what the audio encoders hear


class TurnWarmer:
    """The audio of the turn in progress, resampled as it comes, and the warm request in
    flight. `begin` at the turn's first sample, `feed` each append, `end` when it is
    committed, cleared or dropped."""

    def __init__(self, input_rate: int):
        self.input_rate = input_rate
        self._resampler: StreamResampler | None = None
        self._samples: list[np.ndarray] = []
        self._num_samples = 0
        self._warmed = 0                 # samples the last warm request covered
        self.task: asyncio.Task | None = None

    @property
    def active(self) -> bool:
        return self._resampler is not None

    def begin(self, pcm: bytes) -> None:
        """A turn starts; `pcm` is its 24 kHz pcm16 so far (from its first sample)."""
        self._resampler = StreamResampler(self.input_rate, MODEL_RATE)
        self._samples, self._num_samples, self._warmed = [], 0, 0
        self.feed(pcm)

    def feed(self, pcm: bytes) -> None:
        if self._resampler is None or not pcm:
            return
        out = self._resampler.feed(pcm16_mono(pcm))
        if len(out):
            self._samples.append(out)
            self._num_samples += len(out)

    def end(self) -> None:
        self._resampler = None
        self._samples, self._num_samples = [], 0

    def due(self) -> bool:
        """Time for a warm request: enough new audio and none in flight."""
        return (self._resampler is not None and (self.task is None or self.task.done())
                and self._num_samples - self._warmed >= WARM_EVERY_S * MODEL_RATE)

    def take(self) -> np.ndarray:
        """The turn's 16 kHz samples so far (a prefix of the committed item's), marked warmed."""
        if len(self._samples) > 1:
            self._samples = [np.concatenate(self._samples)]
        self._warmed = self._num_samples
        return self._samples[0].copy()

    async def stop(self) -> bool:
        """Cancels the warm request in flight (its seat is wanted, or the response is starting:
        module docstring); True if there was one."""
        task = self.task
        if task is None or task.done():
            return False
        task.cancel()
        await asyncio.wait([task])
        return True


async def warm_up(engine, admission, messages: list[dict], opts: OutputOptions,
                  request_id: str) -> None:
    """The conversation plus the turn so far, prefilled (`opts.prefill_only`) to fill the caches
    the response will read. Best effort: at the request bound, or refused (e.g. over the
    context window: the response will say so), it is skipped."""
    ticket = admission.try_acquire()
    if ticket is None:
        return
    deltas = engine.generate(messages, SamplingParams(max_tokens=1), request_id=request_id,
                             output=opts)
    try:
        async for _ in deltas:
            pass
    except InvalidRequestError:
        pass
    except Exception as e:  # noqa: BLE001 - a failed warm-up only costs its speed-up
        log.warning("realtime warm-up %s failed: %r", request_id, e)
    finally:
        await deltas.aclose()
        ticket.release()
