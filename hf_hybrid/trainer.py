"""`HybridHFTrainer`: the Hugging Face `Trainer` with hybrid predictive training.

Thin glue: the subclass holds the overrides; what they call lives in the capability packages (jumps/, guard/,
autopilot/, and loop/ and memory/, which they share), reaching the trainer through loop/seam.py. One reason each:
- `get_batch_samples`: an undone jump's batches go out again before fresh ones, keeping the data order (loop/replay.py);
- `training_step`: a Predict step applies its predicted delta at its first micro-batch, then a forward, no backward;
- `_clip_grad_norm` / `_get_grad_norm`: the Trainer calls them on every optimizer step; on a step with no backward
  they must not touch the gradients (or the fp16 GradScaler's unscale bookkeeping), and on a real step the gradient
  norm is where a NaN or an explosion is caught before the optimizer runs; `_track_num_input_tokens`: a batch counts
  once, when trained on: not in a Predict step, nor again when an undo gives it back (loop/replay.py);
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`: they run on every rank, so the hybrid state is
  saved and restored beside the optimizer's (checkpoint.py: replicated tensors once per job);
- `_load_rng_state`: the loaded RNG overwrites earlier seed draws; loop/epoch_seed.py makes the deferred one again;
- `log`: merges the `hybrid/...` metrics into the logs for every `report_to`, `hybrid/updates` into evaluations' too;
- `train`: a guard-stopped run raises `GuardStoppedError` after the Trainer ends; a cut-off one keeps no unjudged jump.
The other loop points come through a callback placed first in line, so that a rolled-back step is made up before
`DefaultFlowCallback` decides whether to stop; one right after it keeps saves and evaluations on the counted steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from .autopilot.runner import LrAutopilot, build_autopilot
from .autopilot.setup import autopilot_use, plain_stats
from .checkpoint import Stateful, find_hybrid_state, load_parts, save_hybrid_state
from .config import hybrid_config, ignored_flags
from .guard.rules import StepGuard
from .guard.runner import GuardAtLoop, GuardStoppedError
from .jumps.clock import JumpClock
from .jumps.controller import Phase
from .jumps.engine import HybridEngine
from .jumps.lr_advice import jump_advice
from .jumps.predict_step import predict_training_step
from .jumps.setup import build_engine
from .launch import check_batch_is_data, run_settings
from .loop.divergence import non_finite
from .loop.seam import StepLosses, mean_across_ranks
from .loop.step_veto import CountedStepSchedule, StepVeto
from .memory.vram import EmergencyCheckpointCallback, VramMonitor
from .trace import StepTrace
from .trl_logs import TrlLogsKept

__all__ = ["GuardStoppedError", "HybridHFTrainer", "HybridMixin"]

logger = logging.get_logger(__name__)


class _HybridStepHooks(TrainerCallback):
    """Forwards the loop points that have no overridable method to the trainer."""

    def __init__(self, trainer: HybridMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       train_dataloader: torch.utils.data.DataLoader | None = None, **kwargs) -> None:
        self.trainer._hybrid_train_begin(train_dataloader)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self.trainer.hybrid_engine is not None:  # just before the Trainer makes the epoch's DataLoader iterator
            self.trainer.hybrid_engine.epoch_seed.epoch_begins()

    def on_pre_optimizer_step(self, *args, **kwargs) -> None:
        self.trainer._hybrid_before_optimizer_step()

    def on_optimizer_step(self, *args, **kwargs) -> None:
        self.trainer._hybrid_after_optimizer_step()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.trainer._hybrid_end_step(control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.trainer._hybrid_train_end()


class HybridMixin(TrlLogsKept):
    """Adds hybrid phases to a `transformers.Trainer` subclass: `class X(HybridMixin, SomeTrainer)`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hybrid_config = hybrid_config(self.args)
        self._hybrid: HybridEngine | None = None
        self._hybrid_pending_state: dict | None = None
        self._hybrid_trace: StepTrace | None = None
        self.step_losses = StepLosses()
        self.step_veto = StepVeto(self)
        self._guard_loop: GuardAtLoop | None = None
        self._lr_autopilot: LrAutopilot | None = None
        self._vram = VramMonitor() if self.hybrid_config.enabled else None
        self._jump_clock = JumpClock(self)
        if not self.hybrid_config.enabled:
            return
        self.hybrid_config = run_settings(self, self.hybrid_config, ignored_flags(self.args))
        # First in line: a rollback extends max_steps at the step's end, before DefaultFlowCallback decides to stop.
        self.callback_handler.callbacks.insert(0, _HybridStepHooks(self))
        CountedStepSchedule.install(self)
        self.add_callback(self._jump_clock)
        # Registered on every rank alike (it all-reduces): not on this rank's NVML reading, which may fail alone.
        if self.hybrid_config.vram_min_free_mb > 0 and torch.cuda.is_available():
            self.add_callback(EmergencyCheckpointCallback(self._vram, self.hybrid_config.vram_min_free_mb))

    # ---- public -----------------------------------------------------------------------------------
    def hybrid_stats(self) -> dict:
        """Optimizer steps per phase, backward reduction, rollbacks and divergences so far."""
        guard = self._guard_loop.guard if self._guard_loop is not None else StepGuard(self.hybrid_config.guard)
        autopilot = self._lr_autopilot.stats() if self._lr_autopilot is not None else plain_stats()
        engine = self._hybrid.stats() if self._hybrid is not None else HybridEngine.plain_stats(self.state.global_step)
        return {**engine, "steps_not_made_up": self.step_veto.not_made_up, **guard.stats(), **autopilot}

    # ---- the step ---------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor | int | None]:
        fresh = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self._hybrid.next_batches(fresh) if self._hybrid is not None else fresh

    def training_step(self, model: torch.nn.Module, inputs: dict,
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if (engine := self._hybrid) is None:
            return super().training_step(model, inputs, num_items_in_batch)
        first_micro_batch = engine.record is None
        if first_micro_batch:
            check_batch_is_data(self, inputs)
            engine.begin_step(self.state.global_step)
            if engine.starts_prediction:
                engine.schedule_at_jump = self.step_veto.schedule_state()
            self.step_losses.window = torch.zeros((), device=self.args.device)
        if engine.phase is not Phase.PREDICT:
            if self._guard_loop is not None:
                self._guard_loop.add_micro_batch(inputs, num_items_in_batch, first_micro_batch)
            if self._lr_autopilot is not None:
                self._lr_autopilot.take_probe(inputs)
            with self.tokens_counted(engine.replay.counts_tokens):
                loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_losses.window += loss.detach().float()
            return loss
        return predict_training_step(self, model, inputs, num_items_in_batch, first_micro_batch)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor | float | None:
        return None if self._hybrid_step_has_no_backward() else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module,
                       grad_norm: torch.Tensor | float | None = None) -> torch.Tensor | float | None:
        if self._hybrid_step_has_no_backward():
            return None
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        engine = self._hybrid
        if engine is None or engine.record is None:
            return grad_norm
        loss, norm = self.reduce_across_ranks(self.step_losses.window, grad_norm)
        guard = self._guard_loop
        guard_vetoes = guard is not None and guard.vetoes(model, loss, norm)
        if guard_vetoes or engine.check_real_step(loss, norm, self.current_learning_rate()):
            self.step_veto.veto_real_step(not_finite=None if guard_vetoes else non_finite(loss, norm))
        else:
            cycle_started = engine.start_cycle(guard.make_room_for_anchor if guard is not None else None)
            if guard is not None:
                guard.accepted(cycle_started)
        return grad_norm

    def _track_num_input_tokens(self, inputs: dict) -> None:
        if self._hybrid is None or self._hybrid.replay.counts_tokens:
            super()._track_num_input_tokens(inputs)

    def _hybrid_step_has_no_backward(self) -> bool:
        return (engine := self._hybrid) is not None and engine.record is not None and engine.phase is Phase.PREDICT

    def _hybrid_before_optimizer_step(self) -> None:
        record = self._hybrid.record if self._hybrid is not None else None
        if record is not None and record.phase.has_backward and self.accelerator.sync_gradients:
            self._hybrid.before_optimizer_step(self.current_learning_rate())
            if self._lr_autopilot is not None:
                self._lr_autopilot.before_update(self.state.global_step + 1)

    def _hybrid_after_optimizer_step(self) -> None:
        record = self._hybrid.record if self._hybrid is not None else None
        stepped = self.accelerator.sync_gradients and not self.accelerator.optimizer_step_was_skipped
        if record is not None and record.phase.has_backward and not (record.skipped or record.rollback) and stepped:
            self._hybrid.after_optimizer_step(self.current_learning_rate())

    def _hybrid_end_step(self, control: TrainerControl) -> None:
        engine = self._hybrid
        if engine is None or engine.record is None:
            return
        record = engine.record
        if record.rollback:
            self.step_veto.make_up(record.undone_steps, engine.schedule_at_jump)
        elif record.skipped:  # a vetoed real step (a NaN, the guard): it neither counts nor advances the schedule
            self.step_veto.make_up(1, self.step_veto.skipped_schedule)
        guard_action = self._guard_loop.end_step(control) if self._guard_loop is not None else None
        autopilot = self._lr_autopilot
        next_phase = engine.end_step(pass_turn=autopilot is not None and autopilot.scale.steps_long_enough,
                                     anchor_free=self._guard_loop is None or not self._guard_loop.stands_on_anchor)
        if autopilot is not None:
            real_step = record.phase.has_backward and not (record.skipped or record.rollback)
            autopilot.end_step(record.step, real_step, guard_action)
        if self._hybrid_trace is not None:
            reading = (autopilot.last_line, autopilot.last_verdict) if autopilot is not None else (None, None)
            self._hybrid_trace.write_step(self.state.global_step, record, engine, guard_action, *reading,
                                          self.current_learning_rate())
        self.step_veto.show_phase(next_phase.value)

    def _stateful_parts(self) -> dict[str, Stateful]:
        """The parts of this train() call whose state a checkpoint carries, by their key in it."""
        parts = {"engine": self._hybrid, "guard": self._guard_loop, "lr_autopilot": self._lr_autopilot}
        return {key: part for key, part in parts.items() if part is not None}

    # ---- the seam the loop parts use (seam.HybridTrainer) ----------------------------------------------
    @property
    def hybrid_engine(self) -> HybridEngine | None:
        return self._hybrid

    def current_learning_rate(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    def reduce_across_ranks(self, *values: torch.Tensor | float) -> list[float]:
        return mean_across_ranks(self.accelerator, self.args.device, values)

    def prepare_inputs(self, inputs: dict) -> dict:
        return self._prepare_inputs(inputs)

    def items_in_batch(self, batch: dict) -> torch.Tensor | int | None:
        return self._get_num_items_in_batch([batch], self.args.device)

    def _hybrid_train_begin(self, train_dataloader: torch.utils.data.DataLoader | None) -> None:
        # The model and optimizer are prepared by now; each train() call builds the engine anew, before any file
        # is touched, so a setup error (no trainable parameter, an optimizer the predictor can't read) leaves none.
        self._hybrid = build_engine(self)
        self._guard_loop = GuardAtLoop(self) if self.hybrid_config.guard.enabled else None
        self._lr_autopilot = build_autopilot(self, self._guard_loop)
        if self._hybrid_pending_state is not None:
            load_parts(self._stateful_parts(), self._hybrid_pending_state)
        self._hybrid_pending_state = None
        self.step_veto.set_epochs_end(train_dataloader)
        self.step_veto.extend_max_steps(self._hybrid.made_up_steps)  # resumed: max_steps is the arguments' again
        if self.hybrid_config.trace and self.is_world_process_zero():
            self._hybrid_trace = StepTrace(self.args.output_dir, self.state.global_step)

    def _hybrid_train_end(self) -> None:
        if self._hybrid is not None:
            self._hybrid.finish()
            autopilot, use = self._lr_autopilot, autopilot_use(self.hybrid_config, self._lr_autopilot)
            if self.is_world_process_zero():
                lines = [*jump_advice(self.hybrid_stats(), self.args.learning_rate, use), self.step_veto.end_line()]
                for line in filter(None, [*lines, autopilot and autopilot.summary(), self._jump_clock.advice()]):
                    logger.warning(line)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hybrid is not None:
            # Every log, an evaluation's too, carries the updates that count: the step axis a plain run's logs share.
            logs = {**logs, "hybrid/updates": float(self._hybrid.counted_updates(self.state.global_step))}
            if not any(k.startswith("eval_") for k in logs):
                guard = self._guard_loop.guard.log_metrics() if self._guard_loop is not None else {}
                autopilot = self._lr_autopilot.log_metrics() if self._lr_autopilot is not None else {}
                vram = self._vram.metrics() if self._vram is not None else {}
                logs = {**logs, **self._hybrid.log_metrics(), **guard, **autopilot, **vram}
        super().log(logs, start_time)

    # ---- checkpoints --------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._hybrid is not None:
            state = {key: part.state_dict() for key, part in self._stateful_parts().items()}
            if self._guard_loop is not None:
                self._guard_loop.snapshot_asked = True
            save_hybrid_state(output_dir, self.args.process_index, state, bool(self._hybrid.predictor.shard_groups),
                              self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.hybrid_config.enabled:
            self._hybrid_pending_state = find_hybrid_state(checkpoint, self.args.process_index)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if self._hybrid is not None:
            self._hybrid.rng_loaded()

    def train(self, *args, **kwargs) -> TrainOutput:
        try:
            output = super().train(*args, **kwargs)
        finally:  # also when cut off (Ctrl-C, an error): an unjudged jump is undone, the trace file and NVML let go
            if self._hybrid is not None:
                self._hybrid.finish()
            if self._hybrid_trace is not None:
                self._hybrid_trace.close()
                self._hybrid_trace = None
            if self._vram is not None:
                self._vram.shutdown()
        if self._guard_loop is not None and self._guard_loop.stop_message is not None:
            raise GuardStoppedError(self._guard_loop.stop_message)
        return output


class HybridHFTrainer(HybridMixin, Trainer):
    """A drop-in `transformers.Trainer` with Warmup, Full, Predict and Correct phases."""
