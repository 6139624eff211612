"""Vetoed and undone optimizer steps, as the Trainer's loop must see them.

A step the hybrid vetoes (a Predict step, a NaN, the guard's verdict) must not reach the optimizer; a step a rollback
undid must not count. A vetoed real step and an undone step are made up (a kept Predict step counts): the learning-rate
schedule goes back to where it was, and `max_steps` grows by as many steps (as far as the Trainer's epochs reach), so
that with every jump rejected the run ends where the Trainer's run ends, at the same learning rate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers.trainer_callback import (
    DefaultFlowCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import IntervalStrategy, SaveStrategy
from transformers.training_args import TrainingArguments
from transformers.utils import logging

from .seam import HybridTrainer

if TYPE_CHECKING:
    from ..jumps.engine import HybridEngine

logger = logging.get_logger(__name__)


class StepVeto:
    """The protocol for a vetoed or undone step, on a `transformers.Trainer`."""

    def __init__(self, trainer: HybridTrainer) -> None:
        self.trainer = trainer
        self.last_step: int | None = None  # the last step the Trainer's epochs can reach (None: no limit)
        self.skipped_schedule: dict | None = None  # the schedule before a vetoed real step, given back at its end
        # Steps this train() call could not make up: the first such event says so at once, the end line the total.
        self.not_made_up = self.first_not_made_up = 0

    def schedule_state(self) -> dict:
        """What a rollback needs to rewind the schedule: the scheduler's state and the optimizer's hyperparameters,
        which the scheduler writes (the learning rate the next step will use is already in the param groups)."""
        trainer = self.trainer
        groups = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
        return {"scheduler": copy.deepcopy(trainer.lr_scheduler.state_dict()), "groups": copy.deepcopy(groups)}

    def veto(self, predict_step: bool) -> None:
        """Keep the optimizer from stepping. Through accelerate's `sync_gradients` flag (set by its private setter):
        `AcceleratedOptimizer.step` does nothing while it is False."""
        accelerator = self.trainer.accelerator
        scaler = accelerator.scaler
        if scaler is not None and not predict_step:
            # The gradients were already unscaled (clipping or the norm): leaving the step to the scaler with
            # an inf recorded skips it and lowers the scale, which keeps GradScaler's bookkeeping consistent.
            for state in scaler._per_optimizer_states.values():
                for found_inf in state.get("found_inf_per_device", {}).values():
                    found_inf.fill_(1.0)
            return
        accelerator.gradient_state._set_sync_gradients(False)

    def veto_real_step(self, not_finite: str | None = None) -> None:
        """A real step's update is refused after its backward: at its end it neither counts nor advances the
        schedule. `not_finite`: the step's number that was not finite ("loss", "grad_norm") where no other part says
        so (the guard is off): one line says the step was skipped."""
        self.skipped_schedule = self.schedule_state()
        self.veto(predict_step=False)
        if not_finite is not None and self.trainer.is_world_process_zero():
            step = self.trainer.state.global_step + 1
            logger.warning(f"hf_hybrid: step {step}: its {not_finite} is not finite: skipped the step; its batch is "
                           "dropped.")

    def make_up(self, steps: int, schedule: dict | None) -> None:
        """`steps` optimizer steps were undone or vetoed, so they must not count (their batches are replayed after a
        rolled-back jump or an undone trial, dropped after the guard's skip or rollback). The schedule goes back to
        `schedule` and the run gets `steps` more."""
        if schedule is not None:
            trainer = self.trainer
            trainer.lr_scheduler.load_state_dict(schedule["scheduler"])
            for group, saved in zip(trainer.optimizer.param_groups, schedule["groups"]):
                for key, value in saved.items():
                    if isinstance(group[key], torch.Tensor):  # a fused or capturable optimizer's device tensor
                        group[key].copy_(value)
                    else:
                        group[key] = value
        self.extend_max_steps(steps)

    def extend_max_steps(self, steps: int) -> None:
        """Add steps to max_steps, as far as the Trainer's epochs reach: its loop ends with the last epoch."""
        trainer = self.trainer
        state = trainer.state
        room = steps if self.last_step is None else min(steps, self.last_step - state.max_steps)
        room = max(room, 0)
        state.max_steps += room
        lost = steps - room
        if lost and not self.not_made_up and trainer.is_world_process_zero():
            logger.warning(
                f"hf_hybrid: {_steps(lost)} undone or skipped (a rolled-back jump, an undone raise, the guard) cannot "
                f"be made up: the Trainer's last epoch ends at step {self.last_step}. This run makes {lost} fewer real "
                "updates than the Trainer would; a max_steps short of the data's last epoch leaves room for them. Any "
                "more are counted at the end."
            )
        self.first_not_made_up = self.first_not_made_up or lost
        self.not_made_up += lost
        for bar in self._progress_bars():
            bar.total = state.max_steps

    def end_line(self) -> str | None:
        """The total of the steps that could not be made up, where more came after the first line said so."""
        if self.not_made_up == self.first_not_made_up:
            return None
        return (f"hf_hybrid: in all, {_steps(self.not_made_up)} undone or skipped could not be made up: this run made "
                f"{self.not_made_up} fewer real updates than the Trainer would.")

    def show_phase(self, phase: str) -> None:
        for bar in self._progress_bars():
            bar.set_postfix(phase=phase, refresh=False)

    def set_epochs_end(self, train_dataloader: torch.utils.data.DataLoader | None) -> None:
        """At a train() call's start, with no step lost yet: the optimizer step at which the Trainer's epoch loop ends,
        as `Trainer.set_initial_training_values` counts it; None when the data has no length (the loop then runs until
        max_steps)."""
        self.not_made_up = self.first_not_made_up = 0
        try:
            batches = len(train_dataloader)
        except TypeError:
            self.last_step = None
            return
        accumulation = self.trainer.args.gradient_accumulation_steps
        self.last_step = self.trainer.state.num_train_epochs * max(-(-batches // accumulation), 1)

    def _progress_bars(self) -> list:
        return [
            callback.training_bar
            for callback in self.trainer.callback_handler.callbacks
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None
        ]


def _steps(n: int) -> str:
    return f"{n} optimizer step{'' if n == 1 else 's'}"


class CountedStepSchedule(TrainerCallback):
    """`--save_steps` and `--eval_steps` count the updates that count, as `max_steps` does: a step made up for a
    rolled-back jump, an undone learning-rate trial or a skipped step does not move either schedule.

    So the run writes the Trainer's checkpoints and no extra one (a made-up step would otherwise meet `save_steps` once
    before the extended end, which saves again), and evaluates after as many of the Trainer's updates as the Trainer
    does. There its held-out loss is comparable step for step, and its DataLoader draws its seed from the global RNG
    (on CPU the dropout RNG too) where the Trainer's does: evaluating at global steps, which made-up steps bring early,
    would shift every dropout mask after it, and a run whose every jump was rejected would no longer end at the
    Trainer's weights. For the same reason an evaluation waits for an open jump's verdict (a rejected one takes the
    count back), and one that an undo took back comes again when the count returns to it.

    Placed right after `DefaultFlowCallback`, whose decisions it corrects; a save or an evaluation asked for by
    anything else (the end of training, the guard's stop, a callback further down) stands."""

    def __init__(self, engine_of: Callable[[], HybridEngine | None]) -> None:
        self.engine_of = engine_of  # the trainer's engine at call time (None with the hybrid off or between runs)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        engine = self.engine_of()
        if engine is None or control.should_training_stop or state.global_step >= state.max_steps:
            return
        counted = engine.counted_updates(state.global_step)
        every = state.save_steps
        if args.save_strategy == SaveStrategy.STEPS and every:
            if state.global_step % every == 0:  # DefaultFlowCallback's own reason to save
                control.should_save = False
            record = engine.last_record
            this_step_counts = record is not None and not (record.rollback or record.skipped)
            if this_step_counts and counted > 0 and counted % every == 0:
                control.should_save = True
        every = state.eval_steps
        if args.eval_strategy == IntervalStrategy.STEPS and every:
            # The multiple of eval_steps the last scheduled evaluation stood for, in the engine's checkpointed state.
            if engine.evaluated_count is None or counted < engine.evaluated_count:  # a run's start, or an undo
                engine.evaluated_count = counted // every * every
            if state.global_step % every == 0:  # DefaultFlowCallback's own reason to evaluate
                control.should_evaluate = False
            due = counted >= engine.evaluated_count + every and counted >= args.eval_delay
            if due and not engine.jump_open:  # not inside a jump still waiting for its verdict
                control.should_evaluate = True
                engine.evaluated_count = counted // every * every

    @staticmethod
    def install(trainer: HybridTrainer) -> None:
        callbacks = trainer.callback_handler.callbacks
        after = next((i + 1 for i, c in enumerate(callbacks) if isinstance(c, DefaultFlowCallback)), len(callbacks))
        callbacks.insert(after, CountedStepSchedule(lambda: trainer.hybrid_engine))
