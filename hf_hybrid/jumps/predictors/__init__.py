"""Predictors, by the name `--hybrid_predictor` takes."""

from __future__ import annotations

import torch
from torch import Tensor

from .adam import AdamPredictor
from .base import Predictor
from .outer import OuterMomentumPredictor
from .velocity import VelocityPredictor

PREDICTORS: dict[str, type[Predictor]] = {
    cls.name: cls for cls in (VelocityPredictor, AdamPredictor, OuterMomentumPredictor)
}


def build_predictor(settings, params: list[Tensor], optimizer: torch.optim.Optimizer) -> Predictor:
    """The predictor `settings.hybrid_predictor` names, with its own `hybrid_*` settings."""
    name = settings.hybrid_predictor
    kwargs = {}
    if name == "velocity":
        kwargs = {"beta": settings.hybrid_velocity_beta}
    elif name == "outer":
        kwargs = {"period": settings.hybrid_outer_period, "outer_lr": settings.hybrid_outer_lr,
                  "momentum": settings.hybrid_outer_momentum}
    return PREDICTORS[name](params, optimizer, **kwargs)


__all__ = ["PREDICTORS", "AdamPredictor", "OuterMomentumPredictor", "Predictor", "VelocityPredictor", "build_predictor"]
