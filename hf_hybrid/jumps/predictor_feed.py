"""What the predictor learns from: each real step's measured update and, on a Correct step, the residual between
the update the predictor would have made and the real one.

`PredictorFeed` is the part of `HybridEngine` (jumps/engine.py) that measures them, around the optimizer step; the
engine owns the predictor, the controller and the step record it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .controller import Phase, PhaseController

if TYPE_CHECKING:
    from .engine import StepRecord
    from .predictors.base import Predictor


class PredictorFeed:
    """Measure real updates for the predictor. Mixed into `HybridEngine`; what it uses of the engine is declared
    below (`shards()` too)."""

    predictor: Predictor
    controller: PhaseController
    record: StepRecord  # the optimizer step under way
    _before_step: list[Tensor] | None  # the parameters before the optimizer step, while it runs
    _predicted: list[Tensor] | None  # on a Correct step, what the predictor would have applied
    _measured_last: bool  # whether the last real step's update was measured (False: a gap since)

    @torch.no_grad()
    def before_optimizer_step(self, lr: float) -> None:
        """Keep the parameters so the real update can be measured after the step; on a Correct step,
        also what the predictor would have done from the same state."""
        self._predicted = None
        # A step vetoed under the fp16 GradScaler still reaches here (the scaler skips it later); it has no update to
        # measure, and after a rollback that retired the predictor, nothing to measure it with.
        if self.record.rollback or self.record.skipped or not self._measures_update:
            return
        if not self._measured_last:
            self.predictor.restart()
        shards = self.shards()
        if self._before_step is None:
            self._before_step = [torch.empty_like(p) for p in shards]
        # One multi-tensor kernel per group instead of a launch per parameter: on a GPU, launches dominate.
        torch._foreach_copy_(self._before_step, shards)
        if self.record.phase is Phase.CORRECT:
            self._predicted = [self.predictor.direction(i, p, lr) for i, p in enumerate(shards)]

    @property
    def _measures_update(self) -> bool:
        """The real update is needed on Correct steps for the residual, and by a predictor that learns from it in
        the window before a prediction can start."""
        if self.record.phase is Phase.CORRECT:
            return True
        window = self.predictor.history_steps
        return self.predictor.uses_updates and (window is None or self.controller.steps_until_predict <= window)

    @torch.no_grad()
    def after_optimizer_step(self, lr: float) -> None:
        """Feed the real update to the predictor, after measuring the residual on a Correct step."""
        measured = self._measures_update
        # Only a predictor that learns from updates has a gap to restart after.
        self._measured_last = measured or not self.predictor.uses_updates
        if not measured:
            if not self.predictor.uses_updates:
                self.predictor.observe([], lr)
            return
        updates = self._before_step
        torch._foreach_neg_(updates)
        torch._foreach_add_(updates, self.shards())  # in place: `_before_step` now holds (after - before)
        if self._predicted is not None:
            self.predictor.measure_residual(updates, self._predicted)
            self._predicted = None
        self.predictor.observe(updates, lr)
