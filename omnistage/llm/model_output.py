"""What a model's forward may return to the runner besides a plain tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LMOutput:
    """A forward's two outputs: `final` (T or R, hidden) final-normed states, which the runner
    samples from, and `exported` (T, width) the states the model hands out for its positions
    when a sequence asks for hidden states (e.g. an intermediate layer's output)."""

    final: torch.Tensor
    exported: torch.Tensor
