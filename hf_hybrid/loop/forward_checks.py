"""Forward passes the hybrid runs besides training: the Predict step's loss check and the probe's paired loss, whole
or by sequence (a language model's or a sequence classifier's); and a micro-batch's loss on the Trainer's own scale.

Both run under a forked RNG, so their dropout masks never shift the real steps' ones: a rolled-back jump must leave no
trace in the training that follows, nor in the logs, which the trainer's `side_forward` keeps (trl_logs.py). Each
forward gets its own shallow copy of the probe batch: `Trainer.compute_loss` pops "labels" from the batch it is given
under a label smoother or a `compute_loss_func`, and the probe is read again.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from accelerate.utils import is_compiled_module
from torch.nn.parallel import DistributedDataParallel
from transformers.loss.loss_utils import ForCausalLMLoss

from .rng import forked_rng
from .seam import HybridTrainer


def _reuses_training_graph(trainer: HybridTrainer, model: torch.nn.Module) -> bool:
    """A compiled model (`--torch_compile`, or compiled by hand) in one process or under DDP: its graphs are guarded on
    the grad mode and on the keyword arguments of the call, so a side forward that differs from a training step in
    either compiles the model's forward again, at the first reading or Predict step (docs/benchmarks.md, "torch.compile:
    the side forwards reuse the training graph"). Not under FSDP, whose forward with grad enabled readies a backward
    that never comes."""
    compiled = trainer.args.torch_compile or is_compiled_module(model)
    return compiled and (trainer.accelerator.num_processes == 1 or _ddp(model) is not None)


def _ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of a (compiled) model, if any."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DistributedDataParallel) else None


@contextmanager
def _grad_mode(trainer: HybridTrainer, model: torch.nn.Module) -> Iterator[None]:
    """No autograd record, except where the side forwards reuse the training graph (`_reuses_training_graph`): it
    keeps a training step's activations until the loss, detached at once, is dropped; no gradient exists then (after
    the optimizer step, or in a Predict step, which runs no backward). Under DDP inside `no_sync`, so that the forward
    readies no gradient reduction for a backward that never comes."""
    if not _reuses_training_graph(trainer, model):
        with torch.no_grad():
            yield
        return
    ddp = _ddp(model)
    with torch.enable_grad(), ddp.no_sync() if ddp is not None else nullcontext():
        yield


@contextmanager
def _paired_forward(trainer: HybridTrainer, model: torch.nn.Module) -> Iterator[None]:
    """The same dropout masks every time (a fixed seed in a forked RNG), so that two forwards of one batch at two
    sets of weights are truly paired."""
    model.train()
    with (forked_rng(trainer.args.device, trainer.args.seed), _grad_mode(trainer, model),
          trainer.compute_loss_context_manager(), trainer.side_forward()):
        yield


def probe_loss(trainer: HybridTrainer, model: torch.nn.Module, probe: dict,
               num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Loss of the probe batch at the current weights, paired with every other forward of it. The batch's mean, or,
    given the Trainer's `num_items_in_batch` for a step whose one micro-batch is the probe, the loss as
    `Trainer.training_step` computes it. Where the side forwards reuse the training graph, the probe's own count of
    items, as the Trainer counts them: the mean (up to rounding), and the model called as a training step calls it."""
    if num_items_in_batch is None and _reuses_training_graph(trainer, model):
        num_items_in_batch = trainer.items_in_batch(probe)
    with _paired_forward(trainer, model):
        return trainer.compute_loss(model, copy.copy(probe), num_items_in_batch=num_items_in_batch).detach()


