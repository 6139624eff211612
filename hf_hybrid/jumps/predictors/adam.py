"""Adam direction: take the optimizer's own next step with its moments held fixed.

With no new gradient, the best guess of the next gradient is the momentum, so the predicted step is
AdamW's: decoupled weight decay plus lr * m_hat / (sqrt(v_hat) + eps), using the optimizer's state
and hyper-parameters. It needs no buffer of its own, which makes it the low-memory choice.
It needs torch's Adam or AdamW (loop/adam_state.py); any other optimizer is refused at start.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...loop.adam_state import unreadable_optimizer
from ...memory.shards import local_shard
from .base import StepwisePredictor


class AdamPredictor(StepwisePredictor):
    name = "adam"
    uses_updates = False

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        super().__init__(params, optimizer)
        self.groups = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.groups[id(p)] = group
        missing = [i for i, p in enumerate(params) if id(p) not in self.groups]
        if missing:
            raise ValueError(f"hybrid_predictor='adam': {len(missing)} trainable parameters are not in the optimizer, "
                             "whose moments it reads. Give the optimizer every trainable parameter, or use "
                             "--hybrid_predictor outer.")
        if reason := unreadable_optimizer(optimizer):
            raise ValueError(f"hybrid_predictor='adam' needs {reason}. Use --hybrid_predictor velocity instead.")

    def direction(self, index: int, param: Tensor, lr: float) -> Tensor:
        p = self.params[index]
        state = self.optimizer.state.get(p)
        group = self.groups[id(p)]
        if not state or "exp_avg" not in state:
            return torch.zeros_like(param)
        beta1, beta2 = group["betas"]
        # Kept a tensor: float() of a fused/capturable optimizer's on-device step would sync once per tensor.
        step = state["step"]
        m_hat = local_shard(state["exp_avg"]) / (1 - beta1**step)
        denom = (local_shard(state["exp_avg_sq"]) / (1 - beta2**step)).sqrt_().add_(group["eps"])
        # The group's own rate (the scheduler keeps it current), so per-group learning rates are honoured.
        group_lr = group["lr"]
        return -group_lr * (m_hat / denom + group["weight_decay"] * param)
