"""Which optimizers step by torch's Adam, so that their next step can be read from their moments without a gradient,
as the learning-rate autopilot's line (autopilot/line.py) and the `adam` predictor (jumps/predictors/adam.py) read
it."""

from __future__ import annotations

import inspect

import torch


def unreadable_optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    """What the optimizer lacks for its next step to be read from Adam's moments, or None where it steps by torch's Adam
    (Adam and AdamW, fused, foreach or not: every `--optim adamw_torch*`) without amsgrad. Optimizers that keep Adam's
    hyperparameters but step otherwise are not read: schedule-free AdamW (it steps from an average, with no first
    moment or step count), Prodigy (its step is scaled by an estimate of its own) and Mechanic's wrapper (by its
    learned multiplier). `optimizer`: the optimizer or accelerate's wrapper around it."""
    inner = getattr(optimizer, "optimizer", optimizer)
    adam_step = inspect.unwrap(torch.optim.Adam.step)  # unwrapped: torch wraps each class's step in a profiling hook
    if inspect.unwrap(type(inner).step) is adam_step and not any(g.get("amsgrad") for g in inner.param_groups):
        return None
    return (f"torch's Adam or AdamW without amsgrad (every --optim adamw_torch*), whose next step it reads (this run's "
            f"optimizer: {type(inner).__name__})")
