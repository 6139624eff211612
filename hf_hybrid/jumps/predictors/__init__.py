"""Predictors, by the name `--hybrid_predictor` takes."""

from __future__ import annotations

from .adam import AdamPredictor
from .base import Predictor
from .outer import OuterMomentumPredictor
from .velocity import VelocityPredictor

PREDICTORS: dict[str, type[Predictor]] = {
    cls.name: cls for cls in (VelocityPredictor, AdamPredictor, OuterMomentumPredictor)
}


__all__ = ["PREDICTORS", "AdamPredictor", "OuterMomentumPredictor", "Predictor", "VelocityPredictor"]
