"""The learning-rate autopilot's evidence: the probe batch's loss along the optimizer's own next step.

Adam's next step is -lr * m_hat / (sqrt(v_hat) + eps), read from its state with no gradient. The probe loss at W,
W + c*step and W + 2c*step puts a parabola along it; where it bottoms out, in steps, is how many of today's steps
the current direction is worth. At a fixed point that number scales as 1 / lr (the step is proportional to the LR,
the curvature it meets to its square), so it reads the LR itself, where the line an outer cycle travelled does not:
measured on cpu-finetune from step 60, a parabola bottom at 0-0.5 steps at the swept LR and 10-270 steps at a
twentieth of it (docs/benchmarks.md, session 14).

Three forwards and one copy of the weights (the jump's undo copy, which exists only while it is in use), made after
the optimizer step, when the gradients it stands in for are freed; the weights come back bit for bit.
"""

from __future__ import annotations

import torch

from .forward_checks import probe_loss
from .predictors.base import local_shard

SPACING = 4.0  # c: the line is read at 0, 4 and 8 of today's steps, far enough to see a line several steps long


def adam_family(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group keeps Adam's moments (Adam, AdamW, fused or not), whose next step can be read
    without a gradient."""
    return all("betas" in group and "eps" in group for group in optimizer.param_groups)


@torch.no_grad()
def _move_along_next_step(optimizer: torch.optim.Optimizer, multiple: float) -> None:
    """Add `multiple` x Adam's next step (weight decay aside) to the weights, one tensor at a time: no buffer of the
    parameters' size."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr = group["lr"]  # a float, or a fused optimizer's tensor
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or "exp_avg_sq" not in state:
                continue
            step = state["step"]  # a tensor, kept as one: no host read per parameter
            m_hat = local_shard(state["exp_avg"]) / (1 - beta1**step)
            denom = (local_shard(state["exp_avg_sq"]) / (1 - beta2**step)).sqrt_().add_(group["eps"])
            local_shard(p).add_(m_hat.div_(denom).mul_(lr).mul_(-multiple))


@torch.no_grad()
def next_step_line(trainer, model: torch.nn.Module, engine, probe: dict) -> list[torch.Tensor]:
    """The probe's loss at the weights W, at W + c*step and at W + 2c*step (c = SPACING), unreduced across ranks."""
    shards = engine._shards()
    engine.snapshot.capture(shards)  # the jump's undo copy, free outside a jump
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    losses = [probe_loss(trainer, model, probe)]
    for _ in range(2):
        _move_along_next_step(optimizer, SPACING)
        losses.append(probe_loss(trainer, model, probe))
    engine.snapshot.restore(shards)
    engine.snapshot.release()
    return losses
