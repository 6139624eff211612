"""The seam between the Trainer glue (trainer.py) and the parts that act inside its loop (guard/runner.py,
autopilot/runner.py, autopilot/setup.py, autopilot/line.py, autopilot/verdict.py, jumps/predict_step.py,
jumps/setup.py, jumps/clock.py, loop/forward_checks.py, loop/step_veto.py, launch.py): what they use of a
`HybridHFTrainer` beyond the public `transformers.Trainer` API, named in one protocol, so that no part reads the
Trainer's private attributes and a reader sees here everything the loop parts ask of it."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..config import HybridConfig
    from ..jumps.engine import HybridEngine
    from .step_veto import StepVeto


@dataclass
class StepLosses:
    """The optimizer step's loss as the Trainer logs it, summed over its micro-batches (`window`), and a Predict step's
    last checked loss (`last`), which an unmonitored Predict micro-batch repeats rather than log a 0."""

    window: torch.Tensor | None = None
    last: torch.Tensor | None = None


class HybridTrainer(Protocol):
    """A `transformers.Trainer` that also offers the loop parts these."""

    hybrid_config: HybridConfig  # the run's settings, by capability
    step_veto: StepVeto  # vetoed, undone and made-up steps, and the schedule's state at a jump
    step_losses: StepLosses

    @property
    def hybrid_engine(self) -> HybridEngine | None:
        """This train() call's engine: the step's phase, its record, the jump and its undo copy (None outside
        train())."""

    def reduce_across_ranks(self, *values: torch.Tensor | float) -> list[float]:
        """Scalars averaged across ranks in one collective, so that every rank decides on the same numbers."""

    def current_learning_rate(self) -> float:
        """The learning rate in effect (the schedule's, the autopilot's scale included)."""

    def prepare_inputs(self, inputs: dict) -> dict:
        """A batch as the Trainer prepares it for the model (on its device)."""

    def items_in_batch(self, batch: dict) -> torch.Tensor | int | None:
        """The `num_items_in_batch` the Trainer passes a step made of this one prepared micro-batch."""

    def side_forward(self) -> AbstractContextManager:
        """Around a forward the hybrid runs besides training: what `compute_loss` records for the logs (TRL's token
        count and metrics) comes back as it was."""


def mean_across_ranks(accelerator: Accelerator, device: torch.device, values: tuple) -> list[float]:
    """`HybridTrainer.reduce_across_ranks` for a Trainer's accelerator and device."""
    # Under FSDP2 the gradient norm comes back as a DTensor, which cannot be stacked with plain tensors.
    values = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(device).reshape(()) for v in values])
    if accelerator.num_processes > 1:
        stacked = accelerator.reduce(stacked, reduction="mean")
    return stacked.tolist()
