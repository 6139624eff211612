"""Forward passes the hybrid runs besides training: the Predict step's loss check and the probe's paired loss.

Both run under a forked RNG, so their dropout masks never shift the real steps' ones: a rolled-back jump must leave no
trace in the training that follows.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from transformers import Trainer


def forked_rng(device: torch.device) -> AbstractContextManager:
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def probe_loss(trainer: Trainer, model: torch.nn.Module, probe: dict,
               num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Loss of the probe batch at the current weights, with the same dropout masks every time (a fixed seed in a
    forked RNG), so before and after are truly paired. The batch's mean, or, given the Trainer's `num_items_in_batch`
    for a step whose one micro-batch is the probe, the loss as `Trainer.training_step` computes it."""
    model.train()
    with forked_rng(trainer.args.device), torch.no_grad(), trainer.compute_loss_context_manager():
        torch.manual_seed(trainer.args.seed)
        return trainer.compute_loss(model, probe, num_items_in_batch=num_items_in_batch).detach()


def predict_step_loss(trainer: Trainer, model: torch.nn.Module, inputs: dict,
                      num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """A Predict micro-batch's loss from a no-grad forward, scaled as `Trainer.training_step` scales a real one."""
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    with forked_rng(trainer.args.device), torch.no_grad(), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)  # absent from older transformers (5.17)
    if scaled is None:  # the same rule as Trainer.training_step
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None
        )
    if not scaled:
        loss = loss / trainer.current_gradient_accumulation_steps
    return loss.detach()
