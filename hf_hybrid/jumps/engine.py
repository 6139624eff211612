"""The hybrid engine: one optimizer step at a time, the parts work together here.

The Trainer subclass calls it at fixed points of its loop (see trainer.py). The engine owns the predictor, the
dynamics model, the divergence and payoff monitors and the phase controller, keeps the step's bookkeeping, and turns
their verdicts into tensor operations; the jump's life cycle is in jumps/lifecycle.py, the measuring of real updates for
the predictor in jumps/predictor_feed.py.

Rank safety: the only rank-local numbers are the micro-batch losses, and they are averaged across ranks (one small
all-reduce per optimizer step, shared with the gradient norm) before any decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..loop.divergence import DivergenceMonitor, non_finite
from ..loop.epoch_seed import EpochSeedDraw
from ..loop.replay import BatchReplay, Unit
from ..memory.placement import CopyPlacement
from ..memory.shards import local_shards
from ..memory.snapshot import WeightSnapshot
from .config import JumpsConfig
from .controller import PHASE_IDS, Phase, PhaseController
from .dynamics import LossDynamicsModel
from .lifecycle import JumpLifecycle
from .payoff import PayoffMeter
from .predictor_feed import PredictorFeed
from .predictors import PREDICTORS


@dataclass
class StepRecord:
    """What happened in one optimizer step, for the trace and the logs."""

    step: int
    phase: Phase
    loss: float | None = None
    rollback: bool = False
    skipped: bool = False
    undone_steps: int = 0  # optimizer steps, this one included, that its rollback undid


class HybridEngine(JumpLifecycle, PredictorFeed):
    def __init__(self, config: JumpsConfig, params: list[Tensor], optimizer: torch.optim.Optimizer, seed: int = 0,
                 accumulation: int = 1, placement: CopyPlacement | None = None) -> None:
        if not params:
            raise ValueError("hybrid training needs at least one trainable parameter; the model has none. Unfreeze "
                             "the parameters to train (with PEFT: check the adapter config's target_modules), or "
                             "pass --hybrid false.")
        self.config, self.params, self.optimizer = config, params, optimizer
        self.placement = placement or CopyPlacement.host()  # the rollback copies': predictor's and guard's
        predictor = PREDICTORS[config.predictor.name]
        placed = {"placement": self.placement} if predictor.placed else {}
        self.predictor = predictor(params, optimizer, **placed, **config.predictor.predictor_kwargs())
        self.controller = PhaseController(replace(config.schedule, **self.predictor.controller_settings()))
        checks = config.checks
        self.monitor = DivergenceMonitor(checks.loss_band, grad_explosion_factor=checks.grad_explosion_factor)
        self.payoff = PayoffMeter(forward_cost=checks.predict_step_cost, noise_margin=checks.probe_noise_margin,
                                  accumulation=accumulation)
        self.dynamics = LossDynamicsModel(seed=seed)
        self.snapshot = WeightSnapshot(on_host=config.offload_snapshot)
        self.replay = BatchReplay()
        self.epoch_seed = EpochSeedDraw()
        self._before_step = None
        # On an accelerator the copy is freed after each step: the caching allocator hands the same blocks back,
        # and a buffer that lives only around the optimizer step stays out of the forward and backward's peak. On
        # the host it is kept, because glibc would map and unmap it every step.
        self._keep_before_step = not params[0].is_cuda
        self._measured_last = True
        self._predicted: list[Tensor] | None = None
        self.skipped_steps = 0
        self.confidence = 0.0
        self.band: tuple[list[float], list[float]] = ([], [])
        self.probe: dict | None = None  # the first batch of the Predict phase, never trained on
        self.probe_loss: float | None = None  # its loss before the phase's first delta
        self.probe_rows: Tensor | None = None  # and each of its sequences' (forward_checks.sequence_losses)
        self.record: StepRecord | None = None  # the optimizer step under way
        self.last_record: StepRecord | None = None
        self.jump_start_step: int | None = None  # the global step at which the open jump began
        # The trainer's LR schedule when the open jump began (opaque here): a rollback hands it back, unadvanced.
        self.schedule_at_jump: dict | None = None
        self.undone_steps = 0  # optimizer steps undone by rollbacks of jumps so far
        # Optimizer steps not counted toward max_steps (undone by a rollback, or skipped): the trainer adds them.
        self.made_up_steps = 0
        # The counted step of the last evaluation `--eval_steps` asked for (CountedStepSchedule, loop/step_veto.py),
        # carried in checkpoints: a resumed run must not take an evaluation an open jump deferred for done.
        self.evaluated_count: int | None = None
        if not config.predict:  # the guard alone: retired from the start, no predictor buffers
            self.controller.retired = True
            self.controller.phase = Phase.FULL
            self._release()

    # ---- one optimizer step -------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.record.phase if self.record is not None else self.controller.phase

    def begin_step(self, step: int) -> None:
        """At the first micro-batch of an optimizer step: fix its phase; at a Predict phase's start, open the jump."""
        self.record = StepRecord(step=step, phase=self.controller.phase)
        if self.starts_prediction:
            self.open_jump(step)

    def next_batches(self, fresh: Unit) -> Unit:
        """The batches for the next optimizer step: a rolled-back jump's come back first (see loop/replay.py)."""
        real = self.controller.phase is not Phase.PREDICT
        if self.epoch_seed.epoch_starting:
            self.epoch_seed.first_fetch(fresh)
        unit = self.replay.hand_out(fresh, new_jump=not real and self.controller.steps_in_phase == 0, trains=real)
        self.epoch_seed.handing_out(unit, real_step=real)
        return unit

    def rng_loaded(self) -> None:
        """A resumed run's RNG came from the checkpoint, after the step's batches were fetched (loop/epoch_seed.py)."""
        self.epoch_seed.rng_loaded(self.replay.last, real_step=self.controller.phase is not Phase.PREDICT)

    def check_real_step(self, loss: float, grad_norm: float | None, lr: float) -> bool:
        """After backward on a real step; returns True when the optimizer step must be vetoed."""
        record = self.record
        record.loss = loss
        after_prediction = self.jump_open
        if non_finite(loss, grad_norm):
            self.skip_step(diverged=True)
            return True
        first_correct = record.phase is Phase.CORRECT and self.controller.steps_in_phase == 0
        if after_prediction and first_correct:
            exploded = grad_norm is not None and self.monitor.grad_diverged(grad_norm)
            if exploded or self.monitor.loss_diverged(loss):
                self.rollback()
                return True
        self.payoff.tick_real(loss)
        self.monitor.observe(loss, grad_norm)
        if self._forecasting:
            self.dynamics.observe(loss, grad_norm, lr)
        return False

    def start_cycle(self, make_room: Callable[[], None] | None = None) -> bool:
        """At a real step that passed every check, before its update: the predictor's next cycle starts here if one is
        due (after a jump's verdict or a rollback). Returns whether it did, for the guard's snapshot."""
        return not self.controller.retired and self.predictor.move_anchor(make_room)

    def skip_step(self, diverged: bool) -> None:
        """This real step's update is vetoed (`diverged`: a non-finite loss or gradient norm; otherwise the guard's
        verdict on a finite outlier). A jump still open is suspect too."""
        if diverged:
            self.monitor.count_non_finite()
        self.skipped_steps += 1
        self.record.skipped = True
        if self.jump_open:
            self.rollback()  # which makes up this step with the jump's
        else:
            self.made_up_steps += 1

    @property
    def _forecasting(self) -> bool:
        """The loss forecast serves only decisions to predict, and only for a predictor that uses it."""
        return self.predictor.uses_forecast and not self.controller.retired

    def weights_restored(self) -> None:
        """The guard put back an older training state (never inside a jump: an outlier there rolls the jump back
        first): the predictor's last measured update no longer leads to the current weights, so it starts over."""
        self._measured_last = False
        if not self.controller.retired:
            self.predictor.restart()

    def _release(self) -> None:
        """Retired: prediction stopped paying, so its parameter-sized buffers are given back for good."""
        self.snapshot.release()
        self.predictor.release()
        self._before_step = self._predicted = None

    def end_step(self, pass_turn: bool = False, anchor_free: bool = False) -> Phase:
        """After the optimizer step: decide the next step's phase (`pass_turn`: pass a turn to predict, see
        autopilot/scale.py;
        `anchor_free`: see `Predictor.jump_kept`)."""
        record, passes = self.record, self.controller.passes
        if not record.rollback:
            if self._forecasting and self.controller.confidence_due:
                self.confidence = self.dynamics.confidence()
            ready = self.predictor.ready and (self.dynamics.ready or not self.predictor.uses_forecast)
            self.controller.end_step(self.confidence, ready, pass_turn)
            if self.controller.passes > passes:
                self.predictor.turn_passed()
            phase = self.controller.phase
            over = record.phase is Phase.CORRECT or (record.phase is Phase.PREDICT and phase is not Phase.PREDICT)
            if over and phase is not Phase.CORRECT and not self.config.checks.payoff_check:
                # Without the probe verdict, a jump that came through its last step (its last Correct step, or its
                # Predict step when it has no Correct phase, as the outer one) is the only sign that prediction pays;
                # without this, back-off could only grow.
                self.controller.reward()
        else:
            self.controller.phase_steps[record.phase.value] += 1
        if record.phase is Phase.PREDICT and not record.rollback and self.controller.phase is not Phase.PREDICT:
            self.predictor.jump_kept(self.snapshot.tensors, anchor_free)
        if self.controller.phase is not Phase.PREDICT and self.controller.phase is not Phase.CORRECT:
            self.snapshot.release()
            self.replay.settle()
            self.jump_start_step = self.schedule_at_jump = None
        self._predicted = None
        if not self._keep_before_step:
            self._before_step = None
        self.last_record, self.record = record, None
        return self.controller.phase

    def shards(self) -> list[Tensor]:
        """The parameters' local shards (the parameters themselves without FSDP2): everything the engine does to
        weights is element-wise on these, so it needs no communication."""
        return local_shards(self.params)

    # ---- reporting and checkpoints --------------------------------------------------------------

    def stats(self) -> dict:
        c, m, p = self.controller, self.monitor, self.payoff
        return run_stats(dict(c.phase_steps), rollbacks=c.rollbacks, retired=c.retired, divergences=m.divergences,
                         non_finite=m.non_finite, skipped_steps=self.skipped_steps, undone_steps=self.undone_steps,
                         predictions_judged=p.verdicts, predictions_kept=p.paid, jump_gain=p.kept_gain,
                         jump_worth_steps=p.kept_worth, turns_passed=c.passes)

    @staticmethod
    def plain_stats(steps: int) -> dict:
        """`stats()` of a run with the hybrid off: every step a plain Full step."""
        return run_stats({p.value: (steps if p is Phase.FULL else 0) for p in Phase})

    def log_metrics(self) -> dict[str, float]:
        stats = self.stats()
        metrics = {f"hybrid/{key}": float(stats[key]) for key in (
            "backward_reduction", "predict_steps", "rollbacks", "divergences", "skipped_steps", "retired")}
        metrics.update({
            "hybrid/phase": float(PHASE_IDS[self.controller.phase]), "hybrid/confidence": float(self.confidence),
            "hybrid/backoff": float(self.controller.backoff), "hybrid/payoff_advantage": float(self.payoff.advantage),
            "hybrid/probe_gain": float(self.payoff.last_gain),
            "hybrid/probe_required": float(self.payoff.last_required),
            "hybrid/probe_noise": float(self.payoff.last_noise),
        })
        if self.predictor.last_residual is not None:
            metrics["hybrid/prediction_error"] = float(self.predictor.last_residual)
        return metrics

    def state_dict(self) -> dict:
        return {
            "controller": self.controller.state_dict(),
            "monitor": self.monitor.state_dict(),
            "payoff": self.payoff.state_dict(),
            "dynamics": self.dynamics.state_dict(),
            "predictor": self.predictor.state_dict(),
            "snapshot": self.snapshot.state_dict(),
            "replay": self.replay.state_dict(),
            "epoch_seed": self.epoch_seed.state_dict(self.replay.queue),
            **self.probe_state(),
            "skipped_steps": self.skipped_steps,
            "jump_start_step": self.jump_start_step,
            "schedule_at_jump": self.schedule_at_jump,
            "undone_steps": self.undone_steps,
            "made_up_steps": self.made_up_steps,
            "evaluated_count": self.evaluated_count,
            "measured_last": self._measured_last,
            "confidence": self.confidence,
            "band": self.band,
        }

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        if self.controller.retired:
            self._release()
        self.monitor.load_state_dict(state["monitor"])
        self.payoff.load_state_dict(state["payoff"])
        self.dynamics.load_state_dict(state["dynamics"])
        self.predictor.load_state_dict(state["predictor"])
        self.snapshot.load_state_dict(state["snapshot"], self.shards())
        device = self.params[0].device
        self.replay.load_state_dict(state["replay"], device)
        self.epoch_seed.load_state_dict(state["epoch_seed"], self.replay.queue)
        self.load_probe_state(state, device)
        self.skipped_steps = state["skipped_steps"]
        self.jump_start_step = state["jump_start_step"]
        self.schedule_at_jump = state["schedule_at_jump"]
        self.undone_steps = state["undone_steps"]
        self.made_up_steps = state["made_up_steps"]
        self.evaluated_count = state["evaluated_count"]
        self._measured_last = state["measured_last"]
        self.confidence = state["confidence"]
        self.band = tuple(state["band"])


def run_stats(phase_steps: dict, rollbacks: int = 0, retired: bool = False, divergences: int = 0, non_finite: int = 0,
              skipped_steps: int = 0, undone_steps: int = 0, predictions_judged: int = 0, predictions_kept: int = 0,
              jump_gain: float = 0.0, jump_worth_steps: float = 0.0, turns_passed: int = 0) -> dict:
    """The engine's end-of-run numbers, one key list whether the hybrid ran or not (the defaults: it did not)."""
    total, predict = sum(phase_steps.values()), phase_steps[Phase.PREDICT.value]
    return {"phase_steps": phase_steps, "backward_steps": total - predict, "predict_steps": predict,
            "backward_reduction": predict / total if total else 0.0, "rollbacks": rollbacks, "retired": retired,
            "divergences": divergences, "non_finite": non_finite, "skipped_steps": skipped_steps,
            "undone_steps": undone_steps, "predictions_judged": predictions_judged, "turns_passed": turns_passed,
            "predictions_kept": predictions_kept, "jump_gain": jump_gain, "jump_worth_steps": jump_worth_steps}
