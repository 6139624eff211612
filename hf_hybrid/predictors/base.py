"""The predictor interface: a new predictor is one file with one subclass.

Every input a predictor sees is rank-identical: the parameters, the real update of the last optimizer
step (computed from all-reduced gradients), and the optimizer's state. Tensors are the local ones
(under FSDP2, each rank's shard), and every operation is element-wise, so predicting needs no
communication and ranks stay bit-identical.

Residual correction is shared: on a Correct step the real update is compared with what the predictor
would have applied, and a per-tensor gain is refitted by least squares (projection of the real update
on the predicted one, clamped and smoothed). The gain shrinks directions that real steps do not
follow; the relative residual is logged as `hybrid/prediction_error`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor


class Predictor(ABC):
    name: ClassVar[str]
    uses_updates: ClassVar[bool] = True  # whether `observe` needs the real update (costs a parameter copy)
    gain_smoothing: ClassVar[float] = 0.3
    max_gain: ClassVar[float] = 2.0

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer
        self.gains = torch.ones(len(params), dtype=torch.float64)
        self.observed = 0
        self.last_residual: float | None = None

    @property
    def ready(self) -> bool:
        """Whether enough real updates were seen to predict."""
        return self.observed >= 2

    def observe(self, updates: list[Tensor], lr: float) -> None:
        """Learn from the real update (parameters after the step minus before) of one optimizer step."""
        self.observed += 1
        self._observe(updates, lr)

    def _observe(self, updates: list[Tensor], lr: float) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def direction(self, index: int, param: Tensor, lr: float) -> Tensor:
        """The un-gained predicted update of parameter `index` for one step at learning rate `lr`."""

    @torch.no_grad()
    def apply_(self, lr: float) -> None:
        """Apply one predicted step to the parameters, in place."""
        for i, p in enumerate(self.params):
            p.add_(self.direction(i, p, lr), alpha=float(self.gains[i]))

    @torch.no_grad()
    def measure_residual(self, updates: list[Tensor], predicted: list[Tensor]) -> float:
        """Compare a real update with the un-gained prediction made from the same state; refit the gains.

        Returns the relative residual ||real - gain * predicted|| / ||real|| over all parameters.
        """
        # Three sums per tensor, read back in one transfer: ||u - g d||^2 = uu - 2 g ud + g^2 dd.
        sums = torch.stack([
            torch.stack([(u * u).sum(dtype=torch.float64), (u * d).sum(dtype=torch.float64),
                         (d * d).sum(dtype=torch.float64)])
            for u, d in ((_local(u), _local(d)) for u, d in zip(updates, predicted))
        ]).tolist()
        num, den = 0.0, 0.0
        for i, (uu, ud, dd) in enumerate(sums):
            fitted = min(max(ud / dd, 0.0), self.max_gain) if dd > 0 else 0.0
            self.gains[i] = (1 - self.gain_smoothing) * self.gains[i] + self.gain_smoothing * fitted
            g = float(self.gains[i])
            num += max(uu - 2 * g * ud + g * g * dd, 0.0)
            den += uu
        self.last_residual = math.sqrt(num / max(den, 1e-30))
        return self.last_residual

    def state_dict(self) -> dict:
        return {"gains": self.gains.clone(), "observed": self.observed, "last_residual": self.last_residual}

    def load_state_dict(self, state: dict) -> None:
        self.gains = state["gains"].clone()
        self.observed = state["observed"]
        self.last_residual = state["last_residual"]


def _local(t: Tensor) -> Tensor:
    """Under FSDP2 a reduction over a DTensor would all-gather; the per-shard gain needs only the shard."""
    return t.to_local() if hasattr(t, "to_local") else t
