"""The jump engine of one `train()` call, built from the prepared trainer: the parameters it moves, the optimizer it
reads and where its copies go."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..memory.placement import CopyPlacement
from .engine import HybridEngine

if TYPE_CHECKING:
    from ..loop.seam import HybridTrainer


def build_engine(trainer: HybridTrainer) -> HybridEngine:
    """A fresh engine for the trainer's prepared model and optimizer."""
    if (previous := trainer.hybrid_engine) is not None:
        # `auto_find_batch_size` starts the loop again after an out-of-memory error, from the weights as they stand: a
        # jump the error cut off before its verdict is undone first, as at a run's end.
        previous.finish()
    # Parameters of the prepared model: under FSDP2 these are the DTensors that hold the local shards.
    params = [p for p in trainer.model_wrapped.parameters() if p.requires_grad]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # unwrapped from accelerate's
    placement = CopyPlacement(trainer.hybrid_config.device_copies_share,
                              announce=trainer.args.local_process_index == 0)
    return HybridEngine(trainer.hybrid_config.jumps, params, optimizer, seed=trainer.args.seed,
                        accumulation=trainer.args.gradient_accumulation_steps, placement=placement)
