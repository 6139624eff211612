"""A Predict step inside `Trainer.training_step`: no backward. The predicted delta is applied at the step's first
micro-batch, a forward with no backward checks the loss, and at the phase's end the jump is judged on its probe batch.

The probe is the phase's first batch, measured at the weights before the first delta and after the last one. On a
one-step jump whose one micro-batch is the probe, the probe's forward after the jump is also the step's loss check:
one forward serves both, so such a jump costs two forwards, not three.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..loop.forward_checks import predict_step_loss, probe_loss, probe_loss_by_sequence
from ..loop.seam import HybridTrainer

if TYPE_CHECKING:
    from .engine import HybridEngine


def predict_training_step(trainer: HybridTrainer, model: torch.nn.Module, inputs: dict,
                          num_items_in_batch: torch.Tensor | int | None, first_micro_batch: bool) -> torch.Tensor:
    """What `HybridMixin.training_step` runs on a Predict micro-batch; returns the loss the Trainer logs."""
    engine = trainer.hybrid_engine
    probe_is_the_step = engine.starts_prediction and engine.ends_prediction and (
        trainer.current_gradient_accumulation_steps == 1
    )
    # Counted as the Trainer counts the step's tokens, the probe's loss is on the scale of the real steps' losses.
    probe_items = num_items_in_batch if probe_is_the_step else None
    if first_micro_batch:
        at_anchor = False
        if engine.starts_prediction and engine.config.checks.payoff_check:
            probe = trainer.prepare_inputs(inputs)
            loss, rows = probe_loss_by_sequence(trainer, model, probe, probe_items)
            engine.set_probe(probe, trainer.reduce_across_ranks(loss)[0], rows)
            if engine.predictor.cycle_steps is not None:
                engine.set_cycle_start(anchor_loss(trainer, model, engine, probe_items))
                at_anchor = True
        engine.apply_prediction(trainer.current_learning_rate(), at_anchor)
    rows_after = None
    if probe_is_the_step and engine.probe is not None:
        loss, rows_after = probe_loss_by_sequence(trainer, model, engine.probe, probe_items)
        trainer.step_losses.last = loss
    else:
        loss = _micro_batch_loss(trainer, model, inputs, num_items_in_batch, engine.monitored)
    trainer.step_losses.window += loss.detach().float()
    if trainer.accelerator.sync_gradients:  # the last micro-batch of this optimizer step
        monitored_loss = trainer.reduce_across_ranks(trainer.step_losses.window)[0] if engine.monitored else None
        engine.check_predict_step(monitored_loss)
        # The run's last step judges an open jump early, so that a rejected one is made up like any other.
        last_step = trainer.state.global_step + 1 >= trainer.state.max_steps
        if (engine.ends_prediction or last_step) and engine.probe is not None:
            if probe_is_the_step:  # the probe's forward after the jump was this step's loss check
                engine.judge_probe(monitored_loss, paired_noise(trainer, engine.probe_rows, rows_after),
                                   forward_run=False)
            else:
                loss_after, rows_after = probe_loss_by_sequence(trainer, model, engine.probe)
                engine.judge_probe(trainer.reduce_across_ranks(loss_after)[0],
                                   paired_noise(trainer, engine.probe_rows, rows_after))
        trainer.step_veto.veto(predict_step=True)
    return loss


def paired_noise(trainer: HybridTrainer, before: torch.Tensor | None, after: torch.Tensor | None) -> float:
    """The standard error of the probe's gain, from its sequences' paired differences over every rank's probe
    micro-batch (equal in size on every rank); 0 where the sequences' losses cannot be read."""
    if before is None or after is None:
        return 0.0
    gains = (before - after).float()
    mean, mean_square = trainer.reduce_across_ranks(gains.mean(), gains.square().mean())
    n = gains.numel() * trainer.accelerator.num_processes
    return math.sqrt(max(mean_square - mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0


@torch.no_grad()
def anchor_loss(trainer: HybridTrainer, model: torch.nn.Module, engine: HybridEngine,
                probe_items: torch.Tensor | int | None) -> float:
    """The probe's loss at the outer cycle's start (the anchor A): one in-place move of the weights and one forward.
    The weights stay at A, where the jump reads it, so it is not brought from host memory twice."""
    engine.predictor.load_anchor()
    loss = probe_loss(trainer, model, engine.probe, probe_items)
    return trainer.reduce_across_ranks(loss)[0]


def _micro_batch_loss(trainer: HybridTrainer, model: torch.nn.Module, inputs: dict,
                      num_items_in_batch: torch.Tensor | int | None, monitored: bool) -> torch.Tensor:
    """A forward to check the loss, or nothing at all on an unmonitored step."""
    if monitored:
        trainer.step_losses.last = predict_step_loss(trainer, model, inputs, num_items_in_batch)
    # Unmonitored, the Trainer only sums this for its loss log: repeat the last checked loss rather than log a 0.
    if trainer.step_losses.last is None:
        return torch.zeros((), device=trainer.args.device)
    return trainer.step_losses.last
