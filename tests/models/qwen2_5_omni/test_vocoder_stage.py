"""The vocoder stage's scheduling (models/qwen2_5_omni/vocoder_stage.py): first chunks before later ones, later
chunks held while a newcomer gathers its first codes, long solves advanced in pieces with the
same result, aborts in the middle of a solve. A small random token2wav: what is under test is
the stage's order of work, its outputs against a one-shot decode of the same stream."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2_5OmniToken2WavConfig

from omnistage.models.qwen2_5_omni.messages import CodecChunk
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.models.qwen2_5_omni.token2wav_stream import StreamConfig, step_streams
from omnistage.models.qwen2_5_omni.vocoder_stage import BUSY_MARGIN, SERVICE_SHARE, VocoderSettings, VocoderStage

MEL, CODES = 16, 64


@pytest.fixture(scope="module")
def model():
    cfg = Qwen2_5OmniToken2WavConfig(
        dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                        ff_mult=2, emb_dim=16, block_size=8, look_ahead_layers=[1],
                        look_backward_layers=[0], repeats=2, num_embeds=CODES, mel_dim=MEL,
                        enc_emb_dim=8, enc_dim=8, enc_channels=[16, 16, 16, 32], enc_kernel_sizes=[3, 3, 3, 1],
                        enc_dilations=[1, 2, 3, 1], enc_attention_channels=8, enc_res2net_scale=2,
                        enc_se_channels=8, dropout=0.0),
        bigvgan_config=dict(mel_dim=MEL, upsample_initial_channel=64, resblock_kernel_sizes=[3],
                            resblock_dilation_sizes=[[1, 3]]))
    t2w = Token2Wav(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in t2w.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return t2w


def make_stage(model, clock=time.monotonic, **settings) -> VocoderStage:
    g = torch.Generator().manual_seed(1)
    voice = SimpleNamespace(cond=torch.randn(1, 8, generator=g), ref_mel=torch.randn(1, 20, MEL, generator=g))
    base = dict(steps=4, stream=StreamConfig(16, 4, 8), max_hold_s=60.0, hold_margin_s=0.0,
                intervals_per_step=0)
    return VocoderStage("token2wav", model, {"v": voice}, VocoderSettings(**{**base, **settings}),
                        clock=clock)


def codes(n: int, seed: int) -> list[int]:
    return torch.randint(0, CODES, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def send(stage: VocoderStage, rid: str, ids: list[int], finished: bool = False) -> None:
    stage.add(CodecChunk(rid, ids, finished, speaker="v", seed=7 if rid == "a" else 8))


def served(outs) -> list[str]:
    return [o.request_id for o in outs if o.payload.samples.numel() or o.final]


def run_to_end(stage: VocoderStage) -> dict[str, torch.Tensor]:
    pcm: dict[str, list[torch.Tensor]] = {}
    while stage.has_work():
        for o in stage.step():
            pcm.setdefault(o.request_id, []).append(o.payload.samples)
    return {r: torch.cat(c) for r, c in pcm.items()}


def test_first_chunks_go_before_later_ones_and_newcomers_hold_later_chunks(model):
    stage = make_stage(model)
    send(stage, "a", codes(60, 0))
    assert served(stage.step()) == ["a"]              # a's first chunk
    send(stage, "b", codes(5, 1))                     # b: 5 of the 20 codes its first chunk needs
    assert not stage.has_work()                       # a's later chunk is held back for b
    assert stage.step() == []
    send(stage, "b", codes(15, 2))
    assert served(stage.step()) == ["b"]              # b's first chunk before a's second
    assert served(stage.step()) == ["a"]              # nobody gathers: later chunks run


def test_hold_ends_after_max_hold_s(model):
    stage = make_stage(model, max_hold_s=0.0)
    send(stage, "a", codes(60, 0))
    stage.step()
    send(stage, "b", codes(5, 1))
    assert stage.has_work() and served(stage.step()) == ["a"]


def test_hold_ends_when_a_waiting_listener_would_run_dry(model):
    """a's later chunk waits for b's first codes only while a has hold_margin_s of speech
    left to play (on a fake clock); the stage process is told when the margin is reached."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], hold_margin_s=0.1)
    send(stage, "a", codes(60, 0))
    [first] = [o for o in stage.step() if o.request_id == "a"]
    sent = first.payload.samples.numel() / stage.sample_rate
    assert sent > 0.1
    send(stage, "b", codes(5, 1))                     # b gathers: a's later chunk is held
    assert not stage.has_work() and stage.step() == []
    assert stage.wake_after() == pytest.approx(sent - 0.1)
    now[0] = sent - 0.11                              # still 0.11 s left: held
    assert not stage.has_work()
    now[0] = sent - 0.09                              # 0.09 s left: a goes first
    assert stage.has_work() and served(stage.step()) == ["a"]


