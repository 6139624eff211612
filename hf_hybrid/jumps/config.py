"""The jumps' settings, read once from the flags (their defaults and documentation: `HybridTrainingArguments`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import FlagSettings, flag, section
from .controller import ControllerConfig
from .predictors import PREDICTORS


@dataclass(frozen=True)
class PredictorConfig(FlagSettings):
    """Which predictor proposes the jumps, and its own settings."""

    name: str = flag("hybrid_predictor")
    velocity_beta: float = flag("hybrid_velocity_beta")
    outer_period: int = flag("hybrid_outer_period")
    outer_lr: float = flag("hybrid_outer_lr")
    outer_momentum: float = flag("hybrid_outer_momentum")

    def __post_init__(self) -> None:
        self.require("name", self.name in PREDICTORS, f"must be one of {sorted(PREDICTORS)}")
        for name in ("velocity_beta", "outer_momentum"):
            self.require(name, 0.0 <= getattr(self, name) < 1.0, "must be in [0, 1)")
        self.at_least(1, "outer_period")
        self.positive("outer_lr")

    def predictor_kwargs(self) -> dict:
        """The constructor arguments of the named predictor."""
        if self.name == "velocity":
            return {"beta": self.velocity_beta}
        if self.name == "outer":
            return {"period": self.outer_period, "outer_lr": self.outer_lr, "momentum": self.outer_momentum}
        return {}


@dataclass(frozen=True)
class ChecksConfig(FlagSettings):
    """How a jump is judged: the loss forecast's band on its steps, the gradient after it, the payoff on its probe."""

    monitor_interval: int = flag("hybrid_monitor_interval")
    loss_band: float = flag("hybrid_loss_band")
    grad_explosion_factor: float = flag("hybrid_grad_explosion_factor")
    payoff_check: bool = flag("hybrid_payoff_check")
    probe_noise_margin: float = flag("hybrid_probe_noise_margin")
    predict_step_cost: float = flag("hybrid_predict_step_cost")

    def __post_init__(self) -> None:
        self.at_least(1, "monitor_interval")
        self.positive("loss_band", "grad_explosion_factor", "predict_step_cost")
        self.at_least(0, "probe_noise_margin")


@dataclass(frozen=True)
class JumpsConfig(FlagSettings):
    predict: bool = flag("hybrid_predict")
    offload_snapshot: bool = flag("hybrid_offload_snapshot")
    schedule: ControllerConfig = section(ControllerConfig)
    predictor: PredictorConfig = section(PredictorConfig)
    checks: ChecksConfig = section(ChecksConfig)
