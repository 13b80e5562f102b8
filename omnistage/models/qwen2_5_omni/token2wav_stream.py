"""Streaming token2wav: `Token2WavStream` decodes one request as its codes arrive (chunked
ODE solves over windows that cover the DiT's reach, then BigVGAN with overlap);
`step_streams` advances many streams with one batched solve."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.qwen2_5_omni.bigvgan import VocoderJob, VocoderStream, vocode_windows
from omnistage.models.qwen2_5_omni.token2wav import (DiTJob, NoiseSource, OdeSolve, Token2Wav,
                                                     check_settings)
from omnistage.models.qwen2_5_omni.token2wav_dit import SpeakerTerms

@dataclass
class StreamConfig:
    """How a stream cuts an utterance; sizes in codes (one code is `repeats` mel frames).

    Each chunk of chunk_size codes gets its own ODE solve over a window with look_back codes of
    left context (start rounded down to a DiT block, so the window's blocks are the utterance's)
    and look_ahead codes of right context, and keeps only its own frames. BigVGAN runs with
    vocoder_context mel frames of overlap each side (None: its receptive field, so the PCM is
    exactly BigVGAN's over the streamed mel); PCM lags the mel by that much until finish().

    Chunk 0 has first_chunk_size codes (None: chunk_size); chunk k >= 1 has
    min(chunk_size * 2**(k-1), max_chunk_size). The first chunks stay small (time to first
    audio, and the second chunk must arrive before the first has played); later ones amortise
    the window's context (look_back + look_ahead codes computed again per chunk, and the
    vocoder's overlap) over more codes.
    """
    chunk_size: int = 36                   # fixed-size defaults; the vocoder stage uses for_dit()
    look_ahead: int = 12                   # (released model: 24-frame blocks, 2 frames per code;
                                           # chunks 48, 48, 96, 144, ..., look-ahead 12, look-back 24)
    look_back: int = 24
    vocoder_context: int | None = None
    max_chunk_size: int | None = None      # None: chunks never grow
    first_chunk_size: int | None = None    # None: chunk_size

    def __post_init__(self):
        for name, low in (("chunk_size", 1), ("look_ahead", 0), ("look_back", 0), ("vocoder_context", 0),
                          ("max_chunk_size", 1), ("first_chunk_size", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise InvalidRequestError(f"{name} must be >= {low}", param=name)
        if self.max_chunk_size is not None and self.max_chunk_size < self.chunk_size:
            raise InvalidRequestError("max_chunk_size must be >= chunk_size", param="max_chunk_size")

    def chunk(self, k: int) -> int:
        """Codes in the k-th chunk (0-based)."""
        if k == 0:
            return self.first_chunk_size or self.chunk_size
        grown = self.chunk_size * 2 ** min(k - 1, 16)
        return min(grown, self.max_chunk_size) if self.max_chunk_size else self.chunk_size

    @property
    def largest_chunk(self) -> int:
        return max(self.max_chunk_size or self.chunk_size, self.chunk(0))

    def longest_window(self, align: int) -> int:
        """Codes in the longest ODE window: look-back (its start rounded down by up to
        `align - 1` more codes, window_align), the largest chunk and the look-ahead."""
        return self.look_back + align + self.largest_chunk + self.look_ahead

    @classmethod
    def for_dit(cls, c, vocoder_context: int = 0) -> "StreamConfig":
        """Per the DiT's masks: one pass's exact reach back and ahead (in blocks). The first
        chunk is 2 blocks plus the codes of `vocoder_context` mel frames (the vocoder's context,
        which the stream holds back until the next chunk), rounded up to whole blocks (a chunk
        ending inside a block would keep frames whose block reaches past the window), so its
        PCM is at least 2 blocks long; with a 2-block first chunk the released model's first
        PCM is 0.12 s, and playback stopped ~0.3 s for the second chunk even with one stream
        on a fast CPU (measured on the small checkpoint, Zen 5). Later chunks start at the
        first one's size and double up to 12 blocks: each window computes look_back +
        look_ahead blocks again and the vocoder its context twice, so the smaller second chunk
        of before (2 blocks, then 4, 8, 12: 5 windows for a 6 s answer of the small checkpoint
        instead of 4) cost throughput at every load: one request float32 1.21 -> 1.37 audio-s
        per wall-s, sixteen 1.95 -> 2.39 (Intel Xeon, 2 cores); a lone Realtime session's
        first audio the same, no playback gap (its second chunk's window is 2 blocks longer)."""
        block = math.ceil(c.block_size / c.repeats)
        held = math.ceil(math.ceil(vocoder_context / c.repeats) / block) * block
        first = 2 * block + held
        return cls(chunk_size=first, look_ahead=len(c.look_ahead_layers) * block,
                   look_back=len(c.look_backward_layers) * block, max_chunk_size=12 * block,
                   first_chunk_size=first)


def window_align(dit_config) -> int:
    """Codes per window-start step: windows start on whole DiT blocks (block_size frames,
    `repeats` frames a code)."""
    return math.lcm(dit_config.block_size, dit_config.repeats) // dit_config.repeats


@dataclass
class ChunkPlan:
    job: DiTJob
    keep: tuple[int, int]        # frames of the window's mel that belong to the chunk
    chunk_end: int               # first code after the chunk


class Token2WavStream:
    """One request: codec codes in (push), float32 PCM chunks at 24 kHz out (on the model's
    device). Holds bounded state: codes and noise from the next window's start, and the
    vocoder's mel window (see VocoderStream). close() drops it all."""

    def __init__(self, model: Token2Wav, cond: torch.Tensor, ref_mel: torch.Tensor,
                 noise: torch.Tensor | torch.Generator, config: StreamConfig | None = None,
                 steps: int = 10, guidance_scale: float = 0.5, sway: float | None = -1.0,
                 speaker: SpeakerTerms | None = None):
        """`speaker`: model.speaker_terms(cond, ref_mel) when the caller keeps it (a stage
        serving a few voices: the speaker encoder then runs once per voice, not per request)."""
        c = model.config.dit_config
        self.model, self.steps, self.sway = model, steps, sway
        self.guidance = check_settings(steps, sway, guidance_scale)
        self.cfg = config or StreamConfig.for_dit(c)
        self.repeats = c.repeats
        self.align = window_align(c)                                   # codes per window-start step
        self.vctx = (model.vocoder.receptive_field() if self.cfg.vocoder_context is None
                     else self.cfg.vocoder_context)
        self._check(self.cfg)
        self.speaker = speaker if speaker is not None else model.speaker_terms(cond, ref_mel)
        self.noise = NoiseSource(noise, c.mel_dim, c.block_size, model.device, model.dtype)
        self.codes = torch.empty(0, dtype=torch.long, device=model.device)
        # Absolute code indices: of self.codes[0], codes pushed so far, first code not decoded.
        self.codes_start = self.received = self.next = 0
        self.vocoder = VocoderStream(model.vocoder, self.vctx)
        self.finishing = self.closed = False
        self.num_chunks = 0      # chunks decoded so far (sizes grow with it)
        # Set by the caller (the vocoder stage, while it is behind its listeners): later chunks
        # are the largest (next_chunk), fewer windows for the codes than the schedule's.
        self.catch_up = False

    def rechunk(self, config: StreamConfig) -> None:
        """Cut the utterance by `config` instead (before the first chunk only; a config of
        other windows than the stream's, e.g. another look-back, is refused)."""
        if config is self.cfg:
            return
        if self.num_chunks or (config.look_back, config.look_ahead, config.vocoder_context) != (
                self.cfg.look_back, self.cfg.look_ahead, self.cfg.vocoder_context):
            raise ValueError("a stream's chunking changes only in its first chunk's and later "
                             "chunks' sizes, before its first chunk")
        self._check(config)
        self.cfg = config

    def _check(self, cfg: StreamConfig) -> None:
        """The first chunk carries audio past the vocoder's context; the longest window fits
        the DiT."""
        if cfg.chunk(0) * self.repeats <= self.vctx:
            param = "first_chunk_size" if cfg.first_chunk_size else "chunk_size"
            raise InvalidRequestError(
                f"{param} must exceed {self.vctx // self.repeats} codes (the vocoder's context of "
                f"{self.vctx} frames) for the first chunk to carry audio", param=param)
        self.model.check_frames(self.repeats * cfg.longest_window(self.align))

    def push(self, codes) -> list[torch.Tensor]:
        """Add codes; returns the PCM chunks that became ready (possibly none)."""
        self.feed(codes)
        return self._drain()

    def finish(self) -> list[torch.Tensor]:
        """No more codes: decode the rest and flush the vocoder's tail."""
        self.end()
        return self._drain()

    def end(self) -> None:
        """No more codes will come (without decoding; step_streams decodes the rest)."""
        self.feed(torch.zeros(0, dtype=torch.long))       # raises if closed
        self.finishing = True

    def close(self) -> None:
        """Release every buffer; the stream cannot be used afterwards."""
        self.closed = True
        self.codes = self.vocoder = self.noise = self.speaker = None

    def feed(self, codes) -> None:
        """Add codes without decoding (step_streams decodes many streams together)."""
        if self.closed:
            raise InvalidRequestError("this token2wav stream is closed; open a new one")
        codes = self.model.check_codes(codes)
        if self.finishing and codes.numel():
            raise InvalidRequestError("codes arrived after finish(); open a new stream", param="codes")
        self.codes = torch.cat([self.codes, codes])
        self.received += codes.numel()

    def ready(self) -> bool:
        """A chunk can be decoded now."""
        left = self.received - self.next
        return not self.closed and (left >= self.next_chunk() + self.cfg.look_ahead
                                    or (self.finishing and left > 0))

    def next_chunk(self) -> int:
        """Codes in the next chunk (unless it is the tail): the schedule's size (cfg.chunk), or
        with catch_up, after the first chunk, the largest chunk."""
        return self._chunk_size(self.num_chunks)

    def _chunk_size(self, k: int) -> int:
        size = self.cfg.chunk(k)
        return max(size, self.cfg.largest_chunk) if self.catch_up and k > 0 else size

    def short_of_codes(self, planned_end: int | None = None) -> bool:
        """Whether the next chunk still lacks codes (with look-ahead): the one after the chunk
        ending at `planned_end` while that one is being solved (None: nothing in flight).
        False once the codes have ended."""
        if self.closed or self.finishing:
            return False
        if planned_end is None:
            return self.received - self.next < self.next_chunk() + self.cfg.look_ahead
        return self.received - planned_end < self._chunk_size(self.num_chunks + 1) + self.cfg.look_ahead

    def window_frames(self) -> int:
        """Mel frames of the next chunk's ODE window (its cost in a batched solve)."""
        c = self.cfg
        return (min(c.look_back + self.align, self.next) + self.next_chunk() + c.look_ahead) * self.repeats

    def has_work(self) -> bool:
        """A chunk to decode, or (after end()) PCM still to emit."""
        return self.ready() or (self.finishing and not self.closed and self.vocoder.pending())

    def plan(self) -> ChunkPlan:
        cs, c = self.next, self.cfg
        size = self.next_chunk()
        if self.received - cs >= size + c.look_ahead:
            ce, we = cs + size, cs + size + c.look_ahead
        else:                       # finishing: the rest is one window
            ce = we = self.received
        ws, r = self._window_start(cs), self.repeats
        job = DiTJob(self.codes[ws - self.codes_start:we - self.codes_start],
                     self.noise.frames(ws * r, we * r), self.speaker, self.guidance, ws * r)
        return ChunkPlan(job, ((cs - ws) * r, (ce - ws) * r), ce)

    def take_mel(self, plan: ChunkPlan, mel: torch.Tensor) -> VocoderJob | None:
        """Take the window's mel (frames, mel_dim) and move past the chunk; returns the window
        BigVGAN must run over for the new PCM (then self.vocoder.complete(job, wav)), or None."""
        self.next = plan.chunk_end
        self.num_chunks += 1
        ws = self._window_start(self.next)          # nothing before it is needed again
        self.codes, self.codes_start = self.codes[ws - self.codes_start:], ws
        self.noise.release(ws * self.repeats)
        return self.vocoder.plan(mel[plan.keep[0]:plan.keep[1]].T,
                                 final=self.finishing and self.next == self.received)

    def _window_start(self, chunk_start: int) -> int:
        return max(0, (chunk_start - self.cfg.look_back) // self.align * self.align)

    def _drain(self) -> list[torch.Tensor]:
        out = []
        while self.has_work():
            pcm = step_streams([self])[0]
            if pcm is not None:
                out.append(pcm)
        return out


def solve_key(stream: Token2WavStream) -> tuple:
    """Streams with equal keys can share one batched solve (same DiT, same ODE settings)."""
    return id(stream.model), stream.steps, stream.sway


class StreamSolve:
    """The next chunk of each of several streams (equal solve_key, all ready) in one batched
    ODE solve, which may advance a few RK4 intervals at a time. The streams' state moves on
    only in finish(); a stream closed meanwhile is skipped."""

    def __init__(self, streams: list[Token2WavStream]):
        self.streams = streams
        self.plans = [s.plan() for s in streams]
        first = streams[0]
        self.ode = OdeSolve(first.model.dit, [p.job for p in self.plans], first.steps, first.sway)

    def advance(self, intervals: int | None = None) -> bool:
        return self.ode.advance(intervals)

    def finish(self) -> list[torch.Tensor | None]:
        """Each stream's new PCM (None: none yet, or the stream was closed). The vocoder
        windows of equal length run as one batch."""
        jobs = [None if s.closed else s.take_mel(p, mel)
                for s, p, mel in zip(self.streams, self.plans, self.ode.result())]
        live = [i for i, j in enumerate(jobs) if j is not None]
        wavs = vocode_windows(self.streams[0].model.vocoder, [jobs[i] for i in live])
        out: list[torch.Tensor | None] = [None] * len(jobs)
        for i, wav in zip(live, wavs):
            out[i] = self.streams[i].vocoder.complete(jobs[i], wav)
        return out


def step_streams(streams: list[Token2WavStream]) -> list[torch.Tensor | None]:
    """Decode one chunk of every ready stream, and flush the tail of ended ones. Streams of the
    same model and ODE settings share one batched solve (one DiT forward per evaluation for all
    their windows and guidance rows). Returns each stream's new PCM chunk, or None."""
    out: list[torch.Tensor | None] = [None] * len(streams)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(streams):
        if s.ready():
            groups.setdefault(solve_key(s), []).append(i)
        elif s.has_work():
            out[i] = s.vocoder.flush()
    for idx in groups.values():
        batch = StreamSolve([streams[i] for i in idx])
        batch.advance()
        for i, pcm in zip(idx, batch.finish()):
            out[i] = pcm
    return out
