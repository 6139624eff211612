"""The jump's life cycle: a Predict phase opens with a snapshot, is watched step by step against the loss forecast,
and ends with the probe's verdict; a jump that does not pay is rolled back bit for bit and its batches replayed.

`JumpLifecycle` is the part of `HybridEngine` (jumps/engine.py) that does this; the engine owns the parts it uses
(controller, predictor, snapshot, payoff meter, replay, loss forecast) and the step bookkeeping around it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..loop.replay import move_batch
from .controller import Phase, PhaseController

if TYPE_CHECKING:
    from ..loop.divergence import DivergenceMonitor
    from ..loop.replay import BatchReplay
    from ..memory.snapshot import WeightSnapshot
    from .config import JumpsConfig
    from .dynamics import LossDynamicsModel
    from .engine import StepRecord
    from .payoff import PayoffMeter
    from .predictors.base import Predictor


class JumpLifecycle:
    """Open, watch, judge and undo a Predict phase. Mixed into `HybridEngine`; what it uses of the engine is
    declared below (`shards()` and `_release()` too)."""

    config: JumpsConfig
    controller: PhaseController
    predictor: Predictor
    snapshot: WeightSnapshot  # the undo copy of the weights
    payoff: PayoffMeter
    replay: BatchReplay
    monitor: DivergenceMonitor
    dynamics: LossDynamicsModel
    record: StepRecord  # the optimizer step under way
    probe: dict | None
    probe_loss: float | None
    probe_rows: torch.Tensor | None
    band: tuple[list[float], list[float]]
    jump_start_step: int | None
    undone_steps: int
    made_up_steps: int

    def counted_updates(self, global_step: int) -> int:
        """The updates that count by `global_step`, as `max_steps` counts them: the Trainer's step count less the
        steps made up for rolled-back jumps, undone raises and skipped steps. A plain run's logs share this axis."""
        return global_step - self.made_up_steps

    @property
    def jump_open(self) -> bool:
        """Whether a jump was made and awaits its verdict: its undo copy is held until then."""
        return self.snapshot.valid

    def open_jump(self, step: int) -> None:
        """At a Predict phase's first step: keep what is needed to undo it."""
        self.snapshot.capture(self.shards())
        self.jump_start_step = step
        self.payoff.begin_prediction()
        # Predicted step k checks the weights after k+1 deltas, about k+2 real steps after the last loss seen. Without
        # a forecast, the band is centred on the loss's recent level.
        if self.predictor.uses_forecast:
            self.band = self.dynamics.forecast(self.controller.planned_predict_steps + 1)

    @property
    def starts_prediction(self) -> bool:
        return self.record.phase is Phase.PREDICT and self.controller.steps_in_phase == 0

    @property
    def ends_prediction(self) -> bool:
        return self.record.phase is Phase.PREDICT and self.controller.steps_in_phase + 1 >= (
            self.controller.planned_predict_steps
        )

    def apply_prediction(self, lr: float, at_anchor: bool = False) -> None:
        """`at_anchor`: the parameters hold the outer predictor's anchor, and the jump starts from the undo copy."""
        if at_anchor:
            self.predictor.apply_(lr, start=self.snapshot.tensors)
        else:
            self.predictor.apply_(lr)

    def set_probe(self, inputs: dict, loss: float, rows: torch.Tensor | None) -> None:
        """Keep the probe batch, its loss and its sequences' losses at the weights before the phase's first delta."""
        self.probe, self.probe_loss, self.probe_rows = inputs, loss, rows
        self.payoff.tick_probe()

    def set_cycle_start(self, start_loss: float) -> None:
        """The probe's loss at the outer cycle's start (its anchor): with its loss at the cycle's end, the cycle's
        progress per real step is plain training's rate, measured on the probe itself. What a kept jump is worth in
        steps is counted against it (payoff.use_rate)."""
        steps = self.predictor.cycle_steps
        # Not charged to the jump: this forward is paid whatever its verdict.
        if steps:
            self.payoff.use_rate((start_loss - self.probe_loss) / steps)

    def judge_probe(self, loss_after: float, noise: float, forward_run: bool = True) -> None:
        """At the end of a Predict phase: keep the jump only if its probe gain beat plain training's by
        `hybrid_probe_noise_margin` times its noise (the gain's standard error over the probe's sequences) or more.
        `forward_run`: False when the step's loss check already was the probe's forward, paid for there."""
        if forward_run:
            self.payoff.tick_probe()
        paid = self.payoff.verdict(self.probe_loss - loss_after, noise)
        self._drop_probe()
        if paid:
            self.controller.reward()
        else:
            self.rollback()

    @property
    def monitored(self) -> bool:
        """Whether this Predict step runs a forward pass to check the loss."""
        k = self.controller.steps_in_phase
        last = k + 1 >= self.controller.planned_predict_steps
        return last or (k + 1) % self.config.checks.monitor_interval == 0

    def check_predict_step(self, loss: float | None) -> None:
        """At the end of a Predict step: roll back if the monitored loss left the forecast band."""
        record = self.record
        record.loss = loss
        if loss is not None:
            k = self.controller.steps_in_phase
            means, stds = self.band
            expected = means[k + 1] if k + 1 < len(means) else None
            spread = stds[k + 1] if k + 1 < len(stds) and math.isfinite(stds[k + 1]) else 0.0
            # The forecast's own spread widens the band, up to the loss's batch noise.
            extra = min(spread, 3.0 * self.monitor.loss_sigma)
            if self.monitor.loss_diverged(loss, expected=expected, extra_sigma=extra):
                self.rollback()
        self.payoff.tick_predict(monitored=loss is not None)

    def rollback(self) -> None:
        """Undo the Predict phase: last good weights, back to Full."""
        if self.jump_open:
            self.snapshot.restore(self.shards())
            self.snapshot.release()
            self.predictor.jump_undone()
        self.payoff.cancel()
        self.replay.give_back()
        self._drop_probe()
        self.controller.abort()
        self.record.rollback = True
        if self.jump_start_step is not None:
            self.record.undone_steps = self.record.step - self.jump_start_step + 1
            self.undone_steps += self.record.undone_steps
            self.made_up_steps += self.record.undone_steps
            self.jump_start_step = None
        if self.controller.retired:
            self._release()

    def finish(self) -> None:
        """At the end of training: a jump still awaiting its probe verdict is undone."""
        if self.probe is not None and self.jump_open:
            self.snapshot.restore(self.shards())
            self.snapshot.release()
            self._drop_probe()

    def probe_state(self) -> dict:
        """The open jump's probe, for a checkpoint taken while it awaits its verdict."""
        return {"probe": move_batch(self.probe, "cpu"), "probe_loss": self.probe_loss,
                "probe_rows": self.probe_rows.cpu() if self.probe_rows is not None else None}

    def load_probe_state(self, state: dict, device: torch.device) -> None:
        self.probe, self.probe_loss = move_batch(state["probe"], device), state["probe_loss"]
        rows = state["probe_rows"]
        self.probe_rows = rows.to(device) if rows is not None else None

    def _drop_probe(self) -> None:
        self.probe = self.probe_loss = self.probe_rows = None

