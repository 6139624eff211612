"""What the hybrid runs with on a given run: it refuses DeepSpeed, says so when FSDP was asked for but not given or a
flag set away from its default is one the active predictor does not read, runs trainers that build their batches in
`_prepare_inputs` (TRL's GRPO, RLOO and distillation trainers) with the non-finite step veto alone, and stops in one
line, at the first step, a trainer whose batches reach `training_step` with no tensor."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import Trainer
from transformers.utils import logging

if TYPE_CHECKING:
    from .config import HybridConfig
    from .loop.seam import HybridTrainer

logger = logging.get_logger(__name__)


def run_settings(trainer: Trainer, config: HybridConfig, ignored: list[str]) -> HybridConfig:
    """The settings the hybrid runs `trainer` with: `config`, less what the run cannot have (said in one line). Raises,
    in one line, where the hybrid cannot act on the run at all. `ignored`: the flags set that the active predictor
    does not read (config.py's `ignored_flags`)."""
    if trainer.is_deepspeed_enabled:
        source = trainer.args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config"
        raise ValueError(
            f"hf_hybrid does not support DeepSpeed yet (config: {source}): DeepSpeed owns the optimizer step and "
            "the fp32 master weights, so a predicted delta would be silently overwritten. Launch with DDP or "
            "FSDP2 (recipes/accelerate/), or pass --hybrid false."
        )
    # `accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP rather than --fsdp; on CPU it then runs DDP.
    fsdp_requested = bool(trainer.args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if fsdp_requested and not trainer.is_fsdp_enabled:
        logger.warning(
            "FSDP was requested but accelerate is not running FSDP (on CPU it falls back to DDP); "
            "hf_hybrid will treat parameters as full, replicated tensors."
        )
    if ignored and trainer.args.process_index == 0:
        logger.warning(f"hf_hybrid: --hybrid_predictor {config.jumps.predictor.name} does not read "
                       f"{', '.join('--' + f for f in ignored)}: they have no effect on this run.")
    return non_finite_veto_only(trainer, config) if builds_its_batches(trainer) else config


def builds_its_batches(trainer: Trainer) -> bool:
    """Whether the trainer overrides `Trainer._prepare_inputs`, with which the hybrid prepares a batch it reads again
    (the autopilot's probe, a jump's probe, the guard's re-run of the last accepted step), as `Trainer.training_step`
    does. An override may build the batch there: TRL's online trainers generate completions and score them, and keep
    a buffer and a step count, so each extra call would generate again, draw from the RNG and move the buffer, and the
    run would train on other completions than the plain trainer's even where the hybrid keeps nothing."""
    return type(trainer)._prepare_inputs is not Trainer._prepare_inputs


def non_finite_veto_only(trainer: Trainer, config: HybridConfig) -> HybridConfig:
    """A trainer that builds its batches runs with the autopilot, the jumps and the guard's checks off (their probes
    and re-runs prepare batches again; and an RL trainer's loss is a policy-gradient surrogate, which no probe or loss
    bound can judge), and the veto of a step whose loss or gradient is not finite on: such a step never reaches the
    weights, where the plain trainer's would leave them NaN."""
    if trainer.args.process_index == 0:
        owner = type(trainer)._prepare_inputs.__qualname__.split(".")[0]
        logger.warning(
            f"hf_hybrid: {owner} builds its batches in _prepare_inputs (TRL's GRPO, RLOO and distillation trainers "
            "generate completions there), which the hybrid's probes would build again: the learning-rate autopilot, "
            "the jumps and the guard's checks are off for this run; a step whose loss or gradient is not finite is "
            "still skipped."
        )
    return replace(config, jumps=replace(config.jumps, predict=False), guard=replace(config.guard, enabled=False),
                   autopilot=replace(config.autopilot, enabled=False))


def check_batch_is_data(trainer: HybridTrainer, inputs: object) -> None:
    """At a step's first micro-batch, where a part re-reads batches as they reach `training_step` (the autopilot's
    probe, a jump's probe, the guard's re-run): a batch that holds no tensor there is built inside the trainer's own
    `training_step` (TRL's online DPO generates its completions there from prompts), and none of them could take a loss
    on it. Raised before the first update, in one line, rather than at the first reading."""
    config = trainer.hybrid_config
    rereads = config.autopilot.enabled or config.jumps.predict or config.guard.enabled
    if rereads and isinstance(inputs, dict) and not any(isinstance(v, torch.Tensor) for v in inputs.values()):
        raise ValueError(
            f"hf_hybrid: {type(trainer).__name__}'s batches reach training_step with no tensor (it builds them there, "
            "as TRL's online DPO generates completions from prompts), so the hybrid's probes and the guard's re-run "
            "cannot take a loss on them. Pass --hybrid_lr_autopilot false --hybrid_predict false --hybrid_guard false "
            "to keep the veto of a non-finite step alone, or --hybrid false."
        )
