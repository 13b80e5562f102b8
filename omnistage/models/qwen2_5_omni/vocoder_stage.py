"""The vocoder stage: codec tokens in, PCM chunks out, many requests per batched pass.

Each request owns a Token2WavStream (bounded state: the codes and mel its next window needs).
A step decodes one chunk of each of several streams that have enough codes (chunk +
look-ahead, or the tail once the talker finished) in one batched ODE solve, so a request's
first audio comes after its first chunk of codes, not after the whole answer.

Scheduling, for time to first audio (TTFA) under load. The router opens a request's stream
as soon as the thinker starts it, so the stage knows who is still waiting for a first chunk.
Each step does one of:
- first chunks that are ready (up to `first_audio_frames` mel frames, at least one window,
  oldest stream first): solved whole at once, unless the stage keeps up (not `_behind`) and a
  listener waiting for a later chunk has less than `hold_margin_s` of speech left: its chunk
  then goes first (the newcomer's listener is not listening yet);
- nothing but tail flushes, while some stream is still gathering its first chunk's codes (for
  at most `max_hold_s`, and, while the stage keeps up, not while a listener waiting for a
  later chunk has less than `hold_margin_s` of speech left to play): each graph step then
  costs one thinker and one talker step, so the newcomer's codes arrive at full speed;
- later chunks: one batched solve over up to `frame_budget` frames, and no more than the
  listener closest to running dry (always in it) can wait for at the measured pace (at least
  one window), advanced `intervals_per_step` RK4 intervals
  per step, so no step is long: a first chunk that becomes ready meanwhile is solved before the solve goes on.
Tails to flush (vocoder only) ride along with any step. Streams already playing lose a little
lead; a new request's first audio no longer waits behind seconds of other requests' DiT work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from omnistage.models.qwen2_5_omni.messages import AudioChunk, CodecChunk
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.token2wav_dit import SpeakerTerms
from omnistage.models.qwen2_5_omni.token2wav_stream import (StreamConfig, StreamSolve,
                                                            Token2WavStream, solve_key,
                                                            step_streams, window_align)
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage
from omnistage.stages.hold import Hold
from omnistage.stages.playback import PlaybackClock


# What a later-chunk solve's pace in service is to its pace alone: in service the graph steps
# the other stages (the thinker, the talker) between a solve's intervals, and the pace the
# stage measures (_frame_s, start to finish) counts them; the warm-up's solve runs alone. Until
# a solve in service measures it, the warm-up's pace times this stands in. Eight Realtime
# sessions on 2 cores (small checkpoint, the live flags) measured 1.3-2.4 ms a window frame in
# service against 0.78 alone; taken alone, eight sessions committing together looked as if
# the stage kept up (8 streams x 0.105 s per second of speech < 1): their first chunks took the
# busy config's 72 codes, one solve each, and the listeners with audio went before the
# others' first chunks (first audio p50 2.1-2.3 s for 15 s utterances; counted so, 1.7 s). Four
# sessions still keep up (4 x 0.21 < 1).
SERVICE_SHARE = 2.0

# How far behind its streams (their need at the measured pace, in wall clocks) the stage may be
# and still give newcomers beside others first_chunk_busy's longer first chunk. A little behind,
# its extra speech carries the listener through an answer: four Realtime sessions of 2 s turns
# on 2 cores (small checkpoint, the live flags) were 1.0x behind at the warm-up's pace and 1.1x
# at the pace service measured; called behind at 1.0, their first chunks were the plain 48
# codes and every listener ran dry (3.2-4.1 s of gaps in all, in 6 of 7 runs); with the busy
# 72, in 3 of 5 runs only the session planned alone (the plain chunk) did, ~0.2 s (one run 4 of
# 4, 4.1 s). Eight sessions (2x and more) still take the plain ones.
BUSY_MARGIN = 1.5


@dataclass
class VocoderSettings:
    steps: int = 10                      # ODE steps (RK4) per chunk
    guidance_scale: float = 0.5
    stream: StreamConfig | None = None   # None: the DiT's own block reach (StreamConfig.for_dit)
    # Codes in a request's first chunk (None: the stream config's; for_dit's is 2 DiT blocks plus
    # the vocoder's context in whole blocks, 48 codes on the released model, so its PCM lasts
    # until the second chunk is decoded on a CPU). 24 (2 blocks): first audio ~0.1 s sooner, but
    # on a CPU the first 0.12 s of speech then plays out ~0.3 s before the second chunk comes.
    # A multiple of the DiT block (12 codes) keeps the stream within its documented bounds.
    first_chunk: int | None = None
    # Opt-in, for live listeners on a CPU: codes in the first chunk of a stream whose first
    # chunk is planned while other streams are in the stage and the stage keeps up with them
    # (None: first_chunk, as alone; behind, see VocoderStage._behind). Those listeners play it
    # while the stage also serves the others' chunks: four Realtime sessions at once (small
    # checkpoint, 2 cores, Zen 5) had 1.0-6.8 s of playback gaps in all with 48 codes and
    # catch-up (0.6 s of first speech), 0.9-4.4 s with 72 here (1.08 s); a lone session's
    # first audio unchanged.
    # The chunking then depends on timing (the audio within ~1e-5 of the mel).
    first_chunk_busy: int | None = None
    seed: int = 0                        # unseeded request i draws noise from seed + i
    frame_budget: int = 1536             # mel frames of later-chunk windows per solve (at least one window)
    first_audio_frames: int = 240        # mel frames of first-chunk windows per step (at least one;
                                         # two of for_dit's on the released model: 60 codes each)
    intervals_per_step: int = 1          # RK4 intervals a later-chunk solve advances per step (0: all)
    max_hold_s: float = 2.0              # longest wait of later chunks for streams gathering first codes
    # A hold ends early while a listener waiting for a later chunk has less than this much speech
    # left to play: the hold is for a newcomer's first audio, not at the cost of a listener's
    # silence. Four Realtime sessions on 2 cores: the first session's third chunk was held while
    # the other three gathered their first codes, and it ran dry 0.2 s; with the margin, gaps
    # summed over the four 0.58-0.63 -> 0.05-0.15 s (6 s turns), first audio ~0.03 s later; at
    # eight (overload) first audio 0.1-0.35 s later (0.0: hold regardless).
    hold_margin_s: float = 0.6
    # Opt-in speed for quality: the DiT's GEMMs in bfloat16 (oneDNN's packed bf16 GEMMs where the
    # CPU has bf16 dot products: 1.3x float32 on a Zen 5; autocast elsewhere, ~1.4x on an Intel
    # Xeon with AMX); mel within ~0.2% RMS of float32. Off: outputs match the reference (float32).
    bf16_dit: bool = False
    # Opt-in speed for quality: the DiT's products over frame rows (attention's q|k|v and output,
    # the feed-forwards; ~90% of its multiply-adds) in int8, weights per output column and
    # activations per row (native W8A8 kernel, VNNI's int8 dot products: ~1.8x oneDNN's bf16 GEMMs
    # on a Zen 5); with bf16_dit the DiT's other products in bf16. The mel within 0.04% RMS of
    # float32 (0.2% with bf16_dit) on the random-weight checkpoints (real checkpoints' activations
    # may have outlier channels, which per-row scales serve worse: measure before relying on it).
    int8_dit: bool = False
    # Opt-in throughput under overload: while any listener has run dry (the stage sent it less
    # speech than the time since its first chunk: the stage is behind), every stream's next
    # later chunk is its largest (it waits for those codes), so an utterance needs fewer
    # windows, each recomputing the DiT's look-back and look-ahead (Token2WavStream.next_chunk).
    # Any listener, not only the dry one's: at 16 requests on 2 cores the others' second chunks
    # are due before they run dry, and taking them large too gave 6.41-6.76 audio-s per wall-s
    # against 5.98-6.23 (bf16).
    # Off: the chunking is a function of the codes alone, so a request's audio is the same
    # bits under any load; on, it depends on timing within the chunking's ~1e-5 of the mel.
    catch_up: bool = False


@dataclass
class _Pick:
    """One step's work: streams to flush, and first chunks to solve, or later chunks to start
    solving, or the solve in flight to advance."""
    flush: list[str]
    first: list[str] = field(default_factory=list)
    later: list[str] = field(default_factory=list)
    resume: bool = False

    @property
    def idle(self) -> bool:
        return not (self.flush or self.first or self.later or self.resume)


class VocoderStage(Stage):
    def __init__(self, name: str, model: Token2Wav, speakers: dict, settings: VocoderSettings,
                 noise_for: Callable[[str], torch.Tensor | torch.Generator] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`speakers`: name -> object with .cond (1, E) and .ref_mel (1, R, M). `noise_for`
        (tests) gives a request's ODE start noise; default: a seeded generator per request.
        `clock`: seconds, for the hold and the listeners' playback."""
        self.name, self.model, self.speakers, self.settings = name, model, speakers, settings
        self.clock = clock
        stream = settings.stream or StreamConfig.for_dit(model.config.dit_config,
                                                         model.vocoder.receptive_field())
        if settings.first_chunk is not None:
            stream = replace(stream, first_chunk_size=settings.first_chunk)
        self.stream_config = stream
        busy = settings.first_chunk_busy
        self.busy_stream_config = None if busy is None else replace(stream, first_chunk_size=busy)
        self.dead: str | None = None   # local stages fail with the process
        self.noise_for = noise_for
        self._streams: dict[str, Token2WavStream] = {}
        self._playback: dict[str, PlaybackClock] = {}   # of the streams that sent speech
        self._speaker_terms: dict[str, SpeakerTerms] = {}      # by voice (see _stream)
        self._count = 0
        self._hold = Hold(settings.max_hold_s, settings.hold_margin_s)   # later chunks (see _pick)
        self._solve: StreamSolve | None = None  # later chunks in flight
        self._solving: list[str] = []           # their request ids, in the solve's order
        self._solve_began = (0.0, 0)            # its start (clock) and window frames
        self._solve_paused = 0.0                # seconds of first-chunk steps while it waited
        # Wall seconds per window frame of a later-chunk solve, start to finish (the steps of
        # other stages between its intervals included): a running mean, None before the first.
        self._frame_s: float | None = None
        # The warm-up's pace times SERVICE_SHARE: the least _behind_by counts a stream's second of
        # speech at (a solve in a quiet tail measures less; see _behind_by). None: no warm-up.
        self._seed_frame_s: float | None = None
        self.sample_rate = 24000
        # Window frames per second of speech in the streams' largest chunks (the schedule
        # streams settle into): with _frame_s, the stage's pace per stream (see _behind_by).
        window = stream.longest_window(window_align(model.config.dit_config))     # codes
        self._frames_per_speech_s = window / (stream.largest_chunk * model.vocoder.hop / self.sample_rate)

    def _open(self, rid: str, speaker: str, seed: int | None) -> Token2WavStream:
        if self.noise_for is not None:
            noise = self.noise_for(rid)
        else:   # a request's seed makes its audio the same whatever shares the batch
            if seed is None:
                seed = self.settings.seed + self._count
                self._count += 1
            noise = torch.Generator(device=self.model.device).manual_seed(seed)
        return self._stream(speaker, noise, self._first_config(
            others=bool(self._streams), far_behind=self._behind_by(self.clock()) >= BUSY_MARGIN))

    def _first_config(self, others: bool, far_behind: bool) -> StreamConfig:
        """The chunking of a stream whose first chunk is still to come: first_chunk_busy's
        while other streams are in the stage and it is not behind them by BUSY_MARGIN
        (`far_behind`: the longer first chunk is for a listener who must wait out the others'
        chunks; when the stage is further behind, gaps come anyway and the shorter first chunk
        brings first audio sooner), else the stage's."""
        busy = self.busy_stream_config is not None and others and not far_behind
        return self.busy_stream_config if busy else self.stream_config

    def _behind(self, now: float) -> bool:
        """The stage cannot keep every listener fed (see _behind_by)."""
        return self._behind_by(now) >= 1.0

    def _behind_by(self, now: float) -> float:
        """The wall clocks the stage's streams need at the measured pace (streams x wall
        seconds per second of speech, a second of speech costing the window frames of the
        largest chunks: the early, smaller chunks recompute more look-back per second of
        speech, and counting them called four Realtime sessions on 2 cores behind, where they
        keep up); inf once a listener has run dry, 0 before a pace exists. 1 or more: behind."""
        if self._a_listener_ran_dry(now):
            return float("inf")
        if self._frame_s is None:
            return 0.0
        # Not below the seed: solves in a quiet tail (the last chunks of a burst's answers, the
        # other stages idle) measure the stage alone; eight Realtime sessions starting after
        # such a tail were called keeping up, took the busy first chunks one solve each, and
        # had first audio p50 2.26-2.38 s against 1.73-1.81 s for the same burst first.
        frame_s = max(self._frame_s, self._seed_frame_s or 0.0)
        return len(self._streams) * frame_s * self._frames_per_speech_s

    def _a_listener_ran_dry(self, now: float) -> bool:
        return any(p.ran_dry(now) for p in self._playback.values())

    def _stream(self, speaker: str, noise: torch.Tensor | torch.Generator,
                config: StreamConfig) -> Token2WavStream:
        spk = self.speakers[speaker]
        terms = self._speaker_terms.get(speaker)
        if terms is None:    # the speaker encoder over the voice's reference mel: once per voice
            terms = self._speaker_terms[speaker] = self.model.speaker_terms(spk.cond, spk.ref_mel)
        return Token2WavStream(self.model, spk.cond, spk.ref_mel, noise, config, steps=self.settings.steps,
                               guidance_scale=self.settings.guidance_scale, speaker=terms)

    def warm_up(self, batches: tuple[int, ...] = (1, 2)) -> bool:
        """Decode first and second chunks once before serving (a few streams at once), so the
        first requests do not pay for what a process does only once: oneDNN's primitives for
        the DiT's products, built per input shape, and the heap pages a chunk touches. Measured on the small
        checkpoint over the Realtime API: a fresh server's first answer waited 0.50 s for its
        first chunk, the next ones 0.28 s. Seeds are explicit: requests' seeds do not move.
        Skipped when a first chunk's window is longer than `first_audio_frames` mel frames
        (chunking too coarse to stream, e.g. one window per utterance): its shapes follow each
        utterance, and the warm-up would decode thousands of frames for nothing. True when it
        decoded. The second chunks' solve gives the first pace (`_frame_s`: its time alone,
        times SERVICE_SHARE for the other stages' steps that service adds): four Realtime
        sessions of 15 s committing together had their second chunks solved in one batch (no
        pace measured yet), and every listener ran dry 0.05-0.37 s."""
        cfg = self.stream_config
        first_window = (cfg.chunk(0) + cfg.look_ahead) * self.model.config.dit_config.repeats
        if first_window > self.settings.first_audio_frames:
            return False
        speaker = next(iter(self.speakers))
        configs = [cfg] + ([self.busy_stream_config] if self.busy_stream_config else [])
        with torch.inference_mode():
            for config, batch in ((c, b) for c in configs for b in batches):
                streams = [self._stream(speaker, torch.Generator(device=self.model.device).manual_seed(i),
                                        config) for i in range(batch)]
                for k, codes in enumerate((config.chunk(0) + config.look_ahead, config.chunk(1))):
                    for stream in streams:
                        stream.feed([0] * codes)
                    frames, start = sum(s.window_frames() for s in streams), self.clock()
                    step_streams(streams)
                    if k == 1:       # a later chunk's pace, until solves in service measure it
                        self._frame_s = self._seed_frame_s = SERVICE_SHARE * (self.clock() - start) / frames
                for stream in streams:
                    stream.close()
        return True

    def add(self, chunk: CodecChunk) -> None:
        s = self._streams.get(chunk.request_id)
        if s is None:
            s = self._streams[chunk.request_id] = self._open(chunk.request_id, chunk.speaker, chunk.seed)
        if chunk.codes:
            s.feed(chunk.codes)
        if chunk.finished:
            s.end()

    def _pick(self, stepping: bool = False) -> _Pick:
        """This step's work (see the module docstring). `stepping`: the step runs it (a hold
        that expired starts again after it)."""
        flush, first, later, gathering = [], [], [], False
        now = self.clock()
        behind_by = self._behind_by(now)
        behind, far_behind = behind_by >= 1.0, behind_by >= BUSY_MARGIN
        dry = self.settings.catch_up and self._a_listener_ran_dry(now)
        for rid, s in self._streams.items():          # insertion order: oldest stream first
            if rid in self._solving:
                continue
            s.catch_up = dry
            if s.num_chunks == 0 and self.busy_stream_config is not None:
                # decided as the first chunk is planned, not when the stream opened: a stream
                # that opened alone and is joined by others before its first chunk plays that
                # chunk while the stage serves them all
                s.rechunk(self._first_config(others=len(self._streams) > 1, far_behind=far_behind))
            if s.ready():
                (first if s.num_chunks == 0 else later).append(rid)
            elif s.has_work() or s.finishing:         # a tail to flush, or an empty end
                flush.append(rid)
            elif s.num_chunks == 0:
                gathering = True
        if first and (behind or not self._about_to_run_dry([*later, *self._solving], now)):
            return _Pick(flush, first=self._within(first, self.settings.first_audio_frames))
        pending = self._solve is not None or bool(later)
        if self._hold.holds(gathering and pending, self._held_least_left([*later, *self._solving], behind, now),
                            now, stepping):
            return _Pick(flush)
        if self._solve is not None:
            return _Pick(flush, resume=True)
        later.sort(key=lambda rid: self._left_to_play(rid, now))   # closest to running dry first
        return _Pick(flush, later=self._within(later, self._later_budget(later[0] if later else None, now)))

    def _later_budget(self, first: str | None, now: float) -> int:
        """Window frames for the next later-chunk solve: frame_budget, or fewer where the
        listener closest to running dry (`first`, always in the solve) would run dry waiting
        for a solve that size at the measured pace: its chunk then goes in a smaller batch,
        the others' in the next. Four Realtime sessions on 2 cores: a listener with 0.5 s
        left waited 0.87 s for a solve of three streams' chunks."""
        left = float("inf") if first is None else self._left_to_play(first, now)
        if not self._frame_s or not 0.0 < left < float("inf"):     # no pace measured yet
            return self.settings.frame_budget
        return min(self.settings.frame_budget, int(left / self._frame_s))

    def _left_to_play(self, rid: str, now: float) -> float:
        p = self._playback.get(rid)
        return float("inf") if p is None else p.left_to_play(now)

    def _least_left(self, rids: list[str], now: float) -> float:
        """The least speech a listener of `rids` has left to play (inf: none)."""
        return min((self._left_to_play(rid, now) for rid in rids), default=float("inf"))

    def _held_least_left(self, rids: list[str], behind: bool, now: float) -> float:
        """What the hold weighs (`rids`: the held listeners): the least speech one has left,
        or, while the stage is behind, nothing (inf): under overload the hold runs its course
        for the newcomer's first audio, since the held listeners' gaps come anyway."""
        return float("inf") if behind else self._least_left(rids, now)

    def _measure_pace(self) -> None:
        """A later-chunk solve ended: its wall seconds per window frame into the running mean
        (less the first chunks solved while it waited: four Realtime sessions on 2 cores, a
        solve that two first chunks interrupted counted 3.2 ms a frame against ~1.5, and the
        stage called itself behind)."""
        began, frames = self._solve_began
        spent = self.clock() - began - self._solve_paused
        self._frame_s = _mean(self._frame_s, spent / max(frames, 1))

    def _about_to_run_dry(self, rids: list[str], now: float) -> bool:
        """Whether a listener of `rids` (waiting for a later chunk: in the solve, or ready)
        has less than hold_margin_s of speech left: while the stage keeps up (not _behind),
        its chunk then goes before newcomers' first chunks, whose listeners are not yet
        listening. When the stage is behind (overload), newcomers go first: with eight Realtime
        sessions on 2 cores, the later chunks of every listener near its end taking turns
        before first chunks put first audio 1.4 -> 2.6 s (p50)."""
        return self._least_left(rids, now) < self.settings.hold_margin_s

    def _waiting_later(self) -> list[str]:
        """The streams waiting for a later chunk: in the solve, or ready for one."""
        ready = [rid for rid, s in self._streams.items()
                 if rid not in self._solving and s.num_chunks > 0 and s.ready()]
        return [*self._solving, *ready]

    def _within(self, rids: list[str], budget: int) -> list[str]:
        """The first of `rids`, then each next one that shares its solve and whose window
        still fits in `budget` frames."""
        key = solve_key(self._streams[rids[0]]) if rids else None
        chosen, spent = [], 0
        for rid in rids:
            s = self._streams[rid]
            cost = s.window_frames()
            if chosen and (spent + cost > budget or solve_key(s) != key):
                continue
            chosen.append(rid)
            spent += cost
        return chosen

    def step(self) -> list[StageOutput]:
        pick = self._pick(stepping=True)
        pcm: dict[str, torch.Tensor | None] = {}
        with torch.inference_mode():
            if pick.first:
                start = self.clock()
                pcm.update(zip(pick.first, step_streams([self._streams[r] for r in pick.first])))
                if self._solve is not None:      # not the later solve's pace (_measure_pace)
                    self._solve_paused += self.clock() - start
            elif pick.later or pick.resume:
                if pick.later:
                    streams = [self._streams[r] for r in pick.later]
                    self._solve_began = (self.clock(), sum(s.window_frames() for s in streams))
                    self._solve_paused = 0.0
                    self._solve, self._solving = StreamSolve(streams), pick.later
                if self._solve.advance(self.settings.intervals_per_step or None):
                    pcm.update(zip(self._solving, self._solve.finish()))
                    self._solve, self._solving = None, []
                    self._measure_pace()
            # Streams that are not ready only flush their vocoder tail here.
            pcm.update(zip(pick.flush, step_streams([self._streams[r] for r in pick.flush])))
        out, now = [], self.clock()
        for rid, p in pcm.items():
            s = self._streams.get(rid)
            if s is None:                 # aborted while its chunk was in flight
                continue
            done = s.finishing and not s.has_work()
            if p is None and not done:
                continue
            samples = p.float().cpu() if p is not None else torch.zeros(0)
            if samples.numel():
                self._playback.setdefault(rid, PlaybackClock()).sent(samples.numel() / self.sample_rate, now)
            out.append(StageOutput(self.name, rid, AudioChunk(rid, samples, self.sample_rate, done),
                                   final=done))
            if done:
                self.abort(rid)
        return out

    def abort(self, request_id: str) -> None:
        s = self._streams.pop(request_id, None)
        self._playback.pop(request_id, None)
        if s is not None:
            s.close()
        if self._solve is not None and all(r not in self._streams for r in self._solving):
            self._solve, self._solving = None, []    # nobody left to solve for

    def has_work(self) -> bool:
        return not self._pick().idle

    def starving(self) -> bool:
        """Some stream's next chunk (after the one being solved, for those in the solve)
        still lacks codes: the talker should run ahead (StageGraph.step), its extra passes
        taking as long as this stage's. While the stage keeps up (not _behind) and a
        listener waiting for a later chunk is about to run dry, only for that listener's
        codes: while first chunks are ready (they go first otherwise: 16 requests at once had
        first audio p50 1.95 -> 2.47 s when the talker was fed then too), and while no
        newcomer gathers its first codes, not while its chunk is solved or ready (the
        talker's passes would halve the solve's pace: four 15 s Realtime turns ending
        together, 2 cores, a listener with 0.44 s left waited 0.7 s for a solve of three)."""
        now = self.clock()
        ends = dict(zip(self._solving, (p.chunk_end for p in self._solve.plans))) if self._solve else {}
        short = [rid for rid, s in self._streams.items() if s.short_of_codes(ends.get(rid))]
        if not short:
            return False
        keeping_up = not self._behind(now)
        if any(s.num_chunks == 0 and s.ready() for s in self._streams.values()):
            listening = [rid for rid in short if self._streams[rid].num_chunks > 0]
            return keeping_up and self._about_to_run_dry(listening, now)
        gathering = any(s.num_chunks == 0 for s in self._streams.values())
        return not (keeping_up and not gathering and self._about_to_run_dry(self._waiting_later(), now))

    def wake_after(self) -> float | None:
        """Seconds until held later chunks may run without new input (None: not holding): the
        hold's end, or a waiting listener's crossing of hold_margin_s. A stage process with
        nothing to do waits for its next message at most this long."""
        if self._hold.since is None:
            return None
        now = self.clock()
        return self._hold.wake_after(self._held_least_left(self._waiting_later(), self._behind(now), now), now)

    def num_requests(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Nothing outside this process to release."""


def _mean(mean: float | None, value: float) -> float:
    """A running mean that follows the stage's load: half the last value, half the past."""
    return value if mean is None else 0.5 * (mean + value)
