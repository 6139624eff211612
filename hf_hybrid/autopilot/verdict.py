"""The verdict on a learning-rate raise: did the raised steps go further than the user's LR would have?

The raise's undo point W0 (the guard's snapshot) and the weights now, W, span the path the raised steps took. Adam's
steps, weight decay included, are proportional to the learning rate, so over the same batches the user's LR would have
gone about 1/r of the way (r: the raise), to W0 + (W - W0) / r. The probe batch is read at both points, paired by
sequence; the raise is undone when W is worse than that point by more than the noise margin of the jumps' probe, and
an even result keeps it. Unlike a jump, a raise was asked for by evidence of its own (a line at least twice as long as
the steps it aims for), and what it is worth accrues over hundreds of steps, slowly against the noise of one trial's
verdict (docs/benchmarks-history.md, "the verdict on a raise"), so a verdict that asked the trial to prove its gain
would undo raises that pay. An overshoot shows at once.

That is a counterfactual on the same batches. The probe's progress per step under the raise, against its progress
before the raise, would not do: early in a run that falls several times over whatever the LR, so a raise that paid
would be undone (docs/benchmarks-history.md, "the verdict on a raise").

One forward and one copy of the weights (the autopilot's scratch copy, held only while in use), once per trial: the
probe at the raised weights is the first forward of the same reading's line (autopilot/line.py). Under DDP the undo
point's weights are broadcast from rank 0, which alone keeps them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..jumps.predict_step import paired_noise
from ..loop.forward_checks import probe_loss_by_sequence
from ..loop.seam import HybridTrainer
from ..memory.snapshot import TrainingSnapshot, WeightSnapshot


@torch.no_grad()
def _move_toward_undo_point(shards: list[torch.Tensor], undo_point: TrainingSnapshot, raise_: float) -> None:
    """W <- W0 + (W - W0) / raise_, one tensor at a time."""
    start = undo_point.weight_copies()
    for i, w in enumerate(shards):
        if undo_point.replicated:
            w0 = torch.empty_like(w)
            if start is not None:
                w0.copy_(start[i])
            dist.broadcast(w0, src=0)
        else:
            w0 = start[i].to(w.device, non_blocking=True)
        w.lerp_(w0, 1.0 - 1.0 / raise_)


@torch.no_grad()
def raise_gain(trainer: HybridTrainer, model: torch.nn.Module, shards: list[torch.Tensor], scratch: WeightSnapshot,
               probe: dict, undo_point: TrainingSnapshot, raise_: float,
               raised: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[float, float]:
    """The probe's loss where the user's LR would have taken the weights, minus its loss at the raised weights
    (positive: the raise paid), and the standard error of that difference; both over every rank's probe. `shards` are
    the weights (local shards); `raised` is the probe's loss at them and each sequence's, unreduced across ranks, as
    `probe_loss_by_sequence` reads them; `scratch` holds the weights meanwhile, puts them back however the verdict
    ends, and is released after."""
    raised, raised_rows = raised
    with scratch.held(shards):
        _move_toward_undo_point(shards, undo_point, raise_)
        user, user_rows = probe_loss_by_sequence(trainer, model, probe)
    gain = trainer.reduce_across_ranks(user - raised)[0]
    return gain, paired_noise(trainer, user_rows, raised_rows)
