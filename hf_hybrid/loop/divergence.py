"""Divergence signals: is a loss or a gradient norm out of the range real training shows?

Pure Python: its inputs are floats that were already reduced across ranks, so every rank reaches the
same verdict and DDP collectives stay in step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def non_finite(loss: float, grad_norm: float | None = None) -> str | None:
    """Which of a step's numbers is not finite ("loss" first, then "grad_norm"), or None. The one test of it that
    the guard, the engine's veto of a real step and the divergence monitor all make."""
    if not math.isfinite(loss):
        return "loss"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return "grad_norm"
    return None


@dataclass
class DivergenceMonitor:
    band_sigmas: float  # --hybrid_loss_band
    grad_explosion_factor: float  # --hybrid_grad_explosion_factor
    level_decay: float = 0.7
    noise_decay: float = 0.95
    min_observations: int = 5
    loss_level: float = 0.0
    last_loss: float = 0.0
    noise_var: float = 0.0
    log_grad_norm: float = 0.0
    observations: int = 0
    divergences: int = 0
    non_finite: int = 0

    def observe(self, loss: float, grad_norm: float | None) -> None:
        """Record a healthy real step."""
        if self.observations == 0:
            self.loss_level = loss
            self.log_grad_norm = math.log(grad_norm) if grad_norm and grad_norm > 0 else 0.0
        else:
            # Half the mean squared step-to-step change: the batch noise, blind to a steady trend
            # (a plain EMA variance would count the falling trend as noise and loosen the band).
            diff = loss - self.last_loss
            self.noise_var = self.noise_decay * self.noise_var + (1 - self.noise_decay) * 0.5 * diff * diff
            self.loss_level = self.level_decay * self.loss_level + (1 - self.level_decay) * loss
            if grad_norm and grad_norm > 0:
                d = self.noise_decay
                self.log_grad_norm = d * self.log_grad_norm + (1 - d) * math.log(grad_norm)
        self.last_loss = loss
        self.observations += 1

    @property
    def loss_sigma(self) -> float:
        # Bias-corrected; a floor keeps an unusually smooth stretch from turning every wiggle into a divergence.
        n = max(self.observations - 1, 1)
        var = self.noise_var / (1 - self.noise_decay**n)
        return max(math.sqrt(var), 1e-3 * max(abs(self.loss_level), 1.0))

    def count_non_finite(self) -> None:
        """A non-finite loss or gradient norm: a divergence of its own kind."""
        self.non_finite += 1
        self.divergences += 1

    def loss_diverged(self, loss: float, expected: float | None = None, extra_sigma: float = 0.0) -> bool:
        """True when `loss` is non-finite or above `expected` (default: the recent level) by the band."""
        if non_finite(loss):
            self.count_non_finite()
            return True
        if self.observations < self.min_observations:
            return False
        center = self.loss_level if expected is None else expected
        sigma = math.sqrt(self.loss_sigma**2 + extra_sigma**2)
        if loss > center + self.band_sigmas * sigma:
            self.divergences += 1
            return True
        return False

    def grad_diverged(self, grad_norm: float) -> bool:
        """True when the gradient norm is non-finite or explodes past `grad_explosion_factor` x its trend."""
        if non_finite(0.0, grad_norm):
            self.count_non_finite()
            return True
        if self.observations < self.min_observations or grad_norm <= 0:
            return False
        if math.log(grad_norm) > self.log_grad_norm + math.log(self.grad_explosion_factor):
            self.divergences += 1
            return True
        return False

    def state_dict(self) -> dict:
        # Settings come from the flags of the run that resumes, not from the checkpoint.
        return {k: v for k, v in asdict(self).items() if k not in _SETTINGS}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


_SETTINGS = ("band_sigmas", "grad_explosion_factor", "level_decay", "noise_decay", "min_observations")
