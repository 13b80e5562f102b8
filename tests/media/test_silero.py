"""Our Silero VAD network against the silero-vad package's own TorchScript model (the oracle) on
real speech: the same probabilities window by window, however a stream's windows are grouped."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.espeak import utterance
from omnistage.media.audio import resample
from omnistage.media.silero import WINDOW, SileroState, load_silero, weights_path


def test_probabilities_equal_the_package_model():
    audio = resample(utterance(3).audio, 24000, 16000)
    audio = np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(8000, np.float32)])
    windows = audio[:audio.size // WINDOW * WINDOW].reshape(-1, WINDOW)
    oracle = torch.jit.load(str(weights_path()), map_location="cpu")   # stateful: one stream
    with torch.inference_mode():
        want = np.array([oracle(torch.from_numpy(w.copy())[None], 16000).item() for w in windows])
    model = load_silero()
    got = model.probabilities(windows, SileroState())
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert (want > 0.9).sum() > 20 and (want < 0.1).sum() > 20        # speech and silence
    state = SileroState()                                             # 3, 1, 7, ... at a time
    parts, at = [], 0
    for n in (3, 1, 7, 30, 1000):
        parts.append(model.probabilities(windows[at:at + n], state))
        at += n
    np.testing.assert_allclose(np.concatenate(parts), got, atol=1e-6)   # BLAS blocking only