def test_a_stage_behind_holds_for_a_newcomer_whatever_the_held_have_left(model):
    """Behind (at the measured pace two streams need more than the wall clock), the hold for
    b's first codes runs its course (max_hold_s) though a has less than hold_margin_s left:
    under overload a's gap comes anyway, and b's first audio should not wait on it."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], hold_margin_s=0.1, max_hold_s=1.0)
    send(stage, "a", codes(60, 0))
    [first] = [o for o in stage.step() if o.request_id == "a"]
    sent = first.payload.samples.numel() / stage.sample_rate
    assert 0.1 < sent < 0.9
    stage._frame_s = 0.6 / stage._frames_per_speech_s   # 2 streams x 0.6 s per second of speech
    send(stage, "b", codes(5, 1))                        # b gathers: a's later chunk is held
    assert not stage.has_work()
    now[0] = sent - 0.09                                 # 0.09 s left: held all the same
    assert not stage.has_work() and stage.wake_after() == pytest.approx(1.0 - now[0])
    now[0] = 1.0                                         # the hold ran its course
    assert stage.has_work() and served(stage.step()) == ["a"]


def test_solves_in_pieces_equal_whole_solves(model):
    whole, pieces = make_stage(model), make_stage(model, intervals_per_step=1)
    for stage in (whole, pieces):
        send(stage, "a", codes(50, 3), finished=True)
        send(stage, "b", codes(37, 4), finished=True)
    a, b = run_to_end(whole), run_to_end(pieces)
    assert a.keys() == b.keys() == {"a", "b"}
    for rid in a:
        assert a[rid].numel() == b[rid].numel() > 0
        torch.testing.assert_close(a[rid], b[rid], rtol=0, atol=0)


def test_later_solve_takes_one_step_per_interval(model):
    stage = make_stage(model, intervals_per_step=1)      # 4 ODE steps = 3 RK4 intervals
    send(stage, "a", codes(60, 0))
    stage.step()                                         # first chunk: whole, at once
    assert [served(stage.step()) for _ in range(3)] == [[], [], ["a"]]


def test_abort_in_the_middle_of_a_solve_frees_everything(model):
    stage = make_stage(model, intervals_per_step=1)
    send(stage, "a", codes(60, 0))
    send(stage, "b", codes(60, 1))
    stage.step()                                         # both first chunks
    stage.step()                                         # later chunks of a and b: 1 of 3 intervals
    assert stage._solve is not None
    stage.abort("a")
    assert stage._solve is not None and stage.num_requests() == 1   # b still in it
    out = [o.request_id for _ in range(2) for o in stage.step()]
    assert out == ["b"]                                  # a's chunk is dropped, b's comes out
    stage.abort("b")
    assert stage.num_requests() == 0 and stage._solve is None and not stage.has_work()


def test_warm_up_decodes_streamed_chunks_only_and_changes_no_output(model):
    """A streamed configuration warms up (first and second chunks decoded before serving) and
    a request's audio is the same as from a stage that did not; chunking too coarse to stream
    (a first window past first_audio_frames, e.g. one window per utterance) is not warmed up."""
    cold, warm = make_stage(model), make_stage(model)
    assert cold._frame_s is None
    assert warm.warm_up() and warm._frame_s > 0          # the second chunks' pace, to start with
    for stage in (cold, warm):
        send(stage, "a", codes(40, 3), finished=True)
    assert torch.equal(run_to_end(cold)["a"], run_to_end(warm)["a"])
    assert not warm.has_work()
    whole = make_stage(model, stream=StreamConfig(4096, 0, 0))
    assert not whole.warm_up()
    # 16 + 4 codes of 2 frames: a 40-frame first window; the default budget is 144.
    assert not make_stage(model, first_audio_frames=39).warm_up()


@pytest.mark.parametrize("catch_up", [False, True])
def test_catch_up_gives_the_largest_chunks_once_a_listener_ran_dry(model, catch_up):
    """With catch_up, once a listener has run dry (the clock past the speech the stage sent it
    since its first chunk) the stage is behind: every stream, the dry one and one still
    playing, waits for the largest chunk's codes and decodes them in one window; before, the
    schedule (chunks 16, 16, 32, 64 codes). Off (the default), the clock changes nothing: the
    chunking follows the codes alone."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], catch_up=catch_up,
                       stream=StreamConfig(16, 4, 8, max_chunk_size=64))
    send(stage, "a", codes(20, 0))
    [first] = stage.step()                                   # a's chunk 0: 16 codes
    played = first.payload.samples.numel() / first.payload.sample_rate
    now[0] = played / 2
    send(stage, "b", codes(20, 1))
    assert served(stage.step()) == ["b"]                     # b's chunk 0, at played / 2
    send(stage, "a", codes(16, 2))                           # chunk 1's 16 codes + look-ahead
    send(stage, "b", codes(16, 3))
    assert stage.has_work() and stage._streams["a"].next_chunk() == 16    # a still playing
    now[0] = played + 0.01                                   # a ran dry; b has half of it left
    assert stage.has_work() != catch_up
    send(stage, "a", codes(48, 4))                           # 84 codes: 16 + 64 + 4 of look-ahead
    send(stage, "b", codes(48, 5))
    assert sorted(served(stage.step())) == ["a", "b"]
    assert [stage._streams[r].next for r in "ab"] == ([80, 80] if catch_up else [32, 32])


