"""The guard at the Trainer's loop: what `StepGuard` (guard/rules.py) decides, carried out on a real training run.

Every real step is judged where its gradient norm is taken, from the same rank-averaged numbers as the engine. A flagged
step is vetoed at once; what the verdict asks for (skip, roll back to the last snapshot, stop) is carried out at the
step's end, after the Trainer stepped the schedule. Between flagged steps this room keeps the last known-good training
state (`TrainingSnapshot`) and the last accepted step's batches, which tell bad weights from bad data. A run resumed
from a checkpoint has no snapshot until its first accepted step: an outlier that convicts the weights before then stops
the run (with a checkpoint) instead of rolling back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from ..loop.divergence import non_finite
from ..loop.forward_checks import training_step_loss
from ..loop.replay import Unit, move_unit
from ..loop.rng import forked_rng
from ..loop.seam import HybridTrainer
from ..memory.host_memory import available_host_bytes, host_memory_warning, local_ranks, rollback_state_bytes
from ..memory.snapshot import TrainingSnapshot, rng_state, snapshot_bytes
from .rules import Action, GuardEvent, StepGuard

if TYPE_CHECKING:
    from transformers import TrainerControl

logger = logging.get_logger(__name__)


class GuardStoppedError(RuntimeError):
    """The guard stopped training: a rollback was needed after too many, or with no snapshot to go back to."""


class GuardAtLoop:
    """The guard's state on one rank of a run, and the Trainer-side work of its verdicts."""

    def __init__(self, trainer: HybridTrainer) -> None:
        self.trainer = trainer
        self.config = trainer.hybrid_config.guard
        self.guard = StepGuard(self.config, grad_norm_outliers=not trainer.args.max_grad_norm)
        # Under DDP every rank holds the same state, so one rank keeps the snapshot for all (FSDP2: each its shards).
        sharded = bool(trainer.hybrid_engine.predictor.shard_groups)
        engine = trainer.hybrid_engine
        self.snapshot = TrainingSnapshot(replicated=trainer.accelerator.num_processes > 1 and not sharded,
                                         placement=engine.placement)
        if self.snapshot.holds_copy and self.config.snapshot_steps:
            engine.placement.expect(lambda: snapshot_bytes(engine.params, engine.optimizer))
        # The micro-batches of the real step under way, with the Trainer's `num_items_in_batch` for them; and the
        # last accepted step's, which tell bad weights from bad data.
        self.inputs: Unit = ([], None)
        self.reference: Unit | None = None
        self.pending: tuple | None = None  # (event, scaler state) until the step's end
        self.stop_message: str | None = None
        # Set by a save: the next accepted step's snapshot is the checkpoint's own state, which a run resumed from it
        # takes at that step too (it starts with none), so both runs hold the same snapshot from there on.
        self.snapshot_asked = False
        # Whether a learning-rate raise is on trial: the snapshot is then its undo point, not replaced on the periodic
        # schedule until the raise is judged. The autopilot, which owns the trial (`LrScale.on_trial`), answers it.
        self.raise_on_trial: Callable[[], bool] = lambda: False
        # The RNG at the start of the real step under way, when a trial's undo point is due in it: an undone trial
        # trains that step again on its own batch (loop/replay.py), and must draw the same dropout masks.
        self.step_rng: dict | None = None
        self.memory_checked = False  # at the first snapshot, where the optimizer's state exists

    def add_micro_batch(self, inputs: dict, num_items_in_batch: torch.Tensor | int | None, first: bool) -> None:
        self.inputs = ([inputs] if first else [*self.inputs[0], inputs]), num_items_in_batch
        if first:
            due = self.snapshot_asked or not self.snapshot.valid  # a run resumed mid-trial takes its first one
            self.step_rng = rng_state() if due and self.raise_on_trial() else None

    def vetoes(self, model: torch.nn.Module, loss: float, grad_norm: float | None) -> bool:
        """The verdict on a real step; a flagged step is vetoed now and dealt with at the step's end."""
        trainer, guard, engine = self.trainer, self.guard, self.trainer.hybrid_engine
        step = trainer.state.global_step
        event = guard.check(step + 1, loss, grad_norm)
        jump_open = engine.jump_open
        if event is None:
            self.reference = self.inputs
            return False
        if jump_open:
            event.action = Action.SKIP  # the engine rolls the jump back, to weights known to be good
        elif event.action is Action.SKIP and self.reference is not None:
            guard.judge_weights(event, *trainer.reduce_across_ranks(*self._reference_signals(model)))
        guard.escalate(event, has_snapshot=self.snapshot.valid)
        engine.record.loss = loss
        diverged = non_finite(loss, grad_norm) is not None
        engine.skip_step(diverged)
        scaler = trainer.accelerator.scaler
        # A finite outlier leaves the fp16 loss scale alone; an overflow lowers it, as the scaler would anyway.
        scaler_state = scaler.state_dict() if scaler is not None and not diverged else None
        self.pending = (event, scaler_state)
        return True

    def accepted(self, cycle_started: bool) -> None:
        """A real step passed every check; before its update, take the snapshot when one is due.

        Where a cycle of the outer predictor starts (`cycle_started`: its anchor just moved), the snapshot stands on the
        anchor and holds only the optimizer state of its own. It is also taken `hybrid_guard_snapshot_steps` steps
        after the last one, and at the next accepted step after a save or a learning-rate raise (a resumed run takes
        that one too); where no cycle starts, or for a raise's trial, with a copy of the weights of its own (1x the
        parameters more), kept until the next cycle starts or, on a trial, until its verdict."""
        trainer, engine, snapshot = self.trainer, self.trainer.hybrid_engine, self.snapshot
        step = trainer.state.global_step
        every = self.config.snapshot_steps
        # The rollback point is never older than `every` steps, however long a cycle is (the warmup's, or one that a
        # rejected jump lengthened): such a cycle takes a copy of its own.
        due = self.snapshot_asked or not snapshot.valid or (step - snapshot.step >= every and not self.raise_on_trial())
        if cycle_started:
            due = due or not (self.raise_on_trial() and not snapshot.on_held_weights)
        if due and self._snapshot_possible():
            # An asked-for snapshot, or a raise's undo point, keeps a copy of its own: a trial holds it across the next
            # cycle start (and a run resumed mid-trial takes its first one as the trial's too).
            own = self._keeps_own_copy() or not cycle_started
            snapshot.capture(step, engine.made_up_steps, engine.params, engine.optimizer,
                             trainer.step_veto.schedule_state(), on_held_weights=not own,
                             held_weights=engine.predictor.held_weights(), rng=self.step_rng)
            self.snapshot_asked = False
            if not self.memory_checked:
                self._check_host_memory()
            if self.raise_on_trial():  # a learning-rate trial's undo point: its batches are recorded from this step on
                engine.replay.begin_trial()
        elif cycle_started and snapshot.on_held_weights:
            snapshot.invalidate()  # its weights were the anchor, which just moved

    def _snapshot_possible(self) -> bool:
        """Not before the optimizer has state (AdamW creates it at its first step; a resumed run has it from the
        start), and never inside a jump: the engine may still reject it, and a snapshot would bring it back."""
        engine = self.trainer.hybrid_engine
        return bool(self.config.snapshot_steps and engine.optimizer.state
                    and not engine.jump_open)

    def _keeps_own_copy(self) -> bool:
        """Whether the next snapshot keeps a copy of the weights of its own even where a cycle starts."""
        return self.snapshot_asked or self.raise_on_trial()

    def make_room_for_anchor(self) -> None:
        """A cycle starts at this accepted step and its anchor needs new buffers; the snapshot about to be taken will
        stand on them, so a copy of the weights of its own is dropped first and the anchor takes its memory, rather
        than adding a copy of the parameters for a moment (after a first kept jump, whose momentum took the last
        anchor's buffers)."""
        if self._snapshot_possible() and not self._keeps_own_copy() and not self.snapshot.on_held_weights:
            self.snapshot.weights.release()

    @property
    def stands_on_anchor(self) -> bool:
        """Whether the rollback point's weights are the outer predictor's anchor."""
        return self.snapshot.valid and self.snapshot.on_held_weights

    def _check_host_memory(self) -> None:
        self.memory_checked = True
        size = rollback_state_bytes(self.trainer.hybrid_engine, self.snapshot)
        line = host_memory_warning(size, available_host_bytes(), local_ranks(), self.snapshot.replicated)
        if line is not None and self.trainer.args.local_process_index == 0:
            logger.warning(line)

    def _reference_signals(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and gradient norm of the last accepted step's batches at the current weights, over its whole
        accumulation window and on the scale of the Trainer's loss, as the guard saw them when it accepted that step:
        would they be flagged now, or did its own update raise their loss? One step's forward and backward, only on a
        flagged step, whose update is vetoed anyway (so its gradients may be overwritten). Unscaled: the fp16 loss
        scale is not involved."""
        trainer = self.trainer
        batches, num_items_in_batch = self.reference
        model.train()
        model.zero_grad()
        total = torch.zeros((), device=trainer.args.device)
        with forked_rng(trainer.args.device, trainer.args.seed):
            for inputs in batches:
                loss = training_step_loss(trainer, model, inputs, num_items_in_batch)
                loss.backward()
                total += loss.detach().float()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return total, torch.nn.utils.get_total_norm(grads)

    def end_step(self, control: TrainerControl) -> Action | None:
        """At the step's end: carry out a pending verdict; returns what was done, for the trace."""
        if self.pending is None:
            return None
        event, scaler_state = self.pending
        self.pending = None
        if scaler_state is not None:
            self.trainer.accelerator.scaler.load_state_dict(scaler_state)
        self._act(event, control)
        return event.action

    def _act(self, event: GuardEvent, control: TrainerControl) -> None:
        """Carry out a flagged step's verdict: the skip is done (vetoed, made up); a rollback or a stop puts the last
        snapshot back and drops the batches since it. Then one warning line says what happened."""
        trainer, engine, snapshot = self.trainer, self.trainer.hybrid_engine, self.snapshot
        done = "skipped the step; its batch is dropped"
        if event.action is not Action.SKIP and snapshot.valid:
            undone = self.restore_snapshot(engine.record.step)
            self.guard.undone_steps += undone
            done = (f"rolled back to the snapshot before step {snapshot.step + 1} ({undone} updates undone, their "
                    "batches dropped)")
        message = f"hf_hybrid guard: step {event.step}: {event.describe()}: {done}."
        if event.action is Action.STOP:
            control.should_save = control.should_training_stop = True
            checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")
            restored = done if snapshot.valid else (
                "no snapshot to restore (--hybrid_guard_snapshot_steps 0)"
                if not self.config.snapshot_steps
                else "no snapshot to restore yet (a resumed run takes its first at its first accepted step)"
            )
            message = (
                f"hf_hybrid guard stopped training at step {event.step}: {event.describe()} after "
                f"{self.guard.rollbacks} rollbacks (--hybrid_guard_max_rollbacks); {restored}; "
                f"checkpoint: {checkpoint}. "
                "Try a lower learning rate or a longer warmup, check the data near this step, or raise "
                "--hybrid_guard_threshold."
            )
            self.stop_message = message
        if trainer.is_world_process_zero():
            logger.warning(message)

    def restore_snapshot(self, step: int) -> int:
        """Put the snapshot back at the end of optimizer step `step` (0-based): weights, optimizer state, schedule
        and RNG. The updates since it no longer count and are made up; their batches are the caller's (the guard drops
        them, an undone raise trains them again). Returns how many updates were undone."""
        trainer, engine, snapshot = self.trainer, self.trainer.hybrid_engine, self.snapshot
        schedule = snapshot.restore(engine.params, engine.optimizer)
        undone = (step + 1 - snapshot.step) - (engine.made_up_steps - snapshot.made_up)
        engine.made_up_steps += undone
        trainer.step_veto.make_up(undone, schedule)
        engine.weights_restored()
        self.reference = None
        return undone

    def state_dict(self) -> dict:
        """For a checkpoint: the statistics and the reference batch. The snapshot stays out (see `snapshot_asked`)."""
        batches, num_items_in_batch = move_unit(self.reference, "cpu") if self.reference else (None, None)
        return {"stats": self.guard.state_dict(), "reference": batches, "reference_items": num_items_in_batch}

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state["stats"])
        unit = (state["reference"], state["reference_items"])
        self.reference = move_unit(unit, self.trainer.args.device) if state["reference"] else None
