"""What the hybrid runs under: it refuses DeepSpeed and trainers that build their batches in `_prepare_inputs` (TRL's
GRPO, RLOO and distillation trainers), and says so when FSDP was asked for but not given."""

from __future__ import annotations

import os

from transformers import Trainer
from transformers.utils import logging

logger = logging.get_logger(__name__)


def check_run_supported(trainer: Trainer) -> None:
    """Raise, in one line, where the hybrid cannot act on this run; warn where it acts on less than was asked."""
    check_batches_are_data(trainer)
    if trainer.is_deepspeed_enabled:
        config = trainer.args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config"
        raise ValueError(
            f"hf_hybrid does not support DeepSpeed yet (config: {config}): DeepSpeed owns the optimizer step and "
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


def check_batches_are_data(trainer: Trainer) -> None:
    """The hybrid prepares a batch it reads again (the autopilot's probe, a jump's probe, the guard's re-run of the
    last accepted step) with the trainer's `_prepare_inputs`, as `Trainer.training_step` does. A trainer that overrides
    it may build the batch there: TRL's online trainers generate completions and score them, and keep a buffer and a
    step count. Each extra call would then generate again, draw from the RNG and move the buffer, so the run would
    train on other completions than the plain trainer's even where the hybrid keeps nothing; and the RL trainers' loss
    is a policy-gradient surrogate, not a measure of progress that a probe or the guard could judge."""
    prepare = type(trainer)._prepare_inputs
    if prepare is Trainer._prepare_inputs:
        return
    owner = prepare.__qualname__.split(".")[0]
    raise ValueError(
        f"hf_hybrid does not support {owner}: it overrides Trainer._prepare_inputs (TRL's GRPO, RLOO and "
        "distillation trainers generate completions there), which the hybrid's probes and the guard would call again "
        f"on a batch they re-read, changing the run. Use {owner} itself, or pass --hybrid false."
    )