def test_starving_while_a_next_chunk_lacks_codes(model):
    """The stage asks its producers for more (StageGraph feeds it) while a stream's next chunk
    lacks codes: the first chunk's 16 + 4 of look-ahead; during a later chunk's solve, the
    chunk after it; never once the codes have ended."""
    stage = make_stage(model, intervals_per_step=1)
    send(stage, "a", codes(10, 0))
    assert stage.starving() and not stage.has_work()
    send(stage, "a", codes(10, 1))
    assert not stage.starving()
    stage.step()                                         # chunk 0: codes 0-15
    assert stage.starving()                              # chunk 1 needs codes up to 36
    send(stage, "a", codes(20, 2))                       # 40 codes
    assert not stage.starving()
    stage.step()                                         # chunk 1 (16-31) in flight
    assert stage._solve is not None and stage.starving() # chunk 2 needs codes up to 52
    send(stage, "a", codes(12, 3))
    assert not stage.starving()
    send(stage, "b", codes(3, 4), finished=True)         # ended: never starving
    assert not stage.starving()


def test_the_talker_is_fed_for_a_near_dry_listener_and_not_against_it(model):
    """While the stage keeps up and a listener waiting for a later chunk is about to run dry
    (less than hold_margin_s left): with a newcomer's first chunk ready, the stage asks for
    codes only for that listener's next chunk; with its chunk in flight, it asks for none
    (the talker's extra passes would slow the solve), unless a newcomer is gathering its
    first codes or the stage is behind."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], intervals_per_step=1)
    send(stage, "a", codes(40, 0))
    [out] = stage.step()                                 # a's first chunk: codes 0-15
    sent = out.payload.samples.numel() / stage.sample_rate
    stage.settings.hold_margin_s = sent / 2
    assert stage.step() == [] and stage._solve is not None   # chunk 1 (16-31) in flight
    assert stage._streams["a"].short_of_codes(32)        # chunk 2 (32-63) needs codes up to 68
    assert stage.starving()                              # a has all its speech left
    now[0] = sent * 0.75                                 # a: a quarter left, its chunk in flight
    assert not stage.starving()
    stage._frame_s = 1.0 / stage._frames_per_speech_s    # behind: the talker is fed regardless
    assert stage.starving()
    stage._frame_s = None
    send(stage, "c", codes(5, 2))                        # a newcomer gathering its first codes
    assert stage.starving()

    now[0] = 0.0
    fed = make_stage(model, clock=lambda: now[0])
    send(fed, "a", codes(20, 0))
    [out] = fed.step()                                   # a's first chunk; chunk 1 needs 36 codes
    sent = out.payload.samples.numel() / fed.sample_rate
    fed.settings.hold_margin_s = sent / 2
    send(fed, "b", codes(20, 1))                         # b's first chunk ready
    assert not fed.starving()                            # a has all its speech left: b first
    now[0] = sent * 0.75
    assert fed.starving()                                # for a's codes
    fed._frame_s = 1.0 / fed._frames_per_speech_s        # behind: newcomers first
    assert not fed.starving()


def ticking(step: float):
    """A clock that moves `step` seconds at every reading."""
    t = [0.0]

    def clock() -> float:
        t[0] += step
        return t[0]
    return clock


@pytest.mark.parametrize("alone_s, tail_s, first", [(0.3, None, 16), (0.2, None, 32), (0.3, 0.05, 16)])
def test_the_warm_up_pace_counts_the_other_stages_steps(model, alone_s, tail_s, first):
    """Until a solve in service measures the pace, the warm-up's solve (alone) stands in,
    times SERVICE_SHARE for the other stages' steps between a solve's intervals in service:
    three streams that a solve alone would keep up with (3 x 0.3 s per second of speech) are
    behind by BUSY_MARGIN or more (3 x 0.6 s), so their first chunks are the plain ones
    (newcomers first), not the busy ones; three that need 3 x 0.4 s are behind, but by less
    than BUSY_MARGIN: the busy ones (their extra speech carries the listeners). A pace
    measured below that seed (`tail_s`: solves in a quiet tail, the other stages idle) does
    not make a burst of newcomers look as if the stage kept up with them."""
    assert 3 * SERVICE_SHARE * 0.2 < BUSY_MARGIN <= 3 * SERVICE_SHARE * 0.3
    probe = make_stage(model, first_chunk_busy=32)
    cfg = probe.busy_stream_config          # the warm-up's last solve: two such streams' second chunks
    streams = [probe._stream("v", torch.Generator().manual_seed(i), cfg) for i in range(2)]
    for stream in streams:
        stream.feed([0] * (cfg.chunk(0) + cfg.look_ahead))
    step_streams(streams)
    for stream in streams:
        stream.feed([0] * cfg.chunk(1))
    frames = sum(stream.window_frames() for stream in streams)
    alone = alone_s / probe._frames_per_speech_s     # seconds a window frame alone
    stage = make_stage(model, clock=ticking(alone * frames), first_chunk_busy=32)
    assert stage.warm_up()
    assert stage._frame_s == pytest.approx(SERVICE_SHARE * alone)
    if tail_s is not None:
        stage._frame_s = tail_s / stage._frames_per_speech_s
    for i, rid in enumerate("abc"):
        send(stage, rid, codes(10, i))
    stage.has_work()
    assert [s.next_chunk() for s in stage._streams.values()] == [first] * 3


def test_a_first_chunk_planned_beside_others_is_the_busy_one(model):
    """first_chunk_busy: a stream whose first chunk is planned while another stream is in the
    stage has the longer first chunk (its listener plays it while the stage serves both),
    whenever it opened; alone, the plain one. The warm-up decodes both shapes. On a fake clock:
    the warm-up measures the stage's pace on its clock, and on a busy machine the real one made
    two streams look behind by BUSY_MARGIN, where the plain first chunk is right (seen in a CI
    run beside stress-ng); this test is about a stage that keeps up."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], first_chunk_busy=32)
    assert stage.warm_up()
    send(stage, "a", codes(10, 0))
    stage.has_work()
    assert stage._streams["a"].next_chunk() == 16        # alone
    send(stage, "b", codes(10, 1))                       # b opens before a's first chunk
    send(stage, "a", codes(10, 2))                       # a: 20 codes, the plain 16 + 4 ahead
    assert not stage.has_work()                          # a now waits for 32 + 4
    assert [stage._streams[r].next_chunk() for r in "ab"] == [32, 32]
    send(stage, "a", codes(16, 3))
    [out] = stage.step()
    assert out.request_id == "a" and stage._streams["a"].next == 32
    send(stage, "b", codes(26, 4))
    [out] = stage.step()
    assert out.request_id == "b" and stage._streams["b"].next == 32
    alone_again = make_stage(model, clock=lambda: now[0], first_chunk_busy=32)
    send(alone_again, "a", codes(20, 0))
    send(alone_again, "b", codes(10, 1))
    assert not alone_again.has_work()                    # a: 20 of 36
    alone_again.abort("b")                               # b gone before a's first chunk
    assert served(alone_again.step()) == ["a"] and alone_again._streams["a"].next == 16
    plain = make_stage(model)
    send(plain, "a", codes(10, 0))
    send(plain, "b", codes(10, 1))
    plain.has_work()
    assert plain._streams["b"].next_chunk() == 16


