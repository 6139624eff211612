"""EMA velocity: extrapolate the smoothed per-step update of recent real steps.

The velocity is kept per unit of learning rate, so a warmup or decay schedule scales the predicted
step the way it scales Adam's. Averaging over ~1/(1-beta) steps removes much of the minibatch noise
that a single real update carries. Memory: one extra buffer the size of the parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...memory.shards import load_tensors, local_shard
from .base import StepwisePredictor


class VelocityPredictor(StepwisePredictor):
    name = "velocity"
    flags = (*StepwisePredictor.flags, "hybrid_velocity_beta")

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer, beta: float) -> None:
        super().__init__(params, optimizer)
        self.beta = beta
        self.velocity = [torch.zeros_like(local_shard(p)) for p in params]
        # After 2/(1-beta) updates the average has 87% of its weight on them; older ones add little.
        self.history_steps = max(2, round(2 / (1 - beta)))

    def restart(self) -> None:
        super().restart()
        torch._foreach_zero_(self.velocity)

    def release(self) -> None:
        self.velocity = []

    @torch.no_grad()
    def _observe(self, updates: list[Tensor], lr: float) -> None:
        if lr <= 0:
            return
        torch._foreach_mul_(self.velocity, self.beta)
        torch._foreach_add_(self.velocity, updates, alpha=(1 - self.beta) / lr)

    def direction(self, index: int, param: Tensor, lr: float) -> Tensor:
        bias_correction = 1 - self.beta**self.observed
        return self.velocity[index] * (lr / bias_correction)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "velocity": [v.detach().cpu() for v in self.velocity]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        load_tensors(self.velocity, state["velocity"], "velocity")
