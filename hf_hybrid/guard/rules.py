"""Run protection for real optimizer steps: is this step an outlier, and what should the run do about it?

Pure Python, like the controller: its inputs are the loss and gradient norm already averaged across ranks,
so every rank reaches the same verdict and DDP/FSDP2 collectives stay in step.

Detection. The last `window` accepted steps' losses and log gradient norms are kept. A step is an outlier
when its loss or gradient norm is not finite, or when either lies more than `threshold` robust sigmas
(1.4826 x the median absolute deviation) above the window's median. Only upward excursions count: a loss
that falls faster than usual is good news. Detection starts once the window is half full; non-finite
values are caught from the first step. A large finite gradient norm counts only when the Trainer does not
clip gradients (`max_grad_norm` 0): clipping already bounds what such a step feeds the optimizer, and the
plain Trainer rides it out. At the end of an LR warmup the gradient norm can jump tenfold for many steps at an
ordinary loss; a reaction there (a rollback, or dropped batches) only changes the run
(docs/benchmarks-history.md, "The guard in the steep early phase").

Reaction, escalating (OLMo-core's SkipStepOptimizer and PaLM's restarts, in one ladder):
- SKIP: the step's update is vetoed and its batch dropped. An outlier alone says nothing about the
  weights: a bad batch looks the same. So the last accepted batch is measured again at the current
  weights (`judge_weights`). If its loss is flagged too (or is not finite), or has risen by more than a
  robust sigma since the step that trained on it (an update lowers its own batch's loss or barely moves
  it; one that raised it overshot), the weights are damaged (by an update that looked fine when it was
  taken), and the skip becomes a rollback. A flagged gradient norm at an ordinary loss does not convict
  the weights: it marks a sharp region, not damage.
- ROLLBACK: back to the last good snapshot, taken before the update of an accepted step. Also when
  outliers persist for `max_skips` steps in a row.
- STOP: a rollback is needed and `max_rollbacks` have already happened, or there is no snapshot to go back to.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from enum import Enum

from ..loop.divergence import non_finite
from .config import GuardConfig

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma
# Floors on the robust sigma, so that an unusually smooth stretch does not turn ordinary noise into outliers:
# relative for the loss (2%), in log units for the gradient norm (at 6 sigmas, 3.3x the median, above what clean
# runs reach: docs/benchmarks-history.md, "Run protection: the guard against injected faults").
LOSS_SIGMA_FLOOR = 0.02
LOG_GRAD_SIGMA_FLOOR = 0.2


class Action(str, Enum):
    SKIP = "skip"
    ROLLBACK = "rollback"
    STOP = "stop"


@dataclass
class GuardEvent:
    """One flagged step: what was out of range, by how much, and what the run does."""

    step: int  # the optimizer step as the Trainer's logs count it (1-based)
    signal: str  # "loss", "grad_norm", "non-finite loss", "non-finite grad_norm", or "weights (<one of those>)"
    value: float
    bound: float | None
    action: Action

    def describe(self) -> str:
        if self.bound is None:
            return f"{self.signal} {self.value:.4g}"
        return f"{self.signal} {self.value:.4g} > bound {self.bound:.4g}"


class RobustWindow:
    """The last `size` values of one signal, with an upper bound at median + threshold robust sigmas."""

    def __init__(self, size: int, sigma_floor: float, relative_floor: bool) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.sigma_floor = sigma_floor
        self.relative_floor = relative_floor

    def bound(self, threshold: float) -> float:
        median, sigma = self.median_and_sigma()
        return median + threshold * sigma

    def median_and_sigma(self) -> tuple[float, float]:
        median = statistics.median(self.values)
        mad = statistics.median(abs(v - median) for v in self.values)
        floor = self.sigma_floor * (max(abs(median), 1.0) if self.relative_floor else 1.0)
        return median, max(MAD_TO_SIGMA * mad, floor)


class StepGuard:
    def __init__(self, config: GuardConfig, min_steps: int | None = None, grad_norm_outliers: bool = True) -> None:
        window = config.window
        self.threshold = config.threshold
        self.grad_norm_outliers = grad_norm_outliers  # False: only a non-finite gradient norm is flagged
        self.max_skips = config.max_skips
        self.max_rollbacks = config.max_rollbacks
        # Half a window: early training's gradient norms swing widely, and a short history flags them.
        self.min_steps = min_steps if min_steps is not None else min(window, max(8, window // 2))
        self.loss = RobustWindow(window, LOSS_SIGMA_FLOOR, relative_floor=True)
        self.log_grad = RobustWindow(window, LOG_GRAD_SIGMA_FLOOR, relative_floor=False)
        self.consecutive_skips = 0
        self.outliers = 0
        self.rollbacks = 0
        self.undone_steps = 0  # applied updates undone by rollbacks; their batches are dropped

    @property
    def armed(self) -> bool:
        """Whether the statistics are ready to flag outliers (non-finite values are flagged regardless)."""
        return len(self.loss.values) >= self.min_steps

    def loss_bound(self) -> float | None:
        return self.loss.bound(self.threshold) if self.armed else None

    def check(self, step: int, loss: float, grad_norm: float | None) -> GuardEvent | None:
        """Judge a real step's (rank-averaged) loss and gradient norm. None: the step is accepted and joins the
        statistics. Otherwise the event says what to do; `has_snapshot` is settled later by `escalate`."""
        event = self._flag(step, loss, grad_norm)
        if event is None:
            self.loss.values.append(loss)
            if grad_norm is not None and grad_norm > 0:
                self.log_grad.values.append(math.log(grad_norm))
            self.consecutive_skips = 0
            return None
        self.outliers += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.max_skips:
            event.action = Action.ROLLBACK
        return event

    def _flag(self, step: int, loss: float, grad_norm: float | None) -> GuardEvent | None:
        bad = non_finite(loss, grad_norm)
        if bad is not None:
            return GuardEvent(step, f"non-finite {bad}", loss if bad == "loss" else grad_norm, None, Action.SKIP)
        if not self.armed:
            return None
        bound = self.loss.bound(self.threshold)
        if loss > bound:
            return GuardEvent(step, "loss", loss, bound, Action.SKIP)
        if (self.grad_norm_outliers and grad_norm is not None and grad_norm > 0
                and len(self.log_grad.values) >= self.min_steps):
            log_bound = self.log_grad.bound(self.threshold)
            if math.log(grad_norm) > log_bound:
                return GuardEvent(step, "grad_norm", grad_norm, math.exp(log_bound), Action.SKIP)
        return None

    def judge_weights(self, event: GuardEvent, reference_loss: float, reference_grad_norm: float | None) -> None:
        """The last accepted batch's loss and gradient norm at the current weights, on the scale of the losses the
        guard judges. Its loss flagged too, or either value not finite, or its loss risen by more than one robust sigma
        since the step that trained on it: the weights, not the batch, are bad, and only a rollback helps."""
        if event.action is not Action.SKIP:
            return
        reference = self._flag(event.step, reference_loss, reference_grad_norm)
        if reference is not None and reference.signal != "grad_norm":
            event.signal, event.value, event.bound = f"weights ({reference.signal})", reference.value, reference.bound
            event.action = Action.ROLLBACK
            return
        # An update lowers, or barely moves, the loss of the batch it was computed on; one robust sigma is far above
        # a clean update's rise and below an overshooting one's (docs/benchmarks-history.md, "an update that
        # overshot its own batch"). The window's last value is that batch's loss when accepted, before its update.
        accepted = self.loss.values[-1]
        rise_bound = accepted + self.loss.median_and_sigma()[1]
        if reference_loss > rise_bound:
            event.signal = f"weights (last accepted batch's loss, {accepted:.4g} before its update)"
            event.value, event.bound, event.action = reference_loss, rise_bound, Action.ROLLBACK

    def escalate(self, event: GuardEvent, has_snapshot: bool) -> None:
        """A rollback that cannot happen, or one too many, stops the run."""
        if event.action is Action.ROLLBACK:
            if not has_snapshot or self.rollbacks >= self.max_rollbacks:
                event.action = Action.STOP
            else:
                self.rollbacks += 1
                self.consecutive_skips = 0

    def stats(self) -> dict:
        return {"guard_outliers": self.outliers, "guard_rollbacks": self.rollbacks,
                "guard_undone_steps": self.undone_steps}

    def log_metrics(self) -> dict[str, float]:
        metrics = {f"hybrid/{k}": float(v) for k, v in self.stats().items()}
        bound = self.loss_bound()
        if bound is not None:
            metrics["hybrid/guard_loss_bound"] = bound
        return metrics

    def state_dict(self) -> dict:
        # Settings come from the flags of the run that resumes, not from the checkpoint.
        return {
            "loss": list(self.loss.values),
            "log_grad": list(self.log_grad.values),
            "consecutive_skips": self.consecutive_skips,
            "outliers": self.outliers,
            "rollbacks": self.rollbacks,
            "undone_steps": self.undone_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.values.extend(state["loss"])
        self.log_grad.values.extend(state["log_grad"])
        for key in ("consecutive_skips", "outliers", "rollbacks", "undone_steps"):
            setattr(self, key, state[key])
