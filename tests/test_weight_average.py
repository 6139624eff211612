"""The benchmark's averaging arm: an EMA of the trainable weights, evaluated in their place and swapped back exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from benchmark import WeightAverage  # noqa: E402


def test_average_follows_the_weights_and_swaps_back_bit_exactly():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # frozen weights (LoRA's base model) are not averaged
    start = model.weight.detach().clone()
    average = WeightAverage(model, decay=0.9)
    expected = start.clone()
    for n in range(1, 4):
        with torch.no_grad():
            model.weight.add_(1.0)
        average.update()
        decay = min(0.9, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * model.weight.detach()
    weights = model.weight.detach().clone()
    assert len(average.average) == 1
    with average.swapped_in():
        torch.testing.assert_close(model.weight.detach(), expected)
    assert torch.equal(model.weight.detach(), weights)
