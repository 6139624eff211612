"""Which launch modes the hybrid runs under: it refuses DeepSpeed, and says so when FSDP was asked for but not given."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from transformers.utils import logging

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.get_logger(__name__)


def check_launch_mode(trainer: Trainer) -> None:
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