def test_a_stream_is_rechunked_only_before_its_first_chunk(model):
    stage = make_stage(model)
    send(stage, "a", codes(20, 0))
    s = stage._streams["a"]
    s.rechunk(StreamConfig(16, 4, 8, first_chunk_size=20))
    assert s.next_chunk() == 20
    with pytest.raises(ValueError, match="look-back|first chunk"):
        s.rechunk(StreamConfig(16, 4, 12))               # other windows
    s.rechunk(StreamConfig(16, 4, 8))
    stage.step()
    with pytest.raises(ValueError, match="before its first chunk"):
        s.rechunk(StreamConfig(16, 4, 8, first_chunk_size=20))


@pytest.mark.parametrize("left, first", [(0.05, "a"), (0.2, "b"), (-0.01, "b")])
def test_a_listener_about_to_run_dry_goes_before_a_newcomer(model, left, first):
    """a's later chunk and b's first chunk are ready. While a still plays but has less than
    hold_margin_s (0.1) left, a's chunk goes first; with more left, or once a listener has run
    dry (the stage is behind: overload), the newcomer's first chunk goes first."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], hold_margin_s=0.1)
    send(stage, "a", codes(60, 0))
    [out] = stage.step()
    sent = out.payload.samples.numel() / stage.sample_rate
    send(stage, "b", codes(20, 1))
    now[0] = sent - left
    assert served(stage.step()) == [first]
    assert served(stage.step()) == ["b" if first == "a" else "a"]


def test_a_stage_behind_its_listeners_serves_newcomers_first_with_plain_first_chunks(model):
    """At a measured pace of 0.8 wall seconds per second of speech (in the largest chunks'
    windows), two streams need 1.6 wall clocks: the stage is behind, by BUSY_MARGIN and more,
    so a newcomer's first chunk goes before a near-dry listener's chunk, and first chunks keep
    the plain size though others are in the stage."""
    assert 2 * 0.8 >= BUSY_MARGIN
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], hold_margin_s=0.1, first_chunk_busy=32)
    send(stage, "a", codes(60, 0))
    [out] = stage.step()
    now[0] = out.payload.samples.numel() / stage.sample_rate - 0.05   # a: 0.05 s left
    stage._frame_s = 0.8 / stage._frames_per_speech_s
    send(stage, "b", codes(20, 1))                       # the plain 16 + 4: ready
    assert served(stage.step()) == ["b"] and stage._streams["b"].next == 16
    stage._frame_s = 0.3 / stage._frames_per_speech_s    # three streams fit: not behind
    send(stage, "c", codes(20, 2))
    assert served(stage.step()) == ["a"]                 # a's chunk; c waits for 32 + 4
    assert stage._streams["c"].next_chunk() == 32


def test_a_later_solve_shrinks_to_what_a_near_dry_listener_can_wait_for(model):
    """Later chunks of a and b are ready and frame_budget takes both windows; at the measured
    pace a solve of both would outlast what a has left to play, so a's goes alone, b's next."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0])
    for rid, seed in (("a", 0), ("b", 1)):
        send(stage, rid, codes(60, seed))
    assert sorted(served(stage.step())) == ["a", "b"]     # both first chunks
    window = stage._streams["a"].window_frames()
    now[0] = 0.001
    left = stage._left_to_play("a", now[0])
    assert 0 < left == stage._left_to_play("b", now[0])
    slow = left / (1.5 * window)                          # a measured pace: one window fits, two not
    stage._frame_s = slow
    assert served(stage.step()) == ["a"]                  # a (first by order) alone
    stage._frame_s = slow                                 # (the fake clock measured 0 s)
    assert served(stage.step()) == ["b"]
    stage._frame_s = left / (3 * window)                  # fast enough for both
    assert sorted(served(stage.step())) == ["a", "b"]


def test_later_chunks_go_to_the_listener_closest_to_running_dry(model):
    """Two streams with later chunks ready and a frame budget for one window: the one whose
    listener has less speech left goes first, though it opened second."""
    now = [0.0]
    stage = make_stage(model, clock=lambda: now[0], frame_budget=1, stream=StreamConfig(16, 4, 8))
    send(stage, "a", codes(20, 0))
    [first_a] = stage.step()                             # a's first chunk at t=0
    now[0] = 0.05
    send(stage, "b", codes(20, 1))
    [first_b] = stage.step()                             # b's at t=0.05: b has more left to play...
    send(stage, "a", codes(40, 2))
    send(stage, "b", codes(40, 3))
    a_left = first_a.payload.samples.numel() / 24000 - now[0]
    b_left = first_b.payload.samples.numel() / 24000
    assert b_left > a_left                               # ...so a goes first
    assert served(stage.step()) == ["a"]
    now[0] = 0.05 + b_left                               # ...until b has less left than a
    send(stage, "a", codes(20, 4))
    assert stage._left_to_play("b", now[0]) < stage._left_to_play("a", now[0])
    assert served(stage.step()) == ["b"]
