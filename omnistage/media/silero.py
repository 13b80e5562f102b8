"""Silero VAD (v5, 16 kHz): the probability that a 32 ms window of audio is speech.

Our own implementation (numpy) over the weights of the model the `silero-vad` pip package serves by
default (`load_silero_vad()`: `silero_vad/data/silero_vad.jit`, TorchScript; its 16 kHz
branch). We read the weights out of that file and run them ourselves: explicit state (one
network for every session) and no import of the package, which sets torch's thread count to 1
for the whole process on import. The TorchScript model is the oracle (tests/media/
test_silero.py: equal probabilities on real speech). (The package's silero_vad_16k.safetensors
holds other, older weights.)

The network, per window: 512 new samples at 16 kHz after the 64 samples before them
(CONTEXT; zeros at the start of a stream), reflect-padded by 64 on the right, a learned STFT
(a strided conv: 129 bins of real and imaginary parts, 4 frames) and its magnitude, four
conv+ReLU layers (strides 1, 2, 2, 1) down to one 128-vector, an LSTM cell carrying (h, c) from
window to window, and ReLU, a 1x1 conv and a sigmoid. State is explicit, so one network serves
every session: each stream keeps its own `SileroState`.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

RATE = 16000
WINDOW = 512            # new samples per window (32 ms)
CONTEXT = 64            # samples of the previous window each one also reads
WEIGHTS = "silero_vad.jit"
# our parameter names -> the TorchScript model's (its 16 kHz branch, `_model`)
JIT_NAMES = {"stft_conv.weight": "stft.forward_basis_buffer",
             **{f"conv{i + 1}.{p}": f"encoder.{i}.reparam_conv.{p}"
                for i in range(4) for p in ("weight", "bias")},
             **{f"lstm_cell.{p}": f"decoder.rnn.{p}"
                for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
             "final_conv.weight": "decoder.decoder.2.weight",
             "final_conv.bias": "decoder.decoder.2.bias"}


_FRAMES = np.arange(4)[:, None] * 128 + np.arange(256)    # the STFT's 4 frames of a window


class SileroNet:
    """The network in numpy float32 (one window is a few hundred kFLOP: torch's per-op dispatch
    and thread pool cost ~50x the arithmetic, numpy's matmuls do not). Weights as in the
    TorchScript model: stft (258, 1, 256), conv{1..4} (out, in, 3) + bias, LSTM cell (512, 128)
    x 2 + biases (gates i, f, g, o), final_conv (1, 128, 1) + bias."""

    STRIDES = (1, 2, 2, 1)

    def __init__(self, weights: dict[str, np.ndarray]):
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self.stft = w["stft_conv.weight"][:, 0].T                    # (256, 258)
        # conv (out, in, k) -> (k * in, out), to multiply rows laid out as [tap][channel]
        self.convs = [(w[f"conv{i}.weight"].transpose(2, 1, 0).reshape(-1, w[f"conv{i}.weight"].shape[0]),
                       w[f"conv{i}.bias"], self.STRIDES[i - 1]) for i in range(1, 5)]
        self.w_ih, self.w_hh = w["lstm_cell.weight_ih"].T, w["lstm_cell.weight_hh"].T  # (128, 512)
        self.b_lstm = w["lstm_cell.bias_ih"] + w["lstm_cell.bias_hh"]
        self.w_out, self.b_out = w["final_conv.weight"][0, :, 0], float(w["final_conv.bias"][0])

    def encode(self, x: np.ndarray) -> np.ndarray:
        """(N, CONTEXT + WINDOW) windows -> (N, 128): everything before the recurrence, so a
        stream's windows go through it in one batch."""
        x = np.concatenate([x, x[:, -2:-CONTEXT - 2:-1]], axis=1)          # reflect: (N, 640)
        frames = x[:, _FRAMES]                                             # (N, 4, 256)
        spec = frames @ self.stft                                         # (N, 4, 258)
        h = np.sqrt(spec[..., :129] ** 2 + spec[..., 129:] ** 2)          # (N, 4, 129)
        for w, b, stride in self.convs:                                   # length 4, 4, 2, 1
            zero = np.zeros((h.shape[0], 1, h.shape[2]), np.float32)
            padded = np.concatenate([zero, h, zero], axis=1)
            out_len = (h.shape[1] - 1) // stride + 1
            taps = [padded[:, k:k + stride * out_len:stride] for k in range(3)]
            h = np.maximum(np.concatenate(taps, axis=2) @ w + b, 0.0)    # (N, out_len, out)
        return h[:, 0]

    def decode(self, feats: np.ndarray, h: np.ndarray, c: np.ndarray):
        """One stream's encoded windows in order (T, 128) from state (128,) x 2 ->
        probabilities (T,) and the state after the last window."""
        x_gates = feats @ self.w_ih + self.b_lstm                         # (T, 512)
        hs = np.empty_like(feats)
        for t in range(feats.shape[0]):
            g = x_gates[t] + h @ self.w_hh
            i, f, o = _sigmoid(g[:128]), _sigmoid(g[128:256]), _sigmoid(g[384:])
            c = f * c + i * np.tanh(g[256:384])
            h = o * np.tanh(c)
            hs[t] = h
        return _sigmoid(np.maximum(hs, 0.0) @ self.w_out + self.b_out), h, c


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass
class SileroState:
    """One stream: the LSTM state and the last CONTEXT samples."""

    h: np.ndarray = field(default_factory=lambda: np.zeros(128, np.float32))
    c: np.ndarray = field(default_factory=lambda: np.zeros(128, np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))


class SileroVadModel:
    """The loaded network; `probabilities` is safe to call from several threads at once (its
    weights are only read)."""

    def __init__(self, net: SileroNet):
        self.net = net

    def probabilities(self, windows: np.ndarray, state: SileroState) -> np.ndarray:
        """Speech probabilities (T,) of consecutive windows (T, WINDOW) of one stream (16 kHz
        float32 in [-1, 1]); `state` moves past them."""
        if windows.shape[0] == 0:
            return np.zeros(0, np.float32)
        flat = np.concatenate([state.context, windows.reshape(-1).astype(np.float32)])
        idx = np.arange(windows.shape[0])[:, None] * WINDOW + np.arange(CONTEXT + WINDOW)
        probs, state.h, state.c = self.net.decode(self.net.encode(flat[idx]), state.h, state.c)
        state.context = flat[-CONTEXT:].copy()
        return probs


def weights_path() -> Path:
    """The model file inside the installed silero-vad package (found, not imported)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed (pip install silero-vad); "
                           "server_vad and semantic_vad need its model")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / WEIGHTS
    if not path.is_file():
        raise RuntimeError(f"silero-vad is installed without its model file {path}")
    return path


def load_silero() -> SileroVadModel:
    """The network with the package model's weights (read on the CPU; no code of the file is
    run: only its tensors are taken)."""
    with warnings.catch_warnings():   # torch.jit.load's deprecation: the file is TorchScript
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.load(str(weights_path()), map_location="cpu").state_dict()
    return SileroVadModel(SileroNet({ours: scripted[f"_model.{theirs}"].detach().numpy()
                                     for ours, theirs in JIT_NAMES.items()}))