def probe_loss_by_sequence(trainer: HybridTrainer, model: torch.nn.Module, probe: dict,
                           num_items_in_batch: torch.Tensor | int | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`probe_loss`, and from the same forward each sequence's mean token loss (None where they cannot be read). The
    model's output is caught on its way out of the forward rather than asked of `compute_loss`: TRL's trainers compute
    the loss from a fused LM head and run a second forward to return the logits. A batch with no labels (DPO's pairs)
    has nothing to split by."""
    if "labels" not in probe:
        return probe_loss(trainer, model, probe, num_items_in_batch), None
    caught = []
    hook = _outermost_model(trainer, model).register_forward_hook(lambda _, __, output: caught.append(output))
    try:
        loss = probe_loss(trainer, model, probe, num_items_in_batch)
    finally:
        hook.remove()
    split = _loss_split(trainer, model)  # after the forward, which sets a classifier's `problem_type`
    return loss, split(caught[-1], probe["labels"]) if split is not None and caught else None


def _outermost_model(trainer: HybridTrainer, model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the model's own: the compiled wrapper itself for a compiled model, whose forward hooks
    run outside the compiled code (a hook on a module inside it would be compiled, and recompiled for), else the model
    without the distributed wrappers. Never `unwrap_model` keeping the compiled wrapper: on a compiled DDP model that
    replaces the wrapper's module with the bare model, and training goes on outside DDP's forward."""
    if is_compiled_module(model):
        return model
    return trainer.accelerator.unwrap_model(model)


def _loss_split(trainer: HybridTrainer, model: torch.nn.Module) -> Callable | None:
    """What splits the loss by sequence, given the model's output and the labels, where the loss is the model's own: a
    language model's cross-entropy over its tokens (`sequence_losses`, from the logits, or from TRL's fused LM head's
    per-token log-probabilities; an encoder-decoder's labels are its decoder's targets as they stand, unshifted), or
    single-label sequence classification's over its classes (`example_losses`)."""
    if getattr(trainer, "label_smoother", None) is not None or trainer.compute_loss_func is not None:
        return None
    unwrapped = trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
    config = getattr(unwrapped, "config", None)
    if getattr(unwrapped, "loss_function", None) is ForCausalLMLoss:
        return functools.partial(_language_model_rows, shift=not getattr(config, "is_encoder_decoder", False))
    if type(unwrapped).__name__.endswith("ForSequenceClassification") and getattr(
            config, "problem_type", None) == "single_label_classification":
        return lambda output, labels: example_losses(_field(output, "logits"), labels)
    return None


def _field(output: object, name: str) -> torch.Tensor | None:
    return output.get(name) if isinstance(output, dict) else None


def _language_model_rows(output: object, labels: torch.Tensor, shift: bool) -> torch.Tensor | None:
    log_probs, mask = _field(output, "log_probs"), _field(output, "label_mask")
    if _field(output, "logits") is None and log_probs is not None and mask is not None:
        return fused_sequence_losses(log_probs, mask)
    return sequence_losses(_field(output, "logits"), labels, shift=shift)


@torch.no_grad()
def fused_sequence_losses(log_probs: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's mean token loss from a fused LM head's output (TRL's): the labels' log-probabilities, zero where
    a label is ignored, and the mask of the labels that count; None unless both are (batch, length)."""
    if log_probs.dim() != 2 or label_mask.shape != log_probs.shape:
        return None
    return -log_probs.float().sum(1) / label_mask.sum(1).clamp(min=1)


@torch.no_grad()
def example_losses(logits: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Each example's cross-entropy over its classes, as a sequence classifier's single-label loss averages them
    (-100 ignored); None unless `logits` is (batch, classes) and `labels` (batch,)."""
    if logits is None or labels is None or logits.dim() != 2 or labels.shape != logits.shape[:1]:
        return None
    return F.cross_entropy(logits.float(), labels.to(logits.device), ignore_index=-100, reduction="none")


@torch.no_grad()
def sequence_losses(logits: torch.Tensor | None, labels: torch.Tensor | None, shift: bool = True,
                    ) -> torch.Tensor | None:
    """Each sequence's mean token loss, as transformers' `ForCausalLMLoss` counts tokens (labels shifted by one, or
    as they stand without `shift`; -100 ignored); None unless `logits` is (batch, length, vocabulary) and `labels`
    (batch, length). One sequence at a time, so that the float32 copy of the logits is one sequence's, not the
    batch's."""
    if logits is None or labels is None or logits.dim() != 3 or labels.shape != logits.shape[:2]:
        return None
    cut = int(shift)
    targets = labels[:, cut:].to(logits.device)
    sums = torch.stack([F.cross_entropy(logits[i, :logits.shape[1] - cut].float(), targets[i], ignore_index=-100,
                                        reduction="sum") for i in range(len(targets))])
    return sums / (targets != -100).sum(1).clamp(min=1)


def predict_step_loss(trainer: HybridTrainer, model: torch.nn.Module, inputs: dict,
                      num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """A Predict micro-batch's loss from a forward with no backward, scaled as `Trainer.training_step` scales a real
    one."""
    model.train()
    with forked_rng(trainer.args.device), _grad_mode(trainer, model):
        return training_step_loss(trainer, model, inputs, num_items_in_batch).detach()


def training_step_loss(trainer: HybridTrainer, model: torch.nn.Module, inputs: dict,
                       num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """A micro-batch's loss as `Trainer.training_step` computes and scales it, under the caller's grad mode and RNG:
    on the scale of the loss the Trainer logs and the guard judges. A plain mean can differ from it: where the Trainer
    does not see that the loss shifts the labels it counts every label, one more per sequence than the loss averages
    over (1.6% at 64 tokens)."""
    with trainer.compute_loss_context_manager(), trainer.side_forward():
        loss = trainer.compute_loss(model, trainer.prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)  # absent from older transformers (5.17)
    if scaled is None:  # the same rule as Trainer.training_step
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None
        )
    return loss if scaled else loss / trainer.current_gradient_accumulation_steps
