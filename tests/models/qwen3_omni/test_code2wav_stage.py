"""The code2wav stage's chunking: growing chunks, and the playback deadline that sends what a
stream has when its listener is about to run dry (on a clock the test drives)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stage import Code2WavSettings, Code2WavStage
from omnistage.models.qwen3_omni.messages import CodecFrames

CONFIG = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              intermediate_size=48, codebook_size=64, num_quantizers=16, decoder_dim=32,
              sliding_window=8, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2))
FRAME_S = 1920 / 24000        # seconds of speech per frame


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    torch.manual_seed(0)
    hf = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**CONFIG)).eval()
    with torch.no_grad():    # transformers' init leaves the waveform at ~1e-8: give it a voice
        for name, p in hf.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() > 1:
                p.normal_(0, 0.7 / (p[0].numel() ** 0.5))
            elif leaf in ("scale", "gamma"):
                p.fill_(0.5)
            elif leaf in ("alpha", "beta"):
                p.normal_(0, 0.3)
    ours = Code2Wav(hf.config)
    ours.load_weights((f"code2wav.{k}", v) for k, v in hf.state_dict().items())
    return ours


def codes(frames: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["codebook_size"], (CONFIG["num_quantizers"], frames), generator=g)


def chunk_sizes(stage: Code2WavStage, rid: str) -> list[int]:
    """Steps the stage while it has work (the stream not finished); the frames of each chunk
    it decoded for `rid`."""
    sizes = []
    while stage.has_work():
        before = stage._streams[rid].done
        stage.step()
        sizes.append(stage._streams[rid].done - before)
    return sizes


def feed(stage: Code2WavStage, rid: str, frames: torch.Tensor, finished: bool = False) -> None:
    stage.add(CodecFrames(rid, frames, finished))


def test_without_a_deadline_chunks_grow_and_wait(model):
    stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=None), clock=Clock())
    feed(stage, "a", codes(40))
    assert chunk_sizes(stage, "a") == [2, 6, 18]                # 54 frames not there yet: waits
    stage.clock.now += 60.0                                     # however long
    assert not stage.has_work()


def test_a_stream_about_to_run_dry_gets_what_it_has(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=0.6), clock=clock)
    feed(stage, "a", codes(26))
    assert chunk_sizes(stage, "a") == [2, 6, 18]
    sent = stage._streams["a"].playback.sent_s
    assert sent == pytest.approx(26 * FRAME_S, abs=0.05)        # the seamless chunks: ~their frames
    feed(stage, "a", codes(20, seed=1))                         # 20 frames, the next chunk is 54
    clock.now += sent - 0.61                                    # 0.61 s left to play: not yet
    assert not stage.has_work()
    clock.now += 0.02                                           # 0.59 s left: due
    assert chunk_sizes(stage, "a") == [20]
    assert stage._streams["a"].last_chunk == 20


def test_a_due_stream_with_fewer_frames_than_its_last_chunk_waits(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=0.6), clock=clock)
    feed(stage, "a", codes(8))
    assert chunk_sizes(stage, "a") == [2, 6]
    feed(stage, "a", codes(5, seed=1))
    clock.now += stage._streams["a"].playback.sent_s - 0.3               # 0.3 s left to play
    assert not stage.has_work()
    feed(stage, "a", codes(1, seed=2))                          # 6 frames: as many as the last chunk
    assert chunk_sizes(stage, "a") == [6]


def test_a_stream_slower_than_real_time_keeps_growing_chunks(model):
    """More requests than the machine serves in real time: small chunks cannot close the gap
    and would spend the steps on their left context."""
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=0.6), clock=clock)
    feed(stage, "a", codes(8))
    assert chunk_sizes(stage, "a") == [2, 6]
    clock.now += 3.0                                            # 25 frames (2 s of speech) in 3 s
    feed(stage, "a", codes(17, seed=1))
    assert stage._streams["a"].playback.left_to_play(clock.now) < 0      # dry, and not keeping up
    assert not stage.has_work()
    feed(stage, "a", codes(1, seed=2))                          # the chunk size (18) is there
    assert chunk_sizes(stage, "a") == [18]


def test_a_dry_stream_that_keeps_up_gets_what_it_has(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=0.6), clock=clock)
    feed(stage, "a", codes(8))
    assert chunk_sizes(stage, "a") == [2, 6]
    clock.now += 0.7                                            # dry; 15 frames (1.2 s) in 0.7 s
    feed(stage, "a", codes(7, seed=1))
    assert stage._streams["a"].playback.left_to_play(clock.now) < 0
    assert chunk_sizes(stage, "a") == [7]


def test_the_stream_closest_to_running_dry_goes_first(model):
    clock = Clock()
    # a budget of one window per step: the order is what the test sees
    settings = Code2WavSettings(first_chunk=8, playback_margin_s=0.6, frame_budget=1)
    stage = Code2WavStage("code2wav", model, settings, clock=clock)
    feed(stage, "a", codes(8))
    stage.step()
    clock.now += 0.05
    feed(stage, "b", codes(8, seed=1))
    stage.step()
    feed(stage, "a", codes(8, seed=2))
    feed(stage, "b", codes(8, seed=3))
    clock.now += 0.2            # both have 0.3-0.45 s left; b started 0.05 s later: a has less
    a, b = (stage._streams[r].playback.left_to_play(clock.now) for r in "ab")
    assert 0 < a < b < 0.6
    assert [o.request_id for o in stage.step()] == ["a"]
    assert [o.request_id for o in stage.step()] == ["b"]


def test_deadline_chunks_join_into_the_same_waveform(model):
    """Seamless chunks join into the whole decode whatever the chunking: the deadline changes
    when speech goes out, never the speech."""
    frames = codes(50, seed=4)

    def run(margin: float | None) -> list[torch.Tensor]:
        clock = Clock()
        stage = Code2WavStage("code2wav", model, Code2WavSettings(first_chunk=2, playback_margin_s=margin), clock=clock)
        pieces = []
        for i in range(0, 50, 5):
            feed(stage, "a", frames[:, i:i + 5], finished=i == 45)
            clock.now += 0.3
            while stage.has_work():
                pieces += [o.payload.samples for o in stage.step() if o.payload.samples.numel()]
        return pieces
    with torch.inference_mode():
        by_size, by_deadline = run(None), run(0.6)
    assert len(by_size) == 4 and len(by_deadline) > 4             # 2, 6, 18, the rest at the end
    whole, early = torch.cat(by_size), torch.cat(by_deadline)
    assert whole.shape == early.shape and whole.std() > 0.01
    torch.testing.assert_close(early, whole, atol=1e-5, rtol=0)


def opened(stage: Code2WavStage, rid: str) -> None:
    """What the router sends when a request starts: its stream opens without frames."""
    feed(stage, rid, torch.zeros(0, 0, dtype=torch.long))


HOLD = dict(first_chunk=2, playback_margin_s=None, hold_margin_s=0.6, max_hold_s=2.0)


def test_a_finished_answers_chunks_wait_while_a_newcomer_gathers_its_first(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(**HOLD), clock=clock)
    feed(stage, "a", codes(26))
    assert chunk_sizes(stage, "a") == [2, 6, 18]                # 2.1 s of speech sent
    feed(stage, "a", codes(24, seed=1), finished=True)          # a's talker is done: its last chunk
    opened(stage, "b")                                          # b starts: no frames yet
    assert not stage.has_work()                                 # a's chunk waits for b's first
    assert stage.wake_after() == pytest.approx(26 * FRAME_S - 0.6, abs=0.05)  # a's margin first
    feed(stage, "b", codes(2, seed=2))
    assert [o.request_id for o in stage.step()] == ["b", "a"]   # b's first chunk, first
    assert stage.wake_after() is None


def test_an_answer_still_spoken_is_not_held(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(**HOLD), clock=clock)
    feed(stage, "a", codes(26))
    assert chunk_sizes(stage, "a") == [2, 6, 18]
    feed(stage, "a", codes(24, seed=1))                         # more frames to come
    opened(stage, "b")
    assert [o.request_id for o in stage.step()] == ["a"]
    assert stage.wake_after() is None


def test_a_hold_ends_for_a_listener_about_to_run_dry(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(**HOLD), clock=clock)
    feed(stage, "a", codes(8))
    assert chunk_sizes(stage, "a") == [2, 6]                    # 0.64 s of speech sent
    feed(stage, "a", codes(18, seed=1), finished=True)
    opened(stage, "b")
    assert not stage.has_work()
    clock.now += stage.wake_after() + 1e-3                      # a crosses the margin
    assert stage._streams["a"].playback.left_to_play(clock.now) < 0.6
    assert [o.request_id for o in stage.step()] == ["a"]        # while b still gathers


def test_a_hold_lasts_at_most_max_hold_s(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(**{**HOLD, "hold_margin_s": 0.0, "max_hold_s": 0.5}),
                          clock=clock)
    feed(stage, "a", codes(26))
    assert chunk_sizes(stage, "a") == [2, 6, 18]
    feed(stage, "a", codes(30, seed=1), finished=True)          # chunks of 24, then the last 6
    opened(stage, "b")                                          # never gets its frames
    assert not stage.has_work()
    assert stage.wake_after() == pytest.approx(0.5)
    clock.now += 0.5
    assert [o.request_id for o in stage.step()] == ["a"]        # one step of later chunks
    assert not stage.has_work()                                 # then the hold starts again
    assert stage.wake_after() == pytest.approx(0.5)


def test_no_hold_without_a_margin_and_a_reply_without_frames_ends(model):
    clock = Clock()
    stage = Code2WavStage("code2wav", model, Code2WavSettings(**{**HOLD, "hold_margin_s": None}), clock=clock)
    feed(stage, "a", codes(26))
    assert chunk_sizes(stage, "a") == [2, 6, 18]
    feed(stage, "a", codes(24, seed=1), finished=True)
    opened(stage, "b")
    assert [o.request_id for o in stage.step()] == ["a"]
    assert stage.wake_after() is None
    feed(stage, "b", torch.zeros(0, 0, dtype=torch.long), finished=True)   # the thinker's reply had no rows
    [out] = stage.step()
    assert out.request_id == "b" and out.final and out.payload.samples.numel() == 0
    assert stage.num_requests() == 0


def test_settings_refuse_bad_deadlines():
    with pytest.raises(ValueError, match="playback_margin_s"):
        Code2WavSettings(playback_margin_s=-0.1)
    with pytest.raises(ValueError, match="deadline_chunk"):
        Code2WavSettings(deadline_chunk=0)
    with pytest.raises(ValueError, match="hold_margin_s"):
        Code2WavSettings(hold_margin_s=-0.1)


def test_warm_up_leaves_no_stream_and_changes_no_output(model):
    """warm_up decodes windows of its own before serving: no request appears, and a request's
    chunks afterwards are the same samples as from a stage that never warmed up."""
    settings = Code2WavSettings(playback_margin_s=None)
    cold, warm = Code2WavStage("code2wav", model, settings), Code2WavStage("code2wav", model, settings)
    warm.warm_up()
    assert warm.num_requests() == 0 and not warm.has_work()
    outs = []
    for stage in (cold, warm):
        feed(stage, "r", codes(9, seed=3), finished=True)
        pcm = []
        while stage.has_work():
            pcm += [o.payload.samples for o in stage.step()]
        outs.append(torch.cat(pcm))
    assert outs[0].numel() > 0 and torch.equal(outs[0], outs[1])
